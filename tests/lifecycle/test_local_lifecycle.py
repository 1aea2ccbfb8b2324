"""The whole job on the local target, with real nodes: `fsdpctl demo --keep` (up -> configure ->
deploy -> smoke) on 2 systemd-nspawn nodes, then the failure paths on the same cluster (wrong MTU, a
node down), then `down` and a look at the host for leftovers.

The demo's cluster is the session's shared one (tests/local/demo_cluster.py); the tests that break it
run after every other test that uses it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.local.conftest import as_root, fsdpctl, host_leftovers, read_state
from tests.local.demo_cluster import NAME, DemoCluster

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _run_dir(home: Path, kind: str) -> Path:
    """The newest run directory of a kind (smoke, scale-test) under the cluster's reports."""
    return sorted((home / "reports" / NAME).glob(f"*-{kind}*"), key=lambda p: p.stat().st_mtime)[-1]


def _report(home: Path) -> dict:
    """The newest smoke report."""
    return json.loads((_run_dir(home, "smoke") / "report.json").read_text())


def _check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


@pytest.mark.timeout(1500)
def test_demo_brings_up_deploys_and_passes_every_smoke_check(demo: DemoCluster):
    home, result = demo.home, demo.result
    for stage in ("up", "configure", "deploy", "smoke"):
        assert f"fsdpctl {stage}" in result.stdout
    report = demo.smoke_report
    assert report["passed"] and report["failed"] == []
    assert report["scheduler"] == "slurm"  # the demo's fsdp and recovery checks ran as Slurm jobs
    assert [c["name"] for c in report["checks"]] == ["inventory", "bandwidth", "fsdp", "monitoring",
                                                     "recovery"]
    assert {c["status"] for c in report["checks"]} == {"pass"}
    # The terminal table names every check with its result.
    for check in report["checks"]:
        assert any(line.split()[:2] == [check["name"], "PASS"] for line in result.stdout.splitlines())
    # The report is written outside the cluster's state dir, so `down` leaves it, and the state
    # points at it.
    assert read_state(home, NAME)["last_report"] == str(_run_dir(home, "smoke")) == str(demo.smoke_run_dir)


def test_report_carries_the_measurements(demo: DemoCluster):
    report = demo.smoke_report
    inventory = _check(report, "inventory")["details"]
    assert inventory["expected_mtu"] == 9000
    assert all(node["mtu"] == 9000 and node["interface"] == "eth0" for node in inventory["nodes"].values())

    bandwidth = report["bandwidth"]
    assert bandwidth["backend"] == "gloo" and bandwidth["world_size"] == 2
    assert all(r["busbw_gbps"] > 0 for r in bandwidth["results"])
    assert report["bandwidth_gate_gbps"] <= bandwidth["peak_busbw_gbps"]

    fsdp = _check(report, "fsdp")["details"]
    assert fsdp["loss_last"] < fsdp["loss_first"]
    assert fsdp["checkpoints"] and all(c["verified"] for c in fsdp["checkpoints"])
    assert fsdp["resume"]["first_step"] == max(c["step"] for c in fsdp["checkpoints"]) + 1
    assert [r["rank"] for r in report["training"]["per_rank"]] == [0, 1]

    recovery = _check(report, "recovery")["details"]
    assert recovery["recovery_time_s"] > 0
    # The restarted workers continued from a checkpoint, not from the start.
    assert recovery["resumed_at_step"] > 1
    assert (recovery["resumed_at_step"] - 1) % recovery["checkpoint_interval"] == 0

    page = (demo.smoke_run_dir / "report.html").read_text()
    # bandwidth, loss and peak memory per rank; utilisation, network, memory over steps and tokens/s
    # measured on each rank (the monitoring check)
    assert page.count("data:image/png;base64,") == 7


def test_second_deploy_reuses_the_wheelhouse_and_the_venvs(demo: DemoCluster):
    result = fsdpctl(demo.home, "deploy", "--cluster", NAME, timeout=300)
    assert "wheelhouse cached" in result.stdout  # on this machine
    assert "via node 0: wheelhouse cached" in result.stdout  # on the shared file system
    # Nothing but the trainer wheel is reinstalled, and that only if the checkout changed meanwhile.
    assert result.stdout.count("already installed") + result.stdout.count("trainer updated") == 2


def test_scale_test_measures_strong_and_weak_scaling_over_1_and_2_nodes(demo: DemoCluster):
    home = demo.home
    result = fsdpctl(home, "scale-test", "--cluster", NAME, "--steps", "4", timeout=600)
    run_dir = _run_dir(home, "scale-test")
    data = json.loads((run_dir / "scaling.json").read_text())
    assert data["node_counts"] == [1, 2]
    for mode in ("strong", "weak"):
        runs = data[mode]["runs"]
        assert [r["nodes"] for r in runs] == [1, 2] and all(r["tokens_per_s"] > 0 for r in runs)
        assert data[mode]["efficiency"]["1"] == 1.0
        linear = 2 * runs[0]["tokens_per_s"]
        assert data[mode]["efficiency"]["2"] == pytest.approx(runs[1]["tokens_per_s"] / linear)
    # Strong scaling keeps the global batch; weak scaling grows it with the ranks.
    strong, weak = data["strong"]["runs"], data["weak"]["runs"]
    assert strong[0]["training.global_batch_size"] == strong[1]["training.global_batch_size"]
    assert weak[1]["training.global_batch_size"] == 2 * weak[0]["training.global_batch_size"]
    assert (run_dir / "scaling.png").read_bytes().startswith(b"\x89PNG")
    assert "efficiency" in result.stdout


def _smoke_inventory_only(home: Path):
    return fsdpctl(home, "smoke", "--cluster", NAME, "--skip", "bandwidth", "--skip", "fsdp",
                   "--skip", "recovery", timeout=120, check=False)


def test_smoke_fails_naming_inventory_when_a_node_has_the_wrong_mtu(demo: DemoCluster):
    home = demo.home
    fsdpctl(home, "ssh", "1", "--", as_root("ip link set eth0 mtu 1500"), timeout=60)
    try:
        result = _smoke_inventory_only(home)
    finally:
        fsdpctl(home, "ssh", "1", "--", as_root("ip link set eth0 mtu 9000"), timeout=60)
    assert result.returncode != 0
    assert "smoke test failed: inventory" in result.stderr
    inventory = _check(_report(home), "inventory")
    assert inventory["status"] == "fail"
    assert "node 1: MTU of eth0 is 1500" in inventory["summary"]
    assert inventory["details"]["nodes"]["0"]["mtu"] == 9000


@pytest.mark.ends_demo_cluster
def test_smoke_fails_naming_inventory_when_a_node_is_down(demo: DemoCluster):
    home = demo.home
    fsdpctl(home, "ssh", "1", "--", as_root("systemctl poweroff"), timeout=60, check=False)
    deadline = time.monotonic() + 60
    while fsdpctl(home, "ssh", "1", "--", "true", timeout=60, check=False).returncode == 0:
        assert time.monotonic() < deadline, "node 1 did not power off"
        time.sleep(1)
    result = fsdpctl(home, "smoke", "--cluster", NAME, timeout=300, check=False)
    assert result.returncode != 0
    assert "smoke test failed: inventory" in result.stderr
    report = _report(home)
    assert "node 1 (198.18.3.3) does not answer" in _check(report, "inventory")["summary"]
    # Nothing that needs every node was started against a dead one.
    for name in ("bandwidth", "fsdp", "recovery"):
        assert _check(report, name)["status"] == "skip"


@pytest.mark.ends_demo_cluster
def test_down_leaves_nothing_behind(demo: DemoCluster):
    home, local = demo.home, demo.local
    assert local, "the demo did not record its local nodes"
    reports = sorted(p.name for p in (home / "reports" / NAME).iterdir())
    fsdpctl(home, "down", "--yes", "--cluster", NAME, timeout=300)
    assert host_leftovers(home, local) == []
    # Every run's logs and reports outlive the cluster.
    assert sorted(p.name for p in (home / "reports" / NAME).iterdir()) == reports
    assert any(name.endswith("-smoke") for name in reports) and any("-configure" in n for n in reports)
