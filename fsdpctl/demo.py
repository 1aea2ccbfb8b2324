"""`fsdpctl demo`: the README's main job on the embedded local target, written with the Python API.

up (local nodes) -> configure -> deploy -> smoke -> down, each the `fsdpctl.api` function the
command of that name calls, with the elapsed time per stage. The smoke report stays in
`$FSDPCTL_HOME/reports/<cluster>/` after teardown. The cluster is torn down whatever happens,
unless `keep` is set.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fsdpctl import api
from fsdpctl.console import error, say
from fsdpctl.errors import EXIT_USAGE, CommandError, UsageError
from fsdpctl.state import cluster_state
from infra.spec import SpecError, load_spec


@dataclass(frozen=True)
class StageTiming:
    stage: str
    seconds: float
    exit_code: int  # what the command of that name would have ended with


def _banner(text: str) -> None:
    say(f"\n==> [demo] {text}")


def _timed(stage: str, action: Callable[[], object]) -> StageTiming:
    """Run one stage; its failure is reported as the command's would be, and ends the demo's stages."""
    started = time.monotonic()
    try:
        action()
        code = 0
    except SpecError as e:
        error(f"fsdpctl {stage}: {e}")
        code = EXIT_USAGE
    except CommandError as e:
        error(f"fsdpctl {stage}: {e}")
        code = e.exit_code
    return StageTiming(stage, time.monotonic() - started, code)


def run_demo(spec_file: Path, *, nodes: int = 2, keep: bool = False, smoke_steps: int | None = None) -> None:
    """Bring a local cluster up from `spec_file`, configure, deploy and smoke-test it, and tear it down
    (unless `keep`); raises CommandError naming the stage that failed."""
    spec = load_spec(spec_file)  # bad spec: fail before anything is created
    if nodes < 1:
        raise UsageError(f"--nodes {nodes}: the demo needs at least 1 node; use --nodes 2")
    name = spec.name
    stages: list[tuple[str, str, Callable[[], object]]] = [
        ("up", f"up {spec_file} --target local --nodes {nodes}",
         lambda: api.up(spec_file, target="local", nodes=nodes)),
        ("configure", f"configure --cluster {name}", lambda: api.configure(name)),
        ("deploy", f"deploy --cluster {name}", lambda: api.deploy(name)),
        ("smoke", f"smoke --cluster {name}" + (f" --steps {smoke_steps}" if smoke_steps else ""),
         lambda: api.smoke(name, steps=smoke_steps)),
    ]
    total = len(stages) + (0 if keep else 1)
    timings: list[StageTiming] = []
    failed: str | None = None
    started = time.monotonic()
    try:
        for i, (stage, command, action) in enumerate(stages, 1):
            _banner(f"{i}/{total} fsdpctl {command}")
            timings.append(_timed(stage, action))
            if timings[-1].exit_code != 0:
                failed = stage
                break
    finally:
        state = cluster_state(name)
        report = state.read().last_report if state.exists() else None
        if not keep and state.exists():
            _banner(f"{total}/{total} fsdpctl down --cluster {name} --yes")
            timings.append(_timed("down", lambda: api.down(name, yes=True)))
            if timings[-1].exit_code != 0 and failed is None:
                failed = "down"
        still_up = state.exists()  # a failed `up` removes what it made

    _banner(f"summary ({time.monotonic() - started:.0f} s)")
    for timing in timings:
        outcome = "ok" if timing.exit_code == 0 else f"FAILED (exit {timing.exit_code})"
        say(f"  {timing.stage:<10} {outcome:<16} {timing.seconds:6.1f} s")
    if report:
        say(f"  smoke report: {report}/report.html (and report.json next to it; kept after down)")
    if still_up:
        say(f"  the cluster is still up: `fsdpctl status --cluster {name}`; "
            f"tear it down with `fsdpctl down --cluster {name}`")
    if failed:
        raise CommandError(f"demo failed at `{failed}` (its error is above)."
                           + (" The cluster is still up." if still_up else " Nothing is left up.")
                           + " Fix the cause and rerun `fsdpctl demo`.")
