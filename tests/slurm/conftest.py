"""Fixtures of the Slurm tests."""

from __future__ import annotations

import pytest

from tests.ansible.conftest import detect_hardware, node_variables, sysfs_tree


@pytest.fixture
def p4d_node(tmp_path):
    hardware = detect_hardware(sysfs_tree(tmp_path / "sysfs", "p4d.24xlarge"))
    line = ("NodeName={host} CPUs=96 Boards=1 SocketsPerBoard=2 CoresPerSocket=24 ThreadsPerCore=2 "
            "RealMemory=1160000\n{gpus}")

    def make(**overrides):
        variables = node_variables(tmp_path / "state", "p4d.24xlarge", hardware)
        hosts = variables["groups"]["nodes"]
        results = [{"item": h, "stdout": line.format(host=h, gpus=8 - 8 * i),
                    "stdout_lines": line.format(host=h, gpus=8 - 8 * i).splitlines()}
                   for i, h in enumerate(hosts)]
        return {**variables, "slurm_hardware": {"results": results}, "slurm_use_cgroup": True, **overrides}

    return make
