from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def torchrun(nproc: int, args: list[str], *, timeout: float = 240) -> subprocess.CompletedProcess:
    """A CPU/gloo torchrun launch on loopback; --standalone picks a free rendezvous port."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                    f"--- stderr\n{proc.stderr[-8000:]}")
