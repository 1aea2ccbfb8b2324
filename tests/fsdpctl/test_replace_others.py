"""After `fsdpctl replace`, what the other nodes knew of the replaced one: its host key is forgotten on
each (they would refuse the new one), and where the new instance has another address (an AWS
replacement), the roles that list every node's address run on the others. The node test of a replace
(the new node configured and deployed to, node-to-node SSH to it still working) is in
tests/faults/test_node_faults.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fsdpctl import configure, lifecycle, remote
from fsdpctl.configure import ConfigureResult
from fsdpctl.errors import CommandError
from fsdpctl.state import HostRecap
from tests.fsdpctl.test_cli import local_cluster


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A three-node cluster whose rank 1 was just replaced (its old record returned), the commands run
    on the other nodes (rank -> command), and the configure runs asked for (tags, limit)."""
    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    state = local_cluster(tmp_path, name="rpl", nodes=3)
    old = next(n for n in state.read().nodes if n.rank == 1)
    ran: dict[int, str] = {}
    configured: list[tuple[str, str]] = []
    down: set[int] = set()

    def run_all(cluster, command, *, ranks, timeout, check):
        assert not check  # a node that does not answer is reported, not raised
        ran.update(dict.fromkeys(ranks, command))
        return {r: subprocess.CompletedProcess([], 255 if r in down else 0, "", "") for r in ranks}

    def run_configure(state, *, tags, limit):
        configured.append((",".join(tags), limit))
        recap = HostRecap(ok=3, changed=1)
        return ConfigureResult("successful", 0, Path("run-dir"), {name: recap for name in limit.split(",")})

    monkeypatch.setattr(remote, "run_all", run_all)
    monkeypatch.setattr(configure, "run_configure", run_configure)
    return state, old, ran, configured, down


def _readdress(state, rank: int, address: str, instance_id: str | None = None) -> None:
    """Rank `rank` as a new instance left it: at `address`, with `instance_id`."""
    state.update(nodes=[{**n.model_dump(), **({"address": address, "instance_id": instance_id}
                                               if n.rank == rank else {})}
                        for n in state.read().nodes])


def test_same_address_the_others_forget_the_old_host_key_and_nothing_is_configured(cluster):
    state, old, ran, configured, _ = cluster
    lifecycle._introduce_to_the_others(state, old, configured=True)
    assert sorted(ran) == [0, 2]
    assert ran[0].startswith("for host in rpl-node1 198.18.9.3; do ssh-keygen -R $host")
    assert configured == []


def test_a_new_address_reaches_the_others_hosts_slurm_and_prometheus(cluster, capsys):
    state, old, ran, configured, _ = cluster
    _readdress(state, 1, "10.0.7.19", "i-0b1")
    lifecycle._introduce_to_the_others(state, old, configured=True)
    assert "for host in rpl-node1 198.18.9.3 10.0.7.19;" in ran[2]
    assert configured == [("common,slurm,monitoring", "rpl-node0,rpl-node2")]
    said = capsys.readouterr().out
    assert "rpl-node1 is a new instance (address 198.18.9.3 -> 10.0.7.19, instance - -> i-0b1)" in said


def test_a_new_instance_id_at_the_same_address_reaches_power_saving_on_the_others(cluster):
    state, old, _, configured, _ = cluster
    _readdress(state, 1, old.address, "i-0b1")
    lifecycle._introduce_to_the_others(state, old, configured=True)
    assert configured == [("common,slurm,monitoring", "rpl-node0,rpl-node2")]


def test_a_node_that_does_not_answer_is_left_out_and_named(cluster, capsys):
    state, old, _, configured, down = cluster
    down.add(2)
    _readdress(state, 1, "10.0.7.19")
    lifecycle._introduce_to_the_others(state, old, configured=True)
    assert configured == [("common,slurm,monitoring", "rpl-node0")]
    assert ("rpl-node2 did not answer: it still knows rpl-node1's old host key and address until `fsdpctl "
            "configure` reaches it") in capsys.readouterr().err


def test_a_cluster_never_configured_gets_no_configure(cluster):
    state, old, ran, configured, _ = cluster
    _readdress(state, 1, "10.0.7.19")
    lifecycle._introduce_to_the_others(state, old, configured=False)
    assert sorted(ran) == [0, 2] and configured == []


def test_a_failed_configure_says_what_still_points_at_the_old_address(cluster, monkeypatch):
    state, old, _, _, _ = cluster
    _readdress(state, 1, "10.0.7.19")
    monkeypatch.setattr(configure, "run_configure", lambda state, *, tags, limit: ConfigureResult(
        "failed", 2, Path("run-dir"), {}))
    with pytest.raises(CommandError) as failed:
        lifecycle._introduce_to_the_others(state, old, configured=True)
    assert str(failed.value).startswith("the other nodes still list rpl-node1 at its old address 198.18.9.3 ")
    assert str(failed.value).endswith("then run `fsdpctl configure --tags common,slurm,monitoring`.")

