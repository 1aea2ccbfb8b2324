"""Smoke-test reports: `report.json` (the data) and `report.html` (the same, with plots), plus the
pass/fail table printed on the terminal.

A report is a `SmokeReport`, which `run_smoke` builds from the checks' results; report.json is its
JSON (`read_report` reads it back):

    {"cluster": NAME, "target": "local"|"aws", "instance_type": ..., "nodes": N, "started_at": ISO,
     "passed": bool, "failed": [check names],
     "checks": [{"name", "status": "pass"|"fail"|"skip", "summary", "duration_s", "details"}],
     "bandwidth": the all-reduce measurement (trainer.collectives or nccl-tests) or null,
     "training": {"steps": [the fsdp run's step records], "summary": its summary record,
                  "per_rank": [{"rank", "max_mem_bytes"}], "window": [start, end] of the fsdp check
                  (Unix time), "monitoring": Prometheus series of that window}}

The plots are drawn with matplotlib's Agg back end and embedded as base64 PNG, so the HTML file is
self-contained (it can be copied off the operator machine or attached to a ticket).
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from fsdpctl.checks.bandwidth import AllReduceMeasurement, BandwidthDetails
from fsdpctl.checks.context import CheckName, Frozen, Status
from fsdpctl.checks.monitoring import MonitoringDetails, MonitoringSeries, Points
from fsdpctl.checks.nodes import InventoryDetails
from fsdpctl.checks.training import FsdpDetails, RankPeakMemory, RecoveryDetails, Window
from trainer.records import StepRecord, SummaryRecord

STATUS_MARK = {"pass": "PASS", "fail": "FAIL", "skip": "SKIP"}
PLOTS_MISSING = ("matplotlib is not installed: the report is written without plots (install the report "
                 "extra: pip install -e '.[report]')")
REPORT_JSON, REPORT_HTML = "report.json", "report.html"

CheckDetails = Annotated[
    InventoryDetails | BandwidthDetails | FsdpDetails | MonitoringDetails | RecoveryDetails,
    Field(discriminator="check")]


class CheckEntry(Frozen):
    """One check's line of the report."""

    name: CheckName
    status: Status
    summary: str
    duration_s: float
    details: CheckDetails | None = None
    """What the check measured (its own type, tagged `check`); none when it did not get that far."""


class TrainingReport(Frozen):
    """What the fsdp check trained, and the monitoring check's series of that window."""

    steps: list[StepRecord] = []
    summary: SummaryRecord | None = None
    per_rank: list[RankPeakMemory] = []
    window: Window | None = None
    monitoring: MonitoringSeries | None = None


class SmokeReport(Frozen):
    cluster: str
    target: str
    instance_type: str
    nodes: int
    nproc_per_node: int
    started_at: str
    """ISO 8601 UTC."""
    scheduler: Literal["slurm", "torchrun"]
    """How the fsdp and recovery checks ran: as Slurm jobs, or torchrun agents started over SSH."""
    passed: bool
    failed: list[CheckName]
    checks: list[CheckEntry]
    bandwidth: AllReduceMeasurement | None = None
    bandwidth_gate_gbps: float | None = None
    training: TrainingReport = TrainingReport()
    logs: str
    """The run's directory: its logs, report.json and report.html."""

    @property
    def html_path(self) -> Path:
        return Path(self.logs) / REPORT_HTML


def plots_available() -> bool:
    """Whether matplotlib can be imported; checked before the checks run, so a missing report extra
    is said up front and never ends a finished smoke test in a traceback."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def check_table(checks: Iterable[CheckEntry]) -> str:
    """The fixed-width pass/fail table the smoke test prints."""
    rows = [(c.name, STATUS_MARK[c.status], f"{c.duration_s:.1f}s", c.summary) for c in checks]
    head = ("check", "result", "time", "summary")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head[:3], widths, strict=True)) + "  " + head[3]]
    lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 7)
    for row in rows:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row[:3], widths, strict=True)) + "  " + row[3])
    return "\n".join(lines)


def _figure_png(draw: Callable) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    try:
        draw(ax)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
    finally:
        plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _bandwidth_plot(bandwidth: AllReduceMeasurement, gate_gbps: float | None) -> str:
    rows = bandwidth.results

    def draw(ax):
        sizes = [r.bytes for r in rows]
        ax.plot(sizes, [r.busbw_gbps for r in rows], marker="o", label="bus bandwidth")
        ax.plot(sizes, [r.algbw_gbps for r in rows], marker=".", linestyle="--", label="algorithm bandwidth")
        if gate_gbps is not None:
            ax.axhline(gate_gbps, color="red", linestyle=":", label=f"gate {gate_gbps:g} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"all-reduce, {bandwidth.world_size} ranks, {bandwidth.backend}")
        ax.legend()

    return _figure_png(draw)


def _loss_plot(steps: list[StepRecord]) -> str:
    def draw(ax):
        ax.plot([s.step for s in steps], [s.loss for s in steps], marker=".")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title("training loss")

    return _figure_png(draw)


def _per_rank_plot(values: Mapping[int, float], scale: float, ylabel: str, title: str) -> str:
    """A bar per rank."""
    def draw(ax):
        ranks = sorted(values)
        ax.bar([str(r) for r in ranks], [values[r] / scale for r in ranks])
        ax.set_xlabel("rank")
        ax.set_ylabel(ylabel)
        ax.set_title(title)

    return _figure_png(draw)


def _time_plot(series: Mapping[str, Points], start: float, scale: float, ylabel: str, title: str,
               lines: Mapping[str, float] | None = None) -> str:
    """One line per key over seconds since `start`; `lines`: dotted horizontal limits by label."""
    def draw(ax):
        for name, points in sorted(series.items()):
            ax.plot([t - start for t, _ in points], [v / scale for _, v in points], label=name)
        for label, value in (lines or {}).items():
            ax.axhline(value / scale, color="red", linestyle=":", label=label)
        ax.set_xlabel("seconds into the fsdp check")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if series:
            ax.legend(fontsize="small")

    return _figure_png(draw)


def _step_plot(series: Mapping[str, Points], scale: float, ylabel: str, title: str) -> str:
    def draw(ax):
        for name, points in sorted(series.items()):
            ax.plot([x for x, _ in points], [v / scale for _, v in points], marker=".", label=name)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize="x-small")

    return _figure_png(draw)


def monitoring_plots(mon: MonitoringSeries) -> dict[str, str]:
    """Utilisation, network and memory over time, and throughput measured on each rank, from the
    monitoring check's Prometheus series (the report's training.monitoring)."""
    out: dict[str, str] = {}
    start = mon.window[0]
    util = {f"CPU {n}": p for n, p in mon.cpu_util.items()}
    util.update({f"GPU {n}": [(t, v / 100) for t, v in p] for n, p in mon.gpu_util.items()})
    if util:
        out["Utilisation over time"] = _time_plot(util, start, 0.01, "%", "CPU (and GPU) utilisation")
    net = {f"{n} {d}": p for d, by_node in mon.network_bps.items() for n, p in by_node.items()}
    if net:
        links = {f"80% of {n}'s link": 0.8 * c for n, c in mon.link_bps.items() if c}
        out["Network over time"] = _time_plot(net, start, 1e9, "Gbit/s", "network (interfaces + EFA)",
                                              dict(list(links.items())[:1]))
    if mon.memory:
        out["Memory per rank over steps"] = _step_plot(mon.memory, 2**20, "MiB",
                                                       "memory per rank (leak check)")
    if mon.per_rank_tokens_per_s:
        out["Tokens/s measured on each rank"] = _per_rank_plot(
            {int(rank): tps for rank, tps in mon.per_rank_tokens_per_s.items()}, 1.0, "tokens/s",
            "throughput measured on each rank")
    return out


def plots(report: SmokeReport) -> dict[str, str]:
    """Base64 PNGs by title, for whatever data the report holds."""
    out = {}
    if report.bandwidth and report.bandwidth.results:
        out["All-reduce bandwidth vs message size"] = _bandwidth_plot(report.bandwidth,
                                                                      report.bandwidth_gate_gbps)
    training = report.training
    if training.steps:
        out["Loss"] = _loss_plot(training.steps)
    if training.per_rank:
        out["Memory per rank"] = _per_rank_plot({r.rank: r.max_mem_bytes for r in training.per_rank}, 2**20,
                                                "MiB", "peak memory per rank")
    if training.monitoring:
        out.update(monitoring_plots(training.monitoring))
    return out


def render_html(report: SmokeReport, *, with_plots: bool = True) -> str:
    esc = html.escape
    verdict = "PASSED" if report.passed else "FAILED: " + ", ".join(report.failed)
    rows = "\n".join(
        f"<tr class='{esc(c.status)}'><td>{esc(c.name)}</td><td>{STATUS_MARK[c.status]}</td>"
        f"<td>{c.duration_s:.1f} s</td><td>{esc(c.summary)}</td></tr>" for c in report.checks)
    details = "\n".join(
        f"<h3>{esc(c.name)}</h3><pre>{esc(c.details.model_dump_json(indent=2, exclude={'check'}))}</pre>"
        for c in report.checks if c.details)
    figures = "\n".join(
        f"<figure><img alt='{esc(title)}' src='data:image/png;base64,{png}'><figcaption>{esc(title)}"
        "</figcaption></figure>" for title, png in plots(report).items()) if with_plots \
        else f"<p>{esc(PLOTS_MISSING)}</p>"
    meta = (f"target: {esc(report.target)}, instance_type: {esc(report.instance_type)}, "
            f"nodes: {report.nodes}, started_at: {esc(report.started_at)}")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Smoke test: {esc(report.cluster)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; }}
td, th {{ border: 1px solid #ccc; padding: 4px 8px; text-align: left; }}
tr.pass td:nth-child(2) {{ color: #070; }} tr.fail td:nth-child(2) {{ color: #b00; font-weight: bold; }}
tr.skip td:nth-child(2) {{ color: #777; }} figure {{ display: inline-block; margin: 1em; }}
pre {{ background: #f6f6f6; padding: 8px; overflow-x: auto; }}
</style></head><body>
<h1>Smoke test: {esc(report.cluster)} &mdash; {esc(verdict)}</h1>
<p>{meta}</p>
<table><tr><th>check</th><th>result</th><th>time</th><th>summary</th></tr>
{rows}
</table>
<h2>Plots</h2>
{figures or '<p>no measurements to plot</p>'}
<h2>Details</h2>
{details}
</body></html>
"""


def write_report(directory: Path, report: SmokeReport, *, with_plots: bool = True) -> tuple[Path, Path]:
    """Write report.json and report.html into `directory`; returns both paths."""
    directory.mkdir(parents=True, exist_ok=True)
    json_path, html_path = directory / REPORT_JSON, directory / REPORT_HTML
    json_path.write_text(report.model_dump_json(indent=2))
    html_path.write_text(render_html(report, with_plots=with_plots))
    return json_path, html_path


def read_report(path: Path) -> SmokeReport:
    """A report.json back as the report it was written from."""
    return SmokeReport.model_validate_json(path.read_text())
