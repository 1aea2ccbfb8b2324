"""Runs under torchrun on 2 CPU ranks (tests/trainer/test_comm_bytes.py): shards a small stack of Linear
layers with `fully_shard` directly (a unit per layer, the last two in one unit kept gathered from forward
to backward, as the trainer's final norm and output projection are), installs
trainer.commbytes.CommBytes and trains a few steps per case. Rank 0 writes, per case, what the counter
took after each step, what torch.profiler saw the c10d collectives carry on one step (input shapes and
dtypes of c10d::_allgather_base_, _reduce_scatter_base_ and allreduce_: the process group's own view,
independent of the counter), and the units' parameter shapes for the test to derive the exact sizes
from; then a MetricsLogger run fed with the counts.

    torchrun --standalone --nproc-per-node 2 -m tests.trainer.comm_bytes_worker OUT.json
    torchrun --standalone --nproc-per-node 2 -m tests.trainer.comm_bytes_worker OUT.json --figure

--figure measures a 10.5M-parameter stack (10 x Linear(1024, 1024)) for fp32 and bf16 parameters and
gradient reduction, resharding after forward (FULL_SHARD) or not (SHARD_GRAD_OP), and adds what ring
algorithms would transmit for those payloads.
"""

from __future__ import annotations

import json
import socket
import sys
from itertools import pairwise
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.profiler import ProfilerActivity, profile

from trainer.commbytes import CommBytes
from trainer.config import MetricsConfig
from trainer.distributed import Runtime, exit_process
from trainer.metrics import MetricsLogger

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# c10d dispatcher op -> (kind, index of the input the rank hands over). The profiler names the dtype of
# a tensor argument, not of a tensor list's (allreduce_ takes a list of one).
C10D_OPS = {"c10d::_allgather_base_": ("all_gather", 1), "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
            "c10d::allreduce_": ("all_reduce", 0)}
# 33 output features: dim 0 does not split evenly over 2 ranks, so FSDP2 pads it.
SMALL = [16, 33, 24, 12, 8]
# name -> mesh (replicate, shard) or (shard,), param dtype, reduce dtype, micro-batches per step
CASES = {
    "full_shard_fp32": ((2,), "fp32", "fp32", 1),
    "full_shard_bf16_reduce": ((2,), "fp32", "bf16", 1),
    "full_shard_bf16_params": ((2,), "bf16", "fp32", 1),
    "full_shard_accum": ((2,), "fp32", "bf16", 2),
    "hybrid_2x1": ((2, 1), "fp32", "fp32", 1),
    "hybrid_2x1_bf16_reduce": ((2, 1), "fp32", "bf16", 1),
    # Replicas of one rank each: the all-reduce still runs (over a group of one), held back until the
    # last micro-batch.
    "hybrid_1x2_accum": ((1, 2), "fp32", "bf16", 2),
}


def build(widths: list[int], mesh_shape: tuple[int, ...], param_dtype: str, reduce_dtype: str,
          reshard: bool = True) -> tuple[nn.Sequential, list[dict]]:
    """The sharded model and its units: parameter shapes, whether resharded after forward."""
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in pairwise(widths)]
    model = nn.Sequential(*layers)
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    mp = MixedPrecisionPolicy(param_dtype=None if param_dtype == "fp32" else DTYPES[param_dtype],
                              reduce_dtype=DTYPES[reduce_dtype])
    units = [([layer], reshard) for layer in layers[:-2]] + [(layers[-2:], False)]
    for modules, reshard_after_forward in units:
        fully_shard(modules, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model, [{"shapes": [list(p.shape) for m in modules for p in m.parameters()],
                    "reshard_after_forward": kept_apart} for modules, kept_apart in units]


def step(model: nn.Sequential, optimizer: torch.optim.Optimizer, micro_batches: int, hybrid: bool) -> None:
    for micro in range(micro_batches):
        if hybrid:
            model.set_requires_all_reduce(micro == micro_batches - 1)
        inputs = torch.randn(4, model[0].in_features)
        model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def profiled_inputs(events) -> dict[str, dict]:
    """Per kind, the elements of the inputs the c10d ops were handed and the dtypes the profiler named."""
    seen = {kind: {"numel": 0, "dtypes": set()} for kind, _ in C10D_OPS.values()}
    for event in events:
        if event.name in C10D_OPS:
            kind, index = C10D_OPS[event.name]
            shape, dtype = event.structured_input_shapes[index], event.input_dtypes[index]
            shapes = shape if dtype == "TensorList" else [shape]
            seen[kind]["numel"] += sum(torch.Size(one).numel() for one in shapes)
            seen[kind]["dtypes"].add(dtype)
    return {kind: {"numel": v["numel"], "dtypes": sorted(v["dtypes"])} for kind, v in seen.items()}


def run_case(mesh_shape, param_dtype, reduce_dtype, micro_batches) -> dict:
    model, units = build(SMALL, mesh_shape, param_dtype, reduce_dtype)
    counter = CommBytes.install(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hybrid = len(mesh_shape) == 2
    steps = []
    for i in range(3):
        if i == 1:
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                step(model, optimizer, micro_batches, hybrid)
        else:
            step(model, optimizer, micro_batches, hybrid)
        steps.append(counter.take())
    return {"steps": steps, "profiled": profiled_inputs(prof.events()), "units": units,
            "mesh": list(mesh_shape), "param_dtype": param_dtype, "reduce_dtype": reduce_dtype,
            "micro_batches": micro_batches}


def metrics_run(path: Path, counts: list[dict | None]) -> None:
    """A MetricsLogger fed one step per entry of `counts` (None: a step whose bytes were not counted)."""
    runtime = Runtime(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=dist.get_rank(),
                      local_world_size=dist.get_world_size(), node_rank=0, device=torch.device("cpu"),
                      backend="gloo", hostname=socket.gethostname())
    metrics = MetricsLogger(MetricsConfig(file=str(path), log_interval=1, profile_steps=0), runtime,
                            total_steps=len(counts), tokens_per_step=1, samples_per_step=1, flops_per_token=1,
                            # no model here: only the byte counts are under test
                            strategy="FULL_SHARD", params=0,
                            hosts=[runtime.hostname] * runtime.world_size, log=lambda _: None)
    metrics.start()
    for number, comm_bytes in enumerate(counts, start=1):
        metrics.log_step(step=number, loss=torch.tensor(1.0), lr=0.1, grad_norm=torch.tensor(1.0),
                         comm_bytes=comm_bytes)
    metrics.close()


def ring_wire_bytes(payload: dict[str, int], shard: int, replicate: int) -> dict[str, int]:
    """What one rank transmits for these payloads if every collective runs as a ring: an all-gather
    forwards n-1 shards, a reduce-scatter (n-1)/n of its input, an all-reduce 2(n-1)/n of its input."""
    return {"all_gather": payload["all_gather"] * (shard - 1),
            "reduce_scatter": payload["reduce_scatter"] * (shard - 1) // shard,
            "all_reduce": 2 * payload["all_reduce"] * (replicate - 1) // replicate}


def figure() -> dict:
    widths = [1024] * 11
    rows = {}
    for strategy, reshard in (("FULL_SHARD", True), ("SHARD_GRAD_OP", False)):
        for param_dtype in ("fp32", "bf16"):
            for reduce_dtype in ("fp32", "bf16"):
                model, _ = build(widths, (dist.get_world_size(),), param_dtype, reduce_dtype, reshard)
                counter = CommBytes.install(model)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
                step(model, optimizer, 1, hybrid=False)
                payload = counter.take()
                rows[f"{strategy} param {param_dtype} reduce {reduce_dtype}"] = {
                    "params": sum(p.numel() for p in model.parameters()), "comm_bytes": payload,
                    "ring_wire_bytes": ring_wire_bytes(payload, dist.get_world_size(), 1)}
    return rows


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    try:
        if "--figure" in sys.argv[2:]:
            result = figure()
        else:
            result = {"cases": {name: run_case(*case) for name, case in CASES.items()}}
            counts = [result["cases"][name]["steps"][-1] for name in ("full_shard_fp32", "full_shard_accum")]
            metrics_file = out.with_suffix(".metrics.jsonl")
            metrics_run(metrics_file, [None, *counts])
            result["metrics_file"] = str(metrics_file)
        if dist.get_rank() == 0:
            out.write_text(json.dumps(result, indent=1))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process(0)
