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

The stall rule judges a step only once it wrote metrics, so a step that hangs before its first record
(a rendezvous or an NCCL/EFA initialisation that never completes, a rank waiting for a lost node's
collective) is not its business; its GPUs idle at about 0 %. So the watcher also asks Prometheus (the
monitoring role's, at FSDP_PROMETHEUS_URL), at most every ASK_EVERY_S, about every training step (the
trainer's or a `--command` job's) it has seen running for FSDP_GPU_IDLE_S, until its run wrote its
summary record: dcgm-exporter's DCGM_FI_DEV_GPU_UTIL, the highest value of each GPU of the job's
nodes over that window (jobs have their nodes to themselves: --exclusive). When every GPU stayed below
FSDP_GPU_IDLE_PCT the job is underused: the watcher writes why into the job directory's `underused`
file and sends SIGUSR1 to the batch script, which asks the workers to checkpoint and requeues the job
(not counted as a failure). A worker that never answers (hung, or not yet past the start, where
SIGUSR1 is still ignored) keeps the step running: after FSDP_GPU_IDLE_GRACE_S the watcher ends it with
SIGKILL, and the batch script, signalled, requeues the job all the same. Once per job: the `underused`
file stays, and a job found underused again (merely input-bound, say) is only logged. No series for
every node of the job (nodes without GPUs, dcgm-exporter missing, Prometheus unreachable) is no
judgement: said once per job, nothing done.

Settings (environment, from /etc/fsdp-cluster/job-watcher.env): FSDP_STALL_FACTOR, FSDP_STALL_MIN_S,
FSDP_WATCH_POLL_S, FSDP_GPU_IDLE_PCT (0: the utilisation rule is off), FSDP_GPU_IDLE_S,
FSDP_GPU_IDLE_GRACE_S, FSDP_PROMETHEUS_URL (empty: no Prometheus, no utilisation judged).
"""

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

STALL_FACTOR = float(os.environ.get("FSDP_STALL_FACTOR", "10"))
STALL_MIN_S = float(os.environ.get("FSDP_STALL_MIN_S", "300"))
POLL_S = float(os.environ.get("FSDP_WATCH_POLL_S", "5"))
STEP_NAME = "train"
"""The name of the training step in fsdpctl's batch script (srun --job-name)."""
METRICS = "metrics.jsonl"
KEPT_INTERVALS = 20
GPU_IDLE_PCT = float(os.environ.get("FSDP_GPU_IDLE_PCT", "5"))
GPU_IDLE_S = float(os.environ.get("FSDP_GPU_IDLE_S", "1800"))
GPU_IDLE_GRACE_S = float(os.environ.get("FSDP_GPU_IDLE_GRACE_S", "600"))
PROMETHEUS_URL = os.environ.get("FSDP_PROMETHEUS_URL", "").rstrip("/")
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
"""dcgm-exporter's GPU utilisation (percent, per GPU: label `gpu`) as the monitoring role's Prometheus
scrapes it: job `dcgm`, each target labelled `node` with its inventory host name, the node's Slurm name."""
GPU_UTIL_JOB = "dcgm"
UNDERUSED = "underused"
ASK_EVERY_S = 60.0
"""Seconds between two questions to Prometheus about one step: the window is 300 s or more, and each
question reads every sample of it."""
PROMETHEUS_TIMEOUT_S = 10


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


@dataclass
class GpuUse:
    """One running training step as the utilisation rule sees it."""

    job: str
    job_dir: str
    seen_at: float
    """When this watcher first saw the step running (monotonic): the window starts no earlier."""
    asked_at: float | None = None
    """When the last question went to Prometheus."""
    judged: bool = False
    """Found underused: acted on (SIGUSR1) or, the job's second time, only logged."""
    signalled_at: float | None = None
    """When this watcher sent the job SIGUSR1 (monotonic)."""
    ended: bool = False
    """Still running after the grace: ended with SIGKILL."""


@dataclass(frozen=True)
class GpuPeak:
    """The highest utilisation of one GPU over the window."""

    node: str
    gpu: str
    pct: float


class NoJudgement(Exception):
    """Why the GPUs of a job could not be judged."""


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


def job_nodes(job):
    """The Slurm names of the nodes job `job` runs on; NoJudgement when Slurm does not say."""
    try:
        listed = run(["squeue", "--noheader", "--jobs", job, "--format", "%N"]).stdout.strip()
        nodes = run(["scontrol", "show", "hostnames", listed]).stdout.split() if listed else []
    except OSError as e:
        raise NoJudgement(f"cannot list its nodes: {e}") from e
    if not nodes:
        raise NoJudgement("Slurm lists no nodes for it")
    return nodes


def promql_string(text):
    """`text` as a PromQL string literal (JSON's escapes are Go's, which PromQL reads)."""
    return json.dumps(text)


def gpu_peaks(nodes, window_s):
    """The highest DCGM_FI_DEV_GPU_UTIL of every GPU of `nodes` over the last `window_s` seconds, from
    Prometheus; NoJudgement when it cannot say for every node."""
    if not PROMETHEUS_URL:
        raise NoJudgement("no Prometheus to ask (FSDP_PROMETHEUS_URL is empty)")
    # Node names are host names; anything but a letter, digit, - or _ is escaped for the regex.
    names = "|".join(re.sub(r"([^A-Za-z0-9_-])", r"\\\1", node) for node in nodes)
    selector = f"{GPU_UTIL}{{job={promql_string(GPU_UTIL_JOB)},node=~{promql_string(names)}}}"
    query = f"max_over_time({selector}[{window_s:.0f}s])"
    url = f"{PROMETHEUS_URL}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    try:
        with urllib.request.urlopen(url, timeout=PROMETHEUS_TIMEOUT_S) as response:
            answer = json.load(response)
        series = answer["data"]["result"]
        peaks = [GpuPeak(node=str(s["metric"].get("node")), gpu=str(s["metric"].get("gpu", "?")),
                         pct=float(s["value"][1])) for s in series]
    except urllib.error.HTTPError as e:
        raise NoJudgement(f"Prometheus at {PROMETHEUS_URL} answered HTTP {e.code} {e.reason}") from e
    except OSError as e:
        raise NoJudgement(f"Prometheus at {PROMETHEUS_URL} is unreachable ({e})") from e
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise NoJudgement(f"Prometheus at {PROMETHEUS_URL} gave an answer without a vector "
                          f"({type(e).__name__}: {e})") from e
    unreadable = [f"{peak.node} GPU {peak.gpu}" for peak in peaks if not math.isfinite(peak.pct)]
    if unreadable:
        raise NoJudgement(f"Prometheus gave no number for {', '.join(unreadable)}")
    missing = [node for node in nodes if node not in {peak.node for peak in peaks}]
    if missing:
        raise NoJudgement(f"Prometheus has no {GPU_UTIL} for {', '.join(missing)} (no GPUs, "
                          "or dcgm-exporter not installed or not scraped)")
    return peaks


def watch_use(step, use, now, unjudged_jobs):
    """Judge the GPU utilisation of one step once it ran for the window; ask an underused job to
    checkpoint and requeue (once per job), and end its step when it has not within the grace.
    `unjudged_jobs`: the jobs whose GPUs could not be judged, said once each."""
    if GPU_IDLE_PCT <= 0 or use.ended:
        return
    if use.signalled_at is not None:
        if now - use.signalled_at > GPU_IDLE_GRACE_S:
            log(f"step {step}: still running {now - use.signalled_at:.0f} s after SIGUSR1 (at most "
                f"{GPU_IDLE_GRACE_S:g} s to checkpoint): ending it; the batch script requeues the job")
            run(["scancel", "--signal=KILL", step])
            use.ended = True
        return
    if use.judged or now - use.seen_at < GPU_IDLE_S:
        return
    if use.asked_at is not None and now - use.asked_at < ASK_EVERY_S:
        return
    use.asked_at = now
    try:
        nodes = job_nodes(use.job)
        peaks = gpu_peaks(nodes, GPU_IDLE_S)
    except NoJudgement as e:
        if use.job not in unjudged_jobs:
            unjudged_jobs.add(use.job)
            log(f"job {use.job}: GPU utilisation not judged: {e}")
        return
    top = max(peaks, key=lambda peak: peak.pct)
    if top.pct >= GPU_IDLE_PCT:
        return
    use.judged = True
    reason = (f"every GPU of {len(nodes)} node(s) stayed below {GPU_IDLE_PCT:g} % utilisation for "
              f"{GPU_IDLE_S:.0f} s (the highest: {top.pct:g} % on {top.node} GPU {top.gpu}): underused")
    marker = os.path.join(use.job_dir, UNDERUSED)
    if os.path.exists(marker):
        log(f"step {step}: {reason}; the job was asked once already ({marker}): left running")
        return
    try:
        with open(marker, "w") as f:
            f.write(reason + "\n")
    except OSError as e:
        log(f"step {step}: cannot write {marker}: {e}")
    log(f"step {step}: {reason}: asking job {use.job} to checkpoint and requeue")
    # The batch script traps USR1, asks the workers to checkpoint and requeues the job.
    run(["scancel", "--batch", "--signal", "USR1", use.job])
    use.signalled_at = now


@dataclass
class Watch:
    """What the watcher knows of the running training steps, from one look to the next."""

    progress: dict[str, Watched] = field(default_factory=dict)
    """The stall rule's view of each step."""
    use: dict[str, GpuUse] = field(default_factory=dict)
    """The utilisation rule's view of each step."""
    unjudged_jobs: set[str] = field(default_factory=set)

    def look(self, steps, now):
        """Apply both rules to the running training steps `steps` (training_steps())."""
        for step in set(self.progress) - set(steps):
            del self.progress[step]
        for step in set(self.use) - set(steps):
            del self.use[step]
        for step, job_dir in steps.items():
            metrics = os.path.join(job_dir, METRICS)
            if step not in self.progress:
                # What the file held when the step started is an earlier step's.
                self.progress[step] = Watched(metrics=metrics, size=size_of(metrics) or 0)
            watch(step, self.progress[step], now)
            if step not in self.use:
                self.use[step] = GpuUse(job=step.split(".")[0], job_dir=job_dir, seen_at=now)
            # A step the stall rule ended is going; one whose run wrote its summary is exporting or
            # shutting down, which leaves the GPUs idle and takes what it takes.
            if not (self.progress[step].ended or self.progress[step].finished):
                watch_use(step, self.use[step], now, self.unjudged_jobs)


def main():
    log(f"watching running training steps every {POLL_S:g} s: one whose metrics stop for "
        f"{STALL_FACTOR:g} x its usual interval (at least {STALL_MIN_S:g} s) is ended")
    if GPU_IDLE_PCT > 0:
        log(f"and a job whose every GPU stays below {GPU_IDLE_PCT:g} % for {GPU_IDLE_S:g} s (Prometheus at "
            f"{PROMETHEUS_URL or 'none'}) is asked to checkpoint and requeue, once; its step is ended "
            f"{GPU_IDLE_GRACE_S:g} s later if still running")
    else:
        log("GPU utilisation is not judged (FSDP_GPU_IDLE_PCT 0)")
    watching = Watch()
    while True:
        try:
            steps = training_steps()
        except (OSError, ValueError) as e:
            log(f"cannot list the running steps: {e}")
            steps = None
        if steps is not None:
            watching.look(steps, time.monotonic())
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())
