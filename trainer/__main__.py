"""`fsdp-train` / `python -m trainer`: train from a config, started by torchrun.

    torchrun --nproc-per-node 8 --nnodes 2 ... -m trainer --config gpt-7b --steps 2000 \\
        --set parallel.strategy=HYBRID_SHARD --metrics-file metrics.jsonl

Option names are full words: torchrun abbreviates its own options, so a short script option could be
taken for one of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

try:
    from trainer.checkpoint import CheckpointError
    from trainer.config import ConfigError, load_config, shipped_config_names
    from trainer.data import DataError
    from trainer.distributed import exit_process
    from trainer.estimate import GPU_MEMORY, estimate, report
    from trainer.hf.fetch import FetchError
    from trainer.train import train
except ModuleNotFoundError as missing:
    # `pip install -e .` of the repository installs the operator tool without the trainer's packages.
    if missing.name is None or missing.name.split(".")[0] == "trainer":
        raise
    sys.exit(f"error: fsdp-train needs the Python package {missing.name.split('.')[0]}, which is not "
             "installed here. Fix: pip install -e '.[trainer]' in the repository (the nodes get it with "
             "`fsdpctl deploy`)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-train", allow_abbrev=False,
        description="Packaged FSDP2 trainer (decoder-only transformer). Start it with torchrun.",
        epilog=f"shipped configs: {', '.join(shipped_config_names())}; keys and defaults: docs/trainer.md. "
               "Also: `fsdp-train eval ...` (a model's loss on documents), `fsdp-train export ...` (a "
               "checkpoint as a Hugging Face directory); each with --help")
    parser.add_argument("--config", help="YAML file or shipped config name")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="override a config key, e.g. --set optim.lr=3e-4 (repeatable)")
    parser.add_argument("--steps", type=int, help="optimizer steps (training.steps)")
    parser.add_argument("--seed", type=int, help="seed for initialisation and data order (training.seed)")
    parser.add_argument("--checkpoint-dir", help="where checkpoints go (checkpoint.dir)")
    parser.add_argument("--checkpoint-interval", type=int, help="steps between checkpoints")
    parser.add_argument("--metrics-file", help="JSONL file: one object per optimizer step + a summary")
    parser.add_argument("--resume", nargs="?", const="auto", metavar="auto|none|PATH",
                        help="resume from the newest verified checkpoint (auto, the default when given "
                             "alone), start fresh (none), or from a given checkpoint")
    parser.add_argument("--print-sharding", action="store_true",
                        help="print every parameter's device, dtype, local and global shape")
    estimate = parser.add_argument_group("memory estimate (no training, no GPU needed)")
    estimate.add_argument("--estimate", metavar="CONFIG",
                          help="print the per-rank memory of CONFIG (with --set overrides) and exit")
    estimate.add_argument("--world-size", type=int, help="ranks (GPUs) to estimate for")
    estimate.add_argument("--gpu", choices=sorted(GPU_MEMORY), help="check the fit on this GPU and find the "
                          "smallest cluster (a multiple of 8 GPUs) that fits")
    estimate.add_argument("--ranks-per-node", type=int, default=8,
                          help="GPUs per node: HYBRID_SHARD's default shard group (default 8)")
    estimate.add_argument("--json", action="store_true", help="the estimate as JSON")
    return parser


def run_estimate(args, parser: argparse.ArgumentParser) -> int:
    if not args.world_size or args.world_size < 1:
        parser.error("--estimate needs --world-size N (N >= 1), e.g. --world-size 16")
    cfg = load_config(args.estimate, args.overrides)
    result = estimate(cfg, args.world_size, args.gpu, ranks_per_node=args.ranks_per_node)
    if args.json:
        print(json.dumps({"config": args.estimate, **result.as_dict()}, indent=1))
    else:
        print("\n".join(report(args.estimate, result)))
    # A config that does not fit the GPU asked about is a failed check, for scripts as for people.
    return 1 if result.fits is False else 0


FLAG_KEYS = {"steps": "training.steps", "seed": "training.seed", "checkpoint_dir": "checkpoint.dir",
             "checkpoint_interval": "checkpoint.interval", "metrics_file": "metrics.file",
             "resume": "checkpoint.resume"}


def _overrides(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help=f"override a config key (repeatable), e.g. {example}")


def build_eval_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-train eval", allow_abbrev=False,
        description="Mean next-token NLL of a model over documents, each scored on its own (alone or under "
                    "torchrun).")
    parser.add_argument("--config", required=True, help="YAML file or shipped config name (e.g. finetune)")
    _overrides(parser, "--set model.hf_dir=DIR --set data.source=jsonl --set data.path=FILE")
    parser.add_argument("--json", action="store_true",
                        help='print one JSON object {"loss": ..., "tokens": ...}')
    return parser


def build_export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-train export", allow_abbrev=False,
        description="Write a verified checkpoint as a Hugging Face model directory (or a PEFT adapter for "
                    "LoRA runs), alone or under torchrun.")
    parser.add_argument("--checkpoint", required=True, help="a checkpoint directory (step_NNNNNNNN)")
    parser.add_argument("--out", required=True, help="the directory to write (replaced when complete)")
    _overrides(parser, "--set parallel.lora.export=merged (the checkpoint's trainer config)")
    return parser


def _subcommand(name: str, argv: list[str]) -> int:
    from trainer.commands import print_eval, run_eval, run_export

    try:
        if name == "eval":
            args = build_eval_parser().parse_args(argv)
            result = run_eval(load_config(args.config, args.overrides))
            if int(os.environ.get("RANK", "0")) == 0:
                print_eval(result, args.json)
        else:
            args = build_export_parser().parse_args(argv)
            run_export(Path(args.checkpoint), Path(args.out), args.overrides)
    except (ConfigError, DataError, CheckpointError, FetchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("eval", "export"):
        return _subcommand(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.estimate:
        try:
            return run_estimate(args, parser)
        except (ConfigError, FetchError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if not args.config:
        parser.error("--config is required (or --estimate CONFIG --world-size N)")
    # Plain flags are shorthands for --set and win over it.
    flags = {key: getattr(args, flag) for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None}
    try:
        cfg = load_config(args.config, args.overrides, flags)
        train(cfg, print_sharding=args.print_sharding)
    except (ConfigError, DataError, CheckpointError, FetchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def entry() -> NoReturn:
    """The process entry point (`fsdp-train`, `python -m trainer`): main, then exit_process."""
    exit_process(main())


if __name__ == "__main__":
    entry()
