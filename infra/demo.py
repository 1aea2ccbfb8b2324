"""`fsdpctl demo`: the README's main job on the embedded local target.

up (local nodes) -> configure -> deploy -> smoke -> down, each through the same sub-command a user
would type, with the elapsed time per stage. The smoke report is copied out of the cluster's state
directory (which `down` removes) to `$FSDPCTL_HOME/reports/<cluster>/` before teardown. The
cluster is torn down whatever happens, unless --keep is given.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from infra.spec import load_spec
from infra.state import cluster_state, home

REPORT_FILES = ("report.json", "report.html")


def reports_dir(cluster: str) -> Path:
    """Where the demo leaves the smoke report of a cluster once it is torn down."""
    return home() / "reports" / cluster


def _banner(text: str) -> None:
    print(f"\n==> [demo] {text}", flush=True)


def keep_report(cluster: str) -> Path | None:
    """Copy the cluster's smoke report out of its state dir; returns the HTML report's new path."""
    source = cluster_state(cluster).root
    if not (source / "report.json").exists():
        return None
    target = reports_dir(cluster)
    target.mkdir(parents=True, exist_ok=True)
    for name in REPORT_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, target / name)
    return target / "report.html"


def cmd_demo(args) -> int:
    from infra.cli import CommandError, main

    spec = load_spec(args.spec)  # bad spec: fail before anything is created
    if args.nodes < 1:
        raise CommandError(f"--nodes {args.nodes}: the demo needs at least 1 node; use --nodes 2")
    name = spec.name
    stages = [
        ("up", ["up", str(args.spec), "--target", "local", "--nodes", str(args.nodes)]),
        ("configure", ["configure", "--cluster", name]),
        ("deploy", ["deploy", "--cluster", name]),
        ("smoke", ["smoke", "--cluster", name,
                   *(["--steps", str(args.smoke_steps)] if args.smoke_steps else [])]),
    ]
    timings: list[tuple[str, float, int]] = []
    failed: str | None = None
    started = time.monotonic()
    try:
        for i, (stage, argv) in enumerate(stages, 1):
            _banner(f"{i}/{len(stages) + (0 if args.keep else 1)} fsdpctl {' '.join(argv)}")
            t0 = time.monotonic()
            rc = main(argv)
            timings.append((stage, time.monotonic() - t0, rc))
            if rc != 0:
                failed = stage
                break
    finally:
        report = keep_report(name)
        if not args.keep and cluster_state(name).exists():
            _banner(f"{len(stages) + 1}/{len(stages) + 1} fsdpctl down --cluster {name}")
            t0 = time.monotonic()
            rc = main(["down", "--cluster", name])
            timings.append(("down", time.monotonic() - t0, rc))
            if rc != 0 and failed is None:
                failed = "down"

    _banner(f"summary ({time.monotonic() - started:.0f} s)")
    for stage, seconds, rc in timings:
        print(f"  {stage:<10} {'ok' if rc == 0 else f'FAILED (exit {rc})':<16} {seconds:6.1f} s")
    if report:
        print(f"  smoke report: {report} (and report.json next to it)")
    if args.keep:
        print(f"  the cluster is still up: `fsdpctl status --cluster {name}`; "
              f"tear it down with `fsdpctl down --cluster {name}`")
    if failed:
        raise CommandError(f"demo failed at `{failed}` (its error is above)."
                           + ("" if args.keep else " The cluster was torn down.")
                           + " Fix the cause and rerun `fsdpctl demo`.")
    return 0
