"""`up` that fails half-way, is terminated, or is SIGKILLed: nothing may be left behind (after
`fsdpctl down` in the SIGKILL case, which is all a user can do then)."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdpctl.state import ClusterRecord, cluster_state
from fsdpctl.targets.local import nodes
from fsdpctl.targets.local.nodes import make_plan
from infra.spec import load_spec
from tests.local.conftest import REPO, fsdpctl, host_leftovers, spec_file

pytestmark = pytest.mark.root

SUBNET = "198.18.5.0/24"  # this module's own subnet

ORPHAN = "fsdp0bad00br"  # a bridge name of fsdpctl's form that no cluster of these tests can have


def add_bridge(name: str, address: str, alias: str | None = None) -> None:
    subprocess.run(["ip", "link", "add", name, "type", "bridge"], check=True)
    if alias is not None:
        subprocess.run(["ip", "link", "set", "dev", name, "alias", alias], check=True)
    subprocess.run(["ip", "addr", "add", address, "dev", name], check=True)


@pytest.fixture
def cleanup_links():
    names: list[str] = []
    yield names
    for name in names:
        subprocess.run(["ip", "link", "del", name], capture_output=True)


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
    spec = spec_file(tmp_path, name, subnet=SUBNET)
    proc = start_up(home, spec)
    local = wait_until_nodes_started(home, name, proc)
    # Held where it is (SIGSTOP): on a loaded host the first `up` could otherwise finish while the second
    # one starts (a clean clone's run did), and there would be no killed `up` left to clean up after.
    proc.send_signal(signal.SIGSTOP)
    # a second `up` of the same cluster meanwhile is refused, and leaves the first one alone
    second = fsdpctl(home, "up", str(spec), "--target", "local", check=False)
    assert second.returncode == 2 and "is busy: fsdpctl up (pid" in second.stderr
    assert proc.poll() is None
    proc.kill()
    proc.communicate()
    assert host_leftovers(home, local), "the killed up should have left running nodes for down to find"
    bridge_alias = Path(f"/sys/class/net/{local['bridge']}/ifalias").read_text().strip()
    down = fsdpctl(home, "down", "--yes")
    assert "is down" in down.stdout
    assert host_leftovers(home, local) == []
    # its bridge named the state directory it belongs to, so a later `up` can tell a live one apart
    assert bridge_alias == f"fsdpctl:{(home / 'clusters' / name).resolve()}"


def test_sigterm_during_up_tears_down_what_it_made(prerequisites, tmp_path):
    home, name = tmp_path / "home", "lnt-term"
    proc = start_up(home, spec_file(tmp_path, name, subnet=SUBNET))
    local = wait_until_nodes_started(home, name, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "removing what it created" in out and "interrupted" in err
    assert host_leftovers(home, local) == []


def test_failure_half_way_through_up_removes_everything_and_says_so(prerequisites, tmp_path, monkeypatch,
                                                                     cleanup_links):
    # A systemd-nspawn that refuses to start the second node, first on PATH.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    wrapper = fake_bin / "systemd-nspawn"
    wrapper.write_text('#!/bin/sh\n'
                       'case "$*" in *-node1/merged*) echo "simulated: cannot start" >&2; exit 1;; esac\n'
                       'exec /usr/bin/systemd-nspawn "$@"\n')
    wrapper.chmod(0o755)
    home, name = tmp_path / "home", "lnt-fail"
    # and the bridge of a run killed long ago (by an fsdpctl before bridges had an alias) on the subnet
    cleanup_links.append(ORPHAN)
    add_bridge(ORPHAN, "198.18.5.250/24")
    spec = spec_file(tmp_path, name, subnet=SUBNET)
    result = fsdpctl(home, "up", str(spec), "--target", "local", check=False,
                     env={"PATH": f"{fake_bin}:{os.environ['PATH']}"})
    assert result.returncode == 1, result.stdout + result.stderr  # it ran and failed
    assert "lnt-fail-node1: systemd-nspawn exited 1" in result.stderr
    assert "simulated: cannot start" in result.stderr
    assert (f"local: removed bridge {ORPHAN} on 198.18.5.0/24, left by an older fsdpctl, for a cluster "
            "whose nodes are gone") in result.stdout
    assert "Everything `up` had created was removed" in result.stderr
    assert not (home / "clusters" / name).exists()
    # The state is gone with everything else, so derive the link names `up` used from its plan.
    monkeypatch.setenv("FSDPCTL_HOME", str(home))
    plan = make_plan(cluster_state(name), load_spec(tmp_path / f"{name}.yaml"), 2, Path("/unused"))
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    names = [plan.bridge, *(node.veth for node in plan.nodes)]
    assert not [n for n in names if f" {n}:" in links or f" {n}@" in links]
    assert not any(str(home) in line for line in Path("/proc/mounts").read_text().splitlines())


def test_only_a_bridge_nothing_uses_counts_as_left_behind(prerequisites, tmp_path, cleanup_links,
                                                          monkeypatch):
    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    live = cluster_state("lnt-live")
    live.root.mkdir(parents=True)
    plan = make_plan(live, load_spec(spec_file(tmp_path, "lnt-live", subnet=SUBNET)), 2, Path("/unused"))
    record = ClusterRecord(name="lnt-live", target="local", created_at=time.time(), local=plan)
    live.state_path.write_text(record.model_dump_json())
    gone = tmp_path / "home" / "clusters" / "lnt-gone"
    cleanup_links += [plan.bridge, "fsdp0bad01br", "fsdp0bad02br", "fsdp0bad03br", "fsdp0bad04br",
                      "fsdp0bad05v0"]
    add_bridge(plan.bridge, "198.18.5.1/24", f"fsdpctl:{live.root}")  # a cluster's, still recorded
    add_bridge("fsdp0bad01br", "198.18.5.241/24", f"fsdpctl:{gone}")  # its state directory was removed
    add_bridge("fsdp0bad02br", "198.18.5.242/24")  # an older fsdpctl's
    add_bridge("fsdp0bad03br", "198.18.2.1/24")  # another subnet
    add_bridge("fsdp0bad04br", "198.18.5.244/24")  # a node is still attached to it
    subprocess.run(["ip", "link", "add", "fsdp0bad05v0", "master", "fsdp0bad04br", "type", "veth",
                    "peer", "name", "fsdp0bad05p0"], check=True)
    assert nodes._orphan_bridges(ipaddress.ip_network("198.18.5.0/24")) == {
        "fsdp0bad01br": f"the cluster at {gone}, which no longer exists",
        "fsdp0bad02br": "an older fsdpctl, for a cluster whose nodes are gone"}
    # a new cluster on the live one's subnet is told whose it is and how to take it down
    new_spec = load_spec(spec_file(tmp_path, "lnt-new", subnet=SUBNET))
    new_plan = make_plan(cluster_state("lnt-new"), new_spec, 2, Path("/unused"))
    assert (f"(cluster lnt-live's bridge: `FSDPCTL_HOME={tmp_path / 'home'} fsdpctl down --cluster lnt-live`)"
            in " ".join(nodes._host_conflicts(new_plan)))
    # once the record no longer names its bridge (after `down`), that bridge is left over too
    live.state_path.write_text(record.model_copy(update={"local": None}).model_dump_json())
    assert plan.bridge in nodes._orphan_bridges(ipaddress.ip_network("198.18.5.0/24"))
