"""End to end through the command line (torchrun, 2 CPU ranks): the metrics file's contents, the
progress lines, --print-sharding, and training on a token file made by the data tool."""

from __future__ import annotations

import json

import pytest

from tests.trainer.conftest import assert_ok, torchrun
from trainer.config import load_config
from trainer.data import main as data_main

REQUIRED = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "step_time_s", "grad_sync_s",
            "grad_sync_share", "mfu", "max_mem_bytes", "mem_max_min_ratio", "mem_bytes_per_rank",
            "world_size", "nodes", "ranks_per_node"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli")
    proc = torchrun(2, ["-m", "trainer", "--config", "tiny", "--metrics-file", str(out / "m.jsonl"),
                        "--print-sharding", "--seed", "1"])
    assert_ok(proc)
    lines = (out / "m.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], proc.stderr


def test_one_record_per_step_then_summary(tiny_run):
    records, _ = tiny_run
    cfg = load_config("tiny")
    steps, summary = records[:-1], records[-1]
    assert [r["step"] for r in steps] == list(range(1, cfg.training.steps + 1))
    for r in steps:
        assert set(r) >= REQUIRED
        assert r["world_size"] == 2 and r["nodes"] == 1 and len(r["mem_bytes_per_rank"]) == 2
        assert r["max_mem_bytes"] == max(r["mem_bytes_per_rank"]) > 0
        mems = r["mem_bytes_per_rank"]
        assert r["mem_max_min_ratio"] == pytest.approx(max(mems) / min(mems))
        tokens = cfg.training.global_batch_size * cfg.data.seq_len
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_time_s"])
        assert r["samples_per_s"] == pytest.approx(cfg.training.global_batch_size / r["step_time_s"])
        # Communication is profiled on the run's 2nd and 3rd steps (metrics.profile_steps=2).
        if r["step"] in (2, 3):
            assert 0 <= r["grad_sync_s"] <= r["comm_exposed_s"] <= r["comm_s"]
            assert r["grad_sync_s"] <= r["profiled_step_time_s"]
            assert r["grad_sync_share"] == pytest.approx(r["grad_sync_s"] / r["profiled_step_time_s"])
        else:
            assert r["grad_sync_s"] is None and r["grad_sync_share"] is None
        assert r["mfu"] is None  # no known peak for a CPU
    # Memory now (what a leak grows) is read once per flush: after the first step, then every
    # log_interval steps; it is on the flush's last record, in bytes like the peak resident set (the
    # two are read differently, statm and getrusage, so neither bounds the other exactly).
    flushes = [r for r in steps if "host_rss_bytes_per_rank" in r]
    assert [r["step"] for r in flushes] == [1, *range(cfg.metrics.log_interval, cfg.training.steps + 1,
                                                      cfg.metrics.log_interval)]
    for r in flushes:
        pairs = zip(r["host_rss_bytes_per_rank"], r["mem_bytes_per_rank"], strict=True)
        assert all(0.5 * peak < rss < 2 * peak for rss, peak in pairs)
    assert not any("device_mem_bytes_per_rank" in r for r in steps)  # CPU: no device memory
    assert steps[0]["lr"] == pytest.approx(cfg.optim.lr / cfg.optim.warmup_steps)
    assert max(r["lr"] for r in steps) == pytest.approx(cfg.optim.lr)
    assert summary["event"] == "summary" and summary["steps"] == len(steps)
    assert summary["final_loss"] == steps[-1]["loss"] < 0.9 * steps[0]["loss"]
    assert summary["max_mem_bytes"] == max(r["max_mem_bytes"] for r in steps)
    assert summary["stopped"] == "completed" and summary["profiled_steps"] == 2
    shares = [steps[1]["grad_sync_share"], steps[2]["grad_sync_share"]]
    assert summary["grad_sync_share"] == pytest.approx(sum(shares) / 2)
    # Throughput of the measured window (steps 2-10): its tokens over its wall time.
    assert summary["measured_steps"] == len(steps) - 1
    assert summary["tokens_per_s"] == pytest.approx(
        (len(steps) - 1) * cfg.training.global_batch_size * cfg.data.seq_len / summary["measured_wall_s"])
    assert len(summary["rank_hosts"]) == 2 and summary["rank_hosts"][0] == summary["rank_hosts"][1]


def test_progress_and_sharding_report_on_rank_0(tiny_run):
    _, stderr = tiny_run
    assert "FULL_SHARD on 2 ranks" in stderr
    assert stderr.count("step 1/10 loss") == 1  # rank 0 only
    report = [line for line in stderr.splitlines() if "local=" in line]
    assert any(line.startswith("layers.0.attention.wq.weight: device=cpu dtype=torch.float32") and
               "local=(32, 64) global=(64, 64)" in line for line in report)
    assert len(report) == 1 + 9 * 2 + 2  # embeddings, 9 per block, final norm, output
    assert "rank 1: 66720 of 133440 parameter elements (50.0%)" in stderr


@pytest.mark.slow
def test_trains_on_a_token_file(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    assert data_main(["build", "--output", str(tmp_path / "data" / "corpus.bin"), str(corpus)]) == 0
    proc = torchrun(2, ["-m", "trainer", "--config", "tiny", "--steps", "6", "--metrics-file",
                        str(tmp_path / "m.jsonl"), "--set", "data.source=tokens",
                        "--set", f"data.path={tmp_path / 'data'}", "--set", "model.vocab_size=257"])
    assert_ok(proc)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "summary" and records[-1]["steps"] == 6
    assert records[-2]["loss"] < records[0]["loss"]
