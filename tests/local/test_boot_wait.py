"""How `fsdpctl up` on the local target decides a node has booted (fsdpctl/targets/local/nodes.py
`_wait_booted`): what the boot check run in the node as root reports, then the login user's first SSH
sessions, with a stand-in `ssh` first on PATH. sshd listens before systemd lets anyone but root log in
(pam_nologin while /run/nologin exists), so the login user's first sessions can end before their
command runs, and ssh exits 255 without a word. A real node whose login-blocking unit fails while
booting: tests/local/test_nodes.py."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from fsdpctl.errors import CommandError
from fsdpctl.state import LocalNode, SshSettings
from fsdpctl.targets.local import nodes

# The stand-in: exits 255 silently (as ssh does when pam_nologin ends the session) the first
# $REFUSALS times, then $THEN (0 unless set).
STANDIN_SSH = """#!/bin/sh
count=$(cat "$CALLS" 2>/dev/null || echo 0)
echo $((count + 1)) > "$CALLS"
[ "$count" -lt "$REFUSALS" ] && exit 255
echo 'bash: line 1: true: command not found' >&2
exit "${THEN:-0}"
"""
INIT_PID = 4242  # the node's systemd, as the host sees it (only handed on to the node-side stand-in)


@pytest.fixture
def booting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """(node, ssh settings, a live stand-in for its nspawn process, the file counting ssh's calls, the
    commands run in the node as root)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(STANDIN_SSH)
    (bin_dir / "ssh").chmod(0o755)
    calls = tmp_path / "calls"
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("CALLS", str(calls))
    in_node: list[str] = []

    def node_side(init_pid: int, script: str, *, timeout: float) -> subprocess.CompletedProcess:
        assert init_pid == INIT_PID
        in_node.append(script)
        out = ("degraded\nsystemd-user-sessions.service fsdp-x.service\nfsdp-x.service\n"
               if "is-system-running --wait" in script else
               "/run/nologin\nsystemd-user-sessions.service loaded failed failed Permit User Sessions\n")
        return subprocess.CompletedProcess([], 0, out, "")

    monkeypatch.setattr(nodes, "_in_node", node_side)
    monkeypatch.setattr(nodes, "_wait_for_init", lambda *_args: INIT_PID)
    node = LocalNode(rank=1, name="boot-node1", address="198.18.9.3", machine="fsdp-test-1", veth="vb1",
                     dir=str(tmp_path), machine_id="0" * 32)
    ssh = SshSettings(user="ubuntu", key_file=str(tmp_path / "key"), known_hosts=str(tmp_path / "known"))
    proc = subprocess.Popen(["sleep", "60"])
    yield node, ssh, proc, calls, in_node
    proc.kill()
    proc.wait()


def test_sessions_refused_while_the_node_boots_are_tried_again(booting, monkeypatch):
    node, ssh, proc, calls, _ = booting
    monkeypatch.setenv("REFUSALS", "2")
    nodes._wait_for_login(node, ssh, proc, INIT_PID, time.monotonic() + 30)
    assert calls.read_text().strip() == "3"


def test_sessions_refused_until_the_deadline_say_what_the_node_shows(booting, monkeypatch):
    node, ssh, proc, _, in_node = booting
    monkeypatch.setenv("REFUSALS", "1000")
    with pytest.raises(CommandError) as failed:
        nodes._wait_for_login(node, ssh, proc, INIT_PID, time.monotonic() + 1)
    assert str(failed.value).startswith(
        "boot-node1: ssh as ubuntu to 198.18.9.3 failed until 180 s had passed: the connection was closed "
        "before the command ran\nIn the node: /run/nologin\nsystemd-user-sessions.service loaded failed")
    assert len(in_node) == 1 and "/run/nologin" in in_node[0]


def test_a_login_whose_command_fails_is_an_error_at_once(booting, monkeypatch):
    node, ssh, proc, calls, _ = booting
    monkeypatch.setenv("REFUSALS", "0")
    monkeypatch.setenv("THEN", "127")
    with pytest.raises(CommandError, match=r"boot-node1: ssh as ubuntu to 198\.18\.9\.3 logs in, but a "
                                           r"command exits 127 there: bash: line 1: true: command not found"):
        nodes._wait_for_login(node, ssh, proc, INIT_PID, time.monotonic() + 30)
    assert calls.read_text().strip() == "1"


def test_units_started_again_and_still_failed_are_said_then_the_user_logs_in(booting, monkeypatch):
    node, ssh, proc, calls, in_node = booting
    monkeypatch.setenv("REFUSALS", "1")
    said: list[str] = []
    nodes._wait_booted(node, ssh, proc, time.monotonic() + 30, said.append)
    assert said == [
        "local: boot-node1: systemd-user-sessions.service, fsdp-x.service failed while booting and were "
        "started again",
        "local: boot-node1 booted degraded; failed units: fsdp-x.service"]
    assert "is-system-running --wait" in in_node[0] and calls.read_text().strip() == "2"
