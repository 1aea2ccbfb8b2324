"""One error path: every fsdpctl command, run against a cluster in each state a user can leave one in
(none at all, up, configured, deployed, down, a garbled state file), ends in a one-line message on
stderr naming the command, never in a traceback.

The states are state files as the commands write them, fabricated here: nothing boots. The nodes
they list do not answer (an `ssh` on PATH refuses every connection, as an unreachable host does),
the machine is not root (so the local target refuses to make or remove nodes), and the AWS profile
named in the environment does not exist.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from fsdpctl import state as state_mod
from fsdpctl.cli import build_parser, main
from tests.infra.conftest import REPO, demo_data

NAME = "errpath"
STATES = ("none", "up", "configured", "deployed", "down", "garbled")


def _commands(spec: Path) -> dict[str, list[str]]:
    """Each command with the arguments a user would give it (the cluster by --cluster where it takes one)."""
    cluster = ["--cluster", NAME]
    return {
        "plan": ["plan", str(spec)],
        "preflight": ["preflight", str(spec)],
        "up": ["up", str(spec), "--target", "local"],
        "configure": ["configure", *cluster],
        "inventory": ["inventory", *cluster],
        "ssh": ["ssh", "0", *cluster, "--", "true"],
        "deploy": ["deploy", *cluster],
        "smoke": ["smoke", *cluster],
        "scale-test": ["scale-test", *cluster],
        "monitor": ["monitor", "--once", *cluster],
        "status": ["status", *cluster],
        "list": ["list"],
        "down": ["down", "--yes", *cluster],
        "exclude": ["exclude", "0", "--reason", "ECC errors", *cluster],
        "replace": ["replace", "0", "--yes", *cluster],
        "heal": ["heal", "--yes", *cluster],
        "extend": ["extend", "--hours", "1", *cluster],
        "train": ["train", "tiny", *cluster],
        "jobs": ["jobs", *cluster],
        "logs": ["logs", "1", *cluster],
        "cancel": ["cancel", "1", *cluster],
        "demo": ["demo", str(spec)],
        "completion": ["completion", "bash"],
    }


def test_the_matrix_covers_every_command(tmp_path):
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(_commands(tmp_path / "spec.yaml")) == set(subparsers.choices)


def fabricate(tmp_path: Path, kind: str) -> Path:
    """The cluster NAME's state as the commands leave it after `kind`; returns its spec file."""
    spec = tmp_path / f"{NAME}.yaml"
    spec.write_text(yaml.safe_dump(demo_data(name=NAME, node_count=2)))
    if kind == "none":
        return spec
    state = state_mod.create(spec, state_mod.load_spec(spec), "local", node_count=2)
    if kind == "down":  # `down` removes the state dir and keeps the reports
        state.new_run_dir("smoke")
        state.remove()
        return spec
    keys = state.keys_dir
    keys.mkdir(parents=True)
    (keys / "id_ed25519").write_text("not a key\n")
    state.update(nodes=[{"rank": r, "name": f"{NAME}-node{r}", "address": f"198.18.9.{2 + r}"}
                        for r in (0, 1)],
                 ssh={"user": "root", "key_file": str(keys / "id_ed25519"),
                      "known_hosts": str(state.known_hosts)},
                 shared_dir="/shared")
    if kind in ("configured", "deployed", "garbled"):
        state.update(last_configure={"time": "2026-12-01T00:00:00+00:00", "ok": True, "status": "successful",
                                     "run_dir": str(state.new_run_dir("configure"))})
    if kind in ("deployed", "garbled"):
        state.update(deploy={"bundle": "b", "venv": "/root/.fsdp-cluster/venv", "wheelhouse_dir": "/w",
                             "trainer_dir": "/t", "ranks": [0, 1], "torch": "2.13.0", "includes_torch": True,
                             "python": "3.11", "deployed_at": time.time()})
    if kind == "garbled":
        state.state_path.write_text(state.state_path.read_text()[:60])
    return spec


@pytest.fixture
def world(tmp_path, monkeypatch):
    """FSDPCTL_HOME, an ssh that reaches nothing, no root, no AWS profile."""
    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    ssh = fake_bin / "ssh"
    ssh.write_text('#!/bin/sh\necho "ssh: connect to host 198.18.9.2 port 22: Connection refused" >&2\n'
                   "exit 255\n")
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("ANSIBLE_LOCAL_TEMP", str(tmp_path / "ansible-tmp"))
    monkeypatch.chdir(REPO)
    return tmp_path


@pytest.mark.parametrize("kind", STATES)
@pytest.mark.parametrize("command", sorted(_commands(Path("spec.yaml"))))
def test_every_command_in_every_state_ends_in_a_message_not_a_traceback(world, kind, command, capsys):
    argv = _commands(fabricate(world, kind))[command]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: usage errors
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith(f"fsdpctl {command}: ")]
    if code:
        assert lines, err
        assert all(len(line) < 2000 for line in lines)
    if "--cluster" in argv and kind in ("none", "down"):  # it names the cluster and where to look
        assert code == 2 and f"no cluster named {NAME!r}" in lines[0] and "`fsdpctl list`" in lines[0]
    if "--cluster" in argv and kind == "garbled":  # it names the file and the repair
        assert code == 2 and "state.json is not valid JSON" in lines[0]
        assert f"fsdpctl down --cluster {NAME} --force" in lines[0]
