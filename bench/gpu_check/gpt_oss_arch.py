"""A gpt-oss architecture cut to its first blocks, for the GPU check's gpt_oss_layers step.

    python bench/gpu_check/gpt_oss_arch.py --arch gpt-oss-20b --layers 4 --output model-config.json [--tiny]

Reads the bundled config.json (trainer/configs/hf/gpt-oss-20b.json or gpt-oss-120b.json, or any gpt-oss
config.json given by path) and writes it with num_hidden_layers and layer_types cut to the first
`--layers` blocks: every width stays (hidden 2880, 64 query and 8 key/value heads of 64, experts of 2880,
top-4, vocab 201088), and so do the sinks, the sliding window on every other block and YaRN. The step
points model.hf_config at the file: the trainer refuses model.n_layers beside an architecture (a shape key
set by config.json), so a shorter model is a shorter config.json. With --tiny the widths are shrunk for
the CPU dry run (the same keys, a few hundred thousand parameters).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from trainer.errors import ConfigError  # noqa: E402
from trainer.hf.config import config_path  # noqa: E402

# The CPU dry run's widths: a window shorter than its 64-token sequences (so the sliding blocks mask),
# more experts than the top-k, head_dim set apart from hidden / heads as gpt-oss does.
TINY = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2, "experts_per_token": 2,
        "vocab_size": 512, "sliding_window": 16}


class ArchError(Exception):
    """The architecture cannot be cut as asked."""


def cut(raw: dict, layers: int, tiny: bool = False) -> dict:
    """config.json `raw` with its first `layers` blocks (and the tiny widths with `tiny`)."""
    if raw.get("model_type") != "gpt_oss":
        raise ArchError(f"model_type is {raw.get('model_type')!r}, not gpt_oss: this step trains gpt-oss "
                        "(use gpt-oss-20b, gpt-oss-120b or a gpt-oss config.json)")
    total = raw["num_hidden_layers"]
    if not 1 <= layers <= total:
        raise ArchError(f"--layers {layers} is not 1..{total}, the blocks of this architecture")
    out = {**raw, "num_hidden_layers": layers}
    if raw.get("layer_types"):
        out["layer_types"] = raw["layer_types"][:layers]
    if tiny:
        out.update(TINY)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--arch", required=True, help="a bundled gpt-oss architecture or a config.json path")
    parser.add_argument("--layers", type=int, required=True, help="blocks to keep, from the first")
    parser.add_argument("--output", type=Path, required=True, help="the config.json to write")
    parser.add_argument("--tiny", action="store_true", help="shrink the widths (the CPU dry run)")
    args = parser.parse_args(argv)
    try:
        source = config_path(args.arch, "--arch")
        config = cut(json.loads(source.read_text()), args.layers, args.tiny)
    except ConfigError as e:  # the trainer's own message for --arch: key, value and fix on one line
        print(f"error: {'; '.join(map(str, e.problems))}", file=sys.stderr)
        return 2
    except ArchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(config, indent=1) + "\n")
    kinds = ", ".join(config.get("layer_types", []))
    widths = "tiny widths" if args.tiny else "its widths"
    print(f"gpt-oss architecture: {source} cut to {args.layers} block(s) ({kinds}), {widths}: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
