"""Faults on real local nodes (2 systemd-nspawn nodes in 198.18.50.0/24): every stage SIGKILLed at a
seeded random point, then rerun or torn down; a node that dies during `deploy`; a node's link cut
in the middle of training. One cluster for the module, logged in to as AWS nodes are (as `ubuntu`, with
passwordless sudo); the tests run in file order.

The seed is printed and can be set with FSDP_FAULT_SEED to replay a run's kill points.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from fsdpctl import remote
from fsdpctl.checks.context import check_context
from fsdpctl.checks.torchrun import NODE_TIMEOUT_S, read_remote_metrics
from fsdpctl.checks.training import trainer_args
from fsdpctl.state import cluster_state
from tests.local.conftest import (
    LOGIN_USER,
    NODE_SSH,
    REPO,
    fsdpctl,
    host_leftovers,
    read_state,
    require_local_prerequisites,
    spec_file,
)

pytestmark = [pytest.mark.root, pytest.mark.slow]

NAME = "flt-nodes"
SUBNET = "198.18.50.0/24"  # the fault suite's subnet
SEED = int(os.environ.get("FSDP_FAULT_SEED", time.time_ns() % 100_000))
RANDOM = random.Random(SEED)
COLLECTIVE_TIMEOUT_S = 30  # distributed.timeout_s for the link-cut run (the trainer's lowest allowed)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    require_local_prerequisites()
    print(f"fault seed {SEED} (FSDP_FAULT_SEED={SEED} replays these kill points)")
    return tmp_path_factory.mktemp("fsdpctl-home")


@pytest.fixture(scope="module")
def spec(home: Path) -> Path:
    local = {"subnet_cidr": SUBNET, "nproc_per_node": 1, "login_user": LOGIN_USER}
    return spec_file(home.parent, NAME, local=local)


@pytest.fixture(scope="module")
def cluster(home: Path, spec: Path):
    """Whatever the tests leave of the cluster is torn down after the module."""
    yield
    fsdpctl(home, "down", "--yes", "--cluster", NAME, timeout=300, check=False)


def kill_at_random_point(home: Path, argv: list[str], low: float, high: float) -> tuple[float, bool]:
    """Start `fsdpctl ARGV`, SIGKILL it after a random delay in [low, high] s; returns the delay and
    whether it was still running (the fault was injected) when the signal came."""
    delay = round(RANDOM.uniform(low, high), 2)
    proc = subprocess.Popen([str(Path(sys.executable).parent / "fsdpctl"), *argv], cwd=REPO,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "FSDPCTL_HOME": str(home)})
    try:
        proc.wait(timeout=delay)
        return delay, False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return delay, True


def node_processes(home: Path, rank: int, pattern: str) -> list[str]:
    """Processes on a node whose command line matches `pattern` (pgrep -af)."""
    done = fsdpctl(home, "ssh", str(rank), "--cluster", NAME, "--", f"pgrep -af {pattern} || true",
                   timeout=60)
    return [line for line in done.stdout.splitlines() if line.strip() and "pgrep" not in line]


def test_up_killed_at_a_random_point_then_down_leaves_nothing(home, spec, cluster, fault):
    delay, injected = kill_at_random_point(home, ["up", str(spec), "--target", "local"], 0.3, 4.0)
    if injected:
        fault.inject(f"SIGKILL of up after {delay} s (seed {SEED})")
    recorded = (home / "clusters" / NAME / "state.json").exists()
    local = read_state(home, NAME).get("local") if recorded else None
    down = fsdpctl(home, "down", "--yes", "--cluster", NAME, check=False)
    if not recorded:  # killed before its state was written: there is no cluster to take down
        assert down.returncode == 2 and "no cluster named" in down.stderr
    else:  # killed before (local is None) or after the nodes were recorded
        assert down.returncode == 0, down.stderr
        assert local is None or host_leftovers(home, local) == []
    # and a fresh up works after it
    fsdpctl(home, "up", str(spec), "--target", "local", timeout=900)


@pytest.mark.parametrize("command, low, high", [("configure", 3, 30), ("deploy", 2, 20)])
def test_a_stage_killed_at_a_random_point_completes_when_rerun(home, cluster, fault, command, low, high):
    delay, injected = kill_at_random_point(home, [command, "--cluster", NAME], low, high)
    if injected:
        fault.inject(f"SIGKILL of {command} after {delay} s (seed {SEED})")
    rerun = fsdpctl(home, command, "--cluster", NAME, check=False, timeout=1200)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    if command == "configure":  # the rerun reached every host and nothing failed on any
        hosts = read_state(home, NAME)["last_configure"]["hosts"]
        assert len(hosts) == 2 and all(h["failed"] == 0 and h["unreachable"] == 0 for h in hosts.values())
        # and the killed run's playbook, which SIGKILL of fsdpctl leaves running, is gone
        playbooks = [p for p in host_leftovers(home, read_state(home, NAME)["local"])
                     if "ansible-playbook" in p]
        assert playbooks == []


def test_smoke_killed_at_a_random_point_leaves_no_job_and_reruns(home, cluster, fault):
    smoke = ["smoke", "--cluster", NAME, "--skip", "bandwidth", "--skip", "recovery", "--steps", "8"]
    delay, injected = kill_at_random_point(home, smoke, 4, 25)
    if injected:
        fault.inject(f"SIGKILL of smoke after {delay} s (seed {SEED})")
    rerun = fsdpctl(home, *smoke, check=False, timeout=900)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    for rank in (0, 1):
        assert node_processes(home, rank, "torchrun") == []


def power_off(home: Path, rank: int) -> None:
    """SIGKILL a local node's nspawn and every process of its container, as a power loss would."""
    node = next(n for n in read_state(home, NAME)["local"]["nodes"] if n["rank"] == rank)
    uuid_text = f"container_uuid={node['machine_id'][:8]}-"
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().decode(errors="replace")
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if uuid_text in environ or f" {node['dir']}/merged " in f" {cmdline} ":
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)


def test_a_node_dying_during_deploy_is_named_and_a_rerun_after_replace_skips_the_others(home, cluster, fault):
    # node 0 learns node 1's host key (node-to-node SSH accepts a new key, refuses a changed one)
    fsdpctl(home, "ssh", "0", "--cluster", NAME, "--", f"{NODE_SSH} {NAME}-node1 true")
    # forget the installed trainer on both nodes, so that deploy has work to do on each
    for rank in (0, 1):
        fsdpctl(home, "ssh", str(rank), "--cluster", NAME, "--", "rm -f ~/.fsdp-cluster/venv/.fsdp-trainer")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "fsdpctl"), "deploy", "--cluster", NAME],
                            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "FSDPCTL_HOME": str(home)})
    out = []
    for line in proc.stdout:  # the install step has started on both nodes
        out.append(line)
        if "installing into" in line:
            break
    power_off(home, 1)
    fault.inject(f"node 1 powered off during deploy's install (seed {SEED})")
    rest, err = proc.communicate(timeout=600)
    out = "".join(out) + rest
    assert proc.returncode == 1, out + err
    assert "installing the trainer failed" in err and "node 1:" in err and "node 0:" not in err, err
    assert "node 0: trainer updated" in out, out
    # the replacement is configured and, since the trainer was deployed before, deployed to
    replaced = fsdpctl(home, "replace", "1", "--yes", "--cluster", NAME, timeout=1200)
    assert "node 1: installed" in replaced.stdout, replaced.stdout[-3000:]
    # node 0 forgot the old node's host key: SSH to the new one (its own key) works without a prompt
    reached = fsdpctl(home, "ssh", "0", "--cluster", NAME, "--", f"{NODE_SSH} {NAME}-node1 hostname",
                      check=False)
    assert (reached.returncode, reached.stdout.strip()) == (0, f"{NAME}-node1"), reached.stderr
    rerun = fsdpctl(home, "deploy", "--cluster", NAME, timeout=900)
    for rank in (0, 1):  # nothing is installed twice
        assert f"node {rank}: already installed" in rerun.stdout, rerun.stdout


def _checkpoints(ctx, directory: str) -> list[int]:
    listing = remote.run(ctx.state, 0, f"ls {directory} 2>/dev/null || true", timeout=NODE_TIMEOUT_S)
    return sorted(int(n.removeprefix("step_")) for n in listing.stdout.split()
                  if n.startswith("step_") and not n.endswith(".tmp"))


def test_a_link_cut_mid_training_times_out_names_the_node_and_resumes_from_the_checkpoint(
        home, cluster, fault, monkeypatch):
    monkeypatch.setenv("FSDPCTL_HOME", str(home))
    state = cluster_state(NAME)
    ctx = replace(check_context(state, state.read(), state.spec(), "link-cut", steps=60, out=print),
                  interfaces={0: "eth0", 1: "eth0"})
    checkpoints, metrics = f"{ctx.work_dir}/checkpoints", f"{ctx.work_dir}/metrics.jsonl"
    args = [*trainer_args(ctx, steps=60, checkpoint_dir=checkpoints, interval=2, metrics=metrics,
                          resume="auto"), "--set", f"distributed.timeout_s={COLLECTIVE_TIMEOUT_S}"]
    job = ctx.job("link-cut", args)
    deadline = time.monotonic() + 300
    while not _checkpoints(ctx, checkpoints):
        assert all(code is None for code in job.poll().values()), job.failure(job.wait(10))
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.5)
    veth = next(n for n in read_state(home, NAME)["local"]["nodes"] if n["rank"] == 1)["veth"]
    subprocess.run(["ip", "link", "set", veth, "down"], check=True)
    fault.inject("node 1's link cut in the middle of training")
    try:
        failure = job.failure(job.wait(600))
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True)
    assert failure, "the job went on without node 1"
    assert failure.startswith(f"node 1 ({NAME}-node1, "), failure
    # node 0's collective gave up after the configured bound, not after the 15-minute default
    node0 = (ctx.run_dir / "link-cut-node0.log").read_text()
    assert f"{COLLECTIVE_TIMEOUT_S * 1000}ms" in node0, node0[-3000:]
    saved = _checkpoints(ctx, checkpoints)
    # with the link back, the same job resumes from the newest checkpoint and finishes
    deadline = time.monotonic() + 60
    while remote.run(state, 1, "true", timeout=NODE_TIMEOUT_S, check=False).returncode:
        assert time.monotonic() < deadline, "node 1 does not answer after its link came back"
    again = ctx.job("link-cut-resumed", args)
    assert again.failure(again.wait(600)) is None
    resumed = (ctx.run_dir / "link-cut-resumed-node0.log").read_text()
    assert f"resumed from {checkpoints}/step_{saved[-1]:08d} (step {saved[-1]})" in resumed, resumed[-3000:]
    steps = [record.step for record in read_remote_metrics(state, 0, metrics).steps]
    fault.lost(0 if steps[-1] == 60 else 1)
    assert steps[-1] == 60


def test_down_killed_at_a_random_point_then_rerun_leaves_nothing(home, cluster, fault):
    local = read_state(home, NAME)["local"]
    delay, injected = kill_at_random_point(home, ["down", "--yes", "--cluster", NAME], 0.2, 3.0)
    if injected:
        fault.inject(f"SIGKILL of down after {delay} s (seed {SEED})")
    if (home / "clusters" / NAME / "state.json").exists():
        fsdpctl(home, "down", "--yes", "--cluster", NAME, timeout=300)
    assert host_leftovers(home, local) == []
