"""Apply an FSDP strategy (by its FSDP1 name) to the meta-device model with FSDP2 `fully_shard`.

FULL_SHARD     1-D mesh over all ranks, parameters resharded after forward.
SHARD_GRAD_OP  1-D mesh, parameters kept gathered from forward to backward (more memory, fewer
               all-gathers).
HYBRID_SHARD   2-D mesh (replicate x shard): shard within a group of `sharding_degree` ranks (a node),
               replicate across groups; gradients reduce-scatter in the group, then all-reduce across.
NO_SHARD       2-D mesh (replicate x 1): every rank holds everything, gradients all-reduce (DDP).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from trainer.config import Layout, ParallelConfig, Strategy
from trainer.model import Transformer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_mesh(layout: Layout, strategy: Strategy, device_type: str) -> DeviceMesh:
    if strategy in (Strategy.HYBRID_SHARD, Strategy.NO_SHARD):
        return init_device_mesh(device_type, (layout.replicate, layout.shard),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (layout.shard,), mesh_dim_names=("shard",))


def parallelize(model: Transformer, mesh: DeviceMesh, cfg: ParallelConfig, device_type: str) -> None:
    """Shard each block, then the root (embeddings, final norm, output); all still on meta."""
    mp_policy = MixedPrecisionPolicy(
        param_dtype=None if cfg.param_dtype == "fp32" else DTYPES[cfg.param_dtype],
        reduce_dtype=DTYPES[cfg.reduce_dtype])
    # Pinned host memory needs an accelerator; without one pinning fails, so only pin with CUDA.
    offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if cfg.cpu_offload else OffloadPolicy()
    # Only FULL_SHARD and HYBRID_SHARD free gathered parameters between forward and backward;
    # NO_SHARD has nothing to gather.
    reshard = cfg.strategy in (Strategy.FULL_SHARD, Strategy.HYBRID_SHARD)
    for block in model.layers:
        block.activation_checkpointing = cfg.activation_checkpointing
        if cfg.compile:
            block.compile()
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy,
                    offload_policy=offload)
    # The root's parameters (output projection first) are needed again as soon as backward starts:
    # keeping them gathered saves one all-gather per step.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload)


def set_gradient_sync(model: FSDPModule, strategy: Strategy, sync: bool) -> None:
    """Gradient accumulation: communicate gradients only on the last micro-batch.

    Under HYBRID_SHARD the reduce-scatter inside the shard group (fast, intra-node) still runs every
    micro-batch so accumulated gradients stay sharded; only the all-reduce across replicas (slow,
    inter-node) waits for the last micro-batch. Other strategies skip all gradient communication on
    the earlier micro-batches."""
    if strategy is Strategy.HYBRID_SHARD:
        model.set_requires_all_reduce(sync)
    else:
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
