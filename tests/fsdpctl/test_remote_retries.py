"""SSH to a node tries again when the connection ended before the remote command started (sshd too
busy to send its banner, or shedding a burst of connections), and only then: a command that ran is
never run twice. A stand-in `ssh` on PATH fails a given number of times with a given message, then runs
the command with sh."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from fsdpctl import remote
from fsdpctl import state as state_mod
from fsdpctl.cli import main
from tests.infra.conftest import demo_data

NAME = "retry"
BANNER = "Connection timed out during banner exchange"
SHED = "kex_exchange_identification: read: Connection reset by peer"
REFUSED = "ssh: connect to host 198.18.9.2 port 22: Connection refused"
AFTER_SESSION = "Connection to 198.18.9.2 closed by remote host."


@pytest.fixture
def cluster(tmp_path, monkeypatch) -> state_mod.ClusterState:
    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(remote, "SSH_RETRY_DELAY_S", 0.0)
    spec = tmp_path / f"{NAME}.yaml"
    spec.write_text(yaml.safe_dump(demo_data(name=NAME, node_count=1)))
    state = state_mod.create(spec, state_mod.load_spec(spec), "local", node_count=1)
    state.keys_dir.mkdir(parents=True)
    (state.keys_dir / "id_ed25519").write_text("not a key\n")
    state.update(nodes=[{"rank": 0, "name": f"{NAME}-node0", "address": "198.18.9.2"}],
                 ssh={"user": "root", "key_file": str(state.keys_dir / "id_ed25519"),
                      "known_hosts": str(state.known_hosts)})
    return state


@pytest.fixture
def ssh(tmp_path, monkeypatch):
    """ssh(failures, message): the stand-in fails `failures` times with `message` (exit 255), then runs
    its last argument; returns the file that counts its calls."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "ssh-calls"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def make(failures: int, message: str) -> Path:
        script = bin_dir / "ssh"
        script.write_text(f"""#!/bin/sh
echo x >> {calls}
if [ "$(wc -l < {calls})" -le {failures} ]; then echo "{message}" >&2; exit 255; fi
for last; do :; done
exec sh -c "$last"
""")
        script.chmod(0o755)
        return calls
    return make


def count(calls: Path) -> int:
    return len(calls.read_text().splitlines())


@pytest.mark.parametrize("message", [BANNER, SHED])
def test_a_session_that_never_started_is_tried_again(cluster, ssh, message):
    calls = ssh(2, message)
    result = remote.run(cluster, 0, "echo ran")
    assert (result.returncode, result.stdout, count(calls)) == (0, "ran\n", 3)


@pytest.mark.parametrize("message", [REFUSED, AFTER_SESSION])
def test_a_node_down_or_a_session_that_ended_is_not_tried_again(cluster, ssh, message):
    calls = ssh(1, message)
    result = remote.run(cluster, 0, "echo ran", check=False)
    assert (result.returncode, count(calls)) == (255, 1)
    assert message in result.stderr


def test_it_gives_up_after_three_tries_with_sshs_own_words(cluster, ssh):
    calls = ssh(5, BANNER)
    with pytest.raises(remote.RemoteCommandFailed, match=BANNER):
        remote.run(cluster, 0, "echo ran")
    assert count(calls) == remote.SSH_ATTEMPTS == 3


def test_fsdpctl_ssh_tries_again_and_says_so(cluster, ssh, capfd):
    calls = ssh(1, BANNER)
    assert main(["ssh", "0", "--cluster", NAME, "--", "echo ran; echo warned >&2"]) == 0
    out, err = capfd.readouterr()
    assert out == "ran\n" and count(calls) == 2
    assert err.splitlines() == [BANNER, f"fsdpctl ssh: {NAME}-node0 (198.18.9.2) did not start the session; "
                                        "trying again (2 of 3)", "warned"]


def test_fsdpctl_ssh_passes_on_the_commands_own_exit_status_once(cluster, ssh, capfd):
    calls = ssh(0, BANNER)
    assert main(["ssh", "0", "--cluster", NAME, "--", "exit 3"]) == 3
    assert count(calls) == 1
