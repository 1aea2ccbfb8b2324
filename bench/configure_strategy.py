"""Time and CPU of `fsdpctl configure` under Mitogen's strategy (the default) against Ansible's own
linear strategy (the baseline), in one run, on a cluster that is already configured.

    fsdpctl up examples/demo.yaml --target local --nodes 2 && fsdpctl configure   # or any cluster
    python bench/configure_strategy.py [--cluster NAME] [--repeat 2] [--output r.json] [--plot r.png]

Each repeat runs the whole playbook once with each strategy, the order alternating between repeats so
that neither always runs first. The runs are second runs (changed=0 expected; a run that changes or
fails anything ends the benchmark): what they cost is Ansible's per-task work, which is what the
strategy changes. It prints, for each strategy, the median wall time, the CPU seconds of the configure
process and everything it started on this machine, and the machine's busy CPU seconds from
/proc/stat: on the local target the nodes are containers here, so that count includes their side;
on AWS it is this machine's side only. Then the ratios mitogen/linear. JSON to --output, a bar chart
to --plot (matplotlib, the `report` extra).
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

STRATEGIES = ("linear", "mitogen")  # the baseline first
RECAP = re.compile(r"^(\S+) ok=(\d+) changed=(\d+) failed=(\d+)", re.MULTILINE)
CONFIGURE_TIMEOUT_S = 3600


@dataclass(frozen=True)
class ConfigureRun:
    strategy: str
    wall_s: float
    process_cpu_s: float
    """User + system CPU of `fsdpctl configure` and every process it started on this machine."""
    machine_busy_cpu_s: float
    """Busy CPU of the whole machine while it ran (/proc/stat), the local target's nodes included."""
    tasks_ok: int
    """ok= summed over the hosts' recaps."""


def busy_cpu_s() -> float:
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, stat.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / 100  # USER_HZ is 100 on Linux


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_configure(cluster: str | None, strategy: str) -> ConfigureRun:
    argv = ["fsdpctl", "configure", "--strategy", strategy, *(["--cluster", cluster] if cluster else [])]
    cpu0, busy0, started = children_cpu_s(), busy_cpu_s(), time.monotonic()
    result = subprocess.run(argv, capture_output=True, text=True, timeout=CONFIGURE_TIMEOUT_S)
    wall, cpu, busy = time.monotonic() - started, children_cpu_s() - cpu0, busy_cpu_s() - busy0
    if result.returncode:
        sys.exit(f"`{' '.join(argv)}` exited {result.returncode}:\n{(result.stdout + result.stderr)[-3000:]}")
    recaps = RECAP.findall(result.stdout)
    changed = {host: int(n) for host, _ok, n, _failed in recaps if int(n)}
    if not recaps or changed:
        sys.exit(f"`{' '.join(argv)}` is not a second run ({changed or 'no recap'}): run `fsdpctl configure` "
                 "until it changes nothing, then the benchmark")
    return ConfigureRun(strategy, wall, cpu, busy, sum(int(ok) for _host, ok, _n, _failed in recaps))


def plot(runs: list[ConfigureRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measures = [("wall_s", "wall (s)"), ("process_cpu_s", "configure's CPU (s)"),
                ("machine_busy_cpu_s", "machine's busy CPU (s)")]
    fig, axes = plt.subplots(1, len(measures), figsize=(10, 3.5))
    for ax, (field, label) in zip(axes, measures, strict=True):
        medians = [statistics.median(getattr(r, field) for r in runs if r.strategy == s) for s in STRATEGIES]
        ax.bar(STRATEGIES, medians, color=["#48c", "#c84"])
        ax.set_title(label)
    fig.suptitle("fsdpctl configure, second run: Ansible's linear strategy against Mitogen's (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", help="the cluster (default: the one brought up last)")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each strategy (default 2)")
    parser.add_argument("--output", type=Path, help="write the runs as JSON here")
    parser.add_argument("--plot", type=Path, help="write a bar chart (PNG) here")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give 1 or more")

    runs: list[ConfigureRun] = []
    for repeat in range(args.repeat):
        for strategy in STRATEGIES if repeat % 2 == 0 else STRATEGIES[::-1]:
            print(f"[{repeat + 1}/{args.repeat}] fsdpctl configure --strategy {strategy}", flush=True)
            run = run_configure(args.cluster, strategy)
            runs.append(run)
            print(f"  {run.wall_s:.1f} s, configure's CPU {run.process_cpu_s:.1f} s, machine busy "
                  f"{run.machine_busy_cpu_s:.1f} CPU-s, {run.tasks_ok} task results ok", flush=True)
    medians = {s: {field: statistics.median(getattr(r, field) for r in runs if r.strategy == s)
                   for field in ("wall_s", "process_cpu_s", "machine_busy_cpu_s")} for s in STRATEGIES}
    for strategy, m in medians.items():
        print(f"{strategy:>8}: median wall {m['wall_s']:.1f} s, configure's CPU {m['process_cpu_s']:.1f} s, "
              f"machine busy {m['machine_busy_cpu_s']:.1f} CPU-s")
    ratios = {field: medians["mitogen"][field] / max(baseline, 1e-9)
              for field, baseline in medians["linear"].items()}
    print(f"mitogen/linear: wall {ratios['wall_s']:.2f}x, configure's CPU {ratios['process_cpu_s']:.2f}x, "
          f"machine busy CPU {ratios['machine_busy_cpu_s']:.2f}x")
    if args.output:
        args.output.write_text(json.dumps({"runs": [asdict(r) for r in runs], "medians": medians,
                                           "mitogen_over_linear": ratios}, indent=2))
    if args.plot:
        plot(runs, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
