"""A rank that stops answering (SIGSTOP: a frozen host, a cut link), with the real trainer on 2 CPU
ranks: the other rank's collective gives up after the configured distributed.timeout_s, on every
group the loop uses (the stop-signal vote and checkpoint commits run on their own gloo groups, which
do not inherit the default group's time-out), instead of hanging for torch's 30-minute default."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import pytest

from tests.faults.test_checkpoint_faults import _wait_for, training
from tests.trainer.test_checkpoint_train import TRAIN, step_metrics
from tests.trainer.test_checkpoint_worker import TORCHRUN

TIMEOUT_S = 30  # the lowest distributed.timeout_s the trainer accepts


@pytest.mark.slow
def test_a_frozen_rank_makes_the_other_fail_after_the_configured_timeout(tmp_path, fault):
    metrics = tmp_path / "metrics.jsonl"
    argv = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", *TRAIN, "--steps", "100000",
            "--metrics-file", str(metrics), "--set", "metrics.log_interval=1", "--set",
            f"distributed.timeout_s={TIMEOUT_S}"]
    with training(argv) as proc:
        _wait_for(lambda: metrics.exists() and len(step_metrics(metrics)) >= 3, proc, "3 steps")
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                 text=True).stdout.split()
        frozen = int(sorted(workers, key=int)[-1])
        os.kill(frozen, signal.SIGSTOP)
        fault.inject("one of 2 trainer ranks frozen (SIGSTOP) mid-run")
        try:
            _, stderr = proc.communicate(timeout=TIMEOUT_S * 10)
        finally:
            with contextlib.suppress(ProcessLookupError):  # torchrun kills it when the other fails
                os.kill(frozen, signal.SIGCONT)
    assert proc.returncode != 0
    assert f"Timed out waiting {TIMEOUT_S * 1000}ms" in stderr, stderr[-3000:]
