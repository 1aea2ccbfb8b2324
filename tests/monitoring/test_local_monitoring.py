"""Monitoring on two real local nodes: after `fsdpctl configure` Prometheus on node 0 has every node
exporter up; a 2-node training run exports its metrics with the right labels while it runs, and a worker
made to leak fails the leak check; the smoke report carries the monitoring check (an ordinary run passes
it); `fsdpctl monitor --once` prints a row per node; the Grafana dashboard only queries metrics a real
run exposes.

The nodes are the session's demo cluster (tests/local/demo_cluster.py), configured, deployed and
smoke-tested by `fsdpctl demo`.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from fsdpctl import remote
from fsdpctl.checks.context import check_context
from fsdpctl.checks.monitoring import HOST_LEAK_BOUND_MIB, check_monitoring
from fsdpctl.checks.torchrun import RUN_TIMEOUT_S, read_remote_metrics
from fsdpctl.checks.training import TrainingRun, trainer_args
from fsdpctl.monitor import NODE_QUERIES, Prometheus, by_node
from fsdpctl.state import cluster_state
from tests.local.conftest import as_root, fsdpctl
from tests.local.demo_cluster import ADDRESSES, NAME, NODES, DemoCluster
from tests.monitoring.promql import metric_names

pytestmark = [pytest.mark.root, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
# Long enough for Prometheus (one scrape a second) to see both ranks' metrics while the run lasts: a
# smoke-model step takes ~0.1 s on a quiet 2-core host, so 60 steps of 4x the batch, ~0.25 s each.
LEAK_STEPS = 60
LEAK_BATCH = 64
LEAK_MIB_PER_STEP = 8
# Exported only where the hardware is (dcgm-exporter's default counters on GPU nodes; the EFA
# script's counters on EFA nodes, whose format test_units checks): absent from a local run.
HARDWARE_ONLY = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
                 "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_XID_ERRORS",
                 "fsdp_efa_rx_bytes_total", "fsdp_efa_tx_bytes_total", "fsdp_efa_rdma_read_bytes_total",
                 "fsdp_efa_rdma_write_bytes_total"}


def _wait(what: str, probe, timeout: float = 30.0, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        time.sleep(poll)


@pytest.fixture(scope="module")
def home(demo: DemoCluster) -> Path:
    return demo.home


@pytest.fixture(scope="module")
def state(home):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FSDPCTL_HOME", str(home))
        yield cluster_state(NAME)


def test_prometheus_on_node_0_has_every_node_exporter_up(state):
    with Prometheus(state) as prom:
        up = _wait("every node exporter up", lambda: (lambda u: u if u == {n: 1.0 for n in NODES} else None)(
            by_node(prom.query('up{job="node"}'))))
    assert up == {n: 1.0 for n in NODES}
    # Listeners on the cluster address only, never a wildcard.
    listening = remote.run(state, 0, "ss -Hltn").stdout
    ports = {m[1]: m[0] for m in re.findall(r"(\S+):(9090|9100)\s", listening)}
    assert ports == {"9090": ADDRESSES[0], "9100": ADDRESSES[0]}, listening


@pytest.fixture(scope="module")
def leak_run(state):
    """A 2-node run in which rank 1 leaks LEAK_MIB_PER_STEP per step (the trainer's fault-injection
    knob): the labels seen while it ran, the monitoring check over its window, the metric names."""
    ctx = check_context(state, state.read(), state.spec(), "monitor-test", steps=LEAK_STEPS)
    args = trainer_args(ctx, steps=LEAK_STEPS, checkpoint_dir=None, interval=1,
                        metrics=f"{ctx.work_dir}/leak-metrics.jsonl", resume="none")
    started = time.time()
    job = ctx.job("leak", [*args, "--set", f"training.global_batch_size={LEAK_BATCH}",
                           "--set", f"metrics.fault_leak_mib_per_step={LEAK_MIB_PER_STEP}",
                           "--set", "metrics.fault_leak_rank=1"])
    try:
        with Prometheus(state) as prom:
            def both_ranks():
                series = prom.query(f'fsdp_trainer_step{{job="{job.run_id}"}}')
                return series if len(series) == 2 else None
            live = _wait("both ranks' metrics in Prometheus while training", both_ranks,
                         timeout=RUN_TIMEOUT_S)
            failure = job.failure(job.wait(RUN_TIMEOUT_S))
            names = set(prom.metric_names())
    finally:
        job.stop()
    assert failure is None, failure
    # What the fsdp check hands the monitoring check: the run's window and its step records.
    training = TrainingRun(window=(started, time.time()),
                           steps=read_remote_metrics(state, 0, f"{ctx.work_dir}/leak-metrics.jsonl").steps)
    result = check_monitoring(ctx, training)
    left = remote.run_all(state, "ls /var/lib/prometheus/node-exporter")
    return {"live": live, "run_id": job.run_id, "result": result, "names": names, "left": left}


def test_trainer_metrics_appear_during_the_run_with_job_rank_and_host(leak_run):
    labels = sorted((s["metric"]["rank"], s["metric"]["host"], s["metric"]["node"]) for s in leak_run["live"])
    assert labels == [("0", NODES[0], NODES[0]), ("1", NODES[1], NODES[1])]
    assert {s["metric"]["job"] for s in leak_run["live"]} == {leak_run["run_id"]}
    # A finished job's files are gone, so its series do not stay exported as if it still ran: neither this
    # run's nor those of the demo's smoke runs (its recovery check kills workers, whose step is retried).
    left = {NODES[rank]: r.stdout.split() for rank, r in leak_run["left"].items()}
    assert all(not name.startswith("fsdp-trainer-") for names in left.values() for name in names), left


def test_a_leaking_worker_fails_the_leak_check(leak_run):
    result = leak_run["result"]
    assert result.status == "fail", result.summary
    leaks = result.details.leaks
    assert set(leaks) == {"rank 0 host RSS", "rank 1 host RSS"}  # no device memory on CPU
    rank1, rank0 = leaks["rank 1 host RSS"], leaks["rank 0 host RSS"]
    assert rank1.steps_fitted == rank0.steps_fitted >= LEAK_STEPS // 2  # every logged step
    assert rank1.status == "fail" and rank1.mib_per_100_steps > HOST_LEAK_BOUND_MIB
    # The fit sees the injected rate (8 MiB a step = 800 MiB per 100 steps) within noise.
    assert 0.7 * LEAK_MIB_PER_STEP * 100 < rank1.mib_per_100_steps < 1.3 * LEAK_MIB_PER_STEP * 100
    assert rank0.status == "pass"
    assert "rank 1 host RSS grows" in result.summary and "rank 0" not in result.summary
    assert result.details.gpu.status == "skip"


def test_dashboard_and_monitor_query_only_metrics_a_real_run_exposes(leak_run):
    dashboard = json.loads((REPO / "dashboards/fsdp-cluster.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel.get("targets", [])
               for name in metric_names(target["expr"])}
    queried |= {name for q in NODE_QUERIES.values() for name in metric_names(q)}
    assert "fsdp_trainer_host_rss_bytes" in queried and "node_cpu_seconds_total" in queried
    assert queried - leak_run["names"] - HARDWARE_ONLY == set()
    assert HARDWARE_ONLY & leak_run["names"] == set()  # else move it out of HARDWARE_ONLY
    # The collectors the role turns off (systemd, which reads every unit over D-Bus at every scrape)
    # export nothing, and nothing above queries them.
    assert {name for name in leak_run["names"] if name.startswith("node_systemd_")} == set()
    variable = dashboard["templating"]["list"][0]
    assert variable["name"] == "job" and variable["query"]["query"] == "label_values(fsdp_trainer_step, job)"


def test_every_dashboard_query_is_valid_promql_that_prometheus_answers(state, leak_run):
    # Grafana's variables as Grafana would fill them; a syntax error or a wrong function is a 400,
    # which Prometheus() raises as PrometheusError.
    dashboard = json.loads((REPO / "dashboards/fsdp-cluster.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert len(exprs) >= 24
    # Evaluated when both ranks' series were seen live, so the trainer panels have data too.
    while_training = float(leak_run["live"][0]["value"][0])
    answered = {}
    with Prometheus(state) as prom:
        for expr in exprs:
            filled = expr.replace("$__rate_interval", "10s").replace("$job", leak_run["run_id"])
            answered[expr] = prom.query(filled, at=while_training)
    # What a local node has (no GPU, no EFA) answers with data: the node and the trainer panels.
    empty = [e for e, result in answered.items() if not result and not (metric_names(e) & HARDWARE_ONLY)]
    assert empty == []


def test_smoke_report_carries_the_monitoring_check(demo: DemoCluster):
    # The leak fit reads the run's logged steps (the smoke run logs every one): 40 steps fit 30
    report = demo.smoke_report
    check = next(c for c in report["checks"] if c["name"] == "monitoring")
    assert check["status"] == "pass", check["summary"]
    assert report["scheduler"] == "slurm"
    leaks = check["details"]["leaks"]
    assert set(leaks) == {"rank 0 host RSS", "rank 1 host RSS"}
    assert all(v["status"] == "pass" and v["steps_fitted"] >= 20 for v in leaks.values())
    network = check["details"]["network"]["nodes"]
    assert set(network) == set(NODES) and all(0 < n["peak_share"] < 0.8 for n in network.values())
    monitoring = report["training"]["monitoring"]
    assert set(monitoring["per_rank_tokens_per_s"]) == {"0", "1"}
    page = (demo.smoke_run_dir / "report.html").read_text()
    for title in ("Utilisation over time", "Network over time", "Memory per rank over steps",
                  "Tokens/s measured on each rank"):
        assert f"<figcaption>{title}</figcaption>" in page


def test_monitor_once_prints_a_row_per_node(home):
    table = fsdpctl(home, "monitor", "--cluster", NAME, "--once").stdout.splitlines()
    assert table[0].split()[:3] == ["RANK", "NODE", "UP"]
    assert [line.split()[:3] for line in table[1:3]] == [["0", NODES[0], "yes"], ["1", NODES[1], "yes"]]
    view = json.loads(fsdpctl(home, "monitor", "--cluster", NAME, "--once", "--json").stdout)
    assert [n["node"] for n in view["nodes"]] == NODES
    assert all(n["up"] == 1 and 0 <= n["cpu_util"] <= 1 and n["link_bps"] > 0 for n in view["nodes"])


def test_monitor_names_a_missing_prometheus(home, state):
    remote.run(state, 0, as_root("systemctl stop prometheus"))
    try:
        result = fsdpctl(home, "monitor", "--cluster", NAME, "--once", check=False, timeout=120)
    finally:
        remote.run(state, 0, as_root("systemctl start prometheus"))
    assert result.returncode != 0
    assert "fsdpctl configure --tags monitoring" in result.stderr


