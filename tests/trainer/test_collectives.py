"""The all-reduce benchmark: the bus-bandwidth formula, size parsing, and a real 2-rank gloo run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fsdpctl.checks.bandwidth import AllReduceMeasurement
from trainer.collectives import bus_bandwidth, parse_size


@pytest.mark.parametrize(("world", "factor"), [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75), (16, 1.875)])
def test_bus_bandwidth_is_nccl_tests_factor(world, factor):
    assert bus_bandwidth(10.0, world) == pytest.approx(10.0 * factor)


def test_bus_bandwidth_rejects_empty_world():
    with pytest.raises(ValueError, match="world size"):
        bus_bandwidth(1.0, 0)


@pytest.mark.parametrize(("text", "size"), [
    ("4096", 4096), ("64K", 65536), ("16M", 16 << 20), ("1G", 1 << 30), ("2gb", 2 << 30)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "1T", "abc", "6", "-4K"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_refuses_to_run_outside_torchrun():
    proc = subprocess.run([sys.executable, "-m", "trainer.collectives"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert "torchrun" in proc.stderr


@pytest.mark.slow
def test_two_rank_gloo_run_reports_consistent_bandwidth(tmp_path):
    out = tmp_path / "bw.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "trainer.collectives", "--sizes", "4K,1M", "--iters", "2", "--warmup", "1",
         "--output", str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["backend"] == "gloo" and data["world_size"] == 2 and data["device"] == "cpu"
    assert [r["bytes"] for r in data["results"]] == [4096, 1 << 20]
    for row in data["results"]:
        assert row["time_us"] > 0
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / (row["time_us"] / 1e6) / 1e9, rel=1e-3)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])  # 2(n-1)/n = 1 for 2 ranks
    assert data["peak_busbw_gbps"] == max(r["busbw_gbps"] for r in data["results"])
    # The smoke test's bandwidth check reads the file through its type: every key is one of its fields.
    measured = AllReduceMeasurement.model_validate_json(out.read_text())
    assert measured.model_dump(exclude_none=True) == {k: v for k, v in data.items() if v is not None}
