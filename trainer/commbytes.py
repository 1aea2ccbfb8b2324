"""Bytes each training step hands to FSDP2's collectives, per rank and by kind, counted on every step.

FSDP2 runs its parameter all-gathers and gradient reduce-scatters through comm objects that
`FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter` replace, and under HSDP calls the
module's all-reduce hook with the very tensor it has just all-reduced across replicas.
`CommBytes.install` wraps the comm objects in place with ones that add their input's
`numel * element_size` (tensor metadata: no device synchronisation, nothing copied, a few dict
additions per unit) and then call through, and sets the hook where FSDP2 all-reduces. A collective
FSDP2 skips (a shard group of one rank, HSDP's all-reduce held back for gradient accumulation) is
not called, so not counted: the figures are what ran, not a formula.

`comm_bytes` is the payload each rank hands to a collective, summed over the step:

  all_gather      its parameter shard in param_dtype, at every gather (forward, then again in
                  backward for a unit resharded after forward)
  reduce_scatter  its whole unsharded gradient in reduce_dtype (dim 0 padded to the shard group size)
  all_reduce      HSDP: its reduce-scatter output (its gradient shard) in reduce_dtype

FSDP2 pads shards to one size, so every rank hands the same bytes. A payload is not what crosses the
wire: ring algorithms transmit n-1 times an all-gather's input, (n-1)/n of a reduce-scatter's and
2(n-1)/n of an all-reduce's for a group of n ranks (gloo runs a reduce-scatter as an all-reduce).
Collectives outside FSDP2 (the gradient norm's scalar all-reduce, the metrics' gather) are not counted.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


class _Counted:
    """An FSDP2 AllGather / ReduceScatter comm that counts its input's bytes, then runs the comm it wraps
    (FSDP2's default or whatever was installed before), allocation included."""

    def __init__(self, inner, kind: str, counter: CommBytes):
        self.inner, self.kind, self.counter = inner, kind, counter

    def allocate(self, *args, **kwargs) -> torch.Tensor:
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, *, input_tensor: torch.Tensor, **kwargs):
        self.counter.add(self.kind, input_tensor)
        return self.inner(input_tensor=input_tensor, **kwargs)


class CommBytes:
    """`counter = CommBytes.install(model)` once the model is fully sharded, then `counter.take()` after
    each optimizer step: {"all_gather": int, "reduce_scatter": int, "all_reduce": int} since the last
    take. Install it after any other custom comm or all-reduce hook: it wraps the comms and takes the
    hook."""

    def __init__(self) -> None:
        self._bytes = dict.fromkeys(KINDS, 0)

    @classmethod
    def install(cls, model: nn.Module) -> CommBytes:
        counter = cls()
        wrapped = set()
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            state = module._get_fsdp_state()
            # The modules of one fully_shard([...]) call share a state: wrap its comms once.
            if id(state) in wrapped:
                continue
            wrapped.add(id(state))
            # The comms in place are only reachable through FSDP2's parameter groups (none for a
            # unit that owns no parameters); the public setters refuse modules with several groups.
            for group in _param_groups(state):
                module.set_custom_all_gather(_Counted(group._all_gather_comm, "all_gather", counter))
                module.set_custom_reduce_scatter(
                    _Counted(group._reduce_scatter_comm, "reduce_scatter", counter))
                # FSDP2 all-reduces exactly where the mesh has a replicate dimension (foreach_reduce).
                if isinstance(group.mesh_info, DDPMeshInfo):
                    module.set_all_reduce_hook(lambda output: counter.add("all_reduce", output))
        return counter

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        self._bytes[kind] += tensor.numel() * tensor.element_size()

    def take(self) -> dict[str, int]:
        """The bytes since the last take; counting starts again from zero."""
        taken, self._bytes = self._bytes, dict.fromkeys(KINDS, 0)
        return taken


def _param_groups(state) -> list:
    """An FSDP2 state's parameter groups: a list (`_fsdp_param_groups`) in the nodes' torch; torch 2.11,
    which the GPU check's machine has, keeps one group or None in `_fsdp_param_group`."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return groups
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []
