"""The GPU/EFA/CUDA/NCCL/GDRCopy/storage roles run for real on two local nodes shaped like Deep Learning
AMI p4d nodes (tests/shaped/dlami.py, given to the local target through FSDPCTL_LOCAL_NODE_LAYER): check
mode first on the fresh image, then `fsdpctl configure` twice. The first run goes through every hardware
role's tasks (no hardware skip) and adopts what the image brings instead of downgrading it; the second
changes nothing. Checked from outside over SSH."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fsdpctl import remote
from fsdpctl.inventory import write_inventory
from fsdpctl.state import cluster_state
from tests.local.conftest import REPO, fsdpctl, spec_file
from tests.shaped import dlami

pytestmark = [pytest.mark.root, pytest.mark.slow]

NAME = "hw-shape"
SUBNET = "198.18.40.0/24"
NODES = [f"{NAME}-node0", f"{NAME}-node1"]
HARDWARE_ROLES = ("nvidia", "cuda", "efa", "nccl", "gpudirect", "storage")
# What the two configure runs apply: the base roles and the hardware ones. The slurm and monitoring
# roles run on plain local nodes (tests/slurm, tests/monitoring); this layer has no stand-ins for
# DCGM and its exporter, which the monitoring role would install on a GPU node.
CONFIGURED_ROLES = ("common", "cluster_ssh", "network", "limits", *HARDWARE_ROLES)
EXTRA_VARS = {
    "fsdp_sysfs_root": dlami.SHAPE,  # hardware_facts reads the shaped tree
    "fsdp_offline": False,  # the local apt repository is the node's package source
    "hardware_required": True,  # absent hardware fails, as on AWS
    "nccl_tests_url": dlami.NCCL_TESTS_TARBALL,
}
LINE = re.compile(
    r"^\s+(ok|changed|skipped|failed|ignored|unreachable)\s+(\S+)\s+(\w+) : (.+?)(?:  \((.*)\))?$",
    re.MULTILINE,
)
RECAP = re.compile(r"^(\S+) ok=(\d+) changed=(\d+) failed=(\d+) skipped=(\d+)", re.MULTILINE)


def results(stdout: str) -> dict[tuple[str, str, str], set[str]]:
    """(host, role, task) -> the statuses it had (a looped task has several). A skip that fired (the
    fsdp.cluster.skip module, whose reason the progress line prints) is `skipped (reason)`; a task
    whose `when` was false is plain `skipped`."""
    found: dict[tuple[str, str, str], set[str]] = {}
    for status, host, role, task, reason in LINE.findall(stdout):
        found.setdefault((host, role, task.strip()), set()).add(f"{status} ({reason})" if reason else status)
    return found


@pytest.fixture(scope="module")
def cluster(prerequisites, tmp_path_factory):
    work = tmp_path_factory.mktemp("shape")
    layer = dlami.build_layer(work / "layer", "p4d.24xlarge", work)
    home = tmp_path_factory.mktemp("home")
    spec = spec_file(tmp_path_factory.mktemp("spec"), NAME, local={"subnet_cidr": SUBNET})
    env = {"FSDPCTL_LOCAL_NODE_LAYER": str(layer)}
    try:
        fsdpctl(home, "up", str(spec), "--target", "local", env=env)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FSDPCTL_HOME", str(home))
            state = cluster_state(NAME)
            remote.run_all(state, dlami.BAKE, timeout=120)  # the image as the DLAMI boots it
            yield home, state
    finally:
        fsdpctl(home, "down", "--yes", "--cluster", NAME, check=False)


@pytest.fixture(scope="module")
def check_mode(cluster):
    """ansible-playbook --check of the hardware roles on the fresh image (nothing written yet)."""
    home, state = cluster
    inventory = write_inventory(state)
    with tempfile.TemporaryDirectory(prefix="hwcp", dir="/tmp") as control:
        env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "ANSIBLE_CONFIG": str(REPO / "ansible/ansible.cfg"),
            "ANSIBLE_HOME": str(home / "ansible-home"),
            "ANSIBLE_LOCAL_TEMP": str(home / "ansible-home/tmp"),
            "ANSIBLE_SSH_CONTROL_PATH_DIR": control,
            "ANSIBLE_NOCOLOR": "1",
        }
        extra = ["-e", json.dumps(EXTRA_VARS)]
        try:
            return subprocess.run(
                [
                    str(Path(sys.executable).parent / "ansible-playbook"),
                    "-i",
                    str(inventory),
                    "ansible/site.yml",
                    "--check",
                    "--tags",
                    ",".join(HARDWARE_ROLES),
                    *extra,
                ],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
        finally:
            remote.close_control_masters(Path(control))


@pytest.fixture(scope="module")
def first_run(cluster, check_mode):
    home, _ = cluster
    extra = [a for k, v in EXTRA_VARS.items() for a in ("-e", f"{k}={json.dumps(v)}")]
    return fsdpctl(home, "configure", "--tags", ",".join(CONFIGURED_ROLES), *extra, check=False)


@pytest.fixture(scope="module")
def second_run(cluster, first_run):
    home, _ = cluster
    extra = [a for k, v in EXTRA_VARS.items() for a in ("-e", f"{k}={json.dumps(v)}")]
    return fsdpctl(home, "configure", "--tags", ",".join(CONFIGURED_ROLES), *extra, check=False)


def test_check_mode_on_the_fresh_image_fails_nowhere(check_mode):
    out = check_mode.stdout
    assert check_mode.returncode == 0, out[-5000:] + check_mode.stderr[-2000:]
    recap = re.findall(
        r"^(\S+)\s+: ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", out, re.MULTILINE
    )
    assert {h for h, *_ in recap} == set(NODES)
    assert all(failed == "0" and unreachable == "0" for _, _, _, unreachable, failed in recap), out[-3000:]


def test_first_run_goes_through_every_hardware_role(first_run):
    out = first_run.stdout
    assert first_run.returncode == 0, out[-6000:] + first_run.stderr[-2000:]
    found = results(out)
    for host in NODES:
        # no role skipped its hardware: the role-level skips did not fire (no reason printed)
        for role, skip in [
            ("nvidia", "Skip the NVIDIA driver (no NVIDIA GPU)"),
            ("cuda", "Skip CUDA and GDRCopy (no NVIDIA GPU)"),
            ("efa", "Skip EFA (no EFA device)"),
            ("nccl", "Skip NCCL and nccl-tests (no NVIDIA GPU)"),
            ("gpudirect", "Skip GPUDirect RDMA (no GPU or no EFA)"),
            ("storage", "Skip the scratch file system (no NVMe instance storage)"),
        ]:
            assert found.get((host, role, skip)) == {"skipped"}, (host, role, skip)
        ran = {
            ("nvidia", "Check the driver version and persistence mode on every GPU"): {"ok"},
            ("nvidia", "Check Fabric Manager matches the driver"): {"ok"},
            ("nvidia", "Start NVIDIA Fabric Manager"): {"ok"},
            ("cuda", "Install CUDA toolkit 12.9.1"): {"changed"},
            ("cuda", "Check the toolkit is the pinned version"): {"ok"},
            ("cuda", "Load the gdrdrv module"): {"changed"},
            ("cuda", "Check the GDRCopy device exists"): {"ok"},
            ("efa", "Check libfabric sees every EFA device"): {"ok"},
            ("efa", "Check the aws-ofi-nccl plugin and Open MPI are installed"): {"ok"},
            ("nccl", "Install the pinned NCCL from NVIDIA's CUDA repository"): {"changed"},
            ("nccl", "Let every process find aws-ofi-nccl and libfabric"): {"changed"},
            ("nccl", "Build nccl-tests against the EFA installer's Open MPI"): {"changed"},
            ("nccl", "Check all_reduce_perf finds NCCL and Open MPI at run time"): {"ok"},
            ("gpudirect", "Check the module is loaded"): {"ok"},
            ("gpudirect", "Check libfabric offers GPU memory on every EFA device"): {"ok"},
            ("storage", "Mount the image's instance-store volume at the scratch mount point"): {"changed"},
            # what the DLAMI brings at or above the pins is adopted, never reinstalled or downgraded
            ("nvidia", "Install the driver packages of the branch"): {"skipped"},
            ("nvidia", "Install Fabric Manager at the driver's version"): {"skipped"},
            ("cuda", "Build the GDRCopy Debian packages"): {"skipped"},
            ("efa", "Run the EFA installer"): {"skipped"},
            ("storage", "Assemble the NVMe devices into RAID0"): {"skipped"},
        }
        for (role, task), statuses in ran.items():
            assert found.get((host, role, task)) == statuses, (
                host,
                role,
                task,
                found.get((host, role, task)),
            )


def test_second_run_changes_nothing(second_run):
    out = second_run.stdout
    assert second_run.returncode == 0, out[-6000:]
    recap = {m[0]: tuple(map(int, m[1:])) for m in RECAP.findall(out)}
    assert set(recap) == set(NODES)
    changed = [line for line in out.splitlines() if line.lstrip().startswith("changed ")]
    assert all(c == 0 for _, c, _, _ in recap.values()), changed


def test_the_nodes_keep_the_images_newer_software_and_find_the_plugin(cluster, first_run):
    _, state = cluster
    script = (
        "dpkg-query -W -f '${Package}=${Version}\\n' libgdrapi nvidia-fabricmanager libnccl2 libnccl-ofi; "
        "head -1 /opt/amazon/efa_installed_packages; "
        "dpkg-query -W 'nvidia-headless-*' 2>/dev/null | wc -l; "
        "ldconfig -p | grep -c libnccl-net-ofi.so; grep -h NCCL_NET_PLUGIN /etc/fsdp-cluster/nccl.env; "
        "findmnt -n -o SOURCE,TARGET /scratch; cat /etc/modules-load.d/fsdp-gpudirect.conf | tail -1; "
        "test -e /dev/gdrdrv && echo gdrdrv"
    )
    for rank, r in remote.run_all(state, script, timeout=30).items():
        lines = r.stdout.split("\n")
        assert sorted(lines[:4]) == [
            "libgdrapi=2.5.2",  # the image's GDRCopy, not rebuilt at the 2.5.1 pin
            "libnccl-ofi=1.18.0-1",
            "libnccl2=2.29.3-1+cuda12.9",
            f"nvidia-fabricmanager={dlami.DRIVER}-1ubuntu1",
        ], (NODES[rank], r.stdout)
        assert lines[4] == "# EFA installer version: 1.50.0"
        assert lines[5] == "0"  # no second driver stack installed over the image's
        assert lines[6] == "1" and lines[7] == 'NCCL_NET_PLUGIN="ofi"'
        assert lines[8].split()[-1] == "/scratch", r.stdout  # a bind mount of the DLAMI's volume
        assert lines[9:11] == ["efa_nv_peermem", "gdrdrv"], r.stdout
