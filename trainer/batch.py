"""What the data pipeline hands the model: the batch contract, and the data's error.

A leaf module, so the tokenizer, the document packer and the loader (trainer.data, which re-exports
both names) can share them without importing one another in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

IGNORE = -100  # a target the loss does not count (F.cross_entropy's default ignore_index)


class DataError(ValueError):
    """Unusable data: the message names the file or key and the fix."""


@dataclass
class Batch:
    """One micro-batch. Unpacked sources (synthetic, token files) leave positions and document_ids
    None: one causal sequence per row with positions 0..seq_len-1."""

    inputs: torch.Tensor  # [b, seq_len] long
    targets: torch.Tensor  # [b, seq_len] long, IGNORE = not counted
    positions: torch.Tensor | None = None  # [b, seq_len] long rope positions, restarting at 0 per document
    document_ids: torch.Tensor | None = None  # [b, seq_len] long: attention only within equal ids (causal)

    @classmethod
    def from_windows(cls, tokens: torch.Tensor) -> Batch:
        """Next-token prediction over whole windows of seq_len + 1 tokens: every target counts."""
        return cls(tokens[:, :-1], tokens[:, 1:])

    def tensors(self) -> list[torch.Tensor]:
        """The tensors that are set (for stream bookkeeping)."""
        return [t for t in (getattr(self, f.name) for f in fields(self)) if t is not None]

    def _map(self, fn) -> Batch:
        return Batch(**{f.name: None if (t := getattr(self, f.name)) is None else fn(t)
                        for f in fields(self)})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        return self._map(torch.Tensor.pin_memory)
