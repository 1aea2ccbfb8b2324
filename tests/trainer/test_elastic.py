"""Elastic restart: two torchrun agents (one worker each) meet through c10d rendezvous on loopback. In
one job, first a worker is SIGKILLed, later a whole node (agent and worker) is killed and a replacement
agent joins; each time the workers restart and resume from the last checkpoint, and the job ends with
the loss curve of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.trainer.rank_launcher import free_port
from tests.trainer.test_checkpoint_worker import (
    REFERENCE_STEPS,
    TORCHRUN,
    losses,
    reference_run,
    worker_args,
    worker_env,
)

pytestmark = pytest.mark.slow


def wait_until(condition, agents: list[subprocess.Popen], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        assert all(agent.poll() is None for agent in agents), f"an agent exited while waiting for {what}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} after {timeout} s")


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def worker_of(agent: subprocess.Popen, pids: Path) -> int:
    for pid_file in pids.iterdir():
        pid = int(pid_file.read_text())
        try:  # a worker of an earlier round may exit between the listing and the read
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ..."; a worker's comm (python) holds no ")"
        if int(stat.rsplit(")", 1)[1].split()[1]) == agent.pid:
            return pid
    raise AssertionError(f"no worker of agent {agent.pid} in {pids}")


def reached(metrics: Path, step: int) -> bool:
    return metrics.exists() and max(losses(metrics), default=0) >= step


def test_killed_worker_then_node_restart_and_reproduce_the_loss_curve(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    reference = losses(reference_run(tmp_path_factory) / "metrics.jsonl")
    metrics, pids = tmp_path / "metrics.jsonl", tmp_path / "pids"
    pids.mkdir()
    port = free_port()
    # Without this every restart reconnects gloo to the previous round's store (pytorch/pytorch#135712).
    env = worker_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    argv = [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test", "--max-restarts", "3",
            "--monitor-interval", "0.5",
            *worker_args(steps=REFERENCE_STEPS, metrics=metrics, step_sleep=0.6, pid_dir=pids,
                         checkpoint={"dir": str(tmp_path / "ckpt"), "interval": 3})]
    logs: list[Path] = []
    agents: list[subprocess.Popen] = []

    def start_agent() -> subprocess.Popen:
        logs.append(tmp_path / f"agent{len(logs)}.log")
        agents.append(subprocess.Popen(argv, env=env, stdout=logs[-1].open("w"), stderr=subprocess.STDOUT,
                                       start_new_session=True))
        return agents[-1]

    try:
        # The first agent hosts the rendezvous store (node 0 of a real job); the second is the one to fail.
        host = start_agent()
        wait_until(lambda: listening(port), agents, 120, "rendezvous store")
        other = start_agent()
        wait_until(lambda: reached(metrics, 4), agents, 180, "step 4")
        os.kill(int((pids / "1.pid").read_text()), signal.SIGKILL)
        wait_until(lambda: reached(metrics, 7), agents, 180, "step 7 after the restart")
        # torchrun starts its workers in their own sessions: a dead node takes agent and worker. The
        # worker is found (as the agent's child) before the agent dies: after, it is reparented.
        worker = worker_of(other, pids)
        os.killpg(other.pid, signal.SIGKILL)
        os.kill(worker, signal.SIGKILL)
        other.wait()
        other = start_agent()  # the replacement node
        codes = [host.wait(timeout=240), other.wait(timeout=240)]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    output = "\n".join(log.read_text() for log in logs)
    assert codes == [0, 0], output[-4000:]
    assert output.count("resumed from") == 2, output[-4000:]
    assert losses(metrics) == reference
