"""The `cluster_ssh` role on two real local nodes: after `fsdpctl configure`, each node reaches the other
over SSH by name and by address with the intra-cluster key, without a prompt (what mpirun needs), and a
second configure changes nothing."""

from __future__ import annotations

import pytest

from fsdpctl import remote
from fsdpctl.configure import run_configure
from fsdpctl.state import cluster_state
from tests.local.conftest import fsdpctl, spec_file

pytestmark = [pytest.mark.root, pytest.mark.slow]

NAME = "ncclt-ssh"
SUBNET = "198.18.4.0/24"  # this test's own subnet
NODES = [f"{NAME}-node0", f"{NAME}-node1"]
ADDRESSES = ["198.18.4.2", "198.18.4.3"]
# BatchMode: fail instead of asking for a password or a host-key confirmation
NODE_SSH = "ssh -o BatchMode=yes -o ConnectTimeout=10"


@pytest.fixture(scope="module")
def configured(prerequisites, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    spec = spec_file(tmp_path_factory.mktemp("spec"), NAME, local={"subnet_cidr": SUBNET})
    try:
        fsdpctl(home, "up", str(spec), "--target", "local")
        result = fsdpctl(home, "configure", check=False)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
        yield home
    finally:
        fsdpctl(home, "down", "--yes", "--cluster", NAME, check=False)


@pytest.fixture
def state(configured, monkeypatch):
    monkeypatch.setenv("FSDPCTL_HOME", str(configured))
    return cluster_state(NAME)


def test_nodes_reach_each_other_by_name_and_address_without_a_prompt(state):
    for rank, peer in ((0, 1), (1, 0)):
        for target in (NODES[peer], ADDRESSES[peer]):
            r = remote.run(state, rank, f"{NODE_SSH} {target} hostname", check=False, timeout=60)
            assert r.returncode == 0, (NODES[rank], target, r.stdout + r.stderr)
            assert r.stdout.strip() == NODES[peer]


def test_every_node_holds_the_same_private_key_readable_by_its_owner_only(state):
    answers = remote.run_all(state, "stat -c %a ~/.ssh/id_fsdp_cluster && sha256sum < ~/.ssh/id_fsdp_cluster")
    modes = {rank: r.stdout.split()[0] for rank, r in answers.items()}
    digests = {r.stdout.split()[1] for r in answers.values()}
    assert modes == {0: "600", 1: "600"}
    assert len(digests) == 1


def test_second_configure_changes_nothing(state):
    out: list[str] = []
    result = run_configure(state, out=out.append)
    assert result.ok, "\n".join(out[-40:])
    assert {h: s.changed for h, s in result.hosts.items()} == dict.fromkeys(NODES, 0), "\n".join(
        line for line in out if line.lstrip().startswith("changed"))
