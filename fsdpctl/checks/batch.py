"""The batch of the smoke test's and scale-test's training runs, set from the world size.

A trainer config fixes `training.global_batch_size`, and the trainer refuses a launch that does not
split it over gradient_accumulation x world size (`derive_layout` in trainer/config.py): the `smoke`
config's 16 sequences in 2 micro-batches split over 1, 2, 4 or 8 ranks, never over two 8-GPU nodes.
The checks run on clusters of 1 to 256 nodes, so they fix the work of one rank instead and pass the
global batch that it makes on the world size at hand.
"""

from __future__ import annotations

SMOKE_MICRO_BATCH = 4
"""Sequences per rank per micro-batch in the smoke test: the `smoke` config's on the 2 x 1-rank
cluster it was sized for (16 sequences / 2 micro-batches / 2 ranks), so that run is unchanged and a
larger cluster gives every rank the same work."""
SMOKE_ACCUMULATION = 2
"""Micro-batches per optimizer step in the smoke test, the `smoke` config's: the first runs without
gradient sync, the last with it (trainer/train.py), so the gradient sync the `fsdp` check gates is
measured on the accumulation path that real runs take."""


def batch_settings(world_size: int, *, micro_batch: int = SMOKE_MICRO_BATCH,
                   accumulation: int = SMOKE_ACCUMULATION) -> dict[str, int | None]:
    """The trainer settings for `micro_batch` sequences per rank in each of `accumulation`
    micro-batches per step on `world_size` ranks (default: the smoke test's): the global batch is
    their product, so it always splits. training.micro_batch_size is emptied, so the trainer derives
    it from these two: a config that fixes its own cannot contradict them."""
    return {"training.global_batch_size": micro_batch * accumulation * world_size,
            "training.gradient_accumulation": accumulation, "training.micro_batch_size": None}


def assignments(settings: dict[str, int | None]) -> list[str]:
    """`settings` as the trainer's `key=value` overrides, in order (None as YAML's null)."""
    return [f"{key}={'null' if value is None else value}" for key, value in settings.items()]


def set_args(settings: dict[str, int | None]) -> list[str]:
    """The trainer's `--set key=value` arguments for `settings`."""
    return [arg for assignment in assignments(settings) for arg in ("--set", assignment)]
