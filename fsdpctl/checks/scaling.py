"""`fsdpctl scale-test`: strong- and weak-scaling runs of the deployed trainer over 1..N nodes.

Strong scaling keeps the global batch fixed (more nodes, less work each); weak scaling keeps the batch
per rank fixed (more nodes, more work). The trainer refuses a global batch that does not split evenly
over the ranks, so strong scaling's is a multiple of the least common multiple of every world size in
the sweep (`strong_global_batch`); a rank's share above STRONG_MICRO_BATCH_MAX sequences runs as
gradient accumulation. Both report throughput in tokens/s over all ranks and the scaling efficiency
at k nodes, E(k) = throughput(k) / (k * throughput(1)): 1.0 is linear scaling.
The throughput of a run is the mean over its steps after the first `WARMUP_STEPS` (start-up, lazy
allocation). Results go to `scaling.json` and `scaling.png` in the run's directory under
`$FSDPCTL_HOME/reports/<cluster>/`, which `fsdpctl down` leaves in place.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from pydantic import ConfigDict, Field

from fsdpctl import remote
from fsdpctl.checks.batch import batch_settings, set_args
from fsdpctl.checks.context import CheckContext, CheckError, Frozen, check_context
from fsdpctl.checks.nodes import check_inventory
from fsdpctl.checks.report import PLOTS_MISSING, plots_available
from fsdpctl.checks.torchrun import RUN_TIMEOUT_S, read_remote_metrics
from fsdpctl.console import say, stage
from fsdpctl.deploy import DeployError
from fsdpctl.errors import CommandError, UsageError
from fsdpctl.slurm_nodes import power_up_all
from fsdpctl.state import ClusterRecord, ClusterState, cluster_operation
from infra.spec import ClusterSpec

WARMUP_STEPS = 2
# Sequences per rank per micro-batch in weak scaling, and the least per rank at the largest size in
# strong scaling: small enough for CPU nodes.
MICRO_BATCH = 2
# The most sequences per rank per micro-batch in strong scaling. The LCM of the world sizes can be
# large (1, 2, 4, ..., 128 and 255 nodes of 8 GPUs: 261,120 sequences, 32,640 per rank on one node,
# 128 GiB per rank for the smoke model by `fsdp-train --estimate`); in micro-batches of at most 512
# sequences (2 GiB) every run fits a GPU.
STRONG_MICRO_BATCH_MAX = 512


_log = stage("scale-test")


class ScalingRun(Frozen):
    """One run of the sweep: its size, the trainer's batch settings (by their `--set` names, as in
    scaling.json), and its throughput after warm-up."""

    model_config = ConfigDict(validate_by_name=True, serialize_by_alias=True)

    nodes: int
    ranks: int
    steps: int
    """Steps the run logged."""
    global_batch_size: int = Field(alias="training.global_batch_size")
    gradient_accumulation: int = Field(alias="training.gradient_accumulation")
    micro_batch_size: int | None = Field(alias="training.micro_batch_size")
    """None: the trainer derives it from the two above."""
    tokens_per_s: float
    """Mean over the steps after the first WARMUP_STEPS, all ranks together."""
    step_time_s: float


class ScalingMode(Frozen):
    runs: list[ScalingRun]
    efficiency: dict[str, float]
    """E(k) by node count k (as text: JSON object keys)."""


class ScalingResult(Frozen):
    """scaling.json."""

    cluster: str
    nproc_per_node: int
    steps: int
    warmup_steps: int
    node_counts: list[int]
    measured_at: str
    """ISO 8601 UTC."""
    strong: ScalingMode
    weak: ScalingMode


def node_counts(n: int) -> list[int]:
    """1, 2, 4, ... up to n, always ending with n."""
    counts = [1 << i for i in range(int(math.log2(n)) + 1)] if n >= 1 else []
    return counts if counts and counts[-1] == n else [*counts, n]


def efficiency(throughputs: dict[int, float]) -> dict[int, float]:
    """E(k) = T(k) / (k * T(1)) for every measured node count k."""
    base = throughputs.get(1)
    if not base:
        raise ValueError("efficiency needs a positive 1-node throughput")
    return {k: t / (k * base) for k, t in sorted(throughputs.items())}


def strong_global_batch(counts: list[int], nproc: int) -> int:
    """The smallest multiple of the LCM of the sweep's world sizes (so every one splits it) that gives
    every rank at least MICRO_BATCH sequences at the largest."""
    lcm = math.lcm(*(k * nproc for k in counts))
    return lcm * max(1, math.ceil(MICRO_BATCH * max(counts) * nproc / lcm))


def strong_settings(global_batch: int, world_size: int) -> dict[str, int | None]:
    """The trainer settings of a strong-scaling run of `global_batch` (a multiple of `world_size`):
    each rank's share in the fewest equal micro-batches of at most STRONG_MICRO_BATCH_MAX sequences."""
    share = global_batch // world_size
    accumulation = next(a for a in range(1, share + 1)
                        if share % a == 0 and share // a <= STRONG_MICRO_BATCH_MAX)
    return batch_settings(world_size, micro_batch=share // accumulation, accumulation=accumulation)


def weak_settings(world_size: int) -> dict[str, int | None]:
    """The trainer settings of a weak-scaling run: MICRO_BATCH sequences per rank, one micro-batch."""
    return batch_settings(world_size, micro_batch=MICRO_BATCH, accumulation=1)


def _run(ctx: CheckContext, mode: str, k: int, steps: int, overrides: dict[str, int | None]
         ) -> ScalingRun:
    metrics = f"{ctx.work_dir}/{mode}-{k}.jsonl"
    args = ["-m", "trainer", "--config", ctx.spec.trainer.config, "--steps", str(steps), "--resume", "none",
            "--metrics-file", metrics, "--seed", "0", *set_args(overrides)]
    job = ctx.job(f"{mode}-{k}", args, ranks=ctx.ranks[:k])
    failure = job.failure(job.wait(RUN_TIMEOUT_S))
    if failure:
        raise CheckError(f"{mode} scaling run on {k} node(s) failed: {failure}")
    lines = read_remote_metrics(ctx.record, ctx.ranks[0], metrics).steps
    timed = lines[WARMUP_STEPS:]
    if not timed:
        raise CheckError(f"{mode} scaling run on {k} node(s) logged {len(lines)} steps; need more than "
                         f"{WARMUP_STEPS} (raise --steps)")
    # `overrides` are the trainer settings by their `--set` names: ScalingRun's aliases.
    return ScalingRun(nodes=k, ranks=k * ctx.nproc, steps=len(lines), **overrides,
                      tokens_per_s=sum(r.tokens_per_s for r in timed) / len(timed),
                      step_time_s=sum(r.step_time_s for r in timed) / len(timed))


def _plot(result: ScalingResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    try:
        for mode, sweep in (("strong", result.strong), ("weak", result.weak)):
            ks = [r.nodes for r in sweep.runs]
            ax_t.plot(ks, [r.tokens_per_s for r in sweep.runs], marker="o", label=f"{mode} scaling")
            ax_e.plot(ks, [sweep.efficiency[str(k)] for k in ks], marker="o", label=f"{mode} scaling")
        ks = [r.nodes for r in result.strong.runs]
        base = result.strong.runs[0].tokens_per_s
        ax_t.plot(ks, [base * k for k in ks], linestyle=":", color="grey", label="linear (strong)")
        ax_e.axhline(1.0, linestyle=":", color="grey", label="linear")
        for ax, ylabel in ((ax_t, "tokens/s (all ranks)"), (ax_e, "efficiency T(k) / (k T(1))")):
            ax.set_xlabel("nodes")
            ax.set_ylabel(ylabel)
            ax.set_xticks(ks)
            ax.grid(True, alpha=0.3)
            ax.legend()
        ax_e.set_ylim(0, max(1.1, *(max(s.efficiency.values()) for s in (result.strong, result.weak))))
        fig.suptitle(f"{result.cluster}: scaling over {result.nproc_per_node} rank(s) per node")
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def _sweep(ctx: CheckContext, mode: str, counts: list[int], steps: int,
           settings: Callable[[int], dict[str, int | None]]) -> ScalingMode:
    """One run per node count, `settings(world size)` its batch, and the efficiency over them."""
    runs = []
    for k in counts:
        _log(f"{mode} scaling on {k} node(s) ...")
        run = _run(ctx, mode, k, steps, settings(k * ctx.nproc))
        _log(f"{mode} scaling on {k} node(s): {run.tokens_per_s:.0f} tokens/s")
        runs.append(run)
    eff = efficiency({r.nodes: r.tokens_per_s for r in runs})
    return ScalingMode(runs=runs, efficiency={str(k): e for k, e in eff.items()})


def run_scaling(state: ClusterState, record: ClusterRecord, spec: ClusterSpec, *, steps: int = 20
                ) -> tuple[ScalingResult, list[Path]]:
    """The strong and weak sweeps on the nodes of `record` (the cluster's record and `spec` its spec, as
    the command read them), written to scaling.json (and scaling.png) in the run's directory; returns
    the result and the files written."""
    plots = plots_available()
    if not plots:
        _log(f"note: {PLOTS_MISSING}")
    ctx = check_context(state, record, spec, "scale-test", steps=steps, out=_log)
    inventory = check_inventory(ctx)
    if inventory.status == "fail":
        raise CheckError(inventory.summary)
    ctx = replace(ctx, interfaces=inventory.interfaces)
    counts = node_counts(len(ctx.ranks))
    remote.run_all(record, f"mkdir -p {ctx.work_dir}", timeout=30)
    global_batch = strong_global_batch(counts, ctx.nproc)
    measured_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        strong = _sweep(ctx, "strong", counts, steps, lambda ranks: strong_settings(global_batch, ranks))
        weak = _sweep(ctx, "weak", counts, steps, weak_settings)
    finally:
        remote.run_all(record, f"rm -rf {ctx.work_dir}", timeout=60, check=False)
    result = ScalingResult(cluster=state.name, nproc_per_node=ctx.nproc, steps=steps,
                           warmup_steps=WARMUP_STEPS, node_counts=counts, measured_at=measured_at,
                           strong=strong, weak=weak)
    json_path, png_path = ctx.run_dir / "scaling.json", ctx.run_dir / "scaling.png"
    json_path.write_text(result.model_dump_json(indent=2))
    paths = [json_path]
    if plots:
        _plot(result, png_path)
        paths.append(png_path)
    return result, paths


def cmd_scale_test(args) -> int:
    if args.steps <= WARMUP_STEPS:
        raise UsageError(f"--steps {args.steps} leaves nothing to measure after {WARMUP_STEPS} warm-up "
                           "steps; use e.g. --steps 20")
    try:
        with cluster_operation(args.cluster, "scale-test") as (state, record, spec):
            power_up_all(record, spec, say, what="scale-test")
            result, paths = run_scaling(state, record, spec, steps=args.steps)
    except (CheckError, DeployError) as e:
        raise CommandError(f"scale test of cluster {record.name!r} failed: {e}\nFix the cause and rerun "
                           "`fsdpctl scale-test`.") from None
    say(f"{'mode':<7} {'nodes':>5} {'ranks':>5} {'tokens/s':>10} {'efficiency':>10}")
    for mode, sweep in (("strong", result.strong), ("weak", result.weak)):
        for run in sweep.runs:
            say(f"{mode:<7} {run.nodes:>5} {run.ranks:>5} {run.tokens_per_s:>10.0f} "
                f"{sweep.efficiency[str(run.nodes)]:>10.2f}")
    say("results: " + ", ".join(str(p) for p in paths) + " (kept after `fsdpctl down`)")
    return 0
