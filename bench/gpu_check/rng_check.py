"""Does a checkpoint restore the random-number state? Through the trainer's own CheckpointManager.

    python bench/gpu_check/rng_check.py --device cuda|cpu --dir CKPT_DIR --output rng.json

A world of one (the trainer's init_distributed) builds a tiny sharded model, moves the CPU and (on
CUDA) the device generator to a known state, saves a checkpoint, draws the numbers that follow, then
scrambles both generators and resumes with `resume=auto`. The state is restored when the draws after
the resume equal the draws after the save. The training loss cannot show this (the model has no
dropout), hence this separate check. Exit status 0 when every generator checked was restored.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from trainer.checkpoint import CheckpointManager  # noqa: E402
from trainer.checkpoint.config import CheckpointConfig  # noqa: E402
from trainer.config import DistributedConfig, derive_layout, load_config  # noqa: E402
from trainer.distributed import exit_process, init_distributed, shutdown  # noqa: E402
from trainer.train import build_optimizer, build_parallel_model  # noqa: E402


def draws(device: torch.device) -> dict[str, torch.Tensor]:
    out = {"cpu": torch.rand(8)}
    if device.type == "cuda":
        out["cuda"] = torch.rand(8, device=device).cpu()
    return out


def check(device_kind: str, ckpt_dir: Path) -> dict:
    cfg = load_config("tiny", [f"distributed.device={device_kind}"])
    layout = derive_layout(cfg, 1, 1)
    runtime = init_distributed(DistributedConfig(device=device_kind))
    try:
        model = build_parallel_model(cfg, runtime, layout)
        optimizer = build_optimizer(model, cfg.optim)
        ckpt = CheckpointConfig(dir=str(ckpt_dir), interval=1, async_save=False, resume="auto")
        torch.manual_seed(1234)  # seeds the CUDA generators too
        torch.rand(3)
        if runtime.device.type == "cuda":
            torch.rand(5, device=runtime.device)
        saver = CheckpointManager(ckpt, rank=0, world_size=1, log=print)
        saver.save(1, model, optimizer, {})
        saver.wait()
        expected = draws(runtime.device)
        torch.manual_seed(999)  # scramble: without a restore the next draws differ
        scrambled = draws(runtime.device)
        step = CheckpointManager(ckpt, rank=0, world_size=1, log=print).maybe_resume(model, optimizer, {})
        got = draws(runtime.device)
        result = {"device": runtime.device.type, "resumed_step": step,
                  "cpu_restored": bool(torch.equal(got["cpu"], expected["cpu"])),
                  "cuda_restored": (bool(torch.equal(got["cuda"], expected["cuda"]))
                                    if "cuda" in expected else None),
                  # Proof the check can fail: the scrambled draws differ from the expected ones.
                  "scramble_differs": bool(not torch.equal(scrambled["cpu"], expected["cpu"]))}
    finally:
        shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--dir", type=Path, required=True, help="checkpoint directory (made, then used)")
    parser.add_argument("--output", type=Path, required=True, help="JSON result")
    args = parser.parse_args(argv)
    result = check(args.device, args.dir)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    ok = result["cpu_restored"] and result["cuda_restored"] is not False and result["scramble_differs"]
    return 0 if ok else 1


if __name__ == "__main__":
    exit_process(main())
