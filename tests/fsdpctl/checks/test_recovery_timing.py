"""When the recovery check kills a node's workers, without nodes: a run whose saves take longer than its
steps, as a tiny model on CPU (the local nodes) or a large checkpoint on GPUs makes it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fsdpctl.checks import training
from fsdpctl.checks.training import _kill_and_time_recovery
from tests.trainer.record_samples import step_record
from trainer.records import MetricsLog

INTERVAL, STEPS = 4, 40


class SaveBoundRun:
    """A 2-node run checkpointing every INTERVAL steps whose saves outlast the steps between them: each
    read of the metrics file finds the last line at the next checkpoint's step, as the polls of the local
    nodes' runs did. Killing node 1's workers restarts them, and they log the step after the last
    checkpoint."""

    def __init__(self):
        self.logged = 0
        self.killed = False
        self.resumed_from: int | None = None
        self.reads_after_restart = 0

    def metrics(self, _record, _rank, _path) -> MetricsLog:
        if self.resumed_from is None:
            self.logged = min(self.logged + INTERVAL, STEPS)
            steps = range(1, self.logged + 1)
        else:  # the restarted workers log their first step after the check's first look
            self.reads_after_restart += 1
            resumed = [self.resumed_from + 1] if self.reads_after_restart > 1 else []
            steps = [*range(1, self.logged + 1), *resumed]
        return MetricsLog(steps=[step_record(s) for s in steps])

    def poll(self) -> dict[int, int | None]:
        done = self.logged == STEPS and not self.killed
        return {0: 0 if done else None, 1: 0 if done else None}

    def failure(self, codes: dict[int, int]) -> str | None:
        return None if not any(codes.values()) else f"exit codes {codes}"

    def kill_workers(self, rank: int) -> set[int]:
        assert rank == 1
        self.killed = True
        self.resumed_from = (self.logged - 1) // INTERVAL * INTERVAL  # the last whole checkpoint
        return {100}

    def worker_pids(self, _rank: int) -> set[int]:
        return {101} if self.killed else {100}


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    """Polls back to back, and a check that waits in vain fails in seconds, not minutes."""
    monkeypatch.setattr(training, "RUN_TIMEOUT_S", 5)
    monkeypatch.setattr(training, "RECOVERY_TIMEOUT_S", 5)


def test_the_kill_lands_after_the_first_checkpoint_when_every_poll_finds_a_checkpoints_step(monkeypatch):
    run = SaveBoundRun()
    monkeypatch.setattr(training, "read_remote_metrics", run.metrics)
    ctx = SimpleNamespace(record=None, ranks=[0, 1])
    details = _kill_and_time_recovery(ctx, run, victim=1, metrics="/m", interval=INTERVAL)
    # The first poll found step 4 (its save may still run), the second step 8: the checkpoint of step 4 is
    # whole, so the kill came then, and the restarted workers went on from it.
    assert (details.killed_after_step, details.resumed_at_step) == (2 * INTERVAL, INTERVAL + 1)
    assert details.victim_node == 1 and details.checkpoint_interval == INTERVAL


def test_a_run_that_ends_before_its_first_checkpoint_is_a_check_error(monkeypatch):
    run = SaveBoundRun()
    monkeypatch.setattr(training, "read_remote_metrics", lambda *_: MetricsLog())
    monkeypatch.setattr(run, "poll", lambda: {0: 0, 1: 0})
    with pytest.raises(training.CheckError, match="the run ended before a checkpoint was written"):
        _kill_and_time_recovery(SimpleNamespace(record=None, ranks=[0, 1]), run, victim=1, metrics="/m",
                                interval=INTERVAL)
