"""`up` that fails half-way, is terminated, or is SIGKILLed: nothing may be left behind (after
`fsdpctl down` in the SIGKILL case, which is all a user can do then)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdpctl.state import cluster_state
from fsdpctl.targets.local.nodes import make_plan
from infra.spec import load_spec
from tests.local.conftest import REPO, fsdpctl, host_leftovers, spec_file

pytestmark = pytest.mark.root


def start_up(home: Path, spec: Path) -> subprocess.Popen:
    argv = [str(Path(sys.executable).parent / "fsdpctl"), "up", str(spec), "--target", "local"]
    return subprocess.Popen(argv, cwd=REPO, env={**os.environ, "FSDPCTL_HOME": str(home)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_until_nodes_started(home: Path, name: str, proc: subprocess.Popen) -> dict:
    """Wait until every node's nspawn has been started; return the recorded `local` resources."""
    state_file = home / "clusters" / name / "state.json"
    deadline = time.monotonic() + 600  # the first use may build the rootfs image
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"up ended early: {proc.communicate()}"
        local = json.loads(state_file.read_text()).get("local") if state_file.exists() else None
        if local and all(Path(n["dir"], "nspawn.pid").exists() for n in local["nodes"]):
            return local
        time.sleep(0.05)
    raise AssertionError("the nodes were never started")


def test_down_cleans_up_after_a_sigkilled_up(prerequisites, tmp_path):
    home, name = tmp_path / "home", "lnt-kill"
    spec = spec_file(tmp_path, name)
    proc = start_up(home, spec)
    local = wait_until_nodes_started(home, name, proc)
    # a second `up` of the same cluster meanwhile is refused, and leaves the first one alone
    second = fsdpctl(home, "up", str(spec), "--target", "local", check=False)
    assert second.returncode == 2 and "is busy: fsdpctl up (pid" in second.stderr
    assert proc.poll() is None
    proc.kill()
    proc.communicate()
    assert host_leftovers(home, local), "the killed up should have left running nodes for down to find"
    down = fsdpctl(home, "down", "--yes")
    assert "is down" in down.stdout
    assert host_leftovers(home, local) == []


def test_sigterm_during_up_tears_down_what_it_made(prerequisites, tmp_path):
    home, name = tmp_path / "home", "lnt-term"
    proc = start_up(home, spec_file(tmp_path, name))
    local = wait_until_nodes_started(home, name, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "removing what it created" in out and "interrupted" in err
    assert host_leftovers(home, local) == []


def test_failure_half_way_through_up_removes_everything_and_says_so(prerequisites, tmp_path, monkeypatch):
    # A systemd-nspawn that refuses to start the second node, first on PATH.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    wrapper = fake_bin / "systemd-nspawn"
    wrapper.write_text('#!/bin/sh\n'
                       'case "$*" in *-node1/merged*) echo "simulated: cannot start" >&2; exit 1;; esac\n'
                       'exec /usr/bin/systemd-nspawn "$@"\n')
    wrapper.chmod(0o755)
    home, name = tmp_path / "home", "lnt-fail"
    result = fsdpctl(home, "up", str(spec_file(tmp_path, name)), "--target", "local", check=False,
                     env={"PATH": f"{fake_bin}:{os.environ['PATH']}"})
    assert result.returncode == 1, result.stdout + result.stderr  # it ran and failed
    assert "lnt-fail-node1: systemd-nspawn exited 1" in result.stderr
    assert "simulated: cannot start" in result.stderr
    assert "Everything `up` had created was removed" in result.stderr
    assert not (home / "clusters" / name).exists()
    # The state is gone with everything else, so derive the link names `up` used from its plan.
    monkeypatch.setenv("FSDPCTL_HOME", str(home))
    plan = make_plan(cluster_state(name), load_spec(tmp_path / f"{name}.yaml"), 2, Path("/unused"))
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    names = [plan.bridge, *(node.veth for node in plan.nodes)]
    assert not [n for n in names if f" {n}:" in links or f" {n}@" in links]
    assert not any(str(home) in line for line in Path("/proc/mounts").read_text().splitlines())
