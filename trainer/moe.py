"""The mixture-of-experts feed-forward of Qwen3-MoE and gpt-oss, used by the blocks that
ModelConfig.is_moe_layer names; the other blocks keep the dense SwiGLU of trainer/model.py.

Per token: router logits (a linear layer, with a bias for gpt-oss) -> softmax over all experts (fp32)
-> the top-k probabilities -> renormalised to sum to 1 when `norm_topk_prob` (gpt-oss's softmax over
the chosen experts' logits is exactly that) -> the weighted sum of the k chosen experts' outputs.

Experts come in the layout each family's checkpoints use, so loading is a renaming, slice by slice
(trainer/hf/adapter.py): Qwen3-MoE's one SwiGLU triple per expert (ExpertList), gpt-oss's stacked
tensors with biases and its clamped SwiGLU (StackedExperts, the grouped-GEMM layout).

Dispatch: the (token, slot) assignments are sorted by expert, so each expert's tokens are one
contiguous run; the experts run on their runs (a loop, or for stacked experts on CUDA in bf16 two
`torch._grouped_mm` calls), and the outputs are added back to their tokens weighted by the router.
Every expert runs, even on zero tokens, so every expert's weights get a (zero) gradient on every rank
and FSDP's reduce-scatter sees the same parameters everywhere.

Expert parallelism (parallel.expert_parallel = P, stacked experts): each group of P consecutive ranks
splits a block's experts, rank i of the group holding experts [i E/P, (i+1) E/P) (trainer/parallelize.py
makes them DTensors sharded over the group, then FSDP shards them further over the ranks holding the
same experts, so no rank ever gathers more than E/P of them). A forward sends each routed token to
the rank of its expert and the results back, two all-to-alls in the group (their gradients are
all-to-alls too); the run lengths travel first, in one small all-to-all.

Load balancing: each forward records, per MoE block, how many assignments each expert got and the
sum of the router probabilities; `router_aux_loss` combines them over the blocks exactly as
transformers' `load_balancing_loss_func` does (Switch Transformer, eqs. 4-6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor

from trainer.config import ModelConfig


class Expert(nn.Module):
    """One SwiGLU expert: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ExpertList(nn.ModuleList):
    """Qwen3-MoE's experts, a SwiGLU triple each (`experts.{e}.w1`...), as its checkpoints store them."""

    def forward(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert on its run of `routed` (rows sorted by expert, counts[e] rows for expert e)."""
        chunks = routed.split(counts.tolist())
        return torch.cat([expert(chunk) for expert, chunk in zip(self, chunks, strict=True)])


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of the interleaved [gate0, up0, gate1, up1, ...] projection."""
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient multiplied by `scale` backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class StackedExperts(nn.Module):
    """gpt-oss's experts, stacked as its checkpoints store them: gate_up_proj [experts, dim, 2 x ffn]
    (x @ W, gate and up columns interleaved), down_proj [experts, ffn, dim], each with a bias. The
    stacked layout is the one grouped GEMM takes, and FSDP shards it by expert."""

    def __init__(self, dim: int, ffn_dim: int, n_experts: int, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        # Expert parallelism (trainer/parallelize.py): FSDP averages these gradients over the world / P
        # ranks that hold the same experts; every other gradient is averaged over the world, so these
        # are scaled by 1 / P on their way (FSDP's own divide factor needs PREMUL_SUM, which gloo lacks).
        self.gradient_scale = 1.0
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, dim, 2 * ffn_dim))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(n_experts, 2 * ffn_dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.down_proj_bias = nn.Parameter(torch.empty(n_experts, dim))

    def forward(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if routed.is_cuda and routed.dtype == torch.bfloat16:
            return self.grouped(routed, counts)
        return self.looped(routed, counts)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate_up_proj, its bias, down_proj, its bias as this rank computes with them: its own experts
        (with expert parallelism FSDP hands the block DTensors of them), gradients scaled."""
        local = []
        for param in (self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias):
            tensor = param.to_local() if isinstance(param, DTensor) else param
            if self.gradient_scale != 1.0:
                tensor = _ScaleGradient.apply(tensor, self.gradient_scale)
            local.append(tensor)
        return local[0], local[1], local[2], local[3]

    def looped(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One matmul pair per expert (any device and dtype; the backward torch has on CPU)."""
        gate_up_proj, gate_up_bias, down_proj, down_bias = self.weights()
        outputs = []
        for e, chunk in enumerate(routed.split(counts.tolist())):
            hidden = clamped_swiglu(chunk @ gate_up_proj[e] + gate_up_bias[e], self.alpha, self.limit)
            outputs.append(hidden @ down_proj[e] + down_bias[e])
        return torch.cat(outputs)

    def grouped(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """All experts in two grouped GEMMs (torch._grouped_mm: CUDA bf16 for training; CPU has the
        forward only), the run lengths staying on the device (no host sync)."""
        ends = torch.cumsum(counts, 0).to(torch.int32)
        expert_of_row = torch.repeat_interleave(torch.arange(counts.shape[0], device=routed.device), counts,
                                                output_size=routed.shape[0])
        gate_up_proj, gate_up_bias, down_proj, down_bias = self.weights()
        gate_up = torch._grouped_mm(routed, gate_up_proj, offs=ends) + gate_up_bias[expert_of_row]
        hidden = clamped_swiglu(gate_up, self.alpha, self.limit)
        return torch._grouped_mm(hidden, down_proj, offs=ends) + down_bias[expert_of_row]


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


@dataclass
class ExpertParallel:
    """The ranks that split a block's experts (set by trainer/parallelize.py)."""

    group: dist.ProcessGroup
    """The expert-parallel group: `size` consecutive ranks."""
    size: int
    """Ranks in the group; each holds n_experts / size experts."""


def exchange_with_experts(routed: torch.Tensor, counts: torch.Tensor, experts: StackedExperts,
                          parallel: ExpertParallel) -> torch.Tensor:
    """Run `routed` (rows sorted by expert, counts[e] for each of all n_experts) on the ranks that hold
    their experts and return the outputs in the same order."""
    local_experts = counts.numel() // parallel.size
    sent = counts.view(parallel.size, local_experts)  # row r: what goes to rank r, per its expert
    received = torch.empty_like(sent)  # row r: what comes from rank r, per my expert
    dist.all_to_all_single(received, sent, group=parallel.group)
    send_sizes, receive_sizes = sent.sum(1).tolist(), received.sum(1).tolist()
    arrived = all_to_all_single_autograd(routed, receive_sizes, send_sizes, parallel.group)
    # Arrived rows come by source rank, each run sorted by my experts: regroup them by expert.
    expert_of_row = torch.arange(local_experts, device=counts.device).repeat(parallel.size)
    expert_of_row = expert_of_row.repeat_interleave(received.reshape(-1), output_size=arrived.shape[0])
    by_expert = torch.argsort(expert_of_row, stable=True)
    outputs = experts(arrived[by_expert], received.sum(0))[torch.argsort(by_expert)]
    return all_to_all_single_autograd(outputs, send_sizes, receive_sizes, parallel.group)


class MoEFeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.n_active_experts
        self.norm_topk_prob = cfg.norm_topk_prob
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=cfg.router_bias)
        if cfg.expert_kind == "gpt_oss":
            self.experts = StackedExperts(cfg.dim, cfg.expert_ffn_dim, cfg.n_experts, cfg.swiglu_alpha,
                                          cfg.swiglu_limit)
        else:
            self.experts = ExpertList(Expert(cfg.dim, cfg.expert_ffn_dim) for _ in range(cfg.n_experts))
        self.stats: RouterStats | None = None
        # Set by trainer/parallelize.py when parallel.expert_parallel > 1.
        self.expert_parallel: ExpertParallel | None = None

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
        if self.expert_parallel is None:
            outputs = self.experts(flat[token_of], counts)
        else:
            outputs = exchange_with_experts(flat[token_of], counts, self.experts, self.expert_parallel)
        outputs = outputs * weights.reshape(-1)[order, None]
        out = torch.zeros_like(flat).index_add_(0, token_of, outputs.to(flat.dtype))
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
