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

The thresholds and why are in docs/smoke-test.md. Series for the report's plots go to
ctx.training["monitoring"].
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from fsdpctl import remote
from fsdpctl.checks.context import CheckContext, CheckResult
from fsdpctl.monitor import RATE_WINDOW, Prometheus, PrometheusError, link_capacity_bps

GPU_UTIL_BOUND = 0.90
NETWORK_USE_BOUND = 0.80
# Growth per 100 steps after warm-up above which a rank is said to leak (docs/smoke-test.md).
HOST_LEAK_BOUND_MIB = 256.0
DEVICE_LEAK_BOUND_MIB = 64.0
WARMUP_FRACTION = 0.25  # of a job's steps; at least WARMUP_MIN_STEPS
WARMUP_MIN_STEPS = 2
MIN_FIT_STEPS = 4  # distinct steps after warm-up needed to fit a slope
MIB = 2**20
RATE_WINDOW_S = int(RATE_WINDOW.removesuffix("s"))


def least_squares_slope(points: Iterable[tuple[float, float]]) -> float:
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


def after_warmup(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(step, value) points past warm-up: the first WARMUP_FRACTION of the series' steps (at least
    WARMUP_MIN_STEPS) fill allocator caches, optimizer state and data buffers once. Counted from
    the series' first step, not step 0: a job resumed at step 41 warms up again."""
    if not points:
        return []
    first = min(x for x, _ in points)
    last = max(x for x, _ in points)
    warmup_end = first + max(WARMUP_MIN_STEPS, int((last - first + 1) * WARMUP_FRACTION))
    return [(x, y) for x, y in points if x >= warmup_end]


def leak_verdict(points: list[tuple[float, float]], bound_mib: float) -> dict[str, Any]:
    """Growth per 100 steps of one rank's memory series (step, bytes) after warm-up, against a bound:
    {"status": pass|fail|skip, "mib_per_100_steps", "bound_mib_per_100_steps", "steps_fitted", "reason"}."""
    fitted = after_warmup(points)
    steps = sorted({x for x, _ in fitted})
    verdict: dict[str, Any] = {"bound_mib_per_100_steps": bound_mib, "steps_fitted": len(steps),
                               "mib_per_100_steps": None}
    if len(steps) < MIN_FIT_STEPS:
        verdict.update(status="skip", reason=f"{len(steps)} distinct step(s) sampled after warm-up, "
                       f"{MIN_FIT_STEPS} needed (run more steps, or scrape more often)")
        return verdict
    growth = least_squares_slope(fitted) * 100 / MIB
    verdict["mib_per_100_steps"] = round(growth, 3)
    verdict["status"] = "fail" if growth > bound_mib else "pass"
    return verdict


def gpu_utilisation(util: list[dict], expected: list[str], since: float) -> dict[str, Any]:
    """Mean utilisation (0-1) of each GPU's DCGM_FI_DEV_GPU_UTIL samples taken at or after `since`,
    keyed `node/gpuN`, and which of the `expected` GPUs reported none: a GPU node without DCGM data
    is a failed check, not a skipped one (the gate would otherwise pass on a broken exporter)."""
    mean = {}
    for r in util:
        values = [float(v) for t, v in r["values"] if float(t) >= since]
        if values:
            mean[f"{r['metric'].get('node', '?')}/gpu{r['metric'].get('gpu', '?')}"] = \
                sum(values) / len(values) / 100
    return {"status": "measured", "mean_util": mean, "missing": [g for g in expected if g not in mean],
            "series": _series(util, "node")}


def gpu_problems(gpu: dict[str, Any]) -> list[str]:
    problems = []
    if gpu["missing"]:
        shown = ", ".join(gpu["missing"][:4]) + (f" and {len(gpu['missing']) - 4} more"
                                                  if len(gpu["missing"]) > 4 else "")
        problems.append(f"no DCGM utilisation from {len(gpu['missing'])} GPU(s) ({shown}): is dcgm-exporter "
                        "running and scraped? (fsdpctl configure --tags monitoring)")
    low = {g: u for g, u in gpu["mean_util"].items() if u < GPU_UTIL_BOUND}
    if low:
        problems.append("GPU utilisation under {:.0%}: {}".format(
            GPU_UTIL_BOUND, ", ".join(f"{g} {u:.0%}" for g, u in sorted(low.items()))))
    return problems


Points = list[tuple[float, float]]


# (step record key, leak bound, what it is); device memory is only in the records of GPU runs.
MEMORY_SERIES = (("host_rss_bytes_per_rank", HOST_LEAK_BOUND_MIB, "host RSS"),
                 ("device_mem_bytes_per_rank", DEVICE_LEAK_BOUND_MIB, "device memory"))


def memory_series(lines: list[dict]) -> dict[str, tuple[float, Points]]:
    """`rank R host RSS` (and `... device memory`) -> (leak bound, [(step, bytes)]) from a run's step
    records: every rank's memory at each step the trainer read it (each logged step)."""
    out: dict[str, tuple[float, Points]] = {}
    for key, bound, kind in MEMORY_SERIES:
        for record in lines:
            for rank, value in enumerate(record.get(key) or []):
                points = out.setdefault(f"rank {rank} {kind}", (bound, []))[1]
                points.append((float(record["step"]), float(value)))
    return out


def _series(result: list[dict], label: str) -> dict[str, list[list[float]]]:
    return {r["metric"].get(label, "?"): [[float(t), float(v)] for t, v in r["values"]] for r in result}


def check_monitoring(ctx: CheckContext, result: CheckResult) -> None:
    window = ctx.training.get("window")
    if not window:
        result.status, result.summary = "skip", "not run: the fsdp check did not train (no time window)"
        return
    start, end = window
    step_s = 1.0
    try:
        with Prometheus(ctx.state) as prom:
            facts = _gather(ctx, prom, start, end, step_s)
    except PrometheusError as e:
        result.fail(str(e))
        return
    problems, notes = [], []
    gpu = facts.pop("gpu")
    if gpu["status"] == "skip":
        notes.append(f"GPU utilisation not checked ({gpu['reason']})")
    else:
        problems += gpu_problems(gpu)
    network = facts["network"]
    for node, figures in sorted(network["nodes"].items()):
        if figures["peak_share"] is not None and figures["peak_share"] >= NETWORK_USE_BOUND:
            problems.append(f"{node} peaked at {figures['peak_share']:.0%} of its {figures['link_gbps']:g} "
                            f"Gbit/s link (bound {NETWORK_USE_BOUND:.0%})")
    leaks = facts["leaks"]
    if not leaks:
        problems.append("no memory figures in the fsdp run's metrics (host_rss_bytes_per_rank): was it "
                        "trained by a trainer older than this fsdpctl? (fsdpctl deploy)")
    for name, verdict in sorted(leaks.items()):
        if verdict["status"] == "fail":
            problems.append(f"{name} grows {verdict['mib_per_100_steps']:.1f} MiB per 100 steps (bound "
                            f"{verdict['bound_mib_per_100_steps']:g})")
    fitted = [v for v in leaks.values() if v["status"] != "skip"]
    if leaks and not fitted:
        notes.append("leak check skipped: " + next(iter(leaks.values()))["reason"])
    facts["gpu"] = gpu
    result.details = facts
    peak = max((f["peak_share"] or 0 for f in network["nodes"].values()), default=0)
    worst = max((v["mib_per_100_steps"] for v in fitted), default=None)
    if problems:
        result.fail("; ".join(problems))
    else:
        result.summary = "; ".join([
            *([] if gpu["status"] == "skip"
              else [f"GPU util >= {min(gpu['mean_util'].values(), default=0):.0%}"]),
            f"network peak {peak:.1%} of link",
            f"memory growth max {worst:.1f} MiB/100 steps over {len(fitted)} rank series" if worst is not None
            else "memory growth not fitted", *notes])


def _gather(ctx: CheckContext, prom: Prometheus, start: float, end: float, step_s: float) -> dict[str, Any]:
    rng = lambda q: prom.query_range(q, start, end, step_s)  # noqa: E731
    facts: dict[str, Any] = {"window": [start, end]}

    # GPUs (dcgm-exporter); past the first WARMUP_FRACTION of the window.
    if not ctx.on_gpu:
        facts["gpu"] = {"status": "skip", "reason": "no GPUs on this target (local nodes)"}
    else:
        util = rng('DCGM_FI_DEV_GPU_UTIL{job="dcgm"}')
        expected = [f"{n.name}/gpu{i}" for n in remote.cluster_nodes(ctx.state) if n.rank in ctx.ranks
                    for i in range(ctx.spec.instance.gpus)]
        facts["gpu"] = gpu_utilisation(util, expected, since=start + (end - start) * WARMUP_FRACTION)

    # Network: kernel interfaces plus EFA, per direction, against the link.
    catalog_link = link_capacity_bps(ctx.state)
    nodes: dict[str, Any] = {}
    link = {r["metric"].get("node"): float(r["value"][1]) * 8
            for r in prom.query('max by (node) (node_network_speed_bytes{device!="lo"})', at=end)}
    series = {}
    for direction, netdev, efa in (("rx", "receive", "rx"), ("tx", "transmit", "tx")):
        # EFA traffic bypasses the kernel's interfaces; nodes without EFA add 0.
        efa_bps = f"sum by (node) (rate(fsdp_efa_{efa}_bytes_total[{RATE_WINDOW}])) * 8"
        q = (f'sum by (node) (rate(node_network_{netdev}_bytes_total{{device!="lo"}}[{RATE_WINDOW}])) * 8 '
             f'+ on (node) group_left () ({efa_bps} or sum by (node) (up{{job="node"}}) * 0)')
        series[direction] = _series(rng(q), "node")
    # A rate over RATE_WINDOW at the window's first seconds still holds the previous check's traffic.
    settled = start + RATE_WINDOW_S if end - start > 2 * RATE_WINDOW_S else start
    for node in sorted(set(series["rx"]) | set(series["tx"])):
        capacity = catalog_link or link.get(node)
        peak = max((v for d in ("rx", "tx") for t, v in series[d].get(node, []) if t >= settled), default=0.0)
        nodes[node] = {"peak_gbps": round(peak / 1e9, 4), "link_gbps": capacity / 1e9 if capacity else None,
                       "peak_share": round(peak / capacity, 4) if capacity else None}
    facts["network"] = {"nodes": nodes, "series_bps": series,
                        "capacity_source": "infra catalog" if catalog_link else "interface speed"}

    # Memory per rank against the step (the run's own records); throughput per rank (Prometheus).
    memory = memory_series(ctx.training.get("steps") or [])
    facts["leaks"] = {name: leak_verdict(points, bound) for name, (bound, points) in memory.items()}
    tokens = rng("fsdp_trainer_rank_tokens_per_second")
    per_rank: dict[str, list[float]] = defaultdict(list)
    for r in tokens:
        per_rank[r["metric"].get("rank", "?")] += [float(v) for _, v in r["values"]]
    facts["per_rank_tokens_per_s"] = {rank: sum(v) / len(v) for rank, v in sorted(per_rank.items()) if v}
    cpu = rng(f'1 - avg by (node) (rate(node_cpu_seconds_total{{mode="idle"}}[{RATE_WINDOW}]))')
    ctx.training["monitoring"] = {
        "window": [start, end], "cpu_util": _series(cpu, "node"),
        "gpu_util": (facts["gpu"].get("series") or {}), "network_bps": series,
        "link_bps": {n: (f["link_gbps"] or 0) * 1e9 for n, f in nodes.items()},
        "memory": {name: points for name, (_, points) in memory.items()},
        "per_rank_tokens_per_s": facts["per_rank_tokens_per_s"]}
    facts["gpu"].pop("series", None)
    return facts
