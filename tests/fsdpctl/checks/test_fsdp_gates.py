"""The fsdp smoke check's gates, each on its own: what a run's records must show to pass."""

from __future__ import annotations

from fsdpctl.checks.training import (
    CheckpointListing,
    _checkpoint_problems,
    _grad_sync_share,
    _loss_trend,
    _memory_balance,
)
from tests.trainer.record_samples import step_record


def test_loss_must_fall_from_the_first_quarter_to_the_last():
    falling = [step_record(s, loss=3.0 - 0.1 * s) for s in range(1, 9)]
    first, last, problems = _loss_trend(falling)
    assert (round(first, 2), round(last, 2), problems) == (2.85, 2.25, [])
    flat = [step_record(s, loss=2.0) for s in range(1, 9)]
    assert _loss_trend(flat)[2] == ["loss did not decrease (mean of the first 2 steps 2.0000, "
                                    "of the last 2 2.0000)"]


def test_memory_must_stay_balanced_across_ranks():
    assert _memory_balance([step_record(1, mem_bytes_per_rank=(100, 110))]) == (1.1, [])
    ratio, problems = _memory_balance([step_record(1), step_record(2, mem_bytes_per_rank=(100, 300))])
    assert ratio == 3.0 and problems == ["memory unbalanced: max/min peak memory across ranks 3.00 > 1.25"]


def test_grad_sync_share_is_gated_on_gpus_only():
    slow_sync = [step_record(s, grad_sync_share=0.9) for s in range(2, 4)]
    assert _grad_sync_share(slow_sync, gated=False) == (0.9, [])
    assert _grad_sync_share(slow_sync, gated=True)[1] == ["gradient sync takes 90% of the step (bound 15%)"]
    assert _grad_sync_share([step_record(2)], gated=True)[1][0].startswith("gradient-sync share not measured")
    assert _grad_sync_share([step_record(2)], gated=False) == (None, [])


def test_checkpoints_must_exist_and_verify_where_there_is_a_shared_file_system():
    good = CheckpointListing(step=4, verified=True, bytes=10, problems=[])
    bad = CheckpointListing(step=8, verified=False, bytes=10, problems=["shard 1 digest differs"])
    assert _checkpoint_problems(None, []) == []
    assert _checkpoint_problems("/shared/c", []) == ["no checkpoint written under /shared/c"]
    assert _checkpoint_problems("/shared/c", [good]) == []
    assert _checkpoint_problems("/shared/c", [good, bad]) == ["checkpoint manifest does not verify: "
                                                              "shard 1 digest differs"]
