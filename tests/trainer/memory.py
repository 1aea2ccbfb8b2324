"""Test-side memory accounting on CPU, where no allocator reports a high-water mark: a dispatch mode
that tracks every tensor storage created by an operator until it is freed, and counters of what FSDP2
holds (gradients, gathered parameters), read from its parameter groups."""

from __future__ import annotations

import weakref

import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakTracker(TorchDispatchMode):
    """Bytes of live storages created inside the mode (current and peak), re-summed after every
    operator, so storages FSDP2 frees by resizing them to zero (its all-gather buffers) count as freed.
    Tensors that existed before entering are not counted: `peak` is what the tracked code added."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0

    @staticmethod
    def _storage(tensor: object) -> torch.UntypedStorage | None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return None
        try:
            return tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None

    def _measure(self) -> None:
        total = 0
        for key, ref in list(self.live.items()):
            storage = ref()
            if storage is None:
                del self.live[key]
            else:
                total += storage.nbytes()
        self.current = total
        self.peak = max(self.peak, total)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Outputs that alias an input (views, in-place ops) allocate nothing.
        inputs = {id(s) for s in map(self._storage, tree_flatten((args, kwargs))[0]) if s is not None}
        for tensor in tree_flatten(out)[0]:
            storage = self._storage(tensor)
            if storage is not None and id(storage) not in inputs and id(storage) not in self.live:
                self.live[id(storage)] = weakref.ref(storage)
        self._measure()
        return out


def fsdp_groups(model: torch.nn.Module) -> list:
    """FSDP2's parameter groups, once each (modules sharded together share one)."""
    groups = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                groups[id(group)] = group
    return list(groups.values())


def fsdp_params(model: torch.nn.Module) -> list:
    return [param for group in fsdp_groups(model) for param in group.fsdp_params]


def _nbytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of gradients this rank holds: sharded ones, and unsharded ones FSDP2 keeps between
    micro-batches when it does not reduce-scatter, and (HSDP) reduce-scattered ones waiting for the
    deferred all-reduce."""
    total = sum(_nbytes(group._partial_reduce_output) for group in fsdp_groups(model))
    for param in fsdp_params(model):
        total += _nbytes(param.sharded_param.grad)
        unsharded = getattr(param, "_unsharded_param", None)
        total += _nbytes(None if unsharded is None else unsharded.grad)
        total += _nbytes(param.unsharded_accumulated_grad)
    return total


def sharded_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's fp32 parameter shards (= its share of gradients when sharded)."""
    return sum(_nbytes(param.sharded_param) for param in fsdp_params(model))


def gathered_param_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of parameters currently all-gathered (unsharded), by parameter name."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    held = {}
    for param in fsdp_params(model):
        if param.sharded_state == ShardedState.UNSHARDED:
            held[param._param_fqn] = param.unsharded_param.numel() * param.unsharded_param.element_size()
    return held
