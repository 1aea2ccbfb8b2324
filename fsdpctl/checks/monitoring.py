"""The `monitoring` check: what Prometheus recorded while the `fsdp` check trained.

Read after the `fsdp` check's runs end, from Prometheus on node 0 (through fsdpctl.monitor's SSH
tunnel) over their time window, and from their metrics:

- GPU utilisation: every GPU's mean DCGM_FI_DEV_GPU_UTIL after warm-up >= GPU_UTIL_BOUND (skipped,
  with the reason, where there are no GPUs: the local target).
- Network: the peak receive and transmit rate of every node (kernel interfaces plus EFA
  hw_counters) < NETWORK_USE_BOUND of its link capacity (infra catalog; a local node's veth reports
  its own speed).
- Memory leaks: per rank, the least-squares slope of host RSS (and device memory on GPUs) against the
  step, after warm-up, must stay under HOST_LEAK_BOUND_MIB (DEVICE_...) per 100 steps. These come
  from the fsdp run's own metrics (every rank's memory at every logged step, gathered by the
  trainer), not from Prometheus: a scrape every few seconds sees too few steps of a short smoke run
  to fit a slope.

The thresholds and why are in docs/smoke-test.md. The series for the report's plots are the
result's `series`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, Literal

from fsdpctl import remote
from fsdpctl.checks.context import CheckContext, CheckResult, Details, Frozen, Status
from fsdpctl.checks.training import TrainingRun, Window
from fsdpctl.monitor import RATE_WINDOW, Prometheus, PrometheusError, link_capacity_bps
from trainer.records import StepRecord

GPU_UTIL_BOUND = 0.90
NETWORK_USE_BOUND = 0.80
# Growth per 100 steps after warm-up above which a rank is said to leak (docs/smoke-test.md).
HOST_LEAK_BOUND_MIB = 256.0
DEVICE_LEAK_BOUND_MIB = 64.0
# The largest one-off rise of a healthy rank's host RSS in a smoke run: a checkpoint save adds ~13 MiB
# and RSS moves by +-7 MiB (docs/smoke-test.md). Device memory repeats exactly once warmed up.
HOST_HEALTHY_JUMP_MIB = 20.0
DEVICE_HEALTHY_JUMP_MIB = 0.0
WARMUP_FRACTION = 0.25  # of a job's steps; at least WARMUP_MIN_STEPS
WARMUP_MIN_STEPS = 2
MIN_FIT_STEPS = 4  # distinct steps after warm-up needed to fit a slope at all
MIB = 2**20
RATE_WINDOW_S = int(RATE_WINDOW.removesuffix("s"))

Point = tuple[float, float]
Points = list[Point]


class RangeSeries(Frozen):
    """One series of a Prometheus range query: its labels and its (Unix time, value) samples."""

    labels: dict[str, str]
    points: Points


class LeakVerdict(Frozen):
    """Growth of one rank's memory series after warm-up, against its bound."""

    status: Status
    mib_per_100_steps: float | None
    """The fitted slope; None when too few steps were sampled to fit one (`skip`)."""
    bound_mib_per_100_steps: float
    steps_fitted: int
    reason: str | None = None
    """Why the series was skipped."""


class GpuUtilisation(Frozen):
    status: Literal["measured", "skip"]
    reason: str | None = None
    """Why it was not measured."""
    mean_util: dict[str, float] = {}
    """Mean utilisation (0-1) after warm-up, by `node/gpuN`."""
    missing: list[str] = []
    """The GPUs that reported no utilisation."""


class NodeNetwork(Frozen):
    peak_gbps: float
    link_gbps: float | None
    peak_share: float | None
    """The peak over the link capacity; None where the capacity is unknown."""


class NetworkUse(Frozen):
    nodes: dict[str, NodeNetwork]
    series_bps: dict[str, dict[str, Points]]
    """Direction (`rx`, `tx`) -> node -> (Unix time, bit/s)."""
    capacity_source: str


class MonitoringDetails(Details):
    check: Literal["monitoring"] = "monitoring"
    window: Window
    gpu: GpuUtilisation
    network: NetworkUse
    leaks: dict[str, LeakVerdict]
    """By series: `rank R host RSS`, `rank R device memory`."""
    per_rank_tokens_per_s: dict[str, float]
    """Mean tokens/s each rank measured of itself, by rank."""


class MonitoringSeries(Frozen):
    """The window's series, for the report's plots."""

    window: Window
    cpu_util: dict[str, Points]
    gpu_util: dict[str, Points]
    network_bps: dict[str, dict[str, Points]]
    link_bps: dict[str, float]
    memory: dict[str, Points]
    """(step, bytes) by series, as `leaks`."""
    per_rank_tokens_per_s: dict[str, float]


class MonitoringResult(CheckResult):
    details: MonitoringDetails | None = None
    series: MonitoringSeries | None = None


def least_squares_slope(points: Iterable[Point]) -> float:
    """The slope of the least-squares line through (x, y) points; ValueError for fewer than two
    distinct x."""
    pts = list(points)
    n = len(pts)
    xs = {x for x, _ in pts}
    if len(xs) < 2:
        raise ValueError(f"a slope needs two distinct x values, got {sorted(xs)}")
    mean_x = sum(x for x, _ in pts) / n
    mean_y = sum(y for _, y in pts) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in pts)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in pts)
    return sxy / sxx


def after_warmup(points: Points) -> Points:
    """(step, value) points past warm-up: the first WARMUP_FRACTION of the series' steps (at least
    WARMUP_MIN_STEPS) fill allocator caches, optimizer state and data buffers once. Counted from
    the series' first step, not step 0: a job resumed at step 41 warms up again."""
    if not points:
        return []
    first = min(x for x, _ in points)
    last = max(x for x, _ in points)
    warmup_end = first + max(WARMUP_MIN_STEPS, int((last - first + 1) * WARMUP_FRACTION))
    return [(x, y) for x, y in points if x >= warmup_end]


def fit_steps_needed(bound_mib: float, healthy_jump_mib: float) -> int:
    """Distinct steps after warm-up that a fit needs before its slope can be judged against the bound:
    least squares over n steps turns a one-off rise of J in their middle into a slope of about 1.5 J / n
    per step, so with fewer than 150 J / bound steps a healthy series' rise (a checkpoint save) would
    read as a leak of more than the bound per 100 steps."""
    return max(MIN_FIT_STEPS, math.ceil(150 * healthy_jump_mib / bound_mib))


def leak_verdict(points: Points, bound_mib: float, healthy_jump_mib: float = 0.0) -> LeakVerdict:
    """Growth per 100 steps of one rank's memory series (step, bytes) after warm-up, against a bound;
    `healthy_jump_mib`: the largest one-off rise the series shows without a leak (fit_steps_needed)."""
    fitted = after_warmup(points)
    steps = len({x for x, _ in fitted})
    needed = fit_steps_needed(bound_mib, healthy_jump_mib)
    if steps < needed:
        return LeakVerdict(status="skip", mib_per_100_steps=None, bound_mib_per_100_steps=bound_mib,
                           steps_fitted=steps,
                           reason=f"{steps} distinct step(s) sampled after warm-up, {needed} needed to tell "
                                  f"a leak of {bound_mib:g} MiB per 100 steps from a one-off rise of "
                                  f"{healthy_jump_mib:g} MiB (run more steps)")
    growth = least_squares_slope(fitted) * 100 / MIB
    return LeakVerdict(status="fail" if growth > bound_mib else "pass", mib_per_100_steps=round(growth, 3),
                       bound_mib_per_100_steps=bound_mib, steps_fitted=steps)


def gpu_utilisation(util: list[RangeSeries], expected: list[str], since: float) -> GpuUtilisation:
    """Mean utilisation (0-1) of each GPU's DCGM_FI_DEV_GPU_UTIL samples taken at or after `since`,
    keyed `node/gpuN`, and which of the `expected` GPUs reported none: a GPU node without DCGM data
    is a failed check, not a skipped one (the gate would otherwise pass on a broken exporter)."""
    mean = {}
    for series in util:
        values = [v for t, v in series.points if t >= since]
        if values:
            gpu = f"{series.labels.get('node', '?')}/gpu{series.labels.get('gpu', '?')}"
            mean[gpu] = sum(values) / len(values) / 100
    return GpuUtilisation(status="measured", mean_util=mean, missing=[g for g in expected if g not in mean])


def gpu_problems(gpu: GpuUtilisation) -> list[str]:
    problems = []
    if gpu.missing:
        shown = ", ".join(gpu.missing[:4]) + (f" and {len(gpu.missing) - 4} more" if len(gpu.missing) > 4
                                              else "")
        problems.append(f"no DCGM utilisation from {len(gpu.missing)} GPU(s) ({shown}): is dcgm-exporter "
                        "running and scraped? (fsdpctl configure --tags monitoring)")
    low = {g: u for g, u in gpu.mean_util.items() if u < GPU_UTIL_BOUND}
    if low:
        problems.append("GPU utilisation under {:.0%}: {}".format(
            GPU_UTIL_BOUND, ", ".join(f"{g} {u:.0%}" for g, u in sorted(low.items()))))
    return problems


# (a step record's memory per rank, leak bound, healthy one-off rise, what it is); device memory is only
# in the records of GPU runs.
MEMORY_SERIES: tuple[tuple[Callable[[StepRecord], list[int] | None], float, float, str], ...] = (
    (lambda record: record.host_rss_bytes_per_rank, HOST_LEAK_BOUND_MIB, HOST_HEALTHY_JUMP_MIB, "host RSS"),
    (lambda record: record.device_mem_bytes_per_rank, DEVICE_LEAK_BOUND_MIB, DEVICE_HEALTHY_JUMP_MIB,
     "device memory"))


def memory_series(lines: list[StepRecord]) -> dict[str, tuple[float, float, Points]]:
    """`rank R host RSS` (and `... device memory`) -> (leak bound, healthy one-off rise, [(step, bytes)])
    from a run's step records: every rank's memory at each step the trainer read it (each logged step)."""
    out: dict[str, tuple[float, float, Points]] = {}
    for per_rank, bound, jump, kind in MEMORY_SERIES:
        for record in lines:
            for rank, value in enumerate(per_rank(record) or []):
                points = out.setdefault(f"rank {rank} {kind}", (bound, jump, []))[2]
                points.append((float(record.step), float(value)))
    return out


def _by_label(result: list[RangeSeries], label: str) -> dict[str, Points]:
    return {series.labels.get(label, "?"): series.points for series in result}


def _range_series(result: list[dict[str, Any]]) -> list[RangeSeries]:
    """A range query's JSON result (Prometheus' HTTP API) as typed series."""
    return [RangeSeries(labels=r["metric"], points=[(float(t), float(v)) for t, v in r["values"]])
            for r in result]


def check_monitoring(ctx: CheckContext, training: TrainingRun | None) -> MonitoringResult:
    """`training`: the fsdp check's run (None when that check did not train)."""
    if training is None:
        return MonitoringResult(status="skip",
                                summary="not run: the fsdp check did not train (no time window)")
    try:
        with Prometheus(ctx.record) as prom:
            details, series = _gather(ctx, prom, training)
    except PrometheusError as e:
        return MonitoringResult(status="fail", summary=str(e))
    problems, notes = [], []
    gpu = details.gpu
    if gpu.status == "skip":
        notes.append(f"GPU utilisation not checked ({gpu.reason})")
    else:
        problems += gpu_problems(gpu)
    network = details.network
    for node, figures in sorted(network.nodes.items()):
        if figures.peak_share is not None and figures.peak_share >= NETWORK_USE_BOUND:
            problems.append(f"{node} peaked at {figures.peak_share:.0%} of its {figures.link_gbps:g} "
                            f"Gbit/s link (bound {NETWORK_USE_BOUND:.0%})")
    leaks = details.leaks
    if not leaks:
        problems.append("no memory figures in the fsdp run's metrics (host_rss_bytes_per_rank): was it "
                        "trained by a trainer older than this fsdpctl? (fsdpctl deploy)")
    for name, verdict in sorted(leaks.items()):
        if verdict.status == "fail":
            problems.append(f"{name} grows {verdict.mib_per_100_steps:.1f} MiB per 100 steps (bound "
                            f"{verdict.bound_mib_per_100_steps:g})")
    fitted = [v for v in leaks.values() if v.mib_per_100_steps is not None]
    if leaks and not fitted:
        notes.append(f"leak check skipped: {next(iter(leaks.values())).reason}")
    if problems:
        return MonitoringResult(status="fail", summary="; ".join(problems), details=details, series=series)
    peak = max((f.peak_share or 0 for f in network.nodes.values()), default=0)
    worst = max((v.mib_per_100_steps for v in fitted if v.mib_per_100_steps is not None), default=None)
    return MonitoringResult(details=details, series=series, summary="; ".join([
        *([] if gpu.status == "skip" else [f"GPU util >= {min(gpu.mean_util.values(), default=0):.0%}"]),
        f"network peak {peak:.1%} of link",
        f"memory growth max {worst:.1f} MiB/100 steps over {len(fitted)} rank series" if worst is not None
        else "memory growth not fitted", *notes]))


def _gather(ctx: CheckContext, prom: Prometheus, training: TrainingRun
            ) -> tuple[MonitoringDetails, MonitoringSeries]:
    start, end = training.window
    step_s = 1.0

    def rng(query: str) -> list[RangeSeries]:
        return _range_series(prom.query_range(query, start, end, step_s))

    # GPUs (dcgm-exporter); past the first WARMUP_FRACTION of the window.
    gpu_series: dict[str, Points] = {}
    if not ctx.on_gpu:
        gpu = GpuUtilisation(status="skip", reason="no GPUs on this target (local nodes)")
    else:
        util = rng('DCGM_FI_DEV_GPU_UTIL{job="dcgm"}')
        expected = [f"{n.name}/gpu{i}" for n in remote.cluster_nodes(ctx.record) if n.rank in ctx.ranks
                    for i in range(ctx.spec.instance.gpus)]
        gpu = gpu_utilisation(util, expected, since=start + (end - start) * WARMUP_FRACTION)
        gpu_series = _by_label(util, "node")

    # Network: kernel interfaces plus EFA, per direction, against the link.
    catalog_link = link_capacity_bps(ctx.record, ctx.spec)
    link = {r["metric"].get("node"): float(r["value"][1]) * 8
            for r in prom.query('max by (node) (node_network_speed_bytes{device!="lo"})', at=end)}
    series: dict[str, dict[str, Points]] = {}
    for direction, netdev, efa in (("rx", "receive", "rx"), ("tx", "transmit", "tx")):
        # EFA traffic bypasses the kernel's interfaces; nodes without EFA add 0.
        efa_bps = f"sum by (node) (rate(fsdp_efa_{efa}_bytes_total[{RATE_WINDOW}])) * 8"
        q = (f'sum by (node) (rate(node_network_{netdev}_bytes_total{{device!="lo"}}[{RATE_WINDOW}])) * 8 '
             f'+ on (node) group_left () ({efa_bps} or sum by (node) (up{{job="node"}}) * 0)')
        series[direction] = _by_label(rng(q), "node")
    # A rate over RATE_WINDOW at the window's first seconds still holds the previous check's traffic.
    settled = start + RATE_WINDOW_S if end - start > 2 * RATE_WINDOW_S else start
    nodes: dict[str, NodeNetwork] = {}
    for node in sorted(set(series["rx"]) | set(series["tx"])):
        capacity = catalog_link or link.get(node)
        peak = max((v for d in ("rx", "tx") for t, v in series[d].get(node, []) if t >= settled), default=0.0)
        nodes[node] = NodeNetwork(peak_gbps=round(peak / 1e9, 4),
                                  link_gbps=capacity / 1e9 if capacity else None,
                                  peak_share=round(peak / capacity, 4) if capacity else None)
    network = NetworkUse(nodes=nodes, series_bps=series,
                         capacity_source="infra catalog" if catalog_link else "interface speed")

    # Memory per rank against the step (the run's own records); throughput per rank (Prometheus).
    memory = memory_series(training.steps)
    per_rank: dict[str, list[float]] = defaultdict(list)
    for tokens in rng("fsdp_trainer_rank_tokens_per_second"):
        per_rank[tokens.labels.get("rank", "?")] += [v for _, v in tokens.points]
    per_rank_tokens_per_s = {rank: sum(v) / len(v) for rank, v in sorted(per_rank.items()) if v}
    cpu = rng(f'1 - avg by (node) (rate(node_cpu_seconds_total{{mode="idle"}}[{RATE_WINDOW}]))')
    details = MonitoringDetails(
        window=(start, end), gpu=gpu, network=network,
        leaks={name: leak_verdict(points, bound, jump) for name, (bound, jump, points) in memory.items()},
        per_rank_tokens_per_s=per_rank_tokens_per_s)
    plotted = MonitoringSeries(
        window=(start, end), cpu_util=_by_label(cpu, "node"), gpu_util=gpu_series, network_bps=series,
        link_bps={n: (f.link_gbps or 0) * 1e9 for n, f in nodes.items()},
        memory={name: points for name, (_, _, points) in memory.items()},
        per_rank_tokens_per_s=per_rank_tokens_per_s)
    return details, plotted
