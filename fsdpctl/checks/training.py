"""The `fsdp` and `recovery` checks: a short multi-node FSDP run (loss, memory balance, gradient
sync share, verified checkpoints, resume) and recovery from a node whose workers are killed."""

from __future__ import annotations

import shlex
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from fsdpctl import remote
from fsdpctl.checks import nccl_network
from fsdpctl.checks.batch import batch_settings, set_args
from fsdpctl.checks.context import CheckContext, CheckError, CheckResult, Details, Frozen
from fsdpctl.checks.nccl_network import NcclNetwork
from fsdpctl.checks.torchrun import RUN_TIMEOUT_S, TorchrunJob, read_remote_metrics
from fsdpctl.console import stage
from fsdpctl.deploy import deployed_venv
from fsdpctl.slurm import PROMETHEUS_TEXTFILE_DIR, SlurmJob
from trainer.records import StepRecord, SummaryRecord

_log = stage("smoke")

# FSDP shards parameters evenly; peak memory of the most loaded rank over the least loaded one.
MEMORY_BALANCE_BOUND = 1.25
# The guide: gradient synchronisation under 15% of the step time (gated on GPUs only: on gloo/CPU,
# communication and computation share the same two cores).
GRAD_SYNC_SHARE_BOUND = 0.15
RECOVERY_TIMEOUT_S = 300
POLL_S = 0.25


Window = tuple[float, float]
"""Wall-clock time (Unix seconds) from the start of a check's runs to their end."""


class RankPeakMemory(Frozen):
    rank: int
    max_mem_bytes: int


class TrainingRun(Frozen):
    """What the fsdp check trained: the monitoring check reads Prometheus over its window and fits
    its step records; the report plots them."""

    window: Window
    steps: list[StepRecord] = []
    summary: SummaryRecord | None = None
    per_rank: list[RankPeakMemory] = []


class CheckpointListing(BaseModel):
    """One row of `python -m trainer.checkpoint list --json`: the fields the check reads."""

    # The listing's other fields (path, world_size, created_at, committed) are not the check's.
    model_config = ConfigDict(frozen=True, extra="ignore")

    step: int | None
    """None: a Hugging Face export, or a save never committed."""
    verified: bool
    bytes: int | None
    problems: list[str]


_LISTING = TypeAdapter(list[CheckpointListing])


class ResumeFacts(Frozen):
    from_step: int
    first_step: int | None
    last_step: int | None


class FsdpDetails(Details):
    check: Literal["fsdp"] = "fsdp"
    steps: int
    """Steps the run logged."""
    world_size: int
    nccl_network: NcclNetwork | None = None
    """GPU nodes: the network NCCL chose (its log)."""
    loss_first: float | None = None
    """Mean loss of the first quarter of the steps."""
    loss_last: float | None = None
    mem_max_min_ratio: float | None = None
    grad_sync_share: float | None = None
    tokens_per_s: float | None = None
    checkpoints: list[CheckpointListing] = []
    resume: ResumeFacts | None = None


class FsdpResult(CheckResult):
    details: FsdpDetails | None = None
    training: TrainingRun
    """What was trained (no steps when the run failed)."""


class RecoveryDetails(Details):
    check: Literal["recovery"] = "recovery"
    victim_node: int
    killed_after_step: int
    resumed_at_step: int
    workers_restarted_after_s: float
    recovery_time_s: float
    """From the kill to the first step the restarted workers logged."""
    checkpoint_interval: int
    poll_interval_s: float
    last_step: int | None = None
    """The run's last logged step."""


class RecoveryResult(CheckResult):
    details: RecoveryDetails | None = None


def trainer_args(ctx: CheckContext, *, steps: int, checkpoint_dir: str | None, interval: int,
                  metrics: str, resume: str) -> list[str]:
    """The trainer's command line for a run of the spec's trainer config on every rank of `ctx`."""
    checkpointing = ["--checkpoint-dir", checkpoint_dir, "--checkpoint-interval", str(interval)] \
        if checkpoint_dir else []
    return ["-m", "trainer", "--config", ctx.spec.trainer.config, "--steps", str(steps), *checkpointing,
            "--metrics-file", metrics, "--resume", resume, "--seed", "0",
            # The config's own global batch splits over some world sizes only (batch.py).
            *set_args(batch_settings(ctx.world_size)),
            # Per-rank metrics for Prometheus (the monitoring role's textfile directory), every step:
            # the monitoring check fits memory against the step (a gather per step is fine in a check).
            "--set", f"metrics.prometheus_dir={PROMETHEUS_TEXTFILE_DIR}", "--set", "metrics.log_interval=1"]


def _list_checkpoints(ctx: CheckContext, checkpoint_dir: str) -> list[CheckpointListing]:
    """The checkpoints under `checkpoint_dir`, verified by the trainer on the first node; none when it
    cannot list them (the check then says no checkpoint was written)."""
    venv = deployed_venv(ctx.record)
    proc = remote.run(ctx.record, ctx.ranks[0], f"{venv}/bin/python -m trainer.checkpoint list --json "
                      f"{shlex.quote(checkpoint_dir)}", timeout=120, check=False)
    if proc.returncode != 0:
        return []
    try:
        return _LISTING.validate_json(proc.stdout)
    except ValidationError as e:
        raise CheckError(f"`python -m trainer.checkpoint list --json {checkpoint_dir}` on node "
                         f"{ctx.ranks[0]} printed no checkpoint listing ({e.errors()[0]['msg']}): deploy "
                         "this checkout's trainer (`fsdpctl deploy`) and rerun") from None


def _job(ctx: CheckContext, name: str, module_args: list[str], **kwargs: Any) -> TorchrunJob | SlurmJob:
    """The check's training run: a Slurm batch job where Slurm runs (a failed run is requeued and
    resumes from its checkpoint), else torchrun agents started over SSH (`--max-restarts`)."""
    if not ctx.slurm:
        return ctx.job(name, module_args, **kwargs)
    kwargs.pop("max_restarts", None)
    return SlurmJob(ctx.record, ctx.spec, ctx.ranks, module_args, nproc=ctx.nproc,
                    port=ctx.spec.trainer.master_port, log_dir=ctx.run_dir, name=name, work_dir=ctx.work_dir,
                    **kwargs)


def check_fsdp(ctx: CheckContext) -> FsdpResult:
    """Train `ctx.steps` steps with checkpoints, gate what the run logged, then resume from its last
    checkpoint in a second run."""
    started = time.time()
    steps = ctx.steps
    interval = max(1, steps // 2)
    # Every rank writes into one checkpoint directory, so checkpoints need the shared file system.
    ckpt = f"{ctx.work_dir}/fsdp-checkpoints" if ctx.shared else None
    metrics = f"{ctx.work_dir}/fsdp-metrics.jsonl"
    job = _job(ctx, "fsdp", trainer_args(ctx, steps=steps, checkpoint_dir=ckpt, interval=interval,
                                         metrics=metrics, resume="none"),
               env=nccl_network.NCCL_DEBUG_ENV if ctx.on_gpu else None)
    failure = job.failure(job.wait(RUN_TIMEOUT_S))
    if failure:
        return FsdpResult(status="fail", summary=f"training run failed: {failure}",
                          training=TrainingRun(window=(started, time.time())))
    log = read_remote_metrics(ctx.record, ctx.ranks[0], metrics)
    lines = log.steps

    def trained() -> TrainingRun:  # the window ends when the check's last run has
        return TrainingRun(window=(started, time.time()), steps=lines, summary=log.summary,
                           per_rank=per_rank_figures(lines))

    problems: list[str] = []
    network = None
    if ctx.on_gpu:  # EFA instances must train over aws-ofi-nccl on EFA, with GPUDirect RDMA
        network = nccl_network.parse_nccl_network(job.logs())
        problems += nccl_network.network_problems(network, efa_interfaces=ctx.spec.instance.efa_interfaces,
                                                  multi_node=len(ctx.ranks) > 1)
    if len(lines) < steps:
        return FsdpResult(status="fail", summary=f"the run logged {len(lines)} of {steps} steps to {metrics}",
                          training=trained())

    first, last, loss_problems = _loss_trend(lines)
    problems += loss_problems
    ratio, memory_problems = _memory_balance(lines)
    problems += memory_problems
    timed = lines[1:] or lines  # the first step includes start-up work
    share, sync_problems = _grad_sync_share(timed, gated=ctx.on_gpu)
    problems += sync_problems
    checkpoints = _list_checkpoints(ctx, ckpt) if ckpt else []
    problems += _checkpoint_problems(ckpt, checkpoints)
    verified = [c for c in checkpoints if c.verified]
    # A training checkpoint has a step; a Hugging Face export in the directory has none.
    resumable = [c.step for c in verified if c.step is not None]
    resume = None
    if ckpt is None:
        checkpoint_note = ("checkpoint and resume skipped: the cluster has no shared file system "
                           "(enable storage.fsx)")
    elif resumable:
        resume, resume_problems = _resume(ctx, ckpt, from_step=max(resumable), interval=interval)
        problems += resume_problems
        checkpoint_note = f"{len(verified)} checkpoint(s) verified; resumed at step {resume.first_step}"

    details = FsdpDetails(steps=len(lines), world_size=ctx.world_size, nccl_network=network, loss_first=first,
                          loss_last=last, mem_max_min_ratio=ratio, grad_sync_share=share,
                          tokens_per_s=sum(r.tokens_per_s for r in timed) / len(timed),
                          checkpoints=checkpoints, resume=resume)
    if problems:
        return FsdpResult(status="fail", summary="; ".join(problems), details=details, training=trained())
    sync_note = "" if ctx.on_gpu else " (reported, not gated, on gloo)"
    sync = "not measured" if share is None else f"{share:.0%}"
    return FsdpResult(summary=(f"loss {first:.3f} -> {last:.3f}; memory max/min {ratio:.2f}; grad sync "
                               f"{sync}{sync_note}; {checkpoint_note}"), details=details, training=trained())


def _loss_trend(lines: list[StepRecord]) -> tuple[float, float, list[str]]:
    """Mean loss of the first and of the last quarter of the steps; the last must be lower."""
    quarter = max(1, len(lines) // 4)
    first = sum(r.loss for r in lines[:quarter]) / quarter
    last = sum(r.loss for r in lines[-quarter:]) / quarter
    if last < first:
        return first, last, []
    return first, last, [f"loss did not decrease (mean of the first {quarter} steps {first:.4f}, "
                         f"of the last {quarter} {last:.4f})"]


def _memory_balance(lines: list[StepRecord]) -> tuple[float, list[str]]:
    """The worst max/min ratio of peak memory across ranks over the run: FSDP shards evenly."""
    ratio = max(r.mem_max_min_ratio for r in lines)
    if ratio > MEMORY_BALANCE_BOUND:
        return ratio, [f"memory unbalanced: max/min peak memory across ranks {ratio:.2f} > "
                       f"{MEMORY_BALANCE_BOUND}"]
    return ratio, []


def _grad_sync_share(timed: list[StepRecord], gated: bool) -> tuple[float | None, list[str]]:
    """The mean share of a step spent in gradient sync over the profiled steps; gated only on GPUs
    (on gloo it says little about the cluster)."""
    shares = [r.grad_sync_share for r in timed if r.grad_sync_share is not None]
    share = sum(shares) / len(shares) if shares else None
    if gated and share is None:
        return None, ["gradient-sync share not measured: no step after the first was profiled (the "
                      "trainer config's metrics.profile_steps is 0, or --steps is below 2)"]
    if gated and share >= GRAD_SYNC_SHARE_BOUND:
        return share, [f"gradient sync takes {share:.0%} of the step (bound {GRAD_SYNC_SHARE_BOUND:.0%})"]
    return share, []


def _checkpoint_problems(ckpt: str | None, checkpoints: list[CheckpointListing]) -> list[str]:
    """With a shared file system the run must have left checkpoints whose manifests verify."""
    if ckpt is None:
        return []
    if not checkpoints:
        return [f"no checkpoint written under {ckpt}"]
    if all(c.verified for c in checkpoints):
        return []
    bad = [p for c in checkpoints for p in c.problems]
    return ["checkpoint manifest does not verify: " + "; ".join(bad[:3])]


def _resume(ctx: CheckContext, ckpt: str, from_step: int, interval: int) -> tuple[ResumeFacts, list[str]]:
    """A second run with `--resume auto` must start at the step after the latest checkpoint and run to
    its end."""
    resume_steps = ctx.steps + max(2, ctx.steps // 4)
    resumed_metrics = f"{ctx.work_dir}/fsdp-resume-metrics.jsonl"
    job = _job(ctx, "fsdp-resume", trainer_args(ctx, steps=resume_steps, checkpoint_dir=ckpt,
                                               interval=interval, metrics=resumed_metrics, resume="auto"))
    failure = job.failure(job.wait(RUN_TIMEOUT_S))
    resumed = read_remote_metrics(ctx.record, ctx.ranks[0], resumed_metrics).steps
    resume = ResumeFacts(from_step=from_step, first_step=resumed[0].step if resumed else None,
                         last_step=resumed[-1].step if resumed else None)
    if failure:
        return resume, [f"resume run failed: {failure}"]
    if resume.first_step != from_step + 1 or resume.last_step != resume_steps:
        return resume, [f"resume did not continue from the checkpoint at step {from_step}: "
                        f"{resume.model_dump()}"]
    return resume, []


def per_rank_figures(lines: list[StepRecord]) -> list[RankPeakMemory]:
    """Peak memory of each rank over the run. (Throughput per rank is what each rank measured of
    itself, from Prometheus: the monitoring check's `per_rank_tokens_per_s`.)"""
    per_step = [r.mem_bytes_per_rank for r in lines if r.mem_bytes_per_rank]
    if not per_step:
        return []
    world = len(per_step[-1])
    return [RankPeakMemory(rank=rank, max_mem_bytes=max(m[rank] for m in per_step if len(m) == world))
            for rank in range(world)]


def check_recovery(ctx: CheckContext) -> RecoveryResult:
    if not ctx.shared:
        return RecoveryResult(status="skip",
                              summary="no shared file system: restarted ranks cannot load checkpoints")
    # Under Slurm every poll of the job is a round trip to the controller: a longer run keeps the
    # kill inside it.
    steps, interval = max(40 if ctx.slurm else 16, ctx.steps), 4
    ckpt, metrics = f"{ctx.work_dir}/recovery-checkpoints", f"{ctx.work_dir}/recovery-metrics.jsonl"
    victim = ctx.ranks[-1]
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: with the shared store, gloo reconnects to the previous
    # round's addresses after a restart and the job hangs (pytorch/pytorch#135712).
    job = _job(ctx, "recovery", trainer_args(ctx, steps=steps, checkpoint_dir=ckpt, interval=interval,
                                            metrics=metrics, resume="auto"),
                  max_restarts=3, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    try:
        timed = _kill_and_time_recovery(ctx, job, victim, metrics, interval)
    except CheckError as e:
        job.stop()
        return RecoveryResult(status="fail", summary=str(e))
    failure = job.failure(job.wait(RUN_TIMEOUT_S))
    lines = read_remote_metrics(ctx.record, ctx.ranks[0], metrics).steps
    details = timed.model_copy(update={"last_step": lines[-1].step if lines else None})
    if failure:
        return RecoveryResult(status="fail", summary=f"the run did not complete after the restart: {failure}",
                              details=details)
    if details.last_step != steps:
        return RecoveryResult(status="fail", details=details,
                              summary=f"the run stopped at step {details.last_step} of {steps}")
    return RecoveryResult(details=details, summary=(
        f"killed node {victim}'s workers after step {details.killed_after_step}; training continued at "
        f"step {details.resumed_at_step} (from the checkpoint of step {details.resumed_at_step - 1}) after "
        f"{details.recovery_time_s:.1f} s; completed {steps} steps"))


def _kill_and_time_recovery(ctx: CheckContext, job: TorchrunJob | SlurmJob, victim: int, metrics: str,
                            interval: int) -> RecoveryDetails:
    """Wait for a checkpoint and a step after it, kill the victim's workers, and time the recovery:
    from the kill to the first metrics line written by the restarted workers.

    Any step past the first checkpoint's will do: that checkpoint is then whole (a save blocks the
    step after it), and where the kill cuts a later save short, the run resumes from the one before.
    Waiting for a step between two checkpoints instead lost the race where steps are short beside a
    save (a tiny model on CPU, a large checkpoint on GPUs): every poll found the last line at a
    checkpoint's step until the run ended.

    Lines the old workers were still writing when the kill landed must not count: torchrun starts
    new workers only after a new rendezvous round, which every agent joins only after stopping its
    old workers; so once the victim has new worker pids, every later metrics line is the new
    workers'. Under Slurm the kill fails the job's step, the batch script starts it again in its
    allocation (every node passing its health check), and the new workers resume from the checkpoint
    in the same way."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        lines = read_remote_metrics(ctx.record, ctx.ranks[0], metrics).steps
        last_step = lines[-1].step if lines else 0
        if last_step > interval:
            break
        if any(code is not None for code in job.poll().values()):
            raise CheckError("the run ended before a checkpoint was written: "
                             + (job.failure({r: c or 0 for r, c in job.poll().items()}) or "no metrics"))
        if time.monotonic() > deadline:
            raise CheckError(f"no step after the first checkpoint within {RUN_TIMEOUT_S} s")
        time.sleep(POLL_S)
    killed_pids = job.kill_workers(victim)
    killed = time.monotonic()
    _log(f"recovery: killed the workers on node {victim} (pids {sorted(killed_pids)}) after step {last_step}")
    lines_before_restart: int | None = None
    restart_s = 0.0
    while time.monotonic() - killed < RECOVERY_TIMEOUT_S:
        if lines_before_restart is None:
            if job.worker_pids(victim) - killed_pids:
                restart_s = time.monotonic() - killed
                lines_before_restart = len(read_remote_metrics(ctx.record, ctx.ranks[0], metrics).steps)
        else:
            lines = read_remote_metrics(ctx.record, ctx.ranks[0], metrics).steps
            if len(lines) > lines_before_restart:
                return RecoveryDetails(victim_node=victim, killed_after_step=last_step,
                                       resumed_at_step=lines[lines_before_restart].step,
                                       workers_restarted_after_s=round(restart_s, 2),
                                       recovery_time_s=round(time.monotonic() - killed, 2),
                                       checkpoint_interval=interval, poll_interval_s=POLL_S)
        if all(code is not None for code in job.poll().values()):
            raise CheckError("the job exited after the kill instead of restarting: "
                             + (job.failure({r: c or 0 for r, c in job.poll().items()}) or "no error"))
        time.sleep(POLL_S)
    raise CheckError(f"training did not continue within {RECOVERY_TIMEOUT_S} s of the kill")
