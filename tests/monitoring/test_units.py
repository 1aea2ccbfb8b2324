"""The leak, network and report logic of the monitoring check, the trainer's textfile exporter, the EFA
counter script and the dashboard's queries, without nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdpctl.checks.monitoring import (
    DEVICE_HEALTHY_JUMP_MIB,
    DEVICE_LEAK_BOUND_MIB,
    HOST_HEALTHY_JUMP_MIB,
    HOST_LEAK_BOUND_MIB,
    MIB,
    MIN_FIT_STEPS,
    MonitoringSeries,
    RangeSeries,
    after_warmup,
    fit_steps_needed,
    gpu_problems,
    gpu_utilisation,
    leak_verdict,
    least_squares_slope,
    memory_series,
)
from fsdpctl.checks.report import monitoring_plots
from fsdpctl.monitor import NODE_QUERIES, render_view
from tests.monitoring.promql import metric_names
from tests.trainer.record_samples import step_record
from trainer.config import MetricsConfig
from trainer.distributed import Runtime
from trainer.errors import ConfigError
from trainer.metrics import current_memory_bytes
from trainer.prometheus import METRICS, RankMetrics, render
from trainer.records import StepRecord

REPO = Path(__file__).resolve().parents[2]
EFA_SCRIPT = REPO / "ansible/roles/monitoring/files/fsdp-efa-counters.py"


def test_slope_of_a_line_is_exact_and_needs_two_x_values():
    assert least_squares_slope([(x, 3 * x + 7) for x in range(10)]) == pytest.approx(3.0)
    assert least_squares_slope([(1, 5), (2, 5), (3, 5)]) == 0
    # Noise around a flat line: the fit, not the last-minus-first difference.
    assert least_squares_slope([(1, 0), (2, 10), (3, -10), (4, 0)]) == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="two distinct x"):
        least_squares_slope([(4, 1), (4, 2)])


def test_warmup_is_a_quarter_of_the_steps_and_at_least_two():
    points = [(s, 0.0) for s in range(1, 41)]
    assert min(x for x, _ in after_warmup(points)) == 11
    assert min(x for x, _ in after_warmup(points[:6])) == 3
    assert after_warmup([]) == []
    # A job resumed at step 41 warms up again: its own first quarter, not steps 1-12 of the run.
    resumed = [(s, 0.0) for s in range(41, 51)]
    assert min(x for x, _ in after_warmup(resumed)) == 43


def _series(per_step_mib: float, steps: int = 40, noise_mib: float = 0.0) -> list[tuple[float, float]]:
    base = 500 * MIB
    return [(s, base + s * per_step_mib * MIB + (noise_mib * MIB if s % 3 == 0 else 0))
            for s in range(1, steps + 1)]


def test_leak_verdicts_against_the_bound():
    flat = leak_verdict(_series(0, noise_mib=8), HOST_LEAK_BOUND_MIB)
    assert flat.status == "pass" and abs(flat.mib_per_100_steps) < 50
    leaking = leak_verdict(_series(8), HOST_LEAK_BOUND_MIB)
    assert leaking.status == "fail" and leaking.mib_per_100_steps == pytest.approx(800, rel=1e-6)
    # Just under and just over the bound (per 100 steps).
    assert leak_verdict(_series(HOST_LEAK_BOUND_MIB / 100 * 0.9), HOST_LEAK_BOUND_MIB).status == "pass"
    assert leak_verdict(_series(HOST_LEAK_BOUND_MIB / 100 * 1.1), HOST_LEAK_BOUND_MIB).status == "fail"
    # A rise during warm-up only is not a leak.
    warm = [(s, (100 if s <= 10 else 900) * MIB) for s in range(1, 41)]
    assert leak_verdict(warm, HOST_LEAK_BOUND_MIB).status == "pass"


def test_too_few_steps_after_warmup_is_a_skip_with_the_reason():
    verdict = leak_verdict(_series(100, steps=MIN_FIT_STEPS + 1), HOST_LEAK_BOUND_MIB)
    assert verdict.status == "skip" and "needed" in verdict.reason
    assert verdict.mib_per_100_steps is None


def test_a_checkpoint_saves_rise_in_a_short_run_is_not_read_as_a_leak():
    """Seen in the fault suite's 8-step smoke run: a healthy rank whose RSS rose once by 13 MiB (a
    checkpoint save) in a fit over 6 steps read as 330 MiB per 100 steps, over the 256 bound. Such a
    fit is too short to judge; from fit_steps_needed on, the same rise is under the bound."""
    needed = fit_steps_needed(HOST_LEAK_BOUND_MIB, HOST_HEALTHY_JUMP_MIB)
    assert needed == 12

    def saved_once(steps: int) -> list[tuple[float, float]]:
        fitted_from = min(x for x, _ in after_warmup([(s, 0.0) for s in range(1, steps + 1)]))
        middle = fitted_from + (steps - fitted_from) // 2
        return [(s, (500 + (HOST_HEALTHY_JUMP_MIB if s > middle else 0)) * MIB) for s in range(1, steps + 1)]

    short = leak_verdict(saved_once(8), HOST_LEAK_BOUND_MIB, HOST_HEALTHY_JUMP_MIB)
    assert short.status == "skip" and short.steps_fitted == 6
    assert short.reason == ("6 distinct step(s) sampled after warm-up, 12 needed to tell a leak of 256 MiB "
                            "per 100 steps from a one-off rise of 20 MiB (run more steps)")
    assert least_squares_slope(after_warmup(saved_once(8))) * 100 / MIB > HOST_LEAK_BOUND_MIB  # what it was
    for steps in (15, 16, 20, 40):  # 12 or more fitted
        verdict = leak_verdict(saved_once(steps), HOST_LEAK_BOUND_MIB, HOST_HEALTHY_JUMP_MIB)
        assert verdict.status == "pass", (steps, verdict)
    # A leak is still a leak in the shortest judged fit, and device memory (no healthy rise) is judged
    # from MIN_FIT_STEPS on.
    leak = [(s, (500 + 8 * s) * MIB) for s in range(1, 16)]
    assert leak_verdict(leak, HOST_LEAK_BOUND_MIB, HOST_HEALTHY_JUMP_MIB).status == "fail"
    assert fit_steps_needed(DEVICE_LEAK_BOUND_MIB, DEVICE_HEALTHY_JUMP_MIB) == MIN_FIT_STEPS


def _dcgm(node: str, gpu: int, utils: list[float]) -> RangeSeries:
    """A query_range series of DCGM_FI_DEV_GPU_UTIL (percent), one sample a second from t=100."""
    return RangeSeries(labels={"node": node, "gpu": str(gpu)},
                       points=[(100 + i, u) for i, u in enumerate(utils)])


def test_gpu_utilisation_is_the_mean_after_warmup_and_every_expected_gpu_must_report():
    expected = ["n0/gpu0", "n0/gpu1", "n1/gpu0", "n1/gpu1"]
    busy = [_dcgm(n, g, [10, 10, 97, 95]) for n in ("n0", "n1") for g in (0, 1)]
    gpu = gpu_utilisation(busy, expected, since=102)  # the first two samples are warm-up
    assert gpu.mean_util == {g: pytest.approx(0.96) for g in expected} and gpu.missing == []
    assert gpu_problems(gpu) == []

    slow = gpu_utilisation([*busy[:3], _dcgm("n1", 1, [90, 90, 60, 70])], expected, since=102)
    assert gpu_problems(slow) == ["GPU utilisation under 90%: n1/gpu1 65%"]

    # An exporter that is down on one node, or on all: a failure naming the GPUs, never a pass or a skip.
    half = gpu_utilisation(busy[:2], expected, since=102)
    assert half.missing == ["n1/gpu0", "n1/gpu1"]
    assert "no DCGM utilisation from 2 GPU(s) (n1/gpu0, n1/gpu1)" in gpu_problems(half)[0]
    none = gpu_utilisation([], expected, since=102)
    assert len(gpu_problems(none)) == 1 and "from 4 GPU(s)" in gpu_problems(none)[0]
    # Samples only during warm-up count as missing too.
    assert gpu_utilisation([_dcgm("n0", 0, [99])], ["n0/gpu0"], since=102).missing == ["n0/gpu0"]


def test_memory_series_per_rank_from_the_steps_that_read_memory():
    # The trainer reads memory at each flush: here steps 1, 10 and 20 (log_interval 10); device
    # memory only on GPU runs.
    lines = [step_record(1, host_rss_bytes_per_rank=[100, 200], device_mem_bytes_per_rank=[5, 6]),
             *(step_record(s) for s in range(2, 10)),
             step_record(10, host_rss_bytes_per_rank=[110, 260], device_mem_bytes_per_rank=[5, 7]),
             step_record(20, host_rss_bytes_per_rank=[120, 320], device_mem_bytes_per_rank=[5, 8])]
    series = memory_series(lines)
    assert series["rank 1 host RSS"] == (HOST_LEAK_BOUND_MIB, HOST_HEALTHY_JUMP_MIB,
                                         [(1.0, 200.0), (10.0, 260.0), (20.0, 320.0)])
    assert series["rank 0 device memory"] == (DEVICE_LEAK_BOUND_MIB, DEVICE_HEALTHY_JUMP_MIB,
                                              [(1.0, 5.0), (10.0, 5.0), (20.0, 5.0)])
    assert set(series) == {f"rank {r} {k}" for r in (0, 1) for k in ("host RSS", "device memory")}
    cpu = memory_series([step_record(s, host_rss_bytes_per_rank=[100]) for s in range(1, 4)])
    assert set(cpu) == {"rank 0 host RSS"}
    assert memory_series([]) == {}


def test_a_leak_is_fitted_from_every_logged_step_of_a_short_run():
    # 20 smoke steps logged every step: the fit sees 15 steps after warm-up, where a Prometheus scrape
    # every 2 s would have caught one or two of them.
    lines = [step_record(s, host_rss_bytes_per_rank=[(500 + (s * 8 if s > 3 else 0)) * MIB, 500 * MIB])
             for s in range(1, 21)]
    series = memory_series(lines)
    bound, jump, points = series["rank 0 host RSS"]
    leaking = leak_verdict(points, bound, jump)
    assert leaking.status == "fail" and leaking.mib_per_100_steps == pytest.approx(800)
    assert leaking.steps_fitted == 15
    bound, jump, points = series["rank 1 host RSS"]
    assert leak_verdict(points, bound, jump).status == "pass"


def _runtime(rank: int = 1, world: int = 2) -> Runtime:
    return Runtime(rank, world, rank, world, 0, torch.device("cpu"), "gloo", "node-a")


def _record(step: int) -> StepRecord:
    return step_record(step, loss=2.5, tokens_per_s=1000.0, mfu=None, step_time_s=0.5, grad_sync_share=None,
                       mem_bytes_per_rank=(111, 222))


def test_rank_metrics_writes_one_prometheus_file_per_rank_and_removes_it(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "fsdp-1234")
    exporter = RankMetrics.create(MetricsConfig(prometheus_dir=str(tmp_path)), _runtime())
    exporter.update(_record(7))
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == ["fsdp-trainer-fsdp-1234-rank1.prom"]
    samples = {line.split("{")[0]: line for line in files[0].read_text().splitlines()
               if not line.startswith("#")}
    assert set(samples) == set(METRICS)
    for line in samples.values():
        assert 'job="fsdp-1234",rank="1",host="' in line
    assert samples["fsdp_trainer_step"].endswith(" 7")
    assert samples["fsdp_trainer_rank_tokens_per_second"].endswith(" 500.0")
    assert samples["fsdp_trainer_peak_memory_bytes"].endswith(" 222")  # this rank's entry
    assert samples["fsdp_trainer_grad_sync_share"].endswith(" nan")
    exporter.close()
    assert list(tmp_path.iterdir()) == []


def test_a_retried_slurm_step_rewrites_the_file_its_killed_attempt_left(tmp_path, monkeypatch):
    # The batch script's attempts run under run ids JOB-RUN-ATTEMPT; a killed worker's file stays behind.
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "42-0-0")
    RankMetrics.create(MetricsConfig(prometheus_dir=str(tmp_path)), _runtime()).update(_record(3))  # killed
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "42-0-1")
    retry = RankMetrics.create(MetricsConfig(prometheus_dir=str(tmp_path)), _runtime())
    retry.update(_record(4))
    (file,) = tmp_path.iterdir()
    assert file.name == "fsdp-trainer-42-rank1.prom" and 'job="42-0-1"' in file.read_text()
    retry.close()
    assert list(tmp_path.iterdir()) == []


def test_rank_metrics_refuses_a_directory_it_cannot_write(tmp_path):
    with pytest.raises(ConfigError, match=r"metrics\.prometheus_dir"):
        RankMetrics.create(MetricsConfig(prometheus_dir=str(tmp_path / "absent")), _runtime())
    assert RankMetrics.create(MetricsConfig(), _runtime()) is None


def test_the_fault_injection_knob_grows_only_the_chosen_ranks_memory():
    cfg = MetricsConfig(fault_leak_mib_per_step=16, fault_leak_rank=1)
    leaking, healthy = RankMetrics.create(cfg, _runtime(1)), RankMetrics.create(cfg, _runtime(0))
    before = current_memory_bytes(torch.device("cpu"))[0]
    for step in range(1, 5):
        healthy.after_step([_record(step)])
    assert current_memory_bytes(torch.device("cpu"))[0] - before < 8 * MIB
    for step in range(1, 5):
        leaking.after_step([_record(step)])
    assert current_memory_bytes(torch.device("cpu"))[0] - before >= 4 * 15 * MIB
    leaking.close()


def test_render_escapes_label_values():
    text = render({"fsdp_trainer_step": 3}, {"job": 'a"b\\c', "rank": "0", "host": "h"})
    assert 'fsdp_trainer_step{job="a\\"b\\\\c",rank="0",host="h"} 3' in text


def test_efa_script_exports_every_counter_of_every_port(tmp_path):
    for device, port, counters in (("rdmap16s27", "1", {"rx_bytes": 10, "tx_bytes": 20}),
                                   ("rdmap32s27", "1", {"rx_bytes": 30, "rdma_read_bytes": 5})):
        directory = tmp_path / "sys/class/infiniband" / device / "ports" / port / "hw_counters"
        directory.mkdir(parents=True)
        for name, value in counters.items():
            (directory / name).write_text(f"{value}\n")
    out = tmp_path / "efa.prom"
    subprocess.run([sys.executable, str(EFA_SCRIPT), str(out), str(tmp_path)], check=True)
    text = out.read_text()
    assert 'fsdp_efa_rx_bytes_total{device="rdmap16s27",port="1"} 10' in text
    assert 'fsdp_efa_rx_bytes_total{device="rdmap32s27",port="1"} 30' in text
    assert 'fsdp_efa_rdma_read_bytes_total{device="rdmap32s27",port="1"} 5' in text
    assert text.count("# TYPE fsdp_efa_rx_bytes_total counter") == 1
    assert not os.path.exists(str(out) + ".tmp")


def test_metric_names_of_promql():
    assert metric_names(NODE_QUERIES["tokens_per_s"]) == {"fsdp_trainer_rank_tokens_per_second",
                                                          "fsdp_trainer_last_update_seconds"}
    assert metric_names('sum by (node) (rate(node_cpu_seconds_total{mode="idle"}[$__rate_interval])) * 8') \
        == {"node_cpu_seconds_total"}


def test_dashboard_is_valid_grafana_json_with_a_query_per_panel():
    dashboard = json.loads((REPO / "dashboards/fsdp-cluster.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels and all(p["targets"][0]["expr"] for p in panels)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"


def test_monitor_view_renders_a_row_per_node():
    view = {"nodes": [{"rank": r, "node": f"n{r}", "up": 1.0, "cpu_util": 0.5, "mem_used_bytes": 2**30,
                       "mem_total_bytes": 2**34, "net_rx_bps": 1e9, "net_tx_bps": 2e9, "link_bps": 1e10,
                       "tokens_per_s": 1234.0} for r in range(2)], "jobs": {"fsdp-1": 2468.0}}
    lines = render_view(view).splitlines()
    assert lines[0].split()[:3] == ["RANK", "NODE", "UP"]
    assert [line.split()[1] for line in lines[1:3]] == ["n0", "n1"]
    assert "1,234" in lines[1] and "fsdp-1 2,468 tok/s" in lines[-1]


def test_monitoring_plots_from_series():
    pytest.importorskip("matplotlib")
    mon = MonitoringSeries(
        window=(100.0, 110.0), cpu_util={"n0": [(100.0, 0.5), (101.0, 0.6)]}, gpu_util={},
        network_bps={"rx": {"n0": [(100.0, 1e9)]}, "tx": {"n0": [(100.0, 2e9)]}}, link_bps={"n0": 1e10},
        memory={"j rank 0 host RSS": [(5.0, 1e8), (6.0, 1.1e8)]},
        per_rank_tokens_per_s={"0": 100.0, "1": 110.0})
    assert set(monitoring_plots(mon)) == {"Utilisation over time", "Network over time",
                                          "Memory per rank over steps", "Tokens/s measured on each rank"}
    assert monitoring_plots(MonitoringSeries(window=(100.0, 110.0), cpu_util={}, gpu_util={}, network_bps={},
                                             link_bps={}, memory={}, per_rank_tokens_per_s={})) == {}
