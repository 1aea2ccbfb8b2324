"""bench/configure_strategy.py against a stand-in `fsdpctl` on PATH that prints a configure's recap:
both strategies, the order alternating, the results as JSON and a plot; a run that changes something is
refused, since it would not measure the per-task cost."""

import importlib.util
import json
import os
import stat
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "configure_strategy.py"


@pytest.fixture
def bench(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("configure_strategy", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "configure_strategy", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def stand_in_fsdpctl(tmp_path: Path, monkeypatch, changed: int) -> Path:
    """An `fsdpctl` that logs its arguments and prints a 2-host recap with `changed` changes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    script = bin_dir / "fsdpctl"
    script.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\necho 'RECAP'\n"
                      f"echo 'n-node0 ok=150 changed={changed} failed=0 skipped=60 unreachable=0'\n"
                      "echo 'n-node1 ok=136 changed=0 failed=0 skipped=62 unreachable=0'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_both_strategies_alternate_and_the_results_come_as_json_and_a_plot(bench, tmp_path, monkeypatch,
                                                                           capsys):
    calls = stand_in_fsdpctl(tmp_path, monkeypatch, changed=0)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    monkeypatch.setattr(sys, "argv", ["configure_strategy.py", "--cluster", "n", "--repeat", "2",
                                      "--output", str(out), "--plot", str(png)])
    assert bench.main() == 0
    assert calls.read_text().splitlines() == [
        "configure --strategy linear --cluster n", "configure --strategy mitogen --cluster n",
        "configure --strategy mitogen --cluster n", "configure --strategy linear --cluster n"]
    result = json.loads(out.read_text())
    assert [r["strategy"] for r in result["runs"]] == ["linear", "mitogen", "mitogen", "linear"]
    assert {r["tasks_ok"] for r in result["runs"]} == {286}
    assert set(result["mitogen_over_linear"]) == {"wall_s", "process_cpu_s", "machine_busy_cpu_s"}
    assert png.stat().st_size > 0
    assert "mitogen/linear: wall " in capsys.readouterr().out


def test_a_run_that_changes_something_is_not_measured(bench, tmp_path, monkeypatch):
    stand_in_fsdpctl(tmp_path, monkeypatch, changed=3)
    monkeypatch.setattr(sys, "argv", ["configure_strategy.py"])
    with pytest.raises(SystemExit, match=r"is not a second run \(\{'n-node0': 3\}\): run `fsdpctl configure` "
                                         "until it changes nothing"):
        bench.main()
