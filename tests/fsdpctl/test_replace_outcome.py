"""How `fsdpctl replace` leaves the node in Slurm, and what `fsdpctl heal` then does with it: back in
service when the new node was configured; drained with a reason of its own when the new instance runs
but failed its configure (heal leaves it to the operator, instead of replacing it on every pass);
untouched when no new instance came up (heal's next pass tries again). The node tests of a replace
are in tests/faults/test_node_faults.py and tests/slurm/test_slurm_nodes.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fsdpctl import configure, remote, slurm_nodes, targets
from fsdpctl.cli import main
from fsdpctl.configure import ConfigureResult
from fsdpctl.errors import CommandError
from fsdpctl.slurm_nodes import NodeState
from fsdpctl.state import HostRecap
from tests.fsdpctl.test_cli import local_cluster


class FakeTarget:
    """A target whose replacement of a node comes up (or fails to, with `launch_error`)."""

    def __init__(self) -> None:
        self.launch_error: CommandError | None = None
        self.replaced: list[int] = []

    def node_destruction(self, state, rank: int) -> str:
        return f"node {rank} is stopped and its files removed"

    def replace_node(self, state, spec, rank: int, *, out) -> None:
        if self.launch_error is not None:
            raise self.launch_error
        self.replaced.append(rank)


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A configured three-node cluster with Slurm (faked: the node changes asked of it are recorded),
    whose configure of a new node succeeds unless `configure_status` says otherwise."""
    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    state = local_cluster(tmp_path, name="rpo", nodes=3)
    state.update(last_configure={"time": "2026-12-01T00:00:00+00:00", "ok": True, "status": "successful",
                                 "run_dir": str(state.new_run_dir("configure"))})
    target = FakeTarget()
    slurm: list[tuple[str, str, str | None]] = []
    configure_status = {"status": "successful"}

    def run_configure(state, *, limit, tags=None):
        status = configure_status["status"]
        recap = HostRecap(ok=3, failed=0 if status == "successful" else 1)
        return ConfigureResult(status, 0 if status == "successful" else 2, Path("/tmp/run-7"),
                               {name: recap for name in limit.split(",")})

    monkeypatch.setattr(targets, "get", lambda name: target)
    monkeypatch.setattr("fsdpctl.lifecycle.write_inventory", lambda state: None)  # no SSH settings here
    monkeypatch.setattr(configure, "run_configure", run_configure)
    monkeypatch.setattr(remote, "run_all", lambda cluster, command, *, ranks, timeout, check: {
        r: subprocess.CompletedProcess([], 0, "", "") for r in ranks})
    monkeypatch.setattr(slurm_nodes, "slurm_configured", lambda record: True)
    monkeypatch.setattr(slurm_nodes, "run_slurm", lambda record, command, check=True: (
        subprocess.CompletedProcess([], 0, "", "")))
    monkeypatch.setattr(slurm_nodes, "drain",
                        lambda record, name, reason: slurm.append(("drain", name, reason)))
    monkeypatch.setattr(slurm_nodes, "resume", lambda record, name: slurm.append(("resume", name, None)))
    return state, target, slurm, configure_status


def test_a_configured_replacement_goes_back_into_service(cluster, capsys):
    _, target, slurm, _ = cluster
    assert main(["replace", "1", "--cluster", "rpo", "--yes"]) == 0
    assert target.replaced == [1] and slurm == [("resume", "rpo-node1", None)]
    assert "rpo-node1 replaced and configured in " in capsys.readouterr().out


def test_a_replacement_that_failed_configuration_is_drained_with_a_reason_of_its_own(cluster, capsys):
    _, target, slurm, configure_status = cluster
    configure_status["status"] = "failed"
    assert main(["replace", "1", "--cluster", "rpo", "--yes"]) == 1
    assert target.replaced == [1]
    assert slurm == [("drain", "rpo-node1", "fsdpctl replace failed: the new rpo-node1 failed configuration "
                      "(failed, logs in /tmp/run-7)")]
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("fsdpctl replace: the new rpo-node1 failed configuration (failed, logs in "
                          "/tmp/run-7)")
    assert ("rpo-node1 stays drained in Slurm and bills as a running instance until then; `fsdpctl heal` "
            "leaves it to you.") in err
    assert "sudo scontrol update nodename=rpo-node1 state=resume" in err


def test_a_canceled_configure_of_the_replacement_drains_it_and_exits_as_interrupted(cluster, capsys):
    """Ctrl-C or SIGTERM in its configure (ansible-runner's run ends canceled): exit 130, which also
    ends `heal --watch` instead of counting as a failed pass."""
    _, _, slurm, configure_status = cluster
    configure_status["status"] = "canceled"
    assert main(["replace", "1", "--cluster", "rpo", "--yes"]) == 130
    assert slurm == [("drain", "rpo-node1", "fsdpctl replace failed: the configure of the new rpo-node1 was "
                      "canceled (logs in /tmp/run-7)")]
    assert "rpo-node1 stays drained in Slurm" in capsys.readouterr().err


def test_a_replacement_that_never_came_up_keeps_its_drain_reason_for_heal_to_try_again(cluster, capsys):
    _, target, slurm, _ = cluster
    target.launch_error = CommandError("pulumi up failed: InsufficientInstanceCapacity")
    assert main(["replace", "1", "--cluster", "rpo", "--yes"]) == 1
    assert slurm == []
    assert "InsufficientInstanceCapacity" in capsys.readouterr().err


def test_heal_names_a_node_whose_replacement_failed_and_leaves_it(cluster, monkeypatch, capsys):
    _, target, _, _ = cluster
    failed = "fsdpctl replace failed: the new rpo-node1 failed configuration (failed, logs in /tmp/run-7)"
    monkeypatch.setattr(slurm_nodes, "node_states", lambda record: {
        "rpo-node0": NodeState("rpo-node0", "idle", None),
        "rpo-node1": NodeState("rpo-node1", "drained", failed),
        "rpo-node2": NodeState("rpo-node2", "idle", None)})
    monkeypatch.setattr(slurm_nodes, "controller_name", lambda record: "rpo-node0")
    assert main(["heal", "--cluster", "rpo", "--yes"]) == 0
    assert target.replaced == []
    out = capsys.readouterr().out
    assert (f"rpo-node1: {failed}; left to you (another instance would fail the same way): once fixed, "
            "`fsdpctl ssh 0 -- sudo scontrol update nodename=rpo-node1 state=resume`, or `fsdpctl replace "
            "1` again") in out
    assert "no node drained by a spot notice" not in out
