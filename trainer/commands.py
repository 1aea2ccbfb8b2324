"""The trainer's two commands besides training, both runnable alone or under torchrun (any number of
ranks: the model is sharded over all of them, FULL_SHARD):

    python -m trainer eval --config CONFIG --set model.hf_dir=DIR --set data.source=jsonl \\
        --set data.path=FILE [--json]
    python -m trainer export --checkpoint CKPT --out OUT [--set KEY=VALUE ...]
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from trainer.checkpoint import CheckpointError
from trainer.checkpoint.manifest import read_manifest, verify_checkpoint
from trainer.config import Layout, Strategy, TrainConfig, assign, parse_assignment, parse_config
from trainer.distributed import Runtime, init_distributed, launch_sizes, shutdown
from trainer.errors import ConfigError, Problem
from trainer.evaluate import EvalResult, evaluate, evaluation_source
from trainer.hf.weights import check_weights, export_trained
from trainer.metrics import stderr_log
from trainer.model import build_model
from trainer.tokenizer import Tokenizer
from trainer.train import build_parallel_model, with_local_data


def _sharded_over_all(cfg: TrainConfig) -> tuple[TrainConfig, Layout]:
    """The config with FULL_SHARD over every rank: how a model is sharded does not change what it
    computes, and these commands have no batch to split."""
    world_size, _ = launch_sizes()
    # Expert parallelism stays when it splits this launch (a checkpoint's P need not).
    expert_parallel = cfg.parallel.expert_parallel if world_size % cfg.parallel.expert_parallel == 0 else 1
    parallel = cfg.parallel.model_copy(update={"strategy": Strategy.FULL_SHARD, "sharding_degree": None,
                                               "cpu_offload": False, "compile": False,
                                               "expert_parallel": expert_parallel})
    return cfg.model_copy(update={"parallel": parallel}), Layout(world_size, 1, world_size, 1)


def run_eval(cfg: TrainConfig, log: Callable[[str], None] = stderr_log) -> EvalResult:
    if not cfg.model.hf_dir:
        raise ConfigError([Problem("model.hf_dir", None, "is required: eval scores a model's weights",
                                   "--set model.hf_dir=DIR (a Hugging Face model directory)")])
    if cfg.data.source not in ("jsonl", "parquet") or not cfg.data.path:
        raise ConfigError([Problem("data.source", cfg.data.source, "must be jsonl or parquet with data.path "
                                   "set (the documents to score)", "--set data.source=jsonl --set "
                                   "data.path=FILE")])
    # The weights against the architecture, from the headers, before any process group.
    check_weights(build_model(cfg.model), Path(cfg.model.hf_dir))
    tokenizer = Tokenizer.from_dir(Path(cfg.model.hf_dir))
    cfg = with_local_data(cfg, log)
    source = evaluation_source(cfg.data, tokenizer, cfg.model.vocab_size, log)
    cfg, layout = _sharded_over_all(cfg)
    runtime = init_distributed(cfg.distributed)
    try:
        model = build_parallel_model(cfg, runtime, layout, log if runtime.is_main else _quiet)
        result = evaluate(model, source, batch_size=cfg.eval.batch_size, device=runtime.device)
        # No rank tears its process group down while another still works with it (gloo aborts the
        # process: "terminate called without an active exception").
        dist.barrier()
        return result
    finally:
        shutdown()


def _quiet(_message: str) -> None:
    pass


def checkpoint_config(checkpoint: Path, overrides: list[str]) -> TrainConfig:
    """The trainer config a verified checkpoint was written with, then `key=value` overrides."""
    problems = verify_checkpoint(checkpoint)
    if problems:
        raise CheckpointError(f"{checkpoint} does not verify, nothing exported: " + "; ".join(problems[:5]))
    manifest, _ = read_manifest(checkpoint)
    data = manifest.get("trainer_config")
    if not isinstance(data, dict):
        raise CheckpointError(f"{checkpoint}/manifest.json holds no trainer config (written before export "
                              "existed); run `python -m trainer --config CONFIG --resume "
                              f"{checkpoint} --steps <its step>` with checkpoint.hf_export_dir set instead")
    for assignment in overrides:
        assign(data, *parse_assignment(assignment))
    # The export is the one thing asked; the run's own export or resume settings do not apply here.
    data["checkpoint"] = {**data.get("checkpoint", {}), "dir": None, "mirror_dir": None, "mirror_s3": None}
    return parse_config(data, f"{checkpoint}/manifest.json trainer_config")


def run_export(checkpoint: Path, out: Path, overrides: list[str], log: Callable[[str], None] = stderr_log
               ) -> Path:
    cfg = checkpoint_config(checkpoint, overrides)
    cfg, layout = _sharded_over_all(cfg)
    runtime: Runtime = init_distributed(cfg.distributed)
    try:
        main_log = log if runtime.is_main else _quiet
        # The weights come from the checkpoint, not model.hf_dir's shards (its config.json and
        # tokenizer files still go into the export).
        model = build_parallel_model(cfg, runtime, layout, fill=False)
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(checkpoint))
        set_model_state_dict(model, state["model"])
        main_log(f"export: loaded {checkpoint}")
        exported = export_trained(model, cfg, out, main_log)
        dist.barrier()  # as in run_eval
        return exported
    finally:
        shutdown()


def print_eval(result: EvalResult, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.as_dict()))
    else:
        print(f"loss {result.loss:.6f} over {result.tokens} tokens")
