"""Seconds from submit to running for a Slurm job that needs a powered-down node, against the same job
on nodes that are up (the baseline), in one run.

    fsdpctl up examples/local-elastic.yaml --target local     # or any cluster with `scaling:`
    fsdpctl configure --tags slurm
    python bench/slurm_resume.py [--cluster NAME] [--repeat 2] [--output result.json] [--plot result.png]

For each repeat it waits until Slurm has powered every CLOUD node down (sinfo `idle~`: after the
spec's scaling.suspend_after_s plus SuspendTimeout), submits `sbatch -N<all nodes> --wrap 'srun
true'` and polls squeue every 0.25 s for submit -> RUNNING and submit -> COMPLETED; then, with every
node up, submits the same job again. It prints both, their ratio, and the controller's power log of
the resume (/var/log/slurm/power.log); JSON to --output, a bar chart to --plot (matplotlib, the
`report` extra). On AWS the figure is an EC2 start plus the node's boot and slurmd; on local nodes a
container boot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

POLL_S = 0.25
POWER_DOWN_TIMEOUT_S = 3600
JOB_TIMEOUT_S = 900


def on_controller(cluster: str | None, command: str) -> str:
    argv = ["fsdpctl", "ssh", "0", *(["--cluster", cluster] if cluster else []), "--", command]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if result.returncode:
        sys.exit(f"`{command}` on the controller failed: {(result.stderr or result.stdout).strip()[-400:]}")
    return result.stdout


def node_states(cluster: str | None) -> dict[str, str]:
    out = on_controller(cluster, "sinfo --noheader --Node --format '%N %T'")
    return dict(line.split() for line in out.splitlines() if line.strip())


def wait_powered_down(cluster: str | None, cloud: list[str]) -> None:
    deadline = time.monotonic() + POWER_DOWN_TIMEOUT_S
    while not all(node_states(cluster)[n].endswith("~") for n in cloud):
        if time.monotonic() > deadline:
            sys.exit(f"{', '.join(cloud)} did not power down within {POWER_DOWN_TIMEOUT_S} s")
        time.sleep(2)


@dataclass(frozen=True)
class JobTiming:
    nodes_powered_down: int
    submit_to_running_s: float
    submit_to_completed_s: float


def time_job(cluster: str | None, node_count: int, powered_down: int) -> JobTiming:
    started = time.monotonic()
    job_id = on_controller(cluster, f"sbatch --parsable -N{node_count} --output=/dev/null "
                                    "--wrap 'srun true'").strip().split(";")[0]
    running = None
    deadline = started + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        state = on_controller(cluster, f"squeue --noheader --states=all --jobs {job_id} --format %T").strip()
        if running is None and state in ("RUNNING", "COMPLETING", "COMPLETED"):
            running = time.monotonic() - started
        if state == "COMPLETED":
            return JobTiming(powered_down, running or 0.0, time.monotonic() - started)
        if state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL"):
            sys.exit(f"job {job_id} ended {state}")
        time.sleep(POLL_S)
    sys.exit(f"job {job_id} did not complete within {JOB_TIMEOUT_S} s")


def plot(results: dict[str, list[JobTiming]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["nodes powered down", "nodes up (baseline)"]
    runs = [results["resume"], results["baseline"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    medians = [statistics.median(t.submit_to_running_s for t in r) for r in runs]
    ax.bar(labels, medians, color=["#c44", "#48c"])
    ax.set_ylabel("submit to running (s, median)")
    ax.set_title("Slurm job start with power saving")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", help="the cluster (default: the one brought up last)")
    parser.add_argument("--repeat", type=int, default=1, help="measurements of each kind (default 1)")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, help="write a bar chart (PNG) here")
    args = parser.parse_args()

    states = node_states(args.cluster)
    conf = on_controller(args.cluster, "cat /etc/slurm/slurm.conf")
    cloud = [line.split()[0].split("=", 1)[1] for line in conf.splitlines()
             if line.startswith("NodeName=") and "State=CLOUD" in line]
    if not cloud:
        sys.exit("the cluster has no State=CLOUD node: give its spec `scaling: {min_nodes: 1}` and run "
                 "`fsdpctl configure --tags slurm`")
    results: dict[str, list[JobTiming]] = {"resume": [], "baseline": []}
    for repeat in range(args.repeat):
        print(f"[{repeat + 1}/{args.repeat}] waiting for {', '.join(cloud)} to power down", flush=True)
        wait_powered_down(args.cluster, cloud)
        resume = time_job(args.cluster, len(states), len(cloud))
        baseline = time_job(args.cluster, len(states), 0)
        results["resume"].append(resume)
        results["baseline"].append(baseline)
        print(f"  powered down: running after {resume.submit_to_running_s:.1f} s; nodes up (baseline): "
              f"{baseline.submit_to_running_s:.1f} s", flush=True)
    resume_s = statistics.median(t.submit_to_running_s for t in results["resume"])
    baseline_s = statistics.median(t.submit_to_running_s for t in results["baseline"])
    print(f"submit -> running, median of {args.repeat}: {resume_s:.1f} s with {len(cloud)} node(s) to power "
          f"up, {baseline_s:.1f} s with every node up: {resume_s / max(baseline_s, 1e-3):.1f}x")
    print("power log of the last resume:")
    print(on_controller(args.cluster, "tail -n 6 /var/log/slurm/power.log").rstrip())
    if args.output:
        args.output.write_text(json.dumps({k: [asdict(t) for t in v] for k, v in results.items()}, indent=2))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
