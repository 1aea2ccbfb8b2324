"""The mixture-of-experts feed-forward of Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss, used by the blocks
that ModelConfig.is_moe_layer names; the other blocks keep the dense SwiGLU of trainer/model.py.

Per token: router logits (a linear layer, with a bias for gpt-oss) -> softmax over all experts (fp32)
-> the top-k probabilities -> renormalised to sum to 1 when `norm_topk_prob` (Mixtral always; gpt-oss's
softmax over the chosen experts' logits is exactly that) -> the weighted sum of the k chosen experts'
outputs; Qwen2-MoE adds its shared expert's output times sigmoid(shared_expert_gate x).

Experts are stacked, [experts, ...] per parameter, for every family: Qwen3-MoE's and Mixtral's SwiGLU
experts as transformers 5 and torchtitan hold them (SwiGLUExperts: gate_up_proj, down_proj, each
expert's matrices as nn.Linear stores them; the checkpoints' per-expert tensors are rows of these,
trainer/hf/adapter.py), gpt-oss's as its checkpoints store them, with biases and its clamped SwiGLU
(GptOssExperts). One layout for all is what lets FSDP shard them by expert, expert parallelism split
them and grouped GEMM run them, the same way for every family.

Dispatch: the (token, slot) assignments are sorted by expert, so each expert's tokens are one
contiguous run; the experts run on their runs (a loop, or on CUDA in bf16 one `torch._grouped_mm` per
projection), and the outputs are added back to their tokens weighted by the router. Every expert runs,
even on zero tokens, so every expert's weights get a (zero) gradient on every rank and FSDP's
reduce-scatter sees the same parameters everywhere.

Expert parallelism (parallel.expert_parallel = P): each group of P consecutive ranks splits a block's
experts, rank i of the group holding experts [i E/P, (i+1) E/P) (trainer/parallelize.py makes them
DTensors sharded over the group, then FSDP shards them further over the ranks holding the same experts,
so no rank ever gathers more than E/P of them). A forward sends each routed token to the rank of its
expert and the results back, two all-to-alls in the group (their gradients are all-to-alls too); the
run lengths travel first, in one small all-to-all.

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


class ExpertRuns:
    """Rows sorted by expert (counts[e] rows for expert e, every expert of a stacked parameter in order)
    and the per-expert products over them: one matmul per expert (any device and dtype; the backward
    torch has on CPU), or with `grouped` one torch._grouped_mm for all experts (CUDA bf16 for training;
    CPU has the forward only), the run lengths staying on the device (no host sync)."""

    def __init__(self, counts: torch.Tensor, grouped: bool):
        self.counts = counts
        # The loop splits the rows on the host (one sync per block, shared by its matmuls); grouped
        # GEMM reads the run lengths on the device.
        self.sizes = None if grouped else counts.tolist()

    def matmul(self, rows: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """rows @ weight[e] (+ bias[e]) for each expert e's rows; weight [experts, in, out], bias
        [experts, out]."""
        if self.sizes is not None:
            outputs = []
            for e, chunk in enumerate(rows.split(self.sizes)):
                product = chunk @ weight[e]
                outputs.append(product if bias is None else product + bias[e])
            return torch.cat(outputs)
        out = torch._grouped_mm(rows, weight, offs=torch.cumsum(self.counts, 0).to(torch.int32))
        if bias is None:
            return out
        expert_of_row = torch.repeat_interleave(torch.arange(self.counts.shape[0], device=rows.device),
                                                self.counts, output_size=rows.shape[0])
        return out + bias[expert_of_row]


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
    """A block's experts as stacked parameters, [experts, ...] each: the layout grouped GEMM takes, that
    FSDP shards by expert and expert parallelism splits (trainer/parallelize.py). Subclasses hold the
    parameters and say what one expert computes (`compute`); this class picks the path: on CUDA in bf16
    `grouped`, elsewhere `looped` (bench/gpu_check/moe_paths.py counts the calls of each)."""

    def __init__(self):
        super().__init__()
        # Expert parallelism (trainer/parallelize.py): FSDP averages these gradients over the world / P
        # ranks that hold the same experts; every other gradient is averaged over the world, so these
        # are scaled by 1 / P on their way (FSDP's own divide factor needs PREMUL_SUM, which gloo lacks).
        self.gradient_scale = 1.0

    def forward(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert on its run of `routed` (rows sorted by expert, counts[e] rows for expert e)."""
        if routed.is_cuda and routed.dtype == torch.bfloat16:
            return self.grouped(routed, counts)
        return self.looped(routed, counts)

    def looped(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.compute(routed, ExpertRuns(counts, grouped=False))

    def grouped(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.compute(routed, ExpertRuns(counts, grouped=True))

    def compute(self, routed: torch.Tensor, runs: ExpertRuns) -> torch.Tensor:
        raise NotImplementedError

    def local(self, param: torch.Tensor) -> torch.Tensor:
        """A parameter as this rank computes with it: its own experts (with expert parallelism FSDP
        hands the block DTensors of them), the gradient scaled."""
        tensor = param.to_local() if isinstance(param, DTensor) else param
        if self.gradient_scale != 1.0:
            tensor = _ScaleGradient.apply(tensor, self.gradient_scale)
        return tensor


class SwiGLUExperts(StackedExperts):
    """Qwen3-MoE's and Mixtral's experts, each a SwiGLU down(silu(gate x) * up x), stacked as transformers
    5 and torchtitan hold them: gate_up_proj [experts, 2 x ffn, dim] (expert e's gate rows, then its up
    rows: the checkpoints' per-expert gate_proj/w1 and up_proj/w3 weights) and down_proj [experts, dim,
    ffn] (down_proj/w2), each expert's matrix as torch.nn.Linear stores it (x @ W^T)."""

    def __init__(self, dim: int, ffn_dim: int, n_experts: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * ffn_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))

    def compute(self, routed: torch.Tensor, runs: ExpertRuns) -> torch.Tensor:
        gate_up_proj, down_proj = self.local(self.gate_up_proj), self.local(self.down_proj)
        gate, up = runs.matmul(routed, gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        return runs.matmul(F.silu(gate) * up, down_proj.transpose(1, 2))


class GptOssExperts(StackedExperts):
    """gpt-oss's experts, stacked as its checkpoints store them: gate_up_proj [experts, dim, 2 x ffn]
    (x @ W, gate and up columns interleaved), down_proj [experts, ffn, dim], each with a bias; the
    activation its clamped SwiGLU."""

    def __init__(self, dim: int, ffn_dim: int, n_experts: int, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, dim, 2 * ffn_dim))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(n_experts, 2 * ffn_dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.down_proj_bias = nn.Parameter(torch.empty(n_experts, dim))

    def compute(self, routed: torch.Tensor, runs: ExpertRuns) -> torch.Tensor:
        gate_up = runs.matmul(routed, self.local(self.gate_up_proj), self.local(self.gate_up_proj_bias))
        hidden = clamped_swiglu(gate_up, self.alpha, self.limit)
        return runs.matmul(hidden, self.local(self.down_proj), self.local(self.down_proj_bias))


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
    """The router and the stacked experts; with `shared_expert` (Qwen2-MoE: a dense SwiGLU, built by
    trainer/model.py) also that expert, which every token goes through, its output scaled by
    sigmoid(shared_expert_gate x) (a linear layer to one logit, no bias) and added to the routed
    experts' sum. The shared expert is dense: FSDP shards it with the block, expert parallelism leaves
    it whole on every rank."""

    def __init__(self, cfg: ModelConfig, shared_expert: nn.Module | None = None):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.n_active_experts
        self.norm_topk_prob = cfg.norm_topk_prob
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=cfg.router_bias)
        self.experts: StackedExperts
        if cfg.expert_kind == "gpt_oss":
            self.experts = GptOssExperts(cfg.dim, cfg.expert_ffn_dim, cfg.n_experts, cfg.swiglu_alpha,
                                         cfg.swiglu_limit)
        else:
            self.experts = SwiGLUExperts(cfg.dim, cfg.expert_ffn_dim, cfg.n_experts)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(cfg.dim, 1, bias=False) if shared_expert is not None else None
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
        # Not bincount: its output's length depends on the data, which breaks a compiled block's graph.
        counts = torch.zeros(self.n_experts, dtype=expert_of.dtype, device=expert_of.device).scatter_add_(
            0, expert_of, torch.ones_like(expert_of))
        token_of = order // self.top_k
        if self.expert_parallel is None:
            outputs = self.experts(flat[token_of], counts)
        else:
            outputs = exchange_with_experts(flat[token_of], counts, self.experts, self.expert_parallel)
        outputs = outputs * weights.reshape(-1)[order, None]
        out = torch.zeros_like(flat).index_add_(0, token_of, outputs.to(flat.dtype))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
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
