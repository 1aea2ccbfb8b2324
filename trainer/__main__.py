"""`fsdp-train` / `python -m trainer`: train from a config, started by torchrun.

    torchrun --nproc-per-node 8 --nnodes 2 ... -m trainer --config gpt-7b --steps 2000 \\
        --set parallel.strategy=HYBRID_SHARD --metrics-file metrics.jsonl

Option names are full words: torchrun abbreviates its own options, so a short script option could be
taken for one of them.
"""

from __future__ import annotations

import argparse
import sys

from trainer.checkpoint import CheckpointError
from trainer.config import ConfigError, load_config, shipped_config_names
from trainer.data import DataError
from trainer.train import train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-train", allow_abbrev=False,
        description="Packaged FSDP2 trainer (decoder-only transformer). Start it with torchrun.",
        epilog=f"shipped configs: {', '.join(shipped_config_names())}; keys and defaults: docs/trainer.md")
    parser.add_argument("--config", required=True, help="YAML file or shipped config name")
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
    return parser


FLAG_KEYS = {"steps": "training.steps", "seed": "training.seed", "checkpoint_dir": "checkpoint.dir",
             "checkpoint_interval": "checkpoint.interval", "metrics_file": "metrics.file",
             "resume": "checkpoint.resume"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Plain flags are shorthands for --set and win over it.
    flags = {key: getattr(args, flag) for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None}
    try:
        cfg = load_config(args.config, args.overrides, flags)
        train(cfg, print_sharding=args.print_sharding)
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
