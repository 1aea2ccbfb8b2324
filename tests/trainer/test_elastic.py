"""Elastic restart: two torchrun agents (one worker each) meet through c10d rendezvous on loopback; one
worker is SIGKILLed mid-run; the agents restart the workers, which resume from the last checkpoint, and
the job ends with the loss curve of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.trainer.test_checkpoint_worker import (
    REFERENCE_STEPS,
    TORCHRUN,
    free_port,
    losses,
    reference_run,
    worker_args,
    worker_env,
)

pytestmark = pytest.mark.slow


def wait_for_step(metrics: Path, step: int, agents: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and max(losses(metrics), default=0) >= step:
            return
        assert all(agent.poll() is None for agent in agents), "an agent exited before the kill"
        time.sleep(0.1)
    raise AssertionError(f"the job did not reach step {step} in {timeout} s")


def test_killed_worker_restarts_and_reproduces_the_loss_curve(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    reference = losses(reference_run(tmp_path_factory) / "metrics.jsonl")
    metrics, pids = tmp_path / "metrics.jsonl", tmp_path / "pids"
    pids.mkdir()
    port = free_port()
    # Without this every restart reconnects gloo to the previous round's store (pytorch/pytorch#135712).
    env = worker_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    argv = [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test", "--max-restarts", "2",
            "--monitor-interval", "0.5",
            *worker_args(steps=REFERENCE_STEPS, metrics=metrics, step_sleep=0.6, pid_dir=pids,
                         checkpoint={"dir": str(tmp_path / "ckpt"), "interval": 3})]
    logs = [tmp_path / f"agent{index}.log" for index in range(2)]
    agents = [subprocess.Popen(argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                               start_new_session=True) for log in logs]
    try:
        wait_for_step(metrics, 4, agents, timeout=180)
        victim = int((pids / "1.pid").read_text())
        os.kill(victim, signal.SIGKILL)
        codes = [agent.wait(timeout=240) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    output = "\n".join(log.read_text() for log in logs)
    assert codes == [0, 0], output[-4000:]
    assert "resumed from" in output, output[-4000:]
    assert losses(metrics) == reference
