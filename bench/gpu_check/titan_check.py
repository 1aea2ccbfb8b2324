"""Can torchtitan run the GPU check's torchtitan_llama1b step here? Imports its training entry point and
bench/gpu_check/titan_llama1b.py, then parses the step's options with torchtitan's own ConfigManager
and reads back what they resolve to; trains nothing, so it runs on CPU too.

    python bench/gpu_check/titan_check.py --output check.json -- [torchtitan options]

Writes {"importable": true, "torch_version", "torchtitan_version", "datasets", "config": {...}} or
{"importable": false, "error": ..., "reason": ...}; exit status 0 either way, except for options torchtitan
does not accept (tyro's usage error, status 2). bench/gpu_check.sh skips the step with `reason` when
torchtitan cannot be imported: torchtitan 0.3.0 imports `DataParallelMeshDims` from torch.distributed.fsdp
(torchtitan/distributed/fsdp.py), which torch 2.11 does not have (torch 2.12 does).
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

MODULE, CONFIG = "titan_llama1b", "llama3_2_1b"


def import_failure(error: Exception, torch_version: str) -> str:
    """Why torchtitan does not import, and what would fix it."""
    missing = getattr(error, "name", None) or ""
    if missing == "torchtitan":
        return "torchtitan is not installed"
    if missing == "torch" or missing.startswith("torch."):
        return (f"torchtitan needs a newer torch than {torch_version}: {type(error).__name__}: {error} "
                "(torchtitan 0.3.0 imports APIs of torch 2.12 and later)")
    if isinstance(error, ModuleNotFoundError):
        return (f"torchtitan does not import with torch {torch_version}: {type(error).__name__}: {error} "
                "(carry the module's wheel: bench/gpu_check.sh --fetch-wheels)")
    return f"torchtitan does not import with torch {torch_version}: {type(error).__name__}: {error}"


def resolved(config) -> dict:
    """The figures of a parsed Trainer.Config that the comparison with the trainer depends on."""
    from torchtitan.models.common.attention import GQAttention
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.rope import RoPE

    model = config.model_spec.model
    attention = next(c for _, c, _, _ in model.traverse(GQAttention.Config))
    ffn = next(c for _, c, _, _ in model.traverse(FeedForward.Config))
    rope = next(c for _, c, _, _ in model.traverse(RoPE.Config))
    return {
        "flavor": config.model_spec.flavor, "dim": model.dim, "n_layers": len(model.layers),
        "n_heads": attention.n_heads, "n_kv_heads": attention.n_kv_heads, "ffn_dim": ffn.w1.out_features,
        "vocab_size": model.vocab_size, "tied_embeddings": model.enable_weight_tying,
        "rope": {"theta": rope.theta, "scaling": rope.scaling, "factor": rope.scaling_factor,
                 "low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor,
                 "original_max_position_embeddings": rope.original_max_position_embeddings},
        "attention": type(attention.inner_attention).__qualname__.removesuffix(".Config"),
        "local_batch_size": config.training.local_batch_size, "seq_len": config.training.seq_len,
        "steps": config.training.steps, "param_dtype": config.training.mixed_precision_param,
        "reduce_dtype": config.training.mixed_precision_reduce, "compile": config.compile.enable,
        "compile_components": list(config.compile.components),
        "activation_checkpoint": None if config.activation_checkpoint is None
        else type(config.activation_checkpoint).__qualname__,
        "cuda_graphs": not config.training.disable_cuda_graphs,
        "optimizer": config.optimizer.implementation, "log_freq": config.metrics.log_freq,
        "dump_folder": config.dump_folder,
    }


def check(options: list[str]) -> dict:
    import torch

    out: dict = {"torch_version": torch.__version__}
    try:
        out["torchtitan_version"] = version("torchtitan")
    except PackageNotFoundError:
        out["torchtitan_version"] = None
    try:
        import torchtitan.train  # noqa: F401  (the entry point torchrun runs: every import it makes)

        __import__(MODULE)
    # Not only ImportError: a module that uses a torch API at import time fails otherwise on an older torch.
    except Exception as e:
        out.update(importable=False, error=f"{type(e).__name__}: {e}",
                   reason=import_failure(e, torch.__version__))
        return out
    # bench/gpu_check/no_datasets when the real package is not installed (see its docstring).
    datasets = sys.modules.get("datasets")
    out["datasets"] = ("stand-in" if getattr(datasets, "STAND_IN", False)
                       else getattr(datasets, "__version__", None))
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(["--module", MODULE, "--config", CONFIG, *options])
    out.update(importable=True, config=resolved(config))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--output", type=Path, required=True, help="where the JSON goes")
    parser.add_argument("options", nargs="*", help="torchtitan options, after --")
    args = parser.parse_args(argv)
    # titan_llama1b sits beside this file; torchrun finds it through PYTHONPATH instead.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    result = check(args.options)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
