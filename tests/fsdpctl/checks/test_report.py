"""Report rendering: JSON + self-contained HTML with embedded plots, and the terminal table."""

from __future__ import annotations

import base64
import json
import re
import sys

from fsdpctl.checks.report import check_table, plots, plots_available, write_report


def _report(passed: bool = True):
    checks = [
        {"name": "inventory", "status": "pass", "summary": "2 node(s) answer, MTU 9000", "duration_s": 1.2},
        {"name": "bandwidth", "status": "pass" if passed else "fail", "summary": "peak 0.3 GB/s",
         "duration_s": 8.0, "details": {"gate_gbps": 0.02}},
        {"name": "fsdp", "status": "pass", "summary": "loss 5.5 -> 4.1", "duration_s": 30.0},
        {"name": "recovery", "status": "skip", "summary": "skipped on request (--skip)", "duration_s": 0.0},
    ]
    return {
        "cluster": "t<1>", "target": "local", "nodes": 2, "passed": passed,
        "failed": [] if passed else ["bandwidth"], "checks": checks,
        "bandwidth": {"backend": "gloo", "world_size": 2, "results": [
            {"bytes": 4096, "algbw_gbps": 0.001, "busbw_gbps": 0.001},
            {"bytes": 1 << 20, "algbw_gbps": 0.2, "busbw_gbps": 0.2}]},
        "bandwidth_gate_gbps": 0.02,
        "training": {"steps": [{"step": i, "loss": 6.0 - 0.1 * i} for i in range(1, 11)],
                     "per_rank": [{"rank": 0, "max_mem_bytes": 3 << 28},
                                  {"rank": 1, "max_mem_bytes": 3 << 28}]},
    }


def test_table_lists_every_check_with_its_result():
    table = check_table(_report(passed=False)["checks"]).splitlines()
    assert table[0].split()[:3] == ["check", "result", "time"]
    body = {line.split()[0]: line.split()[1] for line in table[2:]}
    assert body == {"inventory": "PASS", "bandwidth": "FAIL", "fsdp": "PASS", "recovery": "SKIP"}


def test_plots_are_png_for_each_kind_of_data():
    images = plots(_report())
    assert set(images) == {"All-reduce bandwidth vs message size", "Loss", "Memory per rank"}
    for data in images.values():
        assert base64.b64decode(data).startswith(b"\x89PNG\r\n\x1a\n")


def test_plots_skip_what_is_missing():
    report = _report()
    report["bandwidth"] = None
    report["training"] = {}
    assert plots(report) == {}


def test_write_report_json_round_trips_and_html_embeds_plots(tmp_path):
    json_path, html_path = write_report(tmp_path / "state", _report(passed=False))
    assert json.loads(json_path.read_text())["failed"] == ["bandwidth"]
    page = html_path.read_text()
    assert "FAILED: bandwidth" in page
    assert "t&lt;1&gt;" in page  # escaped, not raw markup
    assert len(re.findall(r"src='data:image/png;base64,", page)) == 3
    for name in ("inventory", "bandwidth", "fsdp", "recovery"):
        assert f"<td>{name}</td>" in page


def test_without_matplotlib_the_report_is_written_without_plots_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert not plots_available()
    _, html_path = write_report(tmp_path, _report(), with_plots=False)
    page = html_path.read_text()
    assert "data:image/png" not in page and "pip install -e &#x27;.[report]&#x27;" in page
    assert json.loads((tmp_path / "report.json").read_text())["checks"] == _report()["checks"]
