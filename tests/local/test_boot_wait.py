"""How `fsdpctl up` on the local target decides a node has booted (fsdpctl/targets/local/nodes.py
`_wait_booted`), with a stand-in `ssh` first on PATH and the node's port 22 taken as answering: sshd
listens before systemd lets anyone but root log in (pam_nologin while /run/nologin exists), so the login
user's first sessions end before their command runs, and ssh exits 255 without a word."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from fsdpctl.errors import CommandError
from fsdpctl.state import LocalNode, SshSettings
from fsdpctl.targets.local import nodes

# The stand-in: exits 255 silently (as ssh does when pam_nologin ends the session) the first
# $REFUSALS times, then prints what the boot script prints on a node that booted.
STANDIN_SSH = """#!/bin/sh
count=$(cat "$CALLS" 2>/dev/null || echo 0)
echo $((count + 1)) > "$CALLS"
[ "$count" -lt "$REFUSALS" ] && exit 255
printf 'running\\n'
"""


@pytest.fixture
def booting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """(node, ssh settings, a live stand-in for its nspawn process, the file counting ssh's calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(STANDIN_SSH)
    (bin_dir / "ssh").chmod(0o755)
    calls = tmp_path / "calls"
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("CALLS", str(calls))

    class Answering:
        def close(self) -> None:
            pass

    monkeypatch.setattr(nodes.socket, "create_connection", lambda *_args, **_kwargs: Answering())
    node = LocalNode(rank=1, name="boot-node1", address="198.18.9.3", machine="fsdp-test-1", veth="vb1",
                     dir=str(tmp_path), machine_id="0" * 32)
    ssh = SshSettings(user="ubuntu", key_file=str(tmp_path / "key"), known_hosts=str(tmp_path / "known"))
    proc = subprocess.Popen(["sleep", "60"])
    yield node, ssh, proc, calls
    proc.kill()
    proc.wait()


def test_sessions_refused_while_the_node_boots_are_tried_again(booting, monkeypatch):
    node, ssh, proc, calls = booting
    monkeypatch.setenv("REFUSALS", "2")
    said: list[str] = []
    nodes._wait_booted(node, ssh, proc, time.monotonic() + 30, said.append)
    assert calls.read_text().strip() == "3" and said == []


def test_sessions_refused_until_the_deadline_name_the_user_and_the_node(booting, monkeypatch):
    node, ssh, proc, _ = booting
    monkeypatch.setenv("REFUSALS", "1000")
    with pytest.raises(CommandError, match=r"boot-node1: ssh as ubuntu to 198\.18\.9\.3 failed until .* had "
                                           r"passed: the connection was closed before the command ran"):
        nodes._wait_booted(node, ssh, proc, time.monotonic() + 1, lambda _line: None)
