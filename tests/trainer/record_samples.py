"""Metrics records for tests that need one without a training run (trainer/records.py's types)."""

from __future__ import annotations

from trainer.records import StepRecord


def step_record(step: int = 1, *, mem_bytes_per_rank: tuple[int, ...] = (111, 222), **figures) -> StepRecord:
    """A 2-rank CPU step record: `figures` override any field (loss, tokens_per_s, host RSS, ...)."""
    mems = list(mem_bytes_per_rank)
    fields = dict(step=step, loss=2.5, lr=1e-4, grad_norm=1.0, tokens_per_s=1000.0, samples_per_s=8.0,
                  step_time_s=0.5, grad_sync_s=None, grad_sync_share=None, comm_s=None, comm_exposed_s=None,
                  comm_exposed_share=None, profiled_step_time_s=None, comm_bytes=None, mfu=None,
                  max_mem_bytes=max(mems), mem_bytes_per_rank=mems, mem_max_min_ratio=max(mems) / min(mems),
                  skipped=False, world_size=len(mems), nodes=len(mems), ranks_per_node=1, device="cpu",
                  strategy="FULL_SHARD", params=1000)
    return StepRecord(**{**fields, **figures})
