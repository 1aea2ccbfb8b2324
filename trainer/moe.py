"""A mixture-of-experts feed-forward (Qwen3-MoE's sparse block), used by the blocks that
ModelConfig.is_moe_layer names; the other blocks keep the dense SwiGLU of trainer/model.py.

Per token: router logits (a linear layer without bias) -> softmax over all experts (fp32) -> the
top-k probabilities -> renormalised to sum to 1 when `norm_topk_prob` -> the weighted sum of the k
chosen experts' SwiGLU outputs. Experts are one nn.Linear triple each (w1/w3/w2, the dense block's
names), so a checkpoint's `mlp.experts.{e}.gate_proj.weight` loads by renaming alone
(trainer/hf/adapter.py), slice by slice.

Dispatch: the (token, slot) assignments are sorted by expert and each expert runs once on its
contiguous run of tokens, in a Python loop over experts. That is correct everywhere and fine on CPU;
the GPU path for later is one `torch._grouped_mm` over stacked expert weights with the same sorted
layout (and expert parallelism: an all-to-all before and after it). Every expert runs, even on zero
tokens, so every expert's weights get a (zero) gradient on every rank and FSDP's reduce-scatter sees
the same parameters everywhere.

Load balancing: each forward records, per MoE block, how many assignments each expert got and the
sum of the router probabilities; `router_aux_loss` combines them over the blocks exactly as
transformers' `load_balancing_loss_func` does (Switch Transformer, eqs. 4-6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    """One SwiGLU expert: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@dataclass
class RouterStats:
    """One MoE block's routing in the last forward."""

    tokens_per_expert: torch.Tensor
    """[n_experts] fp32: top-k assignments per expert (sums to tokens x k)."""
    prob_sum: torch.Tensor
    """[n_experts] fp32: the router probabilities summed over the tokens (carries the gradient)."""
    tokens: int
    """Tokens routed."""


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probabilities [tokens, n_experts] fp32, top-k weights [tokens, k] in the logits' dtype,
    top-k expert indices [tokens, k]) as transformers' Qwen3MoeTopKRouter computes them."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, indices = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights.to(logits.dtype), indices


class MoEFeedForward(nn.Module):
    def __init__(self, dim: int, moe_ffn_dim: int, n_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk_prob = n_experts, top_k, norm_topk_prob
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, moe_ffn_dim) for _ in range(n_experts))
        self.stats: RouterStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat)
        probs, weights, indices = route(logits, self.top_k, self.norm_topk_prob)
        # Sort the tokens x k assignments by expert: each expert's tokens are one contiguous run.
        expert_of = indices.reshape(-1)
        order = torch.argsort(expert_of, stable=True)
        counts = torch.bincount(expert_of, minlength=self.n_experts)
        token_of = order // self.top_k
        routed = flat[token_of]
        gate = weights.reshape(-1)[order, None]
        out = torch.zeros_like(flat)
        # One host sync for the run lengths; the grouped-GEMM path would take the counts on device.
        start = 0
        for expert, n in zip(self.experts, counts.tolist(), strict=True):
            rows = slice(start, start + n)
            out.index_add_(0, token_of[rows], (expert(routed[rows]) * gate[rows]).to(out.dtype))
            start += n
        self.stats = RouterStats(counts.float().detach(), probs.sum(dim=0), flat.shape[0])
        return out.reshape(shape)


def router_aux_loss(stats: list[RouterStats], n_experts: int) -> torch.Tensor:
    """transformers' load_balancing_loss_func over the blocks' last forward (no padding mask):
    n_experts x sum_e f_e P_e, where f_e is expert e's assignments and P_e its summed probability,
    each divided by the tokens routed over all MoE blocks together."""
    rows = sum(s.tokens for s in stats)
    tokens_per_expert = torch.stack([s.tokens_per_expert for s in stats]).sum(0) / rows
    prob_per_expert = torch.stack([s.prob_sum for s in stats]).sum(0) / rows
    return (tokens_per_expert * prob_per_expert).sum() * n_experts
