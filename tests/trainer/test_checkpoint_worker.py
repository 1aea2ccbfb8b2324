"""A tiny deterministic FSDP2 training job driving trainer.checkpoint, run under torchrun by the checkpoint
and elastic tests, and the helpers those tests launch it with (this module holds no tests itself).
Rank 0 appends one JSON line per step to --metrics-file."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from trainer.checkpoint import CheckpointConfig, CheckpointManager
from trainer.distributed import exit_process

WIDTH = 32


class StepCounter:
    """Stands in for a data loader's position: restored through extra state."""

    def __init__(self) -> None:
        self.next_step = 1

    def state_dict(self) -> dict[str, int]:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_step = state["next_step"]


def build_model() -> nn.Module:
    torch.manual_seed(1234)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(3)]
    model = nn.Sequential(*blocks, nn.Linear(WIDTH, 1))
    if dist.is_initialized():
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
    return model


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step is fixed; each rank takes its slice, so the loss curve does not depend
    on the world size."""
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(8, WIDTH, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True).sin()
    per_rank = inputs.shape[0] // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return inputs[rows], targets[rows]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--metrics-file", required=True)
    parser.add_argument("--checkpoint-json", required=True, help="CheckpointConfig as JSON")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--pid-dir", default=None, help="write <rank>.pid here (elastic test kills one)")
    args = parser.parse_args()

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, f"{rank}.pid"), "w") as handle:
            handle.write(str(os.getpid()))

    def log(message: str) -> None:
        print(f"[rank {rank}] {message}", file=sys.stderr, flush=True)

    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    counter = StepCounter()
    extra = {"lr_scheduler": scheduler, "data": counter}
    manager = CheckpointManager(CheckpointConfig.model_validate_json(args.checkpoint_json), rank=rank,
                                world_size=world_size, log=log)
    start = manager.maybe_resume(model, optimizer, extra)
    assert counter.next_step == start + 1, (counter.next_step, start)

    for step in range(start + 1, args.steps + 1):
        inputs, targets = batch(step, rank, world_size)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        counter.next_step = step + 1
        global_loss = loss.detach().clone()
        if distributed:
            dist.all_reduce(global_loss)
            global_loss /= world_size
        if rank == 0:
            with open(args.metrics_file, "a") as handle:
                handle.write(json.dumps({"step": step, "loss": global_loss.item(),
                                         "lr": scheduler.get_last_lr()[0]}) + "\n")
        if manager.should_save(step, final=step == args.steps):
            manager.save(step, model, optimizer, extra)
        time.sleep(args.step_sleep)
    manager.wait()
    if distributed:
        dist.destroy_process_group()
    return 0


# --- used by the tests -----------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    env.pop("RANK", None)
    return env


def worker_args(*, steps: int, metrics: Path, checkpoint: dict, **options: float | Path) -> list[str]:
    args = [str(Path(__file__).resolve()), "--steps", str(steps), "--metrics-file", str(metrics),
            "--checkpoint-json", json.dumps(checkpoint)]
    for name, value in options.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def run_job(nproc: int, *, steps: int, metrics: Path, checkpoint: dict, env: dict[str, str] | None = None,
            **options: float | Path) -> str:
    """Run the worker on ``nproc`` local ranks (as torchrun --standalone starts them, on a free port on
    loopback: tests/trainer/conftest.py); returns its stderr (the checkpoint log), fails the test on a
    non-zero exit."""
    from tests.trainer.conftest import torchrun  # here, not at the top: the ranks run this file too

    args = worker_args(steps=steps, metrics=metrics, checkpoint=checkpoint, **options)
    done = torchrun(nproc, args, timeout=240, env=env or worker_env())
    assert done.returncode == 0, f"{args} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return done.stderr


def losses(metrics: Path) -> dict[int, float]:
    """step -> loss; a step recomputed after a restart keeps its last value."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {record["step"]: record["loss"] for record in records}


REFERENCE_STEPS = 10


def reference_run(tmp_path_factory) -> Path:
    """The uninterrupted 2-rank run of REFERENCE_STEPS steps, checkpointing every 5, that every resumed
    or restarted run must reproduce; run once per session and shared by the test modules. Returns its
    directory (``metrics.jsonl``, ``ckpt/``)."""
    directory = tmp_path_factory.getbasetemp() / "reference"
    metrics = directory / "metrics.jsonl"
    if not metrics.exists():
        directory.mkdir(exist_ok=True)
        partial = directory / "metrics.partial"
        run_job(2, steps=REFERENCE_STEPS, metrics=partial,
                checkpoint={"dir": str(directory / "ckpt"), "interval": 5})
        partial.rename(metrics)
    return directory


if __name__ == "__main__":
    exit_process(main())
