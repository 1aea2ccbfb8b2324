"""The job progress watcher (ansible/roles/slurm/files/job-watcher.py) without nodes: which steps it
watches (stand-in squeue), when it calls a step stalled (times given, not slept), and what it does
then (the job directory's `stalled`, a stand-in scancel)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ansible.conftest import ROLES_DIR
from tests.stand_ins import stand_in_commands

PROGRAM = ROLES_DIR / "slurm/files/job-watcher.py"


@pytest.fixture
def watcher(monkeypatch):
    spec = importlib.util.spec_from_file_location("job_watcher", PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "STALL_FACTOR", 10.0)
    monkeypatch.setattr(module, "STALL_MIN_S", 30.0)
    return module


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    """Stand-in squeue (two jobs: a training step of job 41, a user's step of job 42) and scancel."""
    squeue = ('case "$*" in\n'
              '  *--steps*) printf "41.0|health\\n41.1|train\\n42.0|bash\\n" ;;\n'
              f'  *--jobs*) printf "41|{tmp_path}/job41\\n42|{tmp_path}/job42\\n" ;;\n'
              'esac')
    env = stand_in_commands(tmp_path, squeue=squeue, scancel=f'echo "$*" >> {tmp_path}/scancel.log')
    monkeypatch.setenv("PATH", env["PATH"])
    for job in ("job41", "job42"):
        (tmp_path / job).mkdir()
    return tmp_path


def _records(steps: range, step_time_s: float) -> str:
    return "".join(json.dumps({"step": s, "loss": 1.0, "step_time_s": step_time_s}) + "\n" for s in steps)


def test_only_running_training_steps_are_watched_in_their_job_directory(watcher, slurm):
    assert watcher.training_steps() == {"41.1": f"{slurm}/job41"}


def test_a_step_whose_metrics_stop_is_ended_after_the_limit_with_the_reason(watcher, slurm):
    metrics = slurm / "job41/metrics.jsonl"
    metrics.write_text(_records(range(1, 11), 0.5))  # an earlier attempt's records
    watched = watcher.Watched(metrics=str(metrics), size=metrics.stat().st_size)
    now = 1000.0
    for flush in range(3):  # three writes of 10 records 5 s apart: the usual interval is 5 s
        with metrics.open("a") as f:
            f.write(_records(range(11 + 10 * flush, 21 + 10 * flush), 0.5))
        watcher.watch("41.1", watched, now)
        now += 5
    assert watched.usual_interval_s() == 5
    # silent for the limit, max(30 s, 10 x 5 s) = 50 s: still running; past it: ended
    watcher.watch("41.1", watched, now - 5 + 50)
    assert not (slurm / "scancel.log").exists() and not watched.ended
    watcher.watch("41.1", watched, now - 5 + 51)
    assert (slurm / "scancel.log").read_text() == "--signal=KILL 41.1\n"
    reason = (slurm / "job41/stalled").read_text()
    assert reason == ("no metrics for 51 s (limit 50 s: 10 x the usual 5.0 s between writes, at least 30 s): "
                      "a rank stopped making progress\n")
    watcher.watch("41.1", watched, now + 500)  # once
    assert (slurm / "scancel.log").read_text().count("\n") == 1


def test_before_two_intervals_the_limit_comes_from_the_step_time_and_never_below_the_minimum(watcher, slurm):
    metrics = slurm / "job41/metrics.jsonl"
    watched = watcher.Watched(metrics=str(metrics), size=0)
    metrics.write_text(_records(range(1, 11), 8.0))  # one write: 10 steps of 8 s, the estimate 80 s
    watcher.watch("41.1", watched, 0.0)
    assert watched.estimate_s == 80 and watched.usual_interval_s() == 80
    watcher.watch("41.1", watched, 800.0)
    assert not watched.ended
    watcher.watch("41.1", watched, 801.0)
    assert watched.ended
    quick = watcher.Watched(metrics=str(metrics), size=0)
    metrics.write_text(_records(range(1, 2), 0.01))
    watcher.watch("41.2", quick, 0.0)
    watcher.watch("41.2", quick, 30.0)
    assert not quick.ended  # 10 x 0.01 s, but at least STALL_MIN_S


def test_a_step_that_wrote_nothing_yet_is_starting_not_stalled(watcher, slurm):
    metrics = slurm / "job41/metrics.jsonl"
    metrics.write_text(_records(range(1, 11), 0.5))
    watched = watcher.Watched(metrics=str(metrics), size=metrics.stat().st_size)
    for now in (0.0, 1e4, 1e6):
        watcher.watch("41.1", watched, now)
    assert not watched.ended and not (slurm / "scancel.log").exists()


def test_after_its_summary_record_a_run_is_finishing_not_stalled(watcher, slurm):
    """The export to Hugging Face format and the shutdown come after the summary and write no metrics."""
    metrics = slurm / "job41/metrics.jsonl"
    watched = watcher.Watched(metrics=str(metrics), size=0)
    metrics.write_text(_records(range(1, 11), 0.5) + json.dumps({"event": "summary", "steps": 10}) + "\n")
    watcher.watch("41.1", watched, 0.0)
    watcher.watch("41.1", watched, 1e5)
    assert watched.finished and not watched.ended and not (slurm / "scancel.log").exists()


def test_the_watcher_runs_from_its_settings_and_says_what_it_watches(slurm):
    env = {**os.environ, "FSDP_STALL_FACTOR": "4", "FSDP_STALL_MIN_S": "60", "FSDP_WATCH_POLL_S": "0.1"}
    proc = subprocess.Popen([sys.executable, str(PROGRAM)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        first = proc.stdout.readline()
    finally:
        proc.kill()
        proc.wait()
    assert first == ("watching running training steps every 0.1 s: one whose metrics stop for 4 x its usual "
                     "interval (at least 60 s) is ended\n")


def test_the_role_runs_the_watcher_on_the_controller_with_the_specs_thresholds():
    tasks = (ROLES_DIR / "slurm/tasks/main.yml").read_text()
    assert "include_tasks: job_watcher.yml\n  when: slurm_is_controller | bool" in tasks
    env = (ROLES_DIR / "slurm/templates/job-watcher.env.j2").read_text()
    assert "FSDP_STALL_FACTOR={{ slurm_stall_factor }}" in env
    assert "FSDP_STALL_MIN_S={{ slurm_stall_min_s }}" in env
    defaults = (ROLES_DIR / "slurm/defaults/main.yml").read_text()
    assert 'slurm_stall_factor: "{{ fsdp_stall_factor | default(10) }}"' in defaults
    assert 'slurm_stall_min_s: "{{ fsdp_stall_min_s | default(300) }}"' in defaults
    assert Path(PROGRAM).read_text().startswith("#!/usr/bin/python3\n")
