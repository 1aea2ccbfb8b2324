"""Will a config fit? Per-rank memory of a training step, from the config alone (no GPU, no process
group): `fsdp-train --estimate CONFIG --world-size N [--gpu h100]`, or `estimate(cfg, N, gpu)`.

The model is built on the meta device (shapes, no memory) and every parameter is sharded by the rules
parallelize.py applies: FSDP2 splits dim 0 over the shard group (padded to a multiple), which is all
ranks under FULL_SHARD / SHARD_GRAD_OP, `sharding_degree` ranks (default: ranks per node) under
HYBRID_SHARD and one under NO_SHARD. Per rank:

- parameters: the fp32 master shard (4 bytes per element);
- gradients: fp32 shards (reduce-scattered every micro-batch, so sharded during accumulation too;
  full-size under NO_SHARD);
- optimizer state: AdamW's two fp32 moments (8 bytes per element);
- gathered parameters (compute dtype): FULL_SHARD / HYBRID_SHARD hold the unit being computed, the
  one prefetched and the norm + output unit (kept from forward to backward), plus that unit's
  unsharded gradient and reduce-scatter buffer (reduce dtype); SHARD_GRAD_OP and NO_SHARD hold every
  parameter gathered from forward to backward;
- activations of one micro-batch: the tensors each block saves for backward (compute dtype, with the
  fp32 intermediates of RMSNorm and rotary embeddings), counted per token from the model's shapes, or
  with activation checkpointing only each block's input plus one block recomputed; the attention
  score matrix only without flash attention (CPU); the logits, their gradient and one fp32 loss chunk.

Expert parallelism (P) only shrinks what a block gathers (its E/P experts): E/P experts sharded over
world / P ranks are ceil(E / world) experts' rows per rank, as without it, and a rank's experts work
on k slots per token of the rank in expectation (moe_feed_forward_bytes).

The total is compared with the GPU's memory less a reserve (CUDA context, NCCL buffers, allocator
fragmentation: 10%). Measured against CPU peaks in tests/trainer/test_estimate.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from trainer.config import Strategy, TrainConfig, derive_layout
from trainer.errors import ConfigError, Problem
from trainer.lora import apply_lora
from trainer.model import build_model
from trainer.parallelize import DTYPES

GIB = 2**30
# Memory of one GPU as CUDA reports it, by the names --gpu accepts.
GPU_MEMORY = {"a100-40gb": 40 * GIB, "a100-80gb": 80 * GIB, "h100": 80 * GIB, "h200": 140 * GIB}
USABLE_FRACTION = 0.9


def usable_bytes(gpu: str) -> int:
    """What a run may use of a GPU's memory (the rest: the CUDA context, NCCL buffers, fragmentation)."""
    return int(GPU_MEMORY[gpu] * USABLE_FRACTION)


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CLUSTER_STEP = 8  # GPUs per node on p4d/p5: clusters grow by whole nodes
MAX_CLUSTER = 4096


@dataclass(frozen=True)
class Estimate:
    """Bytes per rank of one configuration on `world_size` ranks."""

    world_size: int
    shard_group: int
    micro_batch_size: int
    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int  # as configured (parallel.activation_checkpointing)
    activations_no_ac: int
    activations_ac: int
    total: int
    gpu: str | None
    gpu_bytes: int | None
    usable_bytes: int | None
    fits: bool | None
    smallest_fitting_world_size: int | None

    def as_dict(self) -> dict:
        return asdict(self)


def _shard_group(cfg: TrainConfig, world_size: int, ranks_per_node: int) -> int:
    strategy = cfg.parallel.strategy
    if strategy is Strategy.NO_SHARD:
        return 1
    if strategy is Strategy.HYBRID_SHARD:
        return cfg.parallel.sharding_degree or ranks_per_node
    return world_size


def _local_elements(shape: tuple[int, ...], group: int) -> int:
    """FSDP2's dim-0 shard of a parameter, padded: ceil(rows / group) rows."""
    return math.ceil(shape[0] / group) * math.prod(shape[1:])


def moe_feed_forward_bytes(cfg: TrainConfig) -> int:
    """Bytes one token saves for backward in a sparse block's feed-forward (trainer/moe.py), its input
    norm aside. Each token fills k expert slots; with expert parallelism a rank's experts work on the
    slots its expert group sends them, k per token of the rank in expectation (balanced routing), so
    per rank the count is the same as without it: the sorted copy of the received rows and the
    returned outputs take the place of the routed copy and the experts' outputs, and the all-to-alls
    save nothing themselves. Measured on 2 CPU ranks in tests/trainer/test_estimate.py."""
    m, e = cfg.model, DTYPE_BYTES[cfg.parallel.param_dtype]
    h, k, fs = m.dim, m.n_active_experts, m.shared_expert_ffn_dim
    router = 4 * m.n_experts  # the fp32 probabilities
    if m.norm_topk_prob:  # the renormalisation's fp32 top-k probabilities and their sum
        router += 4 * (k + 1)
    # Per slot: the routed copy of the input, the experts' own tensors (w1 and w3 outputs, silu, their
    # product; gpt-oss's clamped SwiGLU counted the same), their output, the weighted output index_add_
    # keeps, the routing weight, and the int64 indices (top-k expert, sort order, token of the slot;
    # with expert parallelism also the received rows' regrouping by expert and its inverse).
    indices = 3 + (2 if cfg.parallel.expert_parallel > 1 else 0)
    slot = e * (3 * h + 4 * m.expert_ffn_dim + 1) + 8 * indices
    # Qwen2-MoE: a dense SwiGLU's tensors, its gate's sigmoid, its output.
    shared = e * (4 * fs + 1 + h) if fs else 0
    return router + k * slot + shared


def activation_bytes(cfg: TrainConfig, micro_batch_size: int, *, checkpointing: bool,
                     flash_attention: bool = True) -> int:
    """Bytes of activations one micro-batch holds at its peak: the start of backward without
    checkpointing; with it, the larger of that moment (block inputs + loss) and recomputing one block."""
    m, e = cfg.model, DTYPE_BYTES[cfg.parallel.param_dtype]
    tokens = micro_batch_size * cfg.data.seq_len
    h, kv, f = m.dim, m.kv_heads * m.head_size, m.ffn_dim
    q = m.n_heads * m.head_size  # = h unless head_dim is explicit (Qwen3: 64 x 128 over hidden 5120)
    # Saved for backward, per token (RMSNorm and rotary embeddings compute in fp32):
    rmsnorm = 4 * h + 2 * e * h  # fp32 input, normalised copy, output
    attention = (rmsnorm + 4 * (q + kv) + e * (q + kv)  # q, k before (fp32) and after rotation
                 + e * kv + e * q + 4 * m.n_heads)  # v; attention output and its log-sum-exp
    feed_forward = rmsnorm + e * 4 * f  # w1 and w3 outputs, silu, their product
    scores = 0 if flash_attention else 4 * m.n_heads * cfg.data.seq_len  # the probabilities
    if m.attention_sinks and not flash_attention:  # computed in full off CUDA (trainer/model.py)
        scores = (4 + e) * m.n_heads * cfg.data.seq_len
    per_block = tokens * (attention + feed_forward + scores)
    k, fm, fs = m.n_active_experts, m.expert_ffn_dim, m.shared_expert_ffn_dim
    per_moe_block = tokens * (attention + rmsnorm + moe_feed_forward_bytes(cfg) + scores)
    sparse = sum(m.is_moe_layer(i) for i in range(m.n_layers))
    blocks = (m.n_layers - sparse) * per_block + sparse * per_moe_block
    widest = max(f if sparse < m.n_layers else 0, max(k * fm, fs) if sparse else 0)
    if sparse:
        per_block = max(per_block if sparse < m.n_layers else 0, per_moe_block)
    backward_transient = tokens * e * (3 * widest + 2 * h)  # gradients flowing through one block
    if e == 4:  # F.cross_entropy: the log-softmax saved, then its gradient
        loss = 2 * tokens * m.vocab_size * 4
    else:  # the chunked loss: the gradient in the compute dtype, one fp32 chunk
        loss = tokens * m.vocab_size * e + 3 * min(tokens, 8192) * m.vocab_size * 4
    head = tokens * (e * h + rmsnorm)  # embedding output, final norm
    if checkpointing:
        inputs = m.n_layers * tokens * e * h
        return inputs + head + max(loss, per_block + backward_transient)
    return blocks + head + loss + backward_transient


def _memory(cfg: TrainConfig, world_size: int, ranks_per_node: int, flash_attention: bool
            ) -> dict[str, int]:
    layout = derive_layout(cfg, world_size, min(ranks_per_node, world_size))
    group = _shard_group(cfg, world_size, ranks_per_node)
    model = build_model(cfg.model)
    e, r = DTYPE_BYTES[cfg.parallel.param_dtype], DTYPE_BYTES[cfg.parallel.reduce_dtype]
    if cfg.parallel.lora.enabled:
        apply_lora(model, cfg.parallel.lora, DTYPES[cfg.parallel.param_dtype])
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    local = sum(_local_elements(tuple(p.shape), group) for p in trainable)
    frozen_local = sum(_local_elements(tuple(p.shape), group) for p in frozen)
    full = sum(p.numel() for p in trainable)
    every = sum(p.numel() for p in model.parameters())

    ep = cfg.parallel.expert_parallel

    def unit_elements(module: torch.nn.Module, only_trainable: bool = False) -> int:
        """Elements one FSDP unit gathers: with expert parallelism a block's experts are 1 / ep of them
        (each rank gathers only its expert group's share)."""
        total = 0
        for name, p in module.named_parameters():
            if p.requires_grad or not only_trainable:
                total += p.numel() // ep if ".experts." in f".{name}" else p.numel()
        return total

    units = [unit_elements(block) for block in model.layers]
    embedding = model.tok_embeddings.weight.numel()
    head = model.norm.weight.numel() + model.output.weight.numel()
    # The unsharded gradient and reduce-scatter buffer of the unit in backward: trainable parameters
    # only (LoRA: the adapters).
    ends = (model.tok_embeddings.weight, model.output.weight)
    grad_unit = max([*(unit_elements(b, True) for b in model.layers),
                     *(p.numel() for p in ends if p.requires_grad)])
    if cfg.parallel.strategy in (Strategy.FULL_SHARD, Strategy.HYBRID_SHARD):
        largest = max([*units, embedding])
        gathered = e * (2 * largest + head) + (e + r) * grad_unit
    else:
        gathered = e * every + (e + r) * grad_unit
    # Frozen (LoRA base) weights are kept in the compute dtype and have no gradient or AdamW state.
    params, grads = 4 * local + e * frozen_local, 4 * (full if group == 1 else local)
    optimizer = 8 * local
    if cfg.parallel.cpu_offload:
        params = grads = optimizer = 0
    micro = layout.micro_batch_size
    no_ac = activation_bytes(cfg, micro, checkpointing=False, flash_attention=flash_attention)
    ac = activation_bytes(cfg, micro, checkpointing=True, flash_attention=flash_attention)
    activations = ac if cfg.parallel.activation_checkpointing else no_ac
    return {"world_size": world_size, "shard_group": group, "micro_batch_size": layout.micro_batch_size,
            "params": params, "grads": grads, "optimizer": optimizer, "gathered": gathered,
            "activations": activations, "activations_no_ac": no_ac, "activations_ac": ac,
            "total": params + grads + optimizer + gathered + activations}


def estimate(cfg: TrainConfig, world_size: int, gpu: str | None = None, *, ranks_per_node: int = 8,
             flash_attention: bool = True) -> Estimate:
    """Per-rank memory of `cfg` on `world_size` ranks and, with `gpu`, whether it fits and the smallest
    world size (a multiple of 8 GPUs) that does. Raises ConfigError for an unknown GPU or a layout
    that cannot work (derive_layout's checks)."""
    if gpu is not None and gpu not in GPU_MEMORY:
        raise ConfigError([Problem("--gpu", gpu, "is not a known GPU",
                                   f"use one of: {', '.join(GPU_MEMORY)}")])
    memory = _memory(cfg, world_size, ranks_per_node, flash_attention)
    gpu_bytes = GPU_MEMORY.get(gpu) if gpu else None
    usable = usable_bytes(gpu) if gpu_bytes else None
    smallest = None
    if usable:
        for candidate in range(CLUSTER_STEP, MAX_CLUSTER + 1, CLUSTER_STEP):
            try:
                if _memory(cfg, candidate, ranks_per_node, flash_attention)["total"] <= usable:
                    smallest = candidate
                    break
            except ConfigError:
                continue  # the global batch does not split over this many ranks
    return Estimate(**memory, gpu=gpu, gpu_bytes=gpu_bytes, usable_bytes=usable,
                    fits=None if usable is None else memory["total"] <= usable,
                    smallest_fitting_world_size=smallest)


def report(cfg_name: str, result: Estimate) -> list[str]:
    def gib(value: int) -> str:
        return f"{value / GIB:8.2f} GiB"

    lines = [f"{cfg_name} on {result.world_size} ranks (shard group {result.shard_group}, micro-batch "
             f"{result.micro_batch_size}), per rank:",
             f"  parameters (shard)         {gib(result.params)}",
             f"  gradients                  {gib(result.grads)}",
             f"  optimizer state (AdamW)    {gib(result.optimizer)}",
             f"  gathered parameters        {gib(result.gathered)}",
             f"  activations                {gib(result.activations)}  (with activation checkpointing "
             f"{gib(result.activations_ac).strip()}, without {gib(result.activations_no_ac).strip()})",
             f"  total                      {gib(result.total)}"]
    if result.gpu:
        verdict = "fits" if result.fits else "does NOT fit"
        lines.append(f"  {result.gpu}: {result.gpu_bytes / GIB:.0f} GiB, {result.usable_bytes / GIB:.1f} GiB "
                     f"usable: {verdict}")
        smallest = result.smallest_fitting_world_size
        nodes = smallest // CLUSTER_STEP if smallest else 0
        node_word = "node" if nodes == 1 else "nodes"
        lines.append(f"  smallest cluster that fits: {smallest} GPUs ({nodes} {node_word} of {CLUSTER_STEP})"
                     if smallest else
                     f"  no cluster up to {MAX_CLUSTER} GPUs fits; enable activation checkpointing, shard "
                     "more widely (FULL_SHARD) or lower the micro-batch")
    return lines
