"""The training loss: next-token cross-entropy over the counted targets (IGNORE targets, e.g. padding,
document boundaries and the non-assistant tokens of chats, add nothing), computed without ever
upcasting a reduced-precision logits tensor whole."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.batch import IGNORE

# Rows (tokens) of logits whose fp32 copy exists at any one time.
LOSS_CHUNK_TOKENS = 8192


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of reduced-precision logits [N, vocab] over the counted targets (IGNORE
    targets add nothing), in fp32, one chunk of rows at a time. Forward also writes softmax - one-hot
    chunk by chunk into a tensor of the logits' dtype (zero on ignored rows); backward scales it by
    grad_output, again one chunk at a time in fp32, so neither pass ever holds more than one chunk in
    fp32 (Liger-Kernel's approach).

    The caller's normalisation (1 / counted tokens) and the loss scale arrive together in grad_output
    and are applied in fp32, never stored apart in fp16: (p - y) / N alone underflows fp16 for any p
    under ~1e-3 at N = 16k tokens, and GradScaler's first scale, 65536, is itself past fp16's largest
    value (65504)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        grad = torch.empty_like(logits) if logits.requires_grad else None
        for start in range(0, logits.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            chunk, chunk_targets = logits[rows].float(), targets[rows]
            counted = chunk_targets != IGNORE
            safe_targets = torch.where(counted, chunk_targets, 0)
            log_probs = torch.log_softmax(chunk, dim=-1)
            total += -(log_probs.gather(1, safe_targets[:, None])[:, 0] * counted).sum()
            if grad is not None:
                probs = log_probs.exp_()
                probs[torch.arange(probs.shape[0], device=probs.device), safe_targets] -= 1.0
                grad[rows] = probs * counted[:, None]
        ctx.save_for_backward(grad)
        ctx.chunk_tokens = chunk_tokens
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        factor = grad_output.float()
        # In place: a second full-size copy is what this function exists to avoid (so the graph
        # cannot be backpropagated twice, which training never does).
        for start in range(0, grad.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            grad[rows] = grad[rows].float().mul_(factor)
        return grad, None, None


def token_nll_sum(logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = LOSS_CHUNK_TOKENS
                  ) -> torch.Tensor:
    """Summed next-token negative log-likelihood over the counted targets (IGNORE: not counted), in
    fp32. fp32 logits go straight to F.cross_entropy. Reduced-precision logits are never upcast whole
    (an fp32 copy of batch x seq x vocab is the largest tensor of a step): the loss and its gradient are
    computed over chunks of `chunk_tokens` rows in fp32."""
    flat, flat_targets = logits.flatten(0, 1), targets.flatten()
    if flat.dtype == torch.float32:
        return F.cross_entropy(flat, flat_targets, ignore_index=IGNORE, reduction="sum")
    return _ChunkedCrossEntropy.apply(flat, flat_targets, chunk_tokens)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = LOSS_CHUNK_TOKENS
            ) -> torch.Tensor:
    """Mean token cross-entropy over the counted targets."""
    counted = (targets != IGNORE).sum().clamp(min=1)
    return token_nll_sum(logits, targets, chunk_tokens) / counted
