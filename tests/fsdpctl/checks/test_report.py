"""Report rendering: the typed SmokeReport as JSON (read back to the same report) and self-contained
HTML with embedded plots, and the terminal table."""

from __future__ import annotations

import base64
import json
import re
import sys

from fsdpctl.checks.bandwidth import AllReduceMeasurement, AllReduceRow, BandwidthDetails
from fsdpctl.checks.monitoring import (
    GpuUtilisation,
    LeakVerdict,
    MonitoringDetails,
    MonitoringSeries,
    NetworkUse,
    NodeNetwork,
)
from fsdpctl.checks.nodes import InventoryDetails, NodeInventory
from fsdpctl.checks.report import (
    CheckEntry,
    SmokeReport,
    TrainingReport,
    check_table,
    plots,
    plots_available,
    read_report,
    write_report,
)
from fsdpctl.checks.training import FsdpDetails, RankPeakMemory, RecoveryDetails
from tests.trainer.record_samples import step_record

ROWS = [AllReduceRow(bytes=4096, algbw_gbps=0.001, busbw_gbps=0.001),
        AllReduceRow(bytes=1 << 20, algbw_gbps=0.2, busbw_gbps=0.2)]


def _report(passed: bool = True) -> SmokeReport:
    checks = [
        CheckEntry(name="inventory", status="pass", summary="2 node(s) answer, MTU 9000", duration_s=1.2,
                   details=InventoryDetails(expected_mtu=9000, hardware_checks="skipped (local target)",
                                            nodes={0: NodeInventory(answers=True, interface="eth0", mtu=9000),
                                                   1: NodeInventory(answers=False, error="no answer")})),
        CheckEntry(name="bandwidth", status="pass" if passed else "fail", summary="peak 0.3 GB/s",
                   duration_s=8.0, details=BandwidthDetails(
                       backend="gloo", world_size=2, gate_gbps=0.02, gate_basis="gloo/CPU floor",
                       peak_busbw_gbps=0.2, results=ROWS)),
        CheckEntry(name="fsdp", status="pass", summary="loss 5.5 -> 4.1", duration_s=30.0,
                   details=FsdpDetails(steps=10, world_size=2, loss_first=5.5, loss_last=4.1)),
        CheckEntry(name="monitoring", status="pass", summary="network peak 1% of link", duration_s=2.0),
        CheckEntry(name="recovery", status="skip", summary="skipped on request (--skip)", duration_s=0.0),
    ]
    return SmokeReport(
        cluster="t<1>", target="local", instance_type="p4d.24xlarge", nodes=2, nproc_per_node=1,
        started_at="2026-12-01T00:00:00+00:00", scheduler="torchrun", passed=passed,
        failed=[] if passed else ["bandwidth"], checks=checks,
        bandwidth=AllReduceMeasurement(backend="gloo", world_size=2, results=ROWS, peak_busbw_gbps=0.2),
        bandwidth_gate_gbps=0.02,
        training=TrainingReport(steps=[step_record(i, loss=6.0 - 0.1 * i) for i in range(1, 11)],
                                per_rank=[RankPeakMemory(rank=0, max_mem_bytes=3 << 28),
                                          RankPeakMemory(rank=1, max_mem_bytes=3 << 28)],
                                window=(100.0, 130.0)),
        logs="/reports/t/20261201-000000-smoke")


def test_table_lists_every_check_with_its_result():
    table = check_table(_report(passed=False).checks).splitlines()
    assert table[0].split()[:3] == ["check", "result", "time"]
    body = {line.split()[0]: line.split()[1] for line in table[2:]}
    assert body == {"inventory": "PASS", "bandwidth": "FAIL", "fsdp": "PASS", "monitoring": "PASS",
                    "recovery": "SKIP"}


def test_plots_are_png_for_each_kind_of_data():
    images = plots(_report())
    assert set(images) == {"All-reduce bandwidth vs message size", "Loss", "Memory per rank"}
    for data in images.values():
        assert base64.b64decode(data).startswith(b"\x89PNG\r\n\x1a\n")


def test_plots_skip_what_is_missing():
    report = _report().model_copy(update={"bandwidth": None, "training": TrainingReport()})
    assert plots(report) == {}


def test_monitoring_series_are_plotted():
    series = MonitoringSeries(window=(100.0, 130.0), cpu_util={"n0": [(100.0, 0.5), (110.0, 0.7)]},
                              gpu_util={}, network_bps={"rx": {"n0": [(100.0, 1e9), (110.0, 2e9)]}},
                              link_bps={"n0": 10e9}, memory={"rank 0 host RSS": [(1.0, 5e8), (2.0, 5e8)]},
                              per_rank_tokens_per_s={"0": 100.0, "1": 90.0})
    report = _report().model_copy(update={"bandwidth": None, "training": TrainingReport(monitoring=series)})
    assert set(plots(report)) == {"Utilisation over time", "Network over time", "Memory per rank over steps",
                                  "Tokens/s measured on each rank"}


def test_report_json_reads_back_as_the_same_report(tmp_path):
    monitoring = MonitoringDetails(
        window=(100.0, 130.0), gpu=GpuUtilisation(status="skip", reason="no GPUs on this target"),
        network=NetworkUse(nodes={"n0": NodeNetwork(peak_gbps=0.1, link_gbps=10.0, peak_share=0.01)},
                           series_bps={"rx": {"n0": [(100.0, 1e8)]}}, capacity_source="interface speed"),
        leaks={"rank 0 host RSS": LeakVerdict(status="pass", mib_per_100_steps=12.5,
                                              bound_mib_per_100_steps=256.0, steps_fitted=15)},
        per_rank_tokens_per_s={"0": 100.0})
    recovery = RecoveryDetails(victim_node=1, killed_after_step=6, resumed_at_step=5,
                               workers_restarted_after_s=3.2, recovery_time_s=9.5, checkpoint_interval=4,
                               poll_interval_s=0.25, last_step=16)
    checks = _report().checks
    checks[3] = checks[3].model_copy(update={"details": monitoring})
    checks[4] = CheckEntry(name="recovery", status="pass", summary="killed ...", duration_s=40.0,
                           details=recovery)
    # A skipped fp16 step's gradient norm is infinite: it survives the file too.
    steps = [step_record(1, grad_norm=float("inf"), host_rss_bytes_per_rank=[5, 6]), step_record(2)]
    report = _report().model_copy(update={
        "checks": checks, "training": _report().training.model_copy(update={"steps": steps})})
    json_path, _ = write_report(tmp_path, report, with_plots=False)
    again = read_report(json_path)
    assert again == report
    assert [type(c.details) for c in again.checks] == [InventoryDetails, BandwidthDetails, FsdpDetails,
                                                       MonitoringDetails, RecoveryDetails]
    # The keys other readers use (tests/lifecycle, tests/monitoring, tests/faults) are where they were.
    data = json.loads(json_path.read_text())
    assert data["checks"][0]["details"]["nodes"]["0"]["mtu"] == 9000
    assert data["checks"][3]["details"]["leaks"]["rank 0 host RSS"]["status"] == "pass"
    assert data["checks"][4]["details"]["resumed_at_step"] == 5
    assert data["bandwidth"]["results"][1]["busbw_gbps"] == 0.2 and data["bandwidth_gate_gbps"] == 0.02
    assert data["training"]["window"] == [100.0, 130.0]
    assert [r["rank"] for r in data["training"]["per_rank"]] == [0, 1]
    # Step records as the trainer writes them: the figures only measured on some steps are absent.
    assert "host_rss_bytes_per_rank" not in data["training"]["steps"][1]
    assert data["training"]["steps"][0]["host_rss_bytes_per_rank"] == [5, 6]


def test_write_report_html_embeds_plots(tmp_path):
    json_path, html_path = write_report(tmp_path / "state", _report(passed=False))
    assert json.loads(json_path.read_text())["failed"] == ["bandwidth"]
    page = html_path.read_text()
    assert "FAILED: bandwidth" in page
    assert "t&lt;1&gt;" in page  # escaped, not raw markup
    assert len(re.findall(r"src='data:image/png;base64,", page)) == 3
    for name in ("inventory", "bandwidth", "fsdp", "monitoring", "recovery"):
        assert f"<td>{name}</td>" in page
    assert "&quot;expected_mtu&quot;: 9000" in page  # the details, as JSON


def test_without_matplotlib_the_report_is_written_without_plots_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert not plots_available()
    json_path, html_path = write_report(tmp_path, _report(), with_plots=False)
    page = html_path.read_text()
    assert "data:image/png" not in page and "pip install -e &#x27;.[report]&#x27;" in page
    assert read_report(json_path).checks == _report().checks
