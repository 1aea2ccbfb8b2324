"""Hardware-shaped local nodes: the local target's nodes given a Deep Learning AMI p4d/p5 shape by a
node layer built here (dlami.py). Needs what the local-target tests need (root, systemd-nspawn)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsdpctl import remote
from fsdpctl.state import ClusterState, cluster_state
from tests.local.conftest import (
    as_root,
    fsdpctl,
    prerequisites,  # noqa: F401 (a fixture the tests here use)
)


@contextlib.contextmanager
def shaped_cluster(home: Path, name: str, spec: Path, layer: Path,
                   bake: str) -> Iterator[tuple[Path, ClusterState]]:
    """`fsdpctl up` of the spec with every node given the layer, then `bake` run as root on every node (the
    image as it boots); (FSDPCTL_HOME, the cluster's state) with FSDPCTL_HOME set; taken down whatever
    happens."""
    try:
        fsdpctl(home, "up", str(spec), "--target", "local", env={"FSDPCTL_LOCAL_NODE_LAYER": str(layer)})
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FSDPCTL_HOME", str(home))
            state = cluster_state(name)
            remote.run_all(state, as_root(bake), timeout=120)
            yield home, state
    finally:
        fsdpctl(home, "down", "--yes", "--cluster", name, check=False)


def cached_facts(run_dir: Path, host: str) -> dict:
    """The facts a configure run (its run directory) left for `host`: ansible-runner keeps Ansible's jsonfile
    fact cache in the run's artifacts (one file per host, named with the cache's prefix, e.g. s1_HOST, the
    facts as a JSON payload)."""
    (cache,) = (run_dir / "artifacts/ansible/fact_cache").glob(f"*{host}")
    stored = json.loads(cache.read_text())
    return json.loads(stored["__payload__"]) if "__payload__" in stored else stored
