"""A stop signal under torchrun (2 CPU ranks): SIGUSR1 sent to ONE worker (torchrun does not forward
SIGUSR1, and an operator may signal a single node) stops both ranks after the same step, with a
verified checkpoint of that step, a summary saying why, and exit 0; resuming continues with exactly the
losses of an uninterrupted run (flat learning rate after warm-up, so the run length does not matter)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.trainer.test_checkpoint_worker import REPO, TORCHRUN, worker_env
from trainer.checkpoint.manifest import MANIFEST, verify_checkpoint

pytestmark = pytest.mark.slow

TRAIN = ["-m", "trainer", "--config", "tiny", "--set", "optim.min_lr_ratio=1.0", "--set",
         "metrics.log_interval=1", "--checkpoint-interval", "2"]
STRAIGHT_STEPS = 24


def argv(steps: int, metrics: Path, checkpoints: Path) -> list[str]:
    return [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", *TRAIN, "--steps", str(steps),
            "--metrics-file", str(metrics), "--checkpoint-dir", str(checkpoints)]


def records(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def worker_pid(agent: int, rank: int) -> int:
    """The pid of the torchrun agent's worker with RANK=rank."""
    for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no worker with RANK={rank} under torchrun pid {agent}")


def test_sigusr1_to_one_worker_stops_all_ranks_with_a_checkpoint_and_resume_matches(tmp_path):
    straight = tmp_path / "straight.jsonl"
    done = subprocess.run(argv(STRAIGHT_STEPS, straight, tmp_path / "straight-ckpt"), cwd=REPO,
                          env=worker_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    metrics, checkpoints = tmp_path / "stopped.jsonl", tmp_path / "ckpt"
    # Far more steps than it will run: the signal ends it.
    agent = subprocess.Popen(argv(1000, metrics, checkpoints), cwd=REPO, env=worker_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not any(r.get("step", 0) >= 3 for r in records(metrics)):
            assert agent.poll() is None, agent.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 3"
            time.sleep(0.2)
        signalled_after = max(r["step"] for r in records(metrics) if "step" in r)
        worker = worker_pid(agent.pid, 1)
        os.kill(worker, signal.SIGUSR1)
        _, stderr = agent.communicate(timeout=240)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, stderr[-3000:]
    rows = records(metrics)
    steps, summary = [r for r in rows if "step" in r], rows[-1]
    stopped_at = steps[-1]["step"]
    assert summary["event"] == "summary" and summary["stopped"] == "signal"
    assert summary["signal"] == "SIGUSR1" and summary["last_step"] == stopped_at
    # The step running when the signal came (or the next: it may land between steps) is the last.
    assert signalled_after <= stopped_at <= signalled_after + 2 < STRAIGHT_STEPS - 2
    assert f"stop: checkpoint of step {stopped_at} saved and verified" in stderr
    # rank 0 logs; both ranks took part in the same blocking save, so the checkpoint holds both shards
    final = checkpoints / f"step_{stopped_at:08d}"
    assert verify_checkpoint(final) == []
    assert json.loads((final / MANIFEST).read_text())["world_size"] == 2

    done = subprocess.run(argv(STRAIGHT_STEPS, metrics, checkpoints), cwd=REPO, env=worker_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"(step {stopped_at})" in done.stderr
    resumed = [r for r in records(metrics) if "step" in r]
    want = {r["step"]: r["loss"] for r in records(straight) if "step" in r}
    assert [r["step"] for r in resumed] == list(range(1, STRAIGHT_STEPS + 1))
    assert {r["step"]: r["loss"] for r in resumed} == want
