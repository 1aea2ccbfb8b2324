"""Gloo groups of every rank beside the default one, for collectives off the training path (checkpoint
commits in a background thread, the stop-signal vote). A leaf module: the checkpoint package uses it
and must not import the trainer's configuration."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

collective_timeout = timedelta(seconds=900)
"""The run's distributed.timeout_s, set when the default group is initialised (trainer.distributed)."""


def side_group() -> dist.ProcessGroup:
    """A new gloo group with the run's collective time-out: new_group does not inherit it, and would
    wait 30 minutes for a rank whose node is gone."""
    return dist.new_group(backend="gloo", timeout=collective_timeout)
