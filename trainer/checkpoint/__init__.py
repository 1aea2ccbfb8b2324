"""Sharded, verified, mirrored training checkpoints.

A checkpoint is a directory ``step_<8 digits>`` holding the torch.distributed.checkpoint (DCP) shards of
the model and optimizer (``__<rank>_<n>.distcp`` plus ``.metadata``), one ``trainer_state_rank<r>.pt``
per rank (lr scheduler, data loader, grad scaler, RNG) and ``manifest.json`` with the SHA256 and size of
every other file. All ranks write into ``step_<n>.tmp``; rank 0 gathers every rank's hashes, writes the
manifest last and renames the directory, so a directory without ``.tmp`` is complete by construction and
its manifest proves it has not changed since. Resume loads only checkpoints whose manifest verifies.

See docs/checkpoints.md for the layout, the mirror, retention and elastic restarts.
"""

from __future__ import annotations

from trainer.checkpoint.cli import main
from trainer.checkpoint.config import CheckpointConfig, CheckpointError, parse_s3_url
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.manifest import (
    MANIFEST,
    apply_retention,
    checkpoint_name,
    committed_checkpoints,
    interrupted_saves,
    read_manifest,
    verify_checkpoint,
)
from trainer.checkpoint.mirror import S3Location

__all__ = [
    "MANIFEST", "CheckpointConfig", "CheckpointError", "CheckpointManager", "S3Location", "apply_retention",
    "checkpoint_name", "committed_checkpoints", "interrupted_saves", "main", "parse_s3_url", "read_manifest",
    "verify_checkpoint",
]
