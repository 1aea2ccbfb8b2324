"""End to end with the packaged trainer (python -m trainer, tiny config, 2 CPU ranks as torchrun starts them):
a run stopped at step 5 and resumed to 10 logs exactly the metrics of a straight 10-step run, and its
checkpoints pass `python -m trainer.checkpoint verify`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.conftest import REPO, torchrun
from tests.trainer.test_checkpoint_worker import worker_env

pytestmark = pytest.mark.slow

# Constant lr after warm-up, so a 5-step run is exactly the first half of a 10-step one (the cosine
# schedule otherwise depends on --steps).
TRAIN = ["-m", "trainer", "--config", "tiny", "--set", "optim.min_lr_ratio=1.0"]
DETERMINISTIC_FIELDS = ("step", "loss", "lr", "grad_norm")


def train(steps: int, metrics: Path, checkpoint_dir: Path, *extra: str) -> str:
    args = [*TRAIN, "--steps", str(steps), "--metrics-file", str(metrics),
            "--checkpoint-dir", str(checkpoint_dir), *extra]
    done = torchrun(2, args, timeout=300)
    assert done.returncode == 0, f"{args} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return done.stderr


def step_metrics(metrics: Path) -> list[dict]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [{key: record[key] for key in DETERMINISTIC_FIELDS} for record in records if "step" in record]


def test_trainer_stop_at_5_resume_to_10_matches_straight_run(tmp_path: Path) -> None:
    straight = tmp_path / "straight.jsonl"
    train(10, straight, tmp_path / "straight-ckpt", "--checkpoint-interval", "100")
    resumed, checkpoints = tmp_path / "resumed.jsonl", tmp_path / "ckpt"
    # blocking saves in the interrupted run, the default async ones in the straight and resumed runs
    train(5, resumed, checkpoints, "--checkpoint-interval", "2", "--set", "checkpoint.async_save=false")
    log = train(10, resumed, checkpoints, "--checkpoint-interval", "2")
    assert f"resumed from {checkpoints}/step_00000005 (step 5)" in log
    assert step_metrics(resumed) == step_metrics(straight)
    assert len(step_metrics(resumed)) == 10
    verify = subprocess.run([sys.executable, "-m", "trainer.checkpoint", "verify", str(checkpoints)],
                            cwd=REPO, env=worker_env(), capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert verify.stdout.count("verified") == 3  # keep_last=3: steps 6, 8, 10
