"""Runs under torchrun (tests/trainer/test_estimate.py): the bytes autograd saves for backward in one
forward of a sparse feed-forward (fp32), without expert parallelism and with it over the 2 ranks (the
real split_experts and all-to-all path), on the same weights and the same tokens; rank 0 writes each
rank's figures and token count per case.

    torchrun --standalone --nproc-per-node 2 -m tests.trainer.moe_activation_worker OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from trainer.config import load_config
from trainer.distributed import exit_process
from trainer.model import Transformer
from trainer.moe import MoEFeedForward
from trainer.parallelize import split_experts

# 8 experts of 128, top-2, over hidden 128, in one sparse block.
SPARSE = ["model.vocab_size=256", "model.dim=128", "model.n_heads=4", "model.ffn_dim=352",
          "model.n_layers=1", "model.max_seq_len=128", "model.n_experts=8", "model.n_active_experts=2",
          "model.moe_ffn_dim=128", "data.seq_len=128"]
CASES = {
    # Qwen2-MoE: top-k not renormalised, a shared expert of 256 behind its sigmoid gate.
    "qwen2_moe": [*SPARSE, "model.shared_expert_ffn_dim=256"],
    # Qwen3-MoE: top-k renormalised, no shared expert.
    "qwen3_moe": [*SPARSE, "model.norm_topk_prob=true"],
}
BATCH = 4


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    """The memory behind a tensor: a DTensor's local shard, or what an all-to-all's wrapper received."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    if isinstance(tensor, AsyncCollectiveTensor):
        tensor = tensor.trigger_wait()
    return tensor.untyped_storage()


def saved_bytes(moe: MoEFeedForward, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(bytes of the distinct storages saved for backward by one forward of `moe`, its output). Its
    parameters and its input are left out: the estimator counts those as gathered parameters and as
    the block's norm output."""
    left_out = {_storage(x).data_ptr(), *(_storage(p).data_ptr() for p in moe.parameters())}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = _storage(tensor)
        if storage.data_ptr() not in left_out:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        out = moe(x)
    return sum(saved.values()), out


def measure(overrides: list[str], rank: int, world: int) -> dict[str, int]:
    cfg = load_config("tiny", overrides)
    torch.manual_seed(0)  # the same weights on every rank
    whole = Transformer(cfg.model).layers[0].feed_forward
    with torch.no_grad():
        for param in whole.parameters():
            param.normal_(0, 0.05)
    split = Transformer(cfg.model).layers[0].feed_forward
    split.load_state_dict(whole.state_dict())
    split_experts(split, init_device_mesh("cpu", (world,), mesh_dim_names=("expert",)))
    share = cfg.model.n_experts // world
    with torch.no_grad():  # this rank's experts: its rows of the whole block's stacked tensors
        for name, param in split.experts.named_parameters():
            param.to_local().copy_(getattr(whole.experts, name)[rank * share:(rank + 1) * share])
    x = torch.randn(BATCH, cfg.data.seq_len, cfg.model.dim, generator=torch.Generator().manual_seed(1 + rank),
                    requires_grad=True)
    whole_bytes, whole_out = saved_bytes(whole, x)
    split_bytes, split_out = saved_bytes(split, x)
    # The same computation both ways, so the two figures count the same tokens and routing.
    assert torch.allclose(whole_out, split_out, rtol=1e-5, atol=1e-6), (whole_out - split_out).abs().max()
    return {"tokens": BATCH * cfg.data.seq_len, "expert_parallel_1": whole_bytes,
            f"expert_parallel_{world}": split_bytes}


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for case, overrides in CASES.items():
        ranks = [None] * world
        dist.all_gather_object(ranks, measure(overrides, rank, world))
        results[case] = ranks
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process(0)  # as the trainer's own entry point does (trainer/distributed.py)
