"""The job progress watcher (ansible/roles/slurm/files/job-watcher.py) without nodes: which steps it
watches (stand-in squeue), when it calls a step stalled (times given, not slept), and what it does
then (the job directory's `stalled`, a stand-in scancel); its utilisation rule against a stand-in
Prometheus (a real HTTP server on 127.0.0.1 answering as Prometheus does): what it asks, when a job is
underused, and that no answer means no action."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.ansible.conftest import ROLES_DIR, node_variables, render, render_template
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
    """Stand-in squeue (two jobs: a training step of job 41 on node0 and node1, a user's step of job
    42), scontrol (the host names of job 41's node list) and scancel."""
    squeue = ('case "$*" in\n'
              '  *--steps*) printf "41.0|health\\n41.1|train\\n42.0|bash\\n" ;;\n'
              '  "--noheader --jobs 41 --format %N") echo "node[0-1]" ;;\n'
              f'  *--jobs*) printf "41|{tmp_path}/job41\\n42|{tmp_path}/job42\\n" ;;\n'
              'esac')
    scontrol = '[ "$*" != "show hostnames node[0-1]" ] || printf "node0\\nnode1\\n"'
    env = stand_in_commands(tmp_path, squeue=squeue, scontrol=scontrol,
                            scancel=f'echo "$*" >> {tmp_path}/scancel.log')
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


# ---- the utilisation rule ----------------------------------------------------------------------
class StandInPrometheus:
    """A real HTTP server on 127.0.0.1 that answers GET /api/v1/query as Prometheus does (an instant
    vector of the series it is given, each value a string) or with an HTTP error, and records every
    query it got."""

    def __init__(self) -> None:
        self.series: list[dict] = []
        self.status = 200
        self.queries: list[str] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                stand_in.queries += urllib.parse.parse_qs(url.query).get("query", [])
                if url.path != "/api/v1/query" or stand_in.status != 200:
                    status = 404 if url.path != "/api/v1/query" else stand_in.status
                    body = {"status": "error", "errorType": "unavailable", "error": "stand-in refuses"}
                else:
                    status = 200
                    body = {"status": "success", "data": {"resultType": "vector", "result": stand_in.series}}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def answer(self, peaks: dict[str, list[str]]) -> None:
        """Each node's GPUs' highest utilisation, GPU 0 first, labelled as dcgm-exporter's series are
        once the monitoring role's Prometheus scraped them (max_over_time drops the metric name)."""
        self.series = [
            {"metric": {"Hostname": node, "UUID": f"GPU-{rank}{gpu}", "device": f"nvidia{gpu}",
                        "gpu": str(gpu), "instance": f"10.42.1.{10 + rank}:9400", "job": "dcgm",
                        "modelName": "NVIDIA A100-SXM4-40GB", "node": node, "node_rank": str(rank)},
             "value": [1767225600.123, pct]}
            for rank, (node, pcts) in enumerate(peaks.items()) for gpu, pct in enumerate(pcts)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


QUERY = 'max_over_time(DCGM_FI_DEV_GPU_UTIL{job="dcgm",node=~"node0|node1"}[1800s])'
"""What the watcher asks about job 41 (on node0 and node1) with a window of 1800 s."""


@pytest.fixture
def prometheus(watcher, monkeypatch):
    """A stand-in Prometheus the watcher asks, with the rule's defaults: below 5 % for 1800 s, 600 s to
    checkpoint after SIGUSR1."""
    stand_in = StandInPrometheus()
    monkeypatch.setattr(watcher, "PROMETHEUS_URL", stand_in.url)
    monkeypatch.setattr(watcher, "GPU_IDLE_PCT", 5.0)
    monkeypatch.setattr(watcher, "GPU_IDLE_S", 1800.0)
    monkeypatch.setattr(watcher, "GPU_IDLE_GRACE_S", 600.0)
    yield stand_in
    stand_in.close()


def _use(watcher, slurm, seen_at: float = 0.0):
    return watcher.GpuUse(job="41", job_dir=str(slurm / "job41"), seen_at=seen_at)


def _scancels(slurm) -> list[str]:
    log = slurm / "scancel.log"
    return log.read_text().splitlines() if log.exists() else []


UNDERUSED = ("every GPU of 2 node(s) stayed below 5 % utilisation for 1800 s (the highest: 4 % on node1 "
             "GPU 0): underused\n")


def test_an_underused_job_is_asked_once_to_checkpoint_and_requeue_with_the_reason(watcher, slurm, prometheus,
                                                                                 capsys):
    prometheus.answer({"node0": ["0", "3"], "node1": ["4", "0"]})
    use = _use(watcher, slurm)
    watcher.watch_use("41.1", use, 1800.0, set())
    # exactly the job's nodes and the window, asked once
    assert prometheus.queries == [QUERY]
    assert _scancels(slurm) == ["--batch --signal USR1 41"]
    assert (slurm / "job41/underused").read_text() == UNDERUSED
    said = capsys.readouterr().out
    assert f"step 41.1: {UNDERUSED.strip()}: asking job 41 to checkpoint and requeue" in said
    for now in (1860.0, 2000.0, 2400.0):  # within the grace: neither asked again nor ended
        watcher.watch_use("41.1", use, now, set())
    assert _scancels(slurm) == ["--batch --signal USR1 41"] and prometheus.queries == [QUERY]
    # The requeued job's next step underused again: only logged (the file says it was asked).
    again = watcher.GpuUse(job="41", job_dir=str(slurm / "job41"), seen_at=5000.0)
    watcher.watch_use("41.0", again, 6800.0, set())
    assert len(prometheus.queries) == 2 and _scancels(slurm) == ["--batch --signal USR1 41"]
    assert "the job was asked once already" in capsys.readouterr().out
    assert (slurm / "job41/underused").read_text() == UNDERUSED


def test_an_underused_step_still_running_after_the_grace_is_ended(watcher, slurm, prometheus, capsys):
    """A hung worker never answers SIGUSR1 (nor does one not yet past its start, where it is ignored);
    the batch script, signalled, requeues the job once the step has ended."""
    prometheus.answer({"node0": ["0"], "node1": ["0"]})
    use = _use(watcher, slurm)
    watcher.watch_use("41.1", use, 1800.0, set())
    watcher.watch_use("41.1", use, 2400.0, set())
    assert _scancels(slurm) == ["--batch --signal USR1 41"]
    watcher.watch_use("41.1", use, 2401.0, set())
    assert _scancels(slurm) == ["--batch --signal USR1 41", "--signal=KILL 41.1"]
    assert "step 41.1: still running 601 s after SIGUSR1 (at most 600 s to checkpoint): ending it" \
        in capsys.readouterr().out
    watcher.watch_use("41.1", use, 5000.0, set())
    assert len(_scancels(slurm)) == 2


def test_a_job_with_one_gpu_at_the_threshold_is_busy_and_asked_about_again_a_minute_later(
        watcher, slurm, prometheus):
    prometheus.answer({"node0": ["0", "0"], "node1": ["0", "5"]})  # 5 % is not below 5 %
    use = _use(watcher, slurm)
    for now in (1800.0, 1830.0, 1859.0, 1860.0):
        watcher.watch_use("41.1", use, now, set())
    assert prometheus.queries == [QUERY, QUERY]
    assert _scancels(slurm) == [] and not (slurm / "job41/underused").exists()


def test_a_step_younger_than_the_window_is_not_asked_about(watcher, slurm, prometheus):
    prometheus.answer({"node0": ["0"], "node1": ["0"]})
    use = _use(watcher, slurm, seen_at=100.0)
    for now in (100.0, 1000.0, 1899.0):
        watcher.watch_use("41.1", use, now, set())
    assert prometheus.queries == [] and _scancels(slurm) == []
    watcher.watch_use("41.1", use, 1900.0, set())
    assert prometheus.queries == [QUERY] and _scancels(slurm) == ["--batch --signal USR1 41"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", ["no series", "a node without series", "HTTP error", "connection refused",
                                  "NaN"])
def test_without_an_answer_for_every_node_nothing_is_done_and_it_is_said_once(watcher, slurm, prometheus,
                                                                               monkeypatch, capsys, case):
    """Local nodes have no GPUs, a node may lack dcgm-exporter, Prometheus may be down: no judgement."""
    said = {"no series": "Prometheus has no DCGM_FI_DEV_GPU_UTIL for node0, node1 (no GPUs, or "
                         "dcgm-exporter not installed or not scraped)",
            "a node without series": "Prometheus has no DCGM_FI_DEV_GPU_UTIL for node1",
            "HTTP error": f"Prometheus at {prometheus.url} answered HTTP 503",
            "connection refused": "is unreachable (<urlopen error [Errno 111] Connection refused>)",
            "NaN": "Prometheus gave no number for node1 GPU 0"}[case]
    if case == "a node without series":
        prometheus.answer({"node0": ["0"]})
    elif case == "HTTP error":
        prometheus.status = 503
    elif case == "connection refused":
        monkeypatch.setattr(watcher, "PROMETHEUS_URL", f"http://127.0.0.1:{_closed_port()}")
    elif case == "NaN":
        prometheus.answer({"node0": ["0"], "node1": ["NaN"]})
    unjudged: set[str] = set()
    use = _use(watcher, slurm)
    for now in (1800.0, 1860.0, 1920.0):
        watcher.watch_use("41.1", use, now, unjudged)
    assert _scancels(slurm) == [] and not (slurm / "job41/underused").exists()
    out = capsys.readouterr().out
    assert out.count("job 41: GPU utilisation not judged") == 1 and said in out, out
    assert len(prometheus.queries) == (0 if case == "connection refused" else 3)  # asked again each minute


def test_a_threshold_of_zero_turns_the_rule_off(watcher, slurm, prometheus, monkeypatch):
    monkeypatch.setattr(watcher, "GPU_IDLE_PCT", 0.0)
    prometheus.answer({"node0": ["0"], "node1": ["0"]})
    use = _use(watcher, slurm)
    for now in (1800.0, 1e5, 1e7):
        watcher.watch_use("41.1", use, now, set())
    assert prometheus.queries == [] and _scancels(slurm) == []


def test_each_look_judges_the_running_training_steps_until_their_run_wrote_its_summary(watcher, slurm,
                                                                                        prometheus):
    """Watch.look, as the main loop calls it: job 41's training step (not job 42's) is asked about in
    its job directory; once its run wrote the summary (the export and the shutdown follow, GPUs idle)
    it is not."""
    prometheus.answer({"node0": ["0"], "node1": ["0"]})
    metrics = slurm / "job41/metrics.jsonl"
    watch = watcher.Watch()
    watch.look(watcher.training_steps(), 0.0)
    metrics.write_text(_records(range(1, 11), 0.5) + json.dumps({"event": "summary", "steps": 10}) + "\n")
    watch.look(watcher.training_steps(), 1800.0)
    assert watch.progress["41.1"].finished and prometheus.queries == [] and _scancels(slurm) == []

    watch = watcher.Watch()  # the same step, its run still training
    metrics.write_text("")
    watch.look(watcher.training_steps(), 0.0)
    watch.look(watcher.training_steps(), 1800.0)
    assert set(watch.use) == {"41.1"} and prometheus.queries == [QUERY]
    assert _scancels(slurm) == ["--batch --signal USR1 41"] and (slurm / "job41/underused").exists()


def test_the_watcher_says_its_utilisation_rule_from_its_settings(slurm):
    env = {**os.environ, "FSDP_WATCH_POLL_S": "0.1", "FSDP_GPU_IDLE_PCT": "7.5", "FSDP_GPU_IDLE_S": "900",
           "FSDP_GPU_IDLE_GRACE_S": "300", "FSDP_PROMETHEUS_URL": "http://10.42.1.10:9090"}
    proc = subprocess.Popen([sys.executable, str(PROGRAM)], stdout=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    # The watcher never ends: read its first two lines, or give up on a second that does not come.
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout.readline() for _ in range(2)),
                              daemon=True)
    reader.start()
    reader.join(timeout=30)
    proc.kill()
    proc.wait()
    reader.join()
    assert lines[1:] == ["and a job whose every GPU stays below 7.5 % for 900 s (Prometheus at "
                         "http://10.42.1.10:9090) is asked to checkpoint and requeue, once; its step is "
                         "ended 300 s later if still running\n"]


def test_the_role_points_the_watcher_at_the_monitoring_roles_prometheus_with_the_specs_thresholds(tmp_path):
    variables = node_variables(tmp_path, "p4d.24xlarge", {}, fsdp_gpu_idle_pct=2.5, fsdp_gpu_idle_s=3600)
    env = render_template("slurm", "job-watcher.env.j2", variables)
    # Prometheus runs on rank monitoring_server_rank (0), at its cluster address, port 9090
    assert env.splitlines()[-4:] == ["FSDP_GPU_IDLE_PCT=2.5", "FSDP_GPU_IDLE_S=3600",
                                     "FSDP_GPU_IDLE_GRACE_S=600", "FSDP_PROMETHEUS_URL=http://10.42.1.10:9090"]
    moved = {**variables, "monitoring_server_rank": 1, "monitoring_prometheus_port": 9191}
    assert render("{{ slurm_prometheus_url }}", moved) == "http://10.42.1.11:9191"
    # No node of that rank (excluded): no Prometheus, and the watcher judges nothing.
    gone = render_template("slurm", "job-watcher.env.j2", {**variables, "monitoring_server_rank": 5})
    assert gone.splitlines()[-1] == "FSDP_PROMETHEUS_URL="
    defaults = (ROLES_DIR / "slurm/defaults/main.yml").read_text()
    assert 'slurm_gpu_idle_pct: "{{ fsdp_gpu_idle_pct | default(5) }}"' in defaults
    assert 'slurm_gpu_idle_s: "{{ fsdp_gpu_idle_s | default(1800) }}"' in defaults
