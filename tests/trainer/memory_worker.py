"""Runs under torchrun (tests/trainer/test_memory.py): for each strategy, one non-final micro-batch of
an accumulating step, then rank 0 writes what each rank held: gradient bytes after it (vs its shard
and the full size), the parameters still gathered at the end of forward, and the peak of tensor bytes
over the forward and backward passes of a step (PeakTracker).

    torchrun --standalone --nproc-per-node 2 -m tests.trainer.memory_worker OUT.json
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from tests.trainer.dist_worker import finish
from tests.trainer.memory import PeakTracker, gathered_param_bytes, gradient_bytes, sharded_bytes
from trainer.config import derive_layout, load_config
from trainer.data import BatchLoader, build_source
from trainer.distributed import exit_process, init_distributed, launch_sizes
from trainer.loss import loss_fn
from trainer.parallelize import set_gradient_sync
from trainer.train import build_optimizer, build_parallel_model

STRATEGIES = {"FULL_SHARD": [], "SHARD_GRAD_OP": [],
              "HYBRID_SHARD": ["parallel.sharding_degree=2"]}
# A vocabulary large enough that the embedding table matters, as it does in the presets.
MODEL = ["model.vocab_size=4096", "model.dim=128", "model.n_heads=4", "model.ffn_dim=256",
         "model.n_layers=2"]


def measure(strategy: str, extra: list[str], runtime) -> dict:
    world, local = launch_sizes()
    cfg = load_config("tiny", [f"parallel.strategy={strategy}", *extra, *MODEL,
                               "training.gradient_accumulation=2", f"training.global_batch_size={4 * world}"])
    layout = derive_layout(cfg, world, local)
    model = build_parallel_model(cfg, runtime, layout)
    optimizer = build_optimizer(model, cfg.optim)
    loader = BatchLoader(build_source(cfg.data, cfg.model.vocab_size, 0),
                         micro_batch_size=layout.micro_batch_size, rank=runtime.rank, world_size=world,
                         seed=0, device=runtime.device, prefetch=1)
    try:
        # Forward and backward of the first step's two micro-batches under the tracker: FSDP2 allocates
        # its all-gather buffers then (later it resizes the same storages) and the optimizer step's
        # temporaries would otherwise set the peak.
        with PeakTracker() as tracker:
            for micro in range(2):
                set_gradient_sync(model, cfg.parallel.strategy, micro == 1)
                batch = loader.next()
                (loss_fn(model(batch.inputs), batch.targets) / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # A non-final micro-batch of the next step, by hand.
        set_gradient_sync(model, cfg.parallel.strategy, False)
        batch = loader.next()
        logits = model(batch.inputs)
        gathered = gathered_param_bytes(model)
        loss_fn(logits, batch.targets).backward()
        grads = gradient_bytes(model)
        optimizer.zero_grad(set_to_none=True)
    finally:
        loader.close()
    return {"grad_bytes": grads, "shard_bytes": sharded_bytes(model), "full_bytes": cfg.model.num_params * 4,
            "gathered_at_forward_end": gathered, "step_peak_bytes": tracker.peak,
            "norm_output_bytes": (cfg.model.dim + cfg.model.dim * cfg.model.vocab_size) * 4}


def main() -> None:
    out = sys.argv[1]
    runtime = init_distributed(load_config("tiny").distributed)
    results = {}
    for strategy, extra in STRATEGIES.items():
        mine = measure(strategy, extra, runtime)
        per_rank = [None] * runtime.world_size
        dist.all_gather_object(per_rank, mine)
        results[strategy] = per_rank
    finish(runtime, out, results)


if __name__ == "__main__":
    main()
    exit_process(0)
