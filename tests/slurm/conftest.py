"""Fixtures of the Slurm tests."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsdpctl import remote
from fsdpctl.state import ClusterState
from tests.ansible.conftest import detect_hardware, node_variables, sysfs_tree
from tests.local.conftest import fsdpctl, require_local_prerequisites, spec_file

WAIT_TIMEOUT_S = 400
"""How long a node test waits for a job or a node by default."""


def wait_for(predicate, what: str, timeout: float = WAIT_TIMEOUT_S, interval: float = 1):
    """predicate()'s first true value, asked every `interval` seconds; an AssertionError naming
    `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what} did not happen within {timeout} s")


# What the tests ask again and again while they wait (a node's Slurm state, a job's state) they ask from
# this process, through the functions the CLI calls: starting `fsdpctl` for every ask costs about half a
# CPU-second of imports, and a wait asks every second on a machine that the node tests keep busy. What a
# test asserts once they still read from the CLI, as a user would.

def cluster_state(home: Path, name: str) -> ClusterState:
    return ClusterState(name=name, root=home / "clusters" / name)


def on_node(home: Path, name: str, rank: int, command: str) -> str:
    """The output of `command` on node `rank`, as `fsdpctl ssh RANK -- COMMAND` runs it."""
    return remote.run(cluster_state(home, name), rank, command, timeout=120).stdout


def slurm_node_states(home: Path, name: str) -> dict[str, tuple[str, str]]:
    """Each node's Slurm state and reason, as sinfo on the controller gives them."""
    out = on_node(home, name, 0, "sinfo --noheader --Node --format '%N|%T|%E'")
    return {n: (s, r) for n, s, r in (line.split("|", 2) for line in out.splitlines() if "|" in line)}


@contextlib.contextmanager
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory, name: str, subnet: str, *,
                  spec: dict | None = None, tags: str = "slurm", configure_args: tuple[str, ...] = (),
                  deploy: bool = False, up_env: dict[str, str] | None = None,
                  ) -> Iterator[tuple[Path, dict[str, str]]]:
    """Two local p4d-shaped nodes, `up`, `configure --tags slurm` (or `tags`; and `deploy`): (FSDPCTL_HOME,
    the environment for fsdpctl); torn down whatever happens. `spec`'s `local` adds to the local
    settings; `up_env` to the environment of `up`."""
    require_local_prerequisites()
    home = tmp_path_factory.mktemp("fsdpctl-home")
    spec = spec or {}
    local = {"subnet_cidr": subnet, "nproc_per_node": 1, **spec.get("local", {})}
    spec_path = spec_file(home.parent, name, **{**spec, "local": local})
    env = {k: v for k, v in os.environ.items() if k == "FSDPCTL_CACHE"}
    try:
        fsdpctl(home, "up", str(spec_path), "--target", "local", "--nodes", "2",
                env={**env, **(up_env or {})}, timeout=900)
        fsdpctl(home, "configure", "--tags", tags, *configure_args, env=env, timeout=600)
        if deploy:
            fsdpctl(home, "deploy", env=env, timeout=900)
        yield home, env
    finally:
        fsdpctl(home, "down", "--yes", "--cluster", name, env=env, timeout=300, check=False)


@pytest.fixture
def p4d_node(tmp_path):
    hardware = detect_hardware(sysfs_tree(tmp_path / "sysfs", "p4d.24xlarge"))
    line = ("NodeName={host} CPUs=96 Boards=1 SocketsPerBoard=2 CoresPerSocket=24 ThreadsPerCore=2 "
            "RealMemory=1160000\n{gpus}")

    variables = node_variables(tmp_path / "state", "p4d.24xlarge", hardware)
    hosts = variables["groups"]["nodes"]
    results = [{"item": h, "stdout": line.format(host=h, gpus=8 - 8 * i),
                "stdout_lines": line.format(host=h, gpus=8 - 8 * i).splitlines()}
               for i, h in enumerate(hosts)]

    def make(**overrides):
        return {**variables, "slurm_hardware": {"results": results}, "slurm_use_cgroup": True, **overrides}

    return make
