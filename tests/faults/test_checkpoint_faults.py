"""Faults under the trainer's checkpoints, with the real trainer (tiny config, 2 CPU ranks under
torchrun): the file system fills up during a save, the checkpoint directory is deleted and a shard
truncated while training runs. What must hold: the failed save stops training with an error that
says the disk is full, every committed checkpoint still verifies, and a resume picks the newest
checkpoint that verifies and continues with the losses of an uninterrupted run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.local.conftest import missing_prerequisite
from tests.trainer.test_checkpoint_train import TRAIN, step_metrics
from tests.trainer.test_checkpoint_worker import REPO, TORCHRUN, worker_env

pytestmark = pytest.mark.slow

CHECKPOINT_MB = 1.9  # one checkpoint of the tiny config with 2 ranks (model + AdamW state)


def trainer(steps: int, checkpoint_dir: Path, metrics: Path, *extra: str) -> list[str]:
    return [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", *TRAIN, "--steps", str(steps),
            "--checkpoint-dir", str(checkpoint_dir), "--checkpoint-interval", "2",
            "--metrics-file", str(metrics), *extra]


def run_trainer(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=300)


def verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.checkpoint", "verify", str(path)], cwd=REPO,
                          env=worker_env(), capture_output=True, text=True, timeout=120)


def committed(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp"))


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> list[dict]:
    """The losses of an uninterrupted 8-step run, to compare resumed runs with."""
    base = tmp_path_factory.mktemp("straight")
    done = run_trainer(trainer(8, base / "ckpt", base / "metrics.jsonl", "--checkpoint-interval", "100"))
    assert done.returncode == 0, done.stderr[-3000:]
    return step_metrics(base / "metrics.jsonl")


@pytest.fixture
def small_file_system(tmp_path):
    """A tmpfs that holds one checkpoint and a half: the second save runs out of space."""
    if os.geteuid() != 0:
        missing_prerequisite("mounting a size-limited tmpfs needs root")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    size_kb = int(CHECKPOINT_MB * 1.5 * 1024)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mount_point)], check=True)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.parametrize("save", ["async", "blocking"])
def test_a_full_file_system_during_a_save_stops_training_cleanly_and_the_last_checkpoint_resumes(
        small_file_system, tmp_path, straight_run, fault, save):
    checkpoints, metrics = small_file_system / "run", tmp_path / "metrics.jsonl"
    fault.inject(f"file system full during the step-4 checkpoint save ({save})")
    done = run_trainer(trainer(8, checkpoints, metrics, "--set",
                               f"checkpoint.async_save={str(save == 'async').lower()}"))
    assert done.returncode != 0, "training must stop when its checkpoint cannot be written"
    error = next(line for line in done.stderr.splitlines() if line.startswith("error: "))
    assert "checkpoint step 4" in error and "was not committed" in error, error
    assert f"{checkpoints} has" in error and "MB free" in error and "checkpoint.dir" in error, error
    assert "Traceback" not in error
    # what was committed before the disk filled still verifies
    assert [p.name for p in committed(checkpoints)] == ["step_00000002"]
    assert verify(checkpoints / "step_00000002").returncode == 0
    # with room again, the resume starts from step 2 and ends as the uninterrupted run did
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_file_system)], check=True)
    resumed = run_trainer(trainer(8, checkpoints, metrics))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoints}/step_00000002 (step 2)" in resumed.stderr
    assert "removing" in resumed.stderr and "step_00000004.tmp" in resumed.stderr  # the failed save
    after = step_metrics(metrics)
    fault.lost(sum(1 for a, b in zip(after[-6:], straight_run[-6:], strict=True) if a != b))
    assert after[-6:] == straight_run[-6:]


@contextlib.contextmanager
def training(argv: list[str]) -> Iterator[subprocess.Popen]:
    """The trainer running in the background for the test's body; killed if the body fails."""
    proc = subprocess.Popen(argv, cwd=REPO, env=worker_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"training ended before {what}: {proc.communicate()[1][-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.05)


def test_checkpoints_deleted_and_truncated_while_training_the_next_save_succeeds_and_resume_verifies(
        tmp_path, straight_run, fault):
    checkpoints, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    with training(trainer(8, checkpoints, metrics, "--set", "checkpoint.keep_last=8")) as proc:
        _wait_for(lambda: (checkpoints / "step_00000002" / "manifest.json").exists(), proc, "checkpoint 2")
        shutil.rmtree(checkpoints)
        fault.inject("checkpoint directory deleted while training")
        _wait_for(lambda: (checkpoints / "step_00000004" / "manifest.json").exists(), proc, "checkpoint 4")
        shard = next((checkpoints / "step_00000004").glob("__0_*.distcp"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        fault.inject("a shard of the newest checkpoint truncated while training")
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    names = [p.name for p in committed(checkpoints)]
    assert names == ["step_00000004", "step_00000006", "step_00000008"], names
    assert verify(checkpoints / "step_00000004").returncode != 0  # the truncated one is caught
    assert verify(checkpoints / "step_00000008").returncode == 0
    # the newest is truncated too now: a resume must skip both broken ones and take step 6
    shard = next((checkpoints / "step_00000008").glob("__1_*.distcp"))
    shard.write_bytes(b"")
    resumed = run_trainer(trainer(8, checkpoints, metrics))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoints}/step_00000006 (step 6)" in resumed.stderr
    after = step_metrics(metrics)
    fault.lost(0 if after[-2:] == straight_run[-2:] else 2)
    assert after[-2:] == straight_run[-2:]


def test_sigterm_to_the_trainer_checkpoints_at_the_step_boundary_exits_0_and_resumes(
        tmp_path, straight_run, fault):
    """SIGTERM to the training processes (what `scancel` and a spot drain send to every process of a
    job step): each finishes its step, they save one verified checkpoint at the same step and exit 0."""
    checkpoints, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    with training(trainer(8, checkpoints, metrics, "--checkpoint-interval", "100", "--set",
                          "metrics.log_interval=1", "--steps", "400")) as proc:
        _wait_for(lambda: metrics.exists() and len(step_metrics(metrics)) >= 3, proc, "3 steps")
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                 text=True).stdout.split()
        assert len(workers) == 2, workers
        for pid in workers:
            os.kill(int(pid), signal.SIGTERM)
        fault.inject("SIGTERM to both trainer processes mid-run")
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    saved = committed(checkpoints)
    assert len(saved) == 1, saved
    assert verify(saved[0]).returncode == 0
    stop_step = int(saved[0].name.removeprefix("step_"))
    summary = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
    assert summary["stopped"] == "signal" and summary["last_step"] == stop_step, summary
    # nothing done before the signal is lost: the resume continues from the stop step
    resumed = run_trainer(trainer(8, checkpoints, metrics))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {saved[0]} (step {stop_step})" in resumed.stderr
    after = {row["step"]: row for row in step_metrics(metrics)}
    fault.lost(sum(1 for row in straight_run if after.get(row["step"]) != row))
    assert [after[row["step"]] for row in straight_run] == straight_run
