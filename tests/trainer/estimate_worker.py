"""Run by tests/trainer/test_estimate.py in its own process (a world of one): the measured peak of
tensor bytes over the first forward + backward of small models (PeakTracker; it sees what the step
allocates: gathered parameters, gradients, activations) next to the estimator's figure for the same,
for two dense models and two mixtures of experts.

    python -m tests.trainer.estimate_worker OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

from tests.trainer.memory import PeakTracker
from trainer.config import derive_layout, load_config
from trainer.data import BatchLoader, build_source
from trainer.distributed import exit_process, init_distributed, shutdown
from trainer.estimate import estimate
from trainer.loss import loss_fn
from trainer.train import build_parallel_model

CASES = {
    "deep": ["model.vocab_size=2048", "model.dim=128", "model.n_heads=4", "model.ffn_dim=352",
             "model.n_layers=4", "model.max_seq_len=256", "data.seq_len=256"],
    "wide": ["model.vocab_size=512", "model.dim=256", "model.n_heads=8", "model.ffn_dim=704",
             "model.n_layers=2", "model.max_seq_len=128", "data.seq_len=128"],
    # Qwen3-MoE-like: 8 SwiGLU experts, top-2, one dense block and one sparse.
    "moe": ["model.vocab_size=512", "model.dim=128", "model.n_heads=4", "model.ffn_dim=352",
            "model.n_layers=2", "model.max_seq_len=128", "data.seq_len=128", "model.n_experts=8",
            "model.n_active_experts=2", "model.moe_ffn_dim=128", "model.moe_layers=[1]"],
    # gpt-oss-like: stacked experts with biases, router bias, sinks (full scores on CPU), a window.
    "gpt_oss": ["model.vocab_size=512", "model.dim=128", "model.n_heads=4", "model.ffn_dim=128",
                "model.n_layers=2", "model.max_seq_len=128", "data.seq_len=128", "model.n_experts=8",
                "model.n_active_experts=2", "model.expert_kind=gpt_oss", "model.router_bias=true",
                "model.attention_sinks=true", "model.sliding_window=32", "model.sliding_layers=[0]"],
}
# Cases whose attention materialises the scores on CPU (the sinks' full path): estimated without flash.
FULL_SCORES = {"gpt_oss"}


def main() -> None:
    torch.set_num_threads(1)
    runtime, results = None, {}
    for name, overrides in CASES.items():
        for checkpointing in (False, True):
            cfg = load_config("tiny", [*overrides, f"parallel.activation_checkpointing={checkpointing}",
                                       "training.global_batch_size=8", "training.gradient_accumulation=1"])
            layout = derive_layout(cfg, 1, 1)
            runtime = runtime or init_distributed(cfg.distributed)
            model = build_parallel_model(cfg, runtime, layout)
            loader = BatchLoader(build_source(cfg.data, cfg.model.vocab_size, 0),
                                 micro_batch_size=layout.micro_batch_size, rank=0, world_size=1, seed=0,
                                 device=runtime.device, prefetch=1)
            batch = loader.next()
            with PeakTracker() as tracker:
                loss_fn(model(batch.inputs), batch.targets).backward()
            loader.close()
            est = estimate(cfg, 1, ranks_per_node=1, flash_attention=name not in FULL_SCORES)
            results[f"{name}{'_ac' if checkpointing else ''}"] = {
                "measured": tracker.peak, "estimated": est.gathered + est.grads + est.activations}
    shutdown()
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
    exit_process(0)
