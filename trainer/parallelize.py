"""Apply an FSDP strategy (by its FSDP1 name) to the meta-device model with FSDP2 `fully_shard`.

FULL_SHARD     1-D mesh over all ranks, parameters resharded after forward.
SHARD_GRAD_OP  1-D mesh, parameters kept gathered from forward to backward (more memory, fewer
               all-gathers).
HYBRID_SHARD   2-D mesh (replicate x shard): shard within a group of `sharding_degree` ranks (a node),
               replicate across groups; gradients reduce-scatter in the group, then all-reduce across.
NO_SHARD       2-D mesh (replicate x 1): every rank holds everything, gradients all-reduce (DDP).

With parallel.expert_parallel = P, a mixture-of-experts block's stacked experts get a mesh of their own,
(world / P) x P ("expert_shard" x "expert"): sharded by expert over the P consecutive ranks of an
expert group (a DTensor, Shard(0)), then by FSDP over the world / P ranks that hold the same experts,
as their own FSDP unit inside the block. Their gradients are scaled by 1 / P in backward, so that they
end divided by the world size as every other parameter's are, not by the world / P ranks FSDP
reduces them over.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Shard

from trainer.config import Layout, ParallelConfig, Strategy
from trainer.model import Transformer
from trainer.moe import ExpertParallel, MoEFeedForward

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_mesh(layout: Layout, strategy: Strategy, device_type: str) -> DeviceMesh:
    if strategy in (Strategy.HYBRID_SHARD, Strategy.NO_SHARD):
        return init_device_mesh(device_type, (layout.replicate, layout.shard),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (layout.shard,), mesh_dim_names=("shard",))


def parallelize(model: Transformer, mesh: DeviceMesh, cfg: ParallelConfig, device_type: str) -> None:
    """Shard the embedding, each block, the final norm + output projection, then the (empty) root;
    all still on the meta device."""
    mp_policy = MixedPrecisionPolicy(
        param_dtype=None if cfg.param_dtype == "fp32" else DTYPES[cfg.param_dtype],
        reduce_dtype=DTYPES[cfg.reduce_dtype])
    # Pinned host memory needs an accelerator; without one pinning fails, so only pin with CUDA.
    offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if cfg.cpu_offload else OffloadPolicy()
    # Only FULL_SHARD and HYBRID_SHARD free gathered parameters between forward and backward;
    # NO_SHARD has nothing to gather.
    reshard = cfg.strategy in (Strategy.FULL_SHARD, Strategy.HYBRID_SHARD)
    common = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": offload}
    # Units as torchtitan's distributed/fsdp.py groups them: the embedding alone (its gathered
    # vocab x dim table is freed after forward like a block's parameters), each block, then the final
    # norm with the output projection. That last unit runs first in backward, so keeping it gathered
    # from forward to backward costs no memory peak and saves an all-gather; the root then owns no
    # parameters of its own.
    # Tied embeddings (one parameter used first and last) must live in one unit: the embedding joins
    # the final norm and output projection, gathered from the start of forward to the end of backward.
    tied = model.cfg.tie_embeddings
    if not tied:
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard, **common)
    expert_mesh = None
    if cfg.expert_parallel > 1:
        world = dist.get_world_size()
        expert_mesh = init_device_mesh(device_type, (world // cfg.expert_parallel, cfg.expert_parallel),
                                       mesh_dim_names=("expert_shard", "expert"))
    for block in model.layers:
        block.activation_checkpointing = cfg.activation_checkpointing
        if expert_mesh is not None and isinstance(block.feed_forward, MoEFeedForward):
            split_experts(block.feed_forward, expert_mesh["expert"])
            fully_shard(block.feed_forward.experts, mesh=expert_mesh["expert_shard"],
                        reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload)
        if cfg.compile:
            block.compile()
        fully_shard(block, reshard_after_forward=reshard, **common)
    head = [model.tok_embeddings, model.norm, model.output] if tied else [model.norm, model.output]
    fully_shard(head, reshard_after_forward=False, **common)
    fully_shard(model, reshard_after_forward=False, **common)


def split_experts(moe: MoEFeedForward, expert_mesh: DeviceMesh) -> None:
    """Make the stacked experts' parameters (still on the meta device) DTensors sharded by expert over
    the expert group, and tell the block where its experts are."""
    size = expert_mesh.size()
    for name, param in list(moe.experts.named_parameters(recurse=False)):
        rows = param.shape[0] // size
        local = torch.empty((rows, *param.shape[1:]), device=param.device, dtype=param.dtype)
        split = DTensor.from_local(local, expert_mesh, [Shard(0)], run_check=False, shape=param.shape,
                                   stride=param.stride())
        setattr(moe.experts, name, nn.Parameter(split, requires_grad=param.requires_grad))
    moe.expert_parallel = ExpertParallel(expert_mesh.get_group(), size)
    moe.experts.gradient_scale = 1.0 / size


def set_gradient_sync(model: FSDPModule, strategy: Strategy, sync: bool) -> None:
    """Gradient accumulation: what the non-final micro-batches (sync=False) skip.

    FULL_SHARD / SHARD_GRAD_OP: nothing. Skipping the reduce-scatter would leave every rank holding
    full-size (unsharded) gradients until the last micro-batch, defeating the sharding; torchtitan
    reduce-scatters every micro-batch too. HYBRID_SHARD: the reduce-scatter inside the shard group
    (fast, intra-node) runs every micro-batch so gradients stay sharded; only the all-reduce across
    replicas (slow, inter-node) waits for the last micro-batch. NO_SHARD: gradients are full-size
    anyway, so the whole all-reduce waits for the last micro-batch (DDP's no_sync)."""
    if strategy is Strategy.HYBRID_SHARD:
        model.set_requires_all_reduce(sync)
    elif strategy is Strategy.NO_SHARD:
        model.set_requires_gradient_sync(sync)


def sharding_report(model: Transformer, compute_dtype: str) -> list[str]:
    """One line per parameter (device, dtype, local and global shape, placement) plus a per-rank
    total of local elements, so users can see that sharding took effect."""
    lines = []
    local_total = 0
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            local = param.to_local()
            placement = ",".join(str(p) for p in param.placements)
        else:
            local, placement = param, "local"
        local_total += local.numel()
        lines.append(f"{name}: device={local.device} dtype={local.dtype} (compute {compute_dtype}) "
                     f"local={tuple(local.shape)} global={tuple(param.shape)} placement={placement}")
    totals = [None] * dist.get_world_size()
    dist.all_gather_object(totals, local_total)
    global_total = sum(p.numel() for p in model.parameters())
    for rank, count in enumerate(totals):
        lines.append(f"rank {rank}: {count} of {global_total} parameter elements "
                     f"({100 * count / global_total:.1f}%)")
    return lines
