"""Run the trainer as `python -m trainer` does, counting which path gpt-oss's stacked experts took.

    python bench/gpu_check/moe_paths.py --output moe_paths.json -m trainer ARGS...

trainer/moe.py's StackedExperts runs its experts by two torch._grouped_mm calls (`grouped`: CUDA and bf16)
or by one matmul pair per expert (`looped`: anywhere else). The trainer logs neither, so this counts the
calls of each in the run itself (the forward and, under activation checkpointing, its recomputation),
writes {"grouped_calls": N, "looped_calls": M} when the trainer returns or raises, and exits as the
trainer does. The GPU check's gpt_oss_layers step records it beside its figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from trainer import moe  # noqa: E402
from trainer.__main__ import main as trainer_main  # noqa: E402
from trainer.distributed import exit_process  # noqa: E402

CALLS: Counter[str] = Counter()


def counted(path: str):
    """StackedExperts.<path>, counting its calls."""
    method = getattr(moe.StackedExperts, path)

    def run(self, routed, counts):
        CALLS[path] += 1
        return method(self, routed, counts)

    return run


def split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(this script's options, the trainer's arguments): everything after `-m trainer` is the trainer's."""
    if "-m" not in argv or argv[argv.index("-m") + 1:argv.index("-m") + 2] != ["trainer"]:
        raise SystemExit("error: give the trainer's command after `-m trainer`, e.g. moe_paths.py --output "
                         "moe_paths.json -m trainer --config finetune ...")
    at = argv.index("-m")
    return argv[:at], argv[at + 2:]


def main(argv: list[str] | None = None) -> int:
    own, trainer_args = split(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--output", type=Path, required=True, help="where the call counts go (JSON)")
    args = parser.parse_args(own)
    for path in ("grouped", "looped"):
        setattr(moe.StackedExperts, path, counted(path))
    try:
        return trainer_main(trainer_args)
    finally:
        args.output.write_text(json.dumps({"grouped_calls": CALLS["grouped"],
                                           "looped_calls": CALLS["looped"]}) + "\n")


if __name__ == "__main__":
    exit_process(main())
