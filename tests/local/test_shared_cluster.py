"""The scheduling of the demo cluster's tests (tests/local/demo_cluster.py): under `--dist loadfile` the
files that share it are one unit of work, every other file its own."""

from __future__ import annotations

from tests.local.conftest import REPO
from tests.local.demo_cluster import SHARING_MODULES, _SharedClusterFileScheduling


def _unit(nodeid: str) -> str:
    # _split_scope reads nothing of the scheduler's state
    return _SharedClusterFileScheduling._split_scope(object.__new__(_SharedClusterFileScheduling), nodeid)


def test_the_files_sharing_the_demo_cluster_are_one_unit_and_the_others_one_each():
    assert {_unit(f"{module}::test_x") for module in SHARING_MODULES} == {"demo-cluster"}
    assert _unit("tests/slurm/test_slurm_nodes.py::test_a[rank-1]") == "tests/slurm/test_slurm_nodes.py"
    assert _unit("tests/faults/test_node_faults.py::test_b") == "tests/faults/test_node_faults.py"


def test_every_sharing_module_exists():
    assert [m for m in SHARING_MODULES if not (REPO / m).is_file()] == []
