"""`fsdpctl demo`: the README's main job on the embedded local target.

up (local nodes) -> configure -> deploy -> smoke -> down, each through the same sub-command a user
would type, with the elapsed time per stage. The smoke report stays in
`$FSDPCTL_HOME/reports/<cluster>/` after teardown. The cluster is torn down whatever happens,
unless --keep is given.
"""

from __future__ import annotations

import time
from argparse import Namespace
from collections.abc import Callable

from fsdpctl.console import say
from fsdpctl.errors import CommandError, UsageError
from fsdpctl.state import cluster_state
from infra.spec import load_spec


def _banner(text: str) -> None:
    say(f"\n==> [demo] {text}")


def run_demo(args: Namespace, run: Callable[[list[str]], int]) -> int:
    """The stages, each run by `run(argv)`: the CLI's own entry point, which the CLI passes in."""
    spec = load_spec(args.spec)  # bad spec: fail before anything is created
    if args.nodes < 1:
        raise UsageError(f"--nodes {args.nodes}: the demo needs at least 1 node; use --nodes 2")
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
            rc = run(argv)
            timings.append((stage, time.monotonic() - t0, rc))
            if rc != 0:
                failed = stage
                break
    finally:
        report = cluster_state(name).read().last_report if cluster_state(name).exists() else None
        if not args.keep and cluster_state(name).exists():
            _banner(f"{len(stages) + 1}/{len(stages) + 1} fsdpctl down --cluster {name} --yes")
            t0 = time.monotonic()
            rc = run(["down", "--cluster", name, "--yes"])
            timings.append(("down", time.monotonic() - t0, rc))
            if rc != 0 and failed is None:
                failed = "down"

    _banner(f"summary ({time.monotonic() - started:.0f} s)")
    for stage, seconds, rc in timings:
        say(f"  {stage:<10} {'ok' if rc == 0 else f'FAILED (exit {rc})':<16} {seconds:6.1f} s")
    if report:
        say(f"  smoke report: {report}/report.html (and report.json next to it; kept after down)")
    if args.keep:
        say(f"  the cluster is still up: `fsdpctl status --cluster {name}`; "
            f"tear it down with `fsdpctl down --cluster {name}`")
    if failed:
        raise CommandError(f"demo failed at `{failed}` (its error is above)."
                           + ("" if args.keep else " The cluster was torn down.")
                           + " Fix the cause and rerun `fsdpctl demo`.")
    return 0
