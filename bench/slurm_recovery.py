"""Seconds from a failed training step to the first step done again when the batch script retries it in
its allocation, against the same job recovering through a Slurm requeue (the baseline), in one run,
with where the time goes.

    fsdpctl up examples/local.yaml --target local          # or any cluster with Slurm
    fsdpctl configure --tags slurm && fsdpctl deploy
    python bench/slurm_recovery.py [--cluster NAME] [--nodes 2] [--repeat 1] [--output r.json] [--plot r.png]

Each repeat runs two jobs of the tiny config (`fsdpctl train tiny`, 60 steps, a checkpoint every 5, a
metrics record per step). In the first, once it is past step 12, the workers of its last node are
killed (SIGKILL): the step fails, every node passes its health check, and the batch script starts the
step again in the allocation. In the second, the batch script gets SIGUSR1 (what the spot watcher and a
time limit send): the workers checkpoint and exit, and Slurm requeues the job, which waits out the
requeue delay (AuthInfo cred_expire + 1 s), is scheduled again and passes its prolog before it starts.
For each it polls (an SSH round trip each, about 0.1 to 0.3 s) for the first metrics record of the new
run, and reads the phases from the batch script's log (millisecond time stamps) and the trainer's
checkpoint load time. It prints both, their ratio and the phases; JSON to --output, a stacked bar chart
of the phases to --plot (matplotlib, the `report` extra).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

POLL_S = 0.25
JOB_TIMEOUT_S = 900
FAULT_AFTER_STEP = 12
STEPS = 60
RETRY_MARK = "retried in this allocation"
REQUEUE_MARK = "requeued"
LOG_LINE = re.compile(r"^\[fsdpctl (\d\d):(\d\d):(\d\d)\.(\d{3})\] (.*)$")
LOADED = re.compile(r"checkpoint: resumed from \S+ \(step \d+\) in ([\d.]+)s")


def fsdpctl(cluster: str | None, *args: str, timeout: float = 120) -> str:
    argv = ["fsdpctl", *args[:1], *(["--cluster", cluster] if cluster else []), *args[1:]]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if result.returncode:
        sys.exit(f"`{' '.join(argv)}` failed: {(result.stderr or result.stdout).strip()[-400:]}")
    return result.stdout


def on_node(cluster: str | None, rank: int, command: str) -> str:
    return fsdpctl(cluster, "ssh", str(rank), "--", command)


@dataclass(frozen=True)
class Phases:
    """Seconds from the fault (the kill, or SIGUSR1 to the batch script) to each event of the recovery."""

    kind: str
    """`retry` (in the allocation) or `requeue` (the baseline)."""
    step_ended_s: float
    """The batch script saw the step end."""
    restarted_s: float
    """The new step started: after the health check on every node (retry), or after Slurm's requeue
    delay, the scheduling and the prolog (requeue: the new run's first log line)."""
    checkpoint_load_s: float | None
    """The trainer's own figure for loading the checkpoint (part of the next phase)."""
    first_step_s: float
    """The first metrics record of the new run: torchrun, the rendezvous, the model, the checkpoint
    load and one training step after the restart."""


def log_times(log: str, day: dt.date) -> list[tuple[float, str]]:
    """(Unix time, message) of every line the batch script logged, on the given UTC day (a line
    earlier than the first is on the next day)."""
    out: list[tuple[float, str]] = []
    for line in log.splitlines():
        match = LOG_LINE.match(line)
        if not match:
            continue
        hours, minutes, seconds, millis, message = match.groups()
        moment = dt.datetime.combine(day, dt.time(int(hours), int(minutes), int(seconds), int(millis) * 1000),
                                     tzinfo=dt.UTC).timestamp()
        while out and moment < out[0][0]:
            moment += 86400
        out.append((moment, message))
    return out


def phases(kind: str, log: str, fault_at: float, first_step_at: float) -> Phases:
    """The recovery's phases from the batch script's log of a job that recovered once."""
    day = dt.datetime.fromtimestamp(fault_at, dt.UTC).date()
    lines = [(t, m) for t, m in log_times(log, day) if t >= fault_at - 1]
    ended = next((t for t, m in lines if m.startswith("step exit")), None)
    if kind == "retry":
        restarted = next((t for t, m in lines if RETRY_MARK in m), None)
    else:
        restarted = next((t for t, m in lines if re.match(r"job \d+ run [1-9]\d* on ", m)), None)
    if ended is None or restarted is None:
        raise ValueError(f"the job's log has no {'step end' if ended is None else 'restart'} after the fault")
    loads = LOADED.findall(log)
    return Phases(kind=kind, step_ended_s=round(ended - fault_at, 3),
                  restarted_s=round(restarted - fault_at, 3),
                  checkpoint_load_s=float(loads[-1]) if loads else None,
                  first_step_s=round(first_step_at - fault_at, 3))


def job_row(cluster: str | None, job_id: int) -> dict:
    rows = json.loads(fsdpctl(cluster, "jobs", "--json"))
    return next(r for r in rows if r["job_id"] == job_id)


def wait_for(what: str, predicate, timeout: float = JOB_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(POLL_S)
    sys.exit(f"{what} did not happen within {timeout:.0f} s")


def recover(cluster: str | None, kind: str, nodes: int, repeat: int) -> Phases:
    name = f"bench-recovery-{kind}-{repeat}-{int(time.time())}"
    out = fsdpctl(cluster, "train", "tiny", "--nodes", str(nodes), "--steps", str(STEPS),
                  "--checkpoint-interval", "5", "--set", "metrics.log_interval=1", "--name", name)
    job_id = int(out.split("submitted job ")[1].split()[0])
    job_dir = re.search(r"checkpoints are in (\S+)", out).group(1)
    wait_for(f"job {job_id}'s step {FAULT_AFTER_STEP}",
             lambda: (job_row(cluster, job_id)["last_step"] or 0) >= FAULT_AFTER_STEP)
    if kind == "retry":
        fault = f"kill -KILL $(pgrep -P $(cat /tmp/fsdp-job-{job_id}.agent))"
        on_node(cluster, nodes - 1, fault)
    else:
        on_node(cluster, 0, f"scancel --batch --signal=USR1 {job_id}")
    fault_at = time.time()
    mark = RETRY_MARK if kind == "retry" else f"job {job_id} run 1 on"
    probe = (f"grep -c -F {json.dumps(mark)} {job_dir}/slurm-{job_id}.out; "
             f"wc -l < {job_dir}/metrics.jsonl")

    def counts() -> tuple[int, int]:
        marks, lines = on_node(cluster, 0, probe).split()[-2:]
        return int(marks), int(lines)

    lines_at_restart = wait_for(f"job {job_id}'s restart", lambda: (c := counts())[0] > 0 and c[1])
    wait_for(f"job {job_id}'s first step after the restart", lambda: counts()[1] > lines_at_restart)
    first_step_at = time.time()
    wait_for(f"job {job_id}'s end", lambda: job_row(cluster, job_id)["state"] == "COMPLETED")
    log = on_node(cluster, 0, f"cat {job_dir}/slurm-{job_id}.out")
    return phases(kind, log, fault_at, first_step_at)


def plot(results: dict[str, list[Phases]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["retry in the allocation", "requeue (baseline)"]
    runs = [results["retry"], results["requeue"]]
    ended = [statistics.median(p.step_ended_s for p in r) for r in runs]
    restarted = [statistics.median(p.restarted_s for p in r) for r in runs]
    first = [statistics.median(p.first_step_s for p in r) for r in runs]
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ax.barh(labels, ended, color="#999", label="step ends")
    ax.barh(labels, [r - e for r, e in zip(restarted, ended, strict=True)], left=ended, color="#c44",
            label="health check / requeue wait, scheduling, prolog")
    ax.barh(labels, [f - r for f, r in zip(first, restarted, strict=True)], left=restarted, color="#48c",
            label="torchrun, rendezvous, load, first step")
    ax.set_xlabel("seconds from the fault (median)")
    ax.set_title("Recovery of a failed training step under Slurm")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", help="the cluster (default: the one brought up last)")
    parser.add_argument("--nodes", type=int, default=2, help="nodes of each job (default 2)")
    parser.add_argument("--repeat", type=int, default=1, help="measurements of each kind (default 1)")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, help="write a stacked bar chart (PNG) here")
    args = parser.parse_args()

    results: dict[str, list[Phases]] = {"retry": [], "requeue": []}
    for repeat in range(args.repeat):
        for kind in results:
            print(f"[{repeat + 1}/{args.repeat}] {kind}: a {args.nodes}-node tiny job, fault after step "
                  f"{FAULT_AFTER_STEP}", flush=True)
            measured = recover(args.cluster, kind, args.nodes, repeat)
            results[kind].append(measured)
            print(f"  step ended {measured.step_ended_s:.1f} s, restarted {measured.restarted_s:.1f} s, "
                  f"first step {measured.first_step_s:.1f} s after the fault (checkpoint load "
                  f"{measured.checkpoint_load_s} s)", flush=True)
    retry_s = statistics.median(p.first_step_s for p in results["retry"])
    requeue_s = statistics.median(p.first_step_s for p in results["requeue"])
    print(f"fault -> first step again, median of {args.repeat}: {retry_s:.1f} s retried in the allocation, "
          f"{requeue_s:.1f} s through a requeue (baseline): {requeue_s / max(retry_s, 1e-3):.1f}x faster")
    if args.output:
        args.output.write_text(json.dumps({k: [asdict(p) for p in v] for k, v in results.items()}, indent=2))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
