"""Run under torchrun by test_hf_models.py. Modes:

grads MODEL_DIR DOCS_JSON OUT_JSON [KEY=VALUE ...]
    One forward/backward of the sharded trainer model on the documents (packed, document-masked, the
    loss normalised by the counted tokens) and of transformers' model on each document alone (fp32,
    eager, the summed NLL divided by the same count); rank 0 writes the largest relative gradient
    difference per parameter.
load-memory MODEL_DIR OUT_JSON
    Build and shard the model, then load the safetensors; every rank reports the growth of its peak
    resident set during the load and its shard's bytes.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.config import load_config
from trainer.distributed import exit_process, init_distributed, launch_sizes
from trainer.evaluate import evaluation_source
from trainer.hf.adapter import checkpoint_tensors
from trainer.hf.weights import load_weights
from trainer.loss import token_nll_sum
from trainer.model import build_model
from trainer.parallelize import build_mesh, parallelize
from trainer.tokenizer import Tokenizer
from trainer.train import build_parallel_model, derive_layout


def _config(model_dir: str, docs: str | None = None, extra: tuple[str, ...] = ()):
    overrides = [f"model.hf_dir={model_dir}", "parallel.param_dtype=fp32",
                 "parallel.activation_checkpointing=false", "data.seq_len=64",
                 "training.global_batch_size=2", "training.gradient_accumulation=1", *extra]
    # load-memory reads no data; the path only satisfies the config's check.
    overrides.append(f"data.path={docs or 'unused.jsonl'}")
    return load_config("finetune", overrides)


def reference_grads(reference) -> dict[str, torch.Tensor]:
    """transformers' gradients by checkpoint key: transformers 5 keeps a Qwen3-MoE (Qwen2-MoE) block's experts
    stacked in memory (`mlp.experts.gate_up_proj` [E, 2 x ffn, hidden], gate rows first;
    `mlp.experts.down_proj` [E, hidden, ffn]) and saves them per expert (`mlp.experts.{e}.gate_proj.weight`,
    ...); gpt-oss saves its stacked experts as they are."""
    per_expert = reference.config.model_type in ("qwen3_moe", "qwen2_moe")
    out = {}
    for name, param in reference.named_parameters():
        if not per_expert:
            out[name] = param.grad
        elif name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e, g in enumerate(param.grad):
                gate, up = g.chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e, g in enumerate(param.grad):
                out[f"{prefix}{e}.down_proj.weight"] = g
        else:
            out[name] = param.grad
    return out


def grads(model_dir: str, docs_path: str, out: str, *overrides: str) -> None:
    from tests.trainer.hf_fixtures import load_reference, load_tokenizer

    cfg = _config(model_dir, docs_path, overrides)
    source = evaluation_source(cfg.data, Tokenizer.from_dir(Path(model_dir)), cfg.model.vocab_size, print)
    runtime = init_distributed(cfg.distributed)
    model = build_parallel_model(cfg, runtime, derive_layout(cfg, *launch_sizes()))
    batch = source.samples(torch.arange(source.num_samples))
    counted = (batch.targets != -100).sum()
    # Each rank takes its half of the rows; the loss over all rows is the sum over ranks (FSDP averages
    # the gradients, hence the world size).
    rows = torch.arange(source.num_samples)[dist.get_rank()::dist.get_world_size()]
    part = source.samples(rows)
    logits = model(part.inputs, part.positions, part.document_ids)
    (token_nll_sum(logits, part.targets) * dist.get_world_size() / counted).backward()
    # By checkpoint key: the stacked experts of Qwen3-MoE and Mixtral split into each expert's projections.
    ours = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for part in checkpoint_tensors(name, cfg.model.family, cfg.model.n_experts):
            ours[part.name] = part.view(grad)
    if dist.get_rank() == 0:
        reference = load_reference(Path(model_dir))
        tok = load_tokenizer(Path(model_dir))
        total = 0.0
        for line in Path(docs_path).read_text().splitlines():
            ids = tok(json.loads(line)["text"])["input_ids"][: cfg.data.seq_len]
            ids = torch.tensor([ids])
            total = total + reference(ids, labels=ids).loss * (ids.shape[1] - 1)
        (total / counted).backward()
        theirs = reference_grads(reference)
        result = {name: float((ours[name] - theirs[name]).abs().max() / theirs[name].abs().max())
                  for name in ours}
        Path(out).write_text(json.dumps(result))
    # Rank 1 must not tear its process group down while rank 0 still computes the reference (gloo
    # aborts the process: "terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def load_memory(model_dir: str, out: str) -> None:
    cfg = _config(model_dir)
    init_distributed(cfg.distributed)
    model = build_model(cfg.model)
    parallelize(model, build_mesh(derive_layout(cfg, *launch_sizes()), cfg.parallel.strategy, "cpu"),
                cfg.parallel, "cpu")
    model.to_empty(device="cpu")
    for param in model.parameters():
        param.detach().zero_()  # touch the shard's pages, so the load adds only what it reads besides
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    load_weights(model, Path(model_dir), lambda _m: None)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shard = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    full = sum(p.numel() * 4 for p in model.parameters())
    checksum = sum(float(p.full_tensor().double().sum()) for p in model.parameters())
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"growth": after - before, "shard_bytes": shard, "full_bytes": full,
                                  "checksum": checksum})
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    {"grads": grads, "load-memory": load_memory}[mode](*args)
    exit_process(0)  # as the trainer's own entry point does (trainer/distributed.py)
