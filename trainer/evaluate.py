"""Evaluation: the mean next-token negative log-likelihood over every counted position of a set of
documents, each document scored on its own (packed rows with document masking give the same numbers
as one document at a time), on any number of ranks. Used by `python -m trainer eval` and, every
eval.interval steps, by the training loop (torchtitan's validator)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.batch import IGNORE, DataError
from trainer.documents import PackedSource, eval_batches, packed_source
from trainer.loss import token_nll_sum
from trainer.model import Transformer
from trainer.tokenizer import Tokenizer


@dataclass(frozen=True)
class EvalResult:
    loss: float
    """Mean next-token NLL (nats) over the counted positions."""
    tokens: int
    """Positions counted (each document's tokens after its first; chats: assistant replies)."""

    def as_dict(self) -> dict:
        return {"loss": self.loss, "tokens": self.tokens}


@torch.no_grad()
def evaluate(model: Transformer, source: PackedSource, *, batch_size: int, device: torch.device
             ) -> EvalResult:
    """Collective: every rank runs the same number of forward passes over its share of the rows."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    counted = torch.zeros((), dtype=torch.float64, device=device)
    for batch in eval_batches(source, batch_size, dist.get_rank(), dist.get_world_size()):
        batch = batch.to(device)
        logits = model(batch.inputs, batch.positions, batch.document_ids)
        total += token_nll_sum(logits, batch.targets).double()
        counted += (batch.targets != IGNORE).sum()
    sums = torch.stack([total, counted])
    dist.all_reduce(sums)
    loss, tokens = sums.tolist()
    return EvalResult(loss / max(tokens, 1.0), int(tokens))


@dataclass(frozen=True)
class Validator:
    """The training loop's evaluation: eval.path's documents, packed once before training."""

    source: PackedSource
    batch_size: int
    device: torch.device

    def run(self, model: Transformer) -> EvalResult:
        return evaluate(model, self.source, batch_size=self.batch_size, device=self.device)


def evaluation_source(data_cfg, tokenizer: Tokenizer | None, vocab_size: int,
                      log: Callable[[str], None]) -> PackedSource:
    """The documents under data_cfg.path, tokenized exactly as the tokenizer's defaults do (its special
    tokens, no EOS appended: a document is what the tokenizer makes of it), cut at data.seq_len."""
    if tokenizer is None:
        raise DataError("evaluation needs the model's tokenizer: model.hf_dir has no tokenizer.json")
    return packed_source(data_cfg, tokenizer, vocab_size, log, append_eos=False)
