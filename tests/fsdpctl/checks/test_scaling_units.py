"""Scale-test arithmetic and the smoke test's per-rank figures."""

from __future__ import annotations

import json

import pytest

from fsdpctl.checks.scaling import (
    ScalingMode,
    ScalingResult,
    ScalingRun,
    efficiency,
    node_counts,
    strong_global_batch,
    strong_settings,
)
from fsdpctl.checks.training import RankPeakMemory, per_rank_figures
from tests.trainer.record_samples import step_record


@pytest.mark.parametrize(("n", "counts"), [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]),
                                           (6, [1, 2, 4, 6]), (8, [1, 2, 4, 8])])
def test_node_counts_double_and_end_at_n(n, counts):
    assert node_counts(n) == counts


def test_efficiency_is_throughput_over_linear():
    assert efficiency({1: 100.0, 2: 180.0, 4: 300.0}) == {1: 1.0, 2: 0.9, 4: 0.75}
    with pytest.raises(ValueError, match="1-node"):
        efficiency({2: 100.0})


@pytest.mark.parametrize(("counts", "nproc"), [
    ([1, 2], 1), ([1, 2, 3], 1), ([1, 2, 4], 8), ([1, 2, 4, 6], 2)])
def test_strong_global_batch_divides_every_world_size(counts, nproc):
    batch = strong_global_batch(counts, nproc)
    assert all(batch % (k * nproc) == 0 for k in counts)
    assert batch // (max(counts) * nproc) >= 2


def test_per_rank_figures_take_each_ranks_peak():
    lines = [step_record(1, tokens_per_s=10.0, mem_bytes_per_rank=(5, 9)),
             step_record(2, tokens_per_s=400.0, mem_bytes_per_rank=(7, 8)),
             step_record(3, tokens_per_s=600.0, mem_bytes_per_rank=(6, 8))]
    assert per_rank_figures(lines) == [RankPeakMemory(rank=0, max_mem_bytes=7),
                                       RankPeakMemory(rank=1, max_mem_bytes=9)]
    assert per_rank_figures([step_record(1).model_copy(update={"mem_bytes_per_rank": []})]) == []


def test_scaling_json_names_the_batch_settings_as_the_trainer_does_and_reads_back():
    run = ScalingRun(nodes=2, ranks=2, steps=4, **strong_settings(8, 2), tokens_per_s=900.0, step_time_s=0.5)
    result = ScalingResult(cluster="c", nproc_per_node=1, steps=4, warmup_steps=2, node_counts=[1, 2],
                           measured_at="2026-12-01T00:00:00Z",
                           strong=ScalingMode(runs=[run], efficiency={"2": 0.9}),
                           weak=ScalingMode(runs=[run], efficiency={"2": 0.9}))
    data = json.loads(result.model_dump_json())
    assert data["strong"]["runs"][0] == {
        "nodes": 2, "ranks": 2, "steps": 4, "training.global_batch_size": 8,
        "training.gradient_accumulation": 1, "training.micro_batch_size": None, "tokens_per_s": 900.0,
        "step_time_s": 0.5}
    assert ScalingResult.model_validate_json(result.model_dump_json()) == result
