#!/usr/bin/python3
"""Job progress watcher (installed by the fsdp-cluster `slurm` role on the Slurm controller).

A training job whose ranks stop making progress (a frozen or hung rank: every other rank waits for
it in a collective) holds its nodes until NCCL's or gloo's own timeout, 10 to 30 minutes, if ever.
This watcher ends such a step sooner. Every FSDP_WATCH_POLL_S seconds it lists the running training
steps (`srun --job-name=train` in fsdpctl's batch script) and watches the trainer's metrics file in
the job's directory (its working directory), which rank 0 appends to at every flush
(metrics.log_interval steps). A step whose file has not grown for
max(FSDP_STALL_MIN_S, FSDP_STALL_FACTOR x its usual interval between growths) has stalled: the
watcher writes why into the job directory's `stalled` file and ends the step with SIGKILL (a stalled
step cannot checkpoint: every rank takes part in a checkpoint). The batch script counts that as a
failed step and starts it again from the last checkpoint, in the allocation when every node passes
its health check, else through a requeue.

The usual interval is the median of the intervals between growths this watcher saw, or, before it saw
two, the step time of the last record times the step records of the last growth. A step is judged
only once its file grew during it: loading a large model or compiling may take long, and a job that
writes no metrics (`fsdpctl train --command`) is not watched. Nor is a step once its run wrote its
summary record: what follows (the Hugging Face export, the shutdown) writes no metrics and takes what
it takes.

Settings (environment, from /etc/fsdp-cluster/job-watcher.env): FSDP_STALL_FACTOR, FSDP_STALL_MIN_S,
FSDP_WATCH_POLL_S.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

STALL_FACTOR = float(os.environ.get("FSDP_STALL_FACTOR", "10"))
STALL_MIN_S = float(os.environ.get("FSDP_STALL_MIN_S", "300"))
POLL_S = float(os.environ.get("FSDP_WATCH_POLL_S", "5"))
STEP_NAME = "train"
"""The name of the training step in fsdpctl's batch script (srun --job-name)."""
METRICS = "metrics.jsonl"
KEPT_INTERVALS = 20


def log(message):
    print(message, flush=True)


@dataclass
class Watched:
    """One running training step and what was seen of its metrics file."""

    metrics: str
    size: int
    grew_at: float | None = None
    """When the file last grew during this step (monotonic); None: not yet."""
    intervals: list = field(default_factory=list)
    estimate_s: float | None = None
    """The last record's step time times the step records of the last growth."""
    ended: bool = False
    finished: bool = False
    """The run wrote its summary: no more metrics will come."""

    def usual_interval_s(self):
        if len(self.intervals) >= 2:
            return statistics.median(self.intervals)
        return self.estimate_s


def run(argv):
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode:
        log(f"`{' '.join(argv)}` exited {result.returncode}: {result.stderr.strip()}")
    return result


def training_steps():
    """{"JOB.STEP": the job's directory} of every running training step."""
    steps = run(["squeue", "--noheader", "--steps", "--format", "%i|%j"])
    ids = [line.split("|")[0] for line in steps.stdout.splitlines() if line.split("|")[-1] == STEP_NAME]
    if not ids:
        return {}
    jobs = run(["squeue", "--noheader", "--jobs", ",".join(sorted({i.split(".")[0] for i in ids})),
                "--format", "%i|%Z"])
    dirs = dict(line.split("|", 1) for line in jobs.stdout.splitlines() if "|" in line)
    return {i: dirs[i.split(".")[0]] for i in ids if i.split(".")[0] in dirs}


def size_of(path):
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def read_growth(path, start):
    """(the last step record's step time times the step records written after byte `start`, or None;
    whether those bytes hold the run's summary record)."""
    with open(path, "rb") as f:
        f.seek(start)
        lines = f.read().decode(errors="replace").splitlines()
    records, summary = [], False
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if record.get("event") == "summary":
            summary = True
        elif "step_time_s" in record and "event" not in record:
            records.append(record)
    estimate = float(records[-1]["step_time_s"]) * len(records) if records else None
    return estimate, summary


def watch(step, watched, now):
    """Update what is known of one step; end it when it has stalled."""
    size = size_of(watched.metrics)
    if size is None or watched.ended or watched.finished:
        return
    if size != watched.size:
        if watched.grew_at is not None:
            watched.intervals = [*watched.intervals, now - watched.grew_at][-KEPT_INTERVALS:]
        if size > watched.size:
            estimate, watched.finished = read_growth(watched.metrics, watched.size)
            watched.estimate_s = estimate or watched.estimate_s
        watched.size, watched.grew_at = size, now
        return
    if watched.grew_at is None:
        return  # nothing written during this step yet: still starting
    usual = watched.usual_interval_s() or 0.0
    limit = max(STALL_MIN_S, STALL_FACTOR * usual)
    silent = now - watched.grew_at
    if silent <= limit:
        return
    reason = (f"no metrics for {silent:.0f} s (limit {limit:.0f} s: {STALL_FACTOR:g} x the usual "
              f"{usual:.1f} s between writes, at least {STALL_MIN_S:g} s): a rank stopped making progress")
    job_dir = os.path.dirname(watched.metrics)
    try:
        with open(os.path.join(job_dir, "stalled"), "w") as f:
            f.write(reason + "\n")
    except OSError as e:
        log(f"step {step}: cannot write {job_dir}/stalled: {e}")
    log(f"step {step}: {reason}: ending it")
    run(["scancel", "--signal=KILL", step])
    watched.ended = True


def main():
    log(f"watching running training steps every {POLL_S:g} s: one whose metrics stop for "
        f"{STALL_FACTOR:g} x its usual interval (at least {STALL_MIN_S:g} s) is ended")
    watching = {}
    while True:
        try:
            steps = training_steps()
        except (OSError, ValueError) as e:
            log(f"cannot list the running steps: {e}")
            steps = None
        if steps is not None:
            now = time.monotonic()
            for step in set(watching) - set(steps):
                del watching[step]
            for step, job_dir in steps.items():
                metrics = os.path.join(job_dir, METRICS)
                if step not in watching:
                    # What the file held when the step started is an earlier step's.
                    watching[step] = Watched(metrics=metrics, size=size_of(metrics) or 0)
                watch(step, watching[step], now)
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())
