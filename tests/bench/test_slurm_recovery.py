"""bench/slurm_recovery.py's reading of a recovery from the batch script's log: the phases of a step
retried in its allocation and of a requeue, in seconds from the fault, across midnight too."""

import datetime as dt
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "slurm_recovery.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("slurm_recovery", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["slurm_recovery"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _at(hms: str) -> float:
    return dt.datetime.fromisoformat(f"2026-12-05T{hms}+00:00").timestamp()


RETRY_LOG = ("[fsdpctl 13:50:01.100] job 7 run 0 on n[0-1] (rendezvous 198.18.0.10:29500)\n"
             "step 12: loss 5.1\n"
             "[fsdpctl 13:50:10.900] step exit 1: retried in this allocation (run 0 attempt 1, failed step 1 "
             "of at most 3 retried)\n")


def test_a_retry_in_the_allocation_reads_step_end_health_check_and_load(bench):
    # the batch script logs the step's end, then, after the health check on every node, the retry
    log = RETRY_LOG.replace("[fsdpctl 13:50:10.900] step exit 1: retried",
                            "[fsdpctl 13:50:10.400] step exit 1: noted\n"
                            "[fsdpctl 13:50:10.900] step exit 1: retried")
    log += "checkpoint: resumed from /shared/j/checkpoints/step_00000010 (step 10) in 0.42s\n"
    measured = bench.phases("retry", log, _at("13:50:10"), _at("13:50:15.5"))
    figures = (measured.step_ended_s, measured.restarted_s, measured.checkpoint_load_s, measured.first_step_s)
    assert figures == (0.4, 0.9, 0.42, 5.5)


def test_a_requeue_reads_the_new_runs_start_and_crosses_midnight(bench):
    log = ("[fsdpctl 23:59:50.000] job 7 run 0 on n[0-1] (rendezvous 198.18.0.10:29500)\n"
           "[fsdpctl 23:59:58.000] SIGUSR1: asking the workers to checkpoint\n"
           "[fsdpctl 23:59:59.500] step exit 0 after SIGUSR1: requeued (run 0; a checkpoint on request)\n"
           "[fsdpctl 00:00:35.250] job 7 run 1 on n[0-1] (rendezvous 198.18.0.10:29500)\n"
           "checkpoint: resumed from /shared/j/checkpoints/step_00000013 (step 13) in 0.50s\n")
    fault = dt.datetime.fromisoformat("2026-12-04T23:59:58+00:00").timestamp()
    measured = bench.phases("requeue", log, fault, fault + 44)
    assert (measured.step_ended_s, measured.restarted_s, measured.first_step_s) == (1.5, 37.25, 44)


def test_a_log_without_the_restart_is_an_error_that_says_so(bench):
    with pytest.raises(ValueError, match="no restart after the fault"):
        bench.phases("retry", RETRY_LOG.replace("retried in this allocation", "failed"), _at("13:50:10"),
                     _at("13:50:20"))
