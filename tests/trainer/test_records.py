"""The metrics records (trainer/records.py): what MetricsLogger writes reads back through the same types
with the keys the file always had, and a line that is not a record is an error naming the file and the
line. One gloo rank in this process feeds a real MetricsLogger."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest
import torch
import torch.distributed as dist

from fsdpctl import remote
from fsdpctl.checks.errors import CheckError
from fsdpctl.checks.torchrun import read_remote_metrics
from trainer.config import MetricsConfig
from trainer.distributed import Runtime
from trainer.evaluate import EvalResult
from trainer.metrics import MetricsLogger, drop_unfinished_line
from trainer.records import EvalRecord, MetricsFormatError, StepRecord, SummaryRecord, parse_metrics

# The keys of a step line and of the summary line as the trainer wrote them before the records were
# typed (docs/trainer.md, "Metrics"): readers outside Python (dashboards, fsdpctl jobs' node-side
# probe, bench/gpu_summary.py) rely on them.
STEP_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "step_time_s", "grad_sync_s",
             "grad_sync_share", "comm_s", "comm_exposed_s", "comm_exposed_share", "profiled_step_time_s",
             "comm_bytes", "mfu", "max_mem_bytes", "mem_bytes_per_rank", "mem_max_min_ratio", "skipped",
             "world_size", "nodes", "ranks_per_node", "device", "strategy", "params"}
SUMMARY_KEYS = {"event", "steps", "first_step", "last_step", "first_loss", "final_loss", "min_loss",
                "eval_loss", "tokens_per_s", "samples_per_s", "step_time_s", "measured_steps",
                "measured_wall_s", "grad_sync_s", "grad_sync_share", "comm_exposed_share", "profiled_steps",
                "comm_bytes_per_step", "mfu", "max_mem_bytes", "mem_max_min_ratio", "skipped_steps",
                "stopped", "signal", "wall_time_s", "world_size", "nodes", "ranks_per_node", "device",
                "strategy", "params", "rank_hosts"}

# A step line as the trainer writes it (one rank, no profiling).
STEP_LINE = {"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0,
             "samples_per_s": 2.0, "step_time_s": 0.5, "grad_sync_s": None, "grad_sync_share": None,
             "comm_s": None, "comm_exposed_s": None, "comm_exposed_share": None, "profiled_step_time_s": None,
             "comm_bytes": None, "mfu": None, "max_mem_bytes": 10, "mem_bytes_per_rank": [10],
             "mem_max_min_ratio": 1.0, "skipped": False, "world_size": 1, "nodes": 1, "ranks_per_node": 1,
             "device": "cpu", "strategy": "FULL_SHARD", "params": 1}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A 4-step run logged every 2 steps (memory read on steps 1, 2, 4), an evaluation at step 2, and
    a skipped step 3 with an infinite gradient norm: the logger, and the file it wrote."""
    path = tmp_path_factory.mktemp("records") / "metrics.jsonl"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runtime = Runtime(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                          device=torch.device("cpu"), backend="gloo", hostname=socket.gethostname())
        logger = MetricsLogger(MetricsConfig(file=str(path), log_interval=2, profile_steps=0), runtime,
                               total_steps=4, tokens_per_step=64, samples_per_step=2, flops_per_token=10,
                               strategy="FULL_SHARD", params=1234, hosts=[runtime.hostname],
                               log=lambda _message: None)
        logger.start()
        for step in range(1, 5):
            grad_norm = torch.tensor(float("inf") if step == 3 else 0.5)
            logger.log_step(step=step, loss=torch.tensor(4.0 / step), lr=1e-3, grad_norm=grad_norm,
                            skipped=step == 3,
                            comm_bytes={"all_gather": 10, "reduce_scatter": 20, "all_reduce": 0})
            if step == 2:
                logger.log_eval(step, EvalResult(loss=1.5, tokens=640))
        summary = logger.close()
    finally:
        dist.destroy_process_group()
    return logger, summary, path


def test_what_the_trainer_writes_reads_back_as_the_same_records(written):
    logger, summary, path = written
    log = parse_metrics(path.read_text(), source=str(path))
    assert log.steps == logger.records and [r.step for r in log.steps] == [1, 2, 3, 4]
    assert log.evals == [EvalRecord(step=2, eval_loss=1.5, eval_tokens=640)]
    assert log.summaries == [summary] and log.summary.eval_loss == 1.5
    assert log.steps[2].grad_norm == float("inf") and log.steps[2].skipped


def test_the_lines_keep_the_keys_they_always_had(written):
    _, _, path = written
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [line for line in lines if "event" not in line]
    # Memory now is read at each flush, after the flush's last step: steps 1, 2 and 4.
    assert [set(line) - STEP_KEYS for line in steps] == [{"host_rss_bytes_per_rank"}] * 2 + [set()] + [
        {"host_rss_bytes_per_rank"}]
    assert all(set(line) >= STEP_KEYS for line in steps)
    assert next(line for line in lines if line.get("event") == "eval") == {
        "event": "eval", "step": 2, "eval_loss": 1.5, "eval_tokens": 640}
    assert set(lines[-1]) == SUMMARY_KEYS and lines[-1]["event"] == "summary"
    assert steps[2]["grad_norm"] == float("inf")  # written as Python's json writes it


def test_a_line_still_being_written_is_left_out():
    line = StepRecord.model_validate(STEP_LINE).json_line()
    log = parse_metrics(f"{line}\n{line[:40]}", source="m.jsonl")
    assert len(log.steps) == 1 and log.summary is None
    assert parse_metrics("", source="m.jsonl").steps == []


@pytest.mark.parametrize("whole_lines", [0, 1, 3])
def test_a_resumed_run_cuts_the_line_a_killed_run_left_unfinished(tmp_path, whole_lines):
    path = tmp_path / "metrics.jsonl"
    whole = "".join(StepRecord.model_validate({**STEP_LINE, "step": s}).json_line() + "\n"
                    for s in range(1, whole_lines + 1))
    path.write_text(whole + '{"step": 4, "loss": 1.')
    drop_unfinished_line(path, chunk=16)  # the cut is found across chunks too
    assert path.read_text() == whole
    drop_unfinished_line(path)  # a file that ends with its newline stays as it is
    assert path.read_text() == whole
    runtime = Runtime(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                      device=torch.device("cpu"), backend="gloo", hostname="h")
    path.write_text(whole + '{"step": 4, "lo')
    MetricsLogger(MetricsConfig(file=str(path)), runtime, total_steps=1, tokens_per_step=1,
                  samples_per_step=1, flops_per_token=1, strategy="FULL_SHARD", params=1, hosts=["h"]).close()
    assert [r.step for r in parse_metrics(path.read_text(), source=str(path)).steps] == list(
        range(1, whole_lines + 1))


@pytest.mark.parametrize(("garbled", "what"), [
    ('{"step": 2, "loss": ', "Invalid JSON"),
    (json.dumps({k: v for k, v in STEP_LINE.items() if k != "loss"}), "loss"),
    (json.dumps({"event": "checkpoint", "step": 2}), "does not match any of the expected tags"),
])
def test_a_line_that_is_not_a_record_names_the_file_and_the_line(garbled, what):
    text = "\n".join([json.dumps(STEP_LINE), garbled, json.dumps(STEP_LINE)]) + "\n"
    with pytest.raises(MetricsFormatError,
                       match=rf"^node 0:/w/metrics\.jsonl line 2: .*{what}.*fsdpctl deploy"):
        parse_metrics(text, source="node 0:/w/metrics.jsonl")


def test_fsdpctl_reads_a_garbled_metrics_file_as_a_check_error(monkeypatch):
    def cat(state, rank, command, **kwargs):
        return subprocess.CompletedProcess(command, 0, stdout='{"step": 1}\n', stderr="")

    monkeypatch.setattr(remote, "run", cat)
    with pytest.raises(CheckError, match=r"node 3:/shared/m\.jsonl line 1: .*world_size: Field required"):
        read_remote_metrics(None, 3, "/shared/m.jsonl")


def test_summary_of_a_run_that_logged_nothing_reads_back():
    empty = SummaryRecord(world_size=1, nodes=1, ranks_per_node=1, device="cpu", strategy="FULL_SHARD",
                          params=1, steps=0, first_step=None, last_step=None, first_loss=None,
                          final_loss=None, min_loss=None, eval_loss=None, tokens_per_s=None,
                          samples_per_s=None, step_time_s=None,
                          measured_steps=0, measured_wall_s=None, grad_sync_s=None, grad_sync_share=None,
                          comm_exposed_share=None, profiled_steps=0, comm_bytes_per_step=None, mfu=None,
                          max_mem_bytes=None, mem_max_min_ratio=None, skipped_steps=0, stopped="signal",
                          signal="SIGUSR1", wall_time_s=1.0, rank_hosts=["h"])
    assert parse_metrics(empty.json_line() + "\n", source="m").summary == empty

