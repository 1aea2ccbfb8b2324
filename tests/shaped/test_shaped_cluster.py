"""The GPU/EFA/CUDA/NCCL/GDRCopy/storage roles run for real on a local node shaped like a Deep Learning
AMI p4d node (tests/shaped/dlami.py, given to the local target through FSDPCTL_LOCAL_NODE_LAYER): check
mode first on the fresh image, then `fsdpctl configure` twice. The first run goes through every hardware
role's tasks (no hardware skip) and adopts what the image brings instead of downgrading it; the second
changes nothing. Checked from outside over SSH. Then variants, each a cheap `--tags nccl` run that ends
where it started: a lower NCCL pin (kept, never downgraded), an older NCCL held by an
earlier run (upgraded over its hold), and aws-ofi-nccl removed (the run fails naming the package)."""

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
from fsdpctl.state import ClusterState
from tests.local.conftest import REPO, fsdpctl, spec_file
from tests.shaped import dlami
from tests.shaped.conftest import shaped_cluster

pytestmark = [pytest.mark.root, pytest.mark.slow]

NAME = "hw-shape"
SUBNET = "198.18.40.0/24"
# One node: the hardware roles configure each node alone; what the roles do between nodes (SSH, hosts, MTU)
# runs on the plain 2-node cluster of tests/local/test_configure.py.
NODES = [f"{NAME}-node0"]
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
EXTRA_ARGS = [a for k, v in EXTRA_VARS.items() for a in ("-e", f"{k}={json.dumps(v)}")]
INSTALL_NCCL = "Install or upgrade NCCL from NVIDIA's CUDA repository"
# dpkg-query lists them in its own (name) order
NCCL_PACKAGES = "dpkg-query -W -f '${Package}=${Version} ${db:Status-Want}\\n' libnccl-dev libnccl2"
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
    spec = spec_file(tmp_path_factory.mktemp("spec"), NAME, node_count=1, local={"subnet_cidr": SUBNET})
    with shaped_cluster(home, NAME, spec, layer, dlami.BAKE) as home_and_state:
        yield home_and_state


def check_mode_run(
    home: Path, state: ClusterState, tags: tuple[str, ...], extra_vars: dict
) -> subprocess.CompletedProcess:
    """ansible-playbook --check of the roles `tags` on the cluster's nodes (fsdpctl configure has no check
    mode), with Ansible's own output, where `changed: [host]` is a would-change."""
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
        extra = ["-e", json.dumps(extra_vars)]
        try:
            return subprocess.run(
                [
                    str(Path(sys.executable).parent / "ansible-playbook"),
                    "-i",
                    str(inventory),
                    "ansible/site.yml",
                    "--check",
                    "--tags",
                    ",".join(tags),
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
def check_mode(cluster):
    """ansible-playbook --check of the hardware roles on the fresh image (nothing written yet)."""
    home, state = cluster
    return check_mode_run(home, state, HARDWARE_ROLES, EXTRA_VARS)


@pytest.fixture(scope="module")
def first_run(cluster, check_mode):
    home, _ = cluster
    return fsdpctl(home, "configure", "--tags", ",".join(CONFIGURED_ROLES), *EXTRA_ARGS, check=False)


@pytest.fixture(scope="module")
def second_run(cluster, first_run):
    home, _ = cluster
    return fsdpctl(home, "configure", "--tags", ",".join(CONFIGURED_ROLES), *EXTRA_ARGS, check=False)


def configure_nccl(home: Path, rank: int, *extra: str) -> subprocess.CompletedProcess:
    """Only the nccl role, on one node (no efa role before it in the play): a cheap variant run."""
    return fsdpctl(
        home, "configure", "--tags", "nccl", "--limit", NODES[rank], *EXTRA_ARGS, *extra, check=False
    )


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
            ("common", "Hold the installed kernel and NVIDIA packages"): {"changed"},
            ("nvidia", "Run the persistence daemon with persistence mode on"): {"changed"},
            ("nvidia", "Check the driver version and persistence mode on every GPU"): {"ok"},
            ("nvidia", "Check Fabric Manager matches the driver"): {"ok"},
            ("nvidia", "Start NVIDIA Fabric Manager"): {"ok"},
            ("cuda", "Check the toolkit is the pinned version"): {"ok"},
            # the image's gdrdrv service had not run: the role starts it, which loads the module and makes
            # /dev/gdrdrv (modprobe alone makes no device)
            ("cuda", "Start GDRCopy's service (loads gdrdrv, makes /dev/gdrdrv)"): {"changed"},
            ("cuda", "Check the GDRCopy device exists"): {"ok"},
            ("efa", "Check libfabric sees every EFA device"): {"ok"},
            ("efa", "Check the aws-ofi-nccl plugin and Open MPI are installed"): {"ok"},
            ("nccl", "Fail without aws-ofi-nccl on an EFA node"): {"skipped"},
            ("nccl", INSTALL_NCCL): {"changed"},
            ("nccl", "Let every process find aws-ofi-nccl and libfabric"): {"changed"},
            ("nccl", "Build nccl-tests against the EFA installer's Open MPI"): {"changed"},
            ("nccl", "Check all_reduce_perf finds NCCL and Open MPI at run time"): {"ok"},
            ("gpudirect", "Check the module is loaded"): {"ok"},
            ("gpudirect", "Check libfabric offers GPU memory on every EFA device"): {"ok"},
            # the image's instance-store volume is adopted: bound now by the scratch program, and at every
            # boot by its unit
            ("storage", "Ask the scratch program what it would do"): {"ok"},
            ("storage", "Build or mount the scratch file system"): {"changed"},
            ("storage", "Enable the scratch unit at boot"): {"changed"},
            # what the DLAMI brings at or above the pins is adopted, never reinstalled or downgraded
            ("nvidia", "Install the driver packages of the branch"): {"skipped"},
            ("nvidia", "Install Fabric Manager at the driver's version"): {"skipped"},
            ("nvidia", "Hold the new driver and Fabric Manager packages"): {"skipped"},
            ("cuda", "Install CUDA toolkit 12.9.1"): {"skipped"},  # the image's runfile toolkit
            ("cuda", "Build the GDRCopy Debian packages"): {"skipped"},
            ("efa", "Run the EFA installer"): {"skipped"},
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


def test_the_boot_unit_binds_the_images_volume_again_after_a_stop_start(cluster, second_run):
    # a stop/start: nothing mounted, then the DLAMI's dlami-nvme.service mounts a new file system (mode
    # 0755) while the unit, started as at boot, waits for it; the node ends as it was
    _, state = cluster
    waiting = "[ $(systemctl show -P ActiveState fsdp-scratch) = activating ]"
    script = (
        "systemctl is-enabled fsdp-scratch; "
        "grep -x FSDP_SCRATCH_IMAGE_WAIT_S=300 /etc/fsdp-cluster/scratch.env; "
        f"umount /scratch && umount {dlami.DLAMI_MOUNT} && systemctl start --no-block fsdp-scratch && "
        f"mount -t tmpfs -o size=64m,mode=0755 dlami-nvme {dlami.DLAMI_MOUNT} && "
        f"timeout 120 sh -c 'while {waiting}; do sleep 1; done'; "
        "systemctl is-active fsdp-scratch; findmnt -n -o SOURCE /scratch | tail -1; stat -c %a /scratch"
    )
    for rank, r in remote.run_all(state, script, timeout=180, check=False).items():
        assert r.stdout.splitlines() == [
            "enabled",
            "FSDP_SCRATCH_IMAGE_WAIT_S=300",
            "active",
            "dlami-nvme",  # a bind mount of the image's volume
            "1777",
        ], (NODES[rank], r.stdout, r.stderr)


def test_persistence_mode_is_on_by_the_daemons_own_flag(cluster, first_run):
    # the stand-in nvidia-smi reads the flag off the running daemon, as the driver applies it: the packaged
    # unit's --no-persistence-mode (and StopWhenUnneeded) would show Disabled
    _, state = cluster
    script = (
        "nvidia-smi --query-gpu=index,driver_version,persistence_mode --format=csv,noheader | cut -d' ' -f3 "
        "| sort -u; systemctl is-enabled nvidia-persistenced; "
        "systemctl show --property StopWhenUnneeded --value nvidia-persistenced; "
        f"tr '\\0' ' ' < /proc/$(cat {dlami.PERSISTENCED_PIDFILE})/cmdline"
    )
    for rank, r in remote.run_all(state, script, timeout=30).items():
        lines = r.stdout.splitlines()
        assert lines[:3] == ["Enabled", "enabled", "no"], (NODES[rank], r.stdout)
        assert "--persistence-mode" in lines[3].split(), (NODES[rank], r.stdout)


def test_the_images_toolkits_are_adopted_holds_set_and_huge_pages_left_on(cluster, first_run):
    _, state = cluster
    script = (
        "dpkg-query -W 'cuda-toolkit-*' 2>/dev/null | wc -l; ls -d /usr/local/cuda-*; "
        "grep -c FI_EFA_USE_HUGE_PAGE /etc/fsdp-cluster/nccl.env; apt-mark showhold"
    )
    for rank, r in remote.run_all(state, script, timeout=30, check=False).items():
        lines = r.stdout.splitlines()
        assert lines[0] == "0", (NODES[rank], r.stdout)  # no package installed over the runfile toolkits
        assert lines[1:4] == [f"/usr/local/cuda-{release}" for release in dlami.IMAGE_CUDA]
        assert lines[4] == "0", (NODES[rank], r.stdout)  # FI_EFA_USE_HUGE_PAGE only when asked for
        # the image's NVIDIA packages held by the common role, NCCL by its own
        assert set(lines[5:]) == {
            "libnccl-dev",
            "libnccl2",
            "libnvidia-nscq",
            "nvidia-driver-cuda",
            "nvidia-fabricmanager",
        }, (NODES[rank], r.stdout)


def test_nccl_is_upgraded_over_its_hold_and_never_downgraded(cluster, second_run):
    home, state = cluster
    pinned = [f"libnccl-dev={dlami.NCCL} hold", f"libnccl2={dlami.NCCL} hold"]
    older = dlami.OLDER_NCCL
    # a lower pin asks for a downgrade: the pinned (newer) NCCL is kept, still held
    lower = configure_nccl(home, 0, "-e", f"fsdp_nccl_version={older.split('+')[0]}")
    assert lower.returncode == 0, lower.stdout[-5000:]
    assert results(lower.stdout)[(NODES[0], "nccl", INSTALL_NCCL)] == {"ok"}
    assert remote.run(state, 0, NCCL_PACKAGES).stdout.splitlines() == pinned
    # an older NCCL held by an earlier configure (an older pin): upgraded to the pin over its hold, held again
    remote.run(
        state,
        0,
        "apt-get install -y -q --allow-downgrades --allow-change-held-packages "
        f"libnccl2={older} libnccl-dev={older} >/dev/null && apt-mark hold libnccl2 libnccl-dev >/dev/null",
        timeout=120,
    )
    assert remote.run(state, 0, NCCL_PACKAGES).stdout.splitlines() == [
        f"libnccl-dev={older} hold",
        f"libnccl2={older} hold",
    ]
    upgrade = configure_nccl(home, 0)
    assert upgrade.returncode == 0, upgrade.stdout[-5000:]
    assert results(upgrade.stdout)[(NODES[0], "nccl", INSTALL_NCCL)] == {"changed"}
    assert remote.run(state, 0, NCCL_PACKAGES).stdout.splitlines() == pinned


def test_an_efa_node_without_aws_ofi_nccl_fails_naming_the_package(cluster, second_run):
    # without the efa role in the play the nccl role reads the node itself; a guessed aws-ofi-nccl version
    # would write an environment for a plugin that is not there
    home, state = cluster
    remote.run(state, 0, "dpkg -r libnccl-ofi >/dev/null", timeout=60)
    try:
        broken = configure_nccl(home, 0)
    finally:
        remote.run(
            state, 0, f"dpkg -i {dlami.IMAGE_DEBS}/libnccl-ofi_1.18.0-1_amd64.deb >/dev/null", timeout=60
        )
    assert broken.returncode != 0, broken.stdout[-5000:]
    assert results(broken.stdout)[(NODES[0], "nccl", "Fail without aws-ofi-nccl on an EFA node")] == {
        "failed"
    }
    message = " ".join(broken.stdout.split())
    assert "the aws-ofi-nccl package libnccl-ofi is not installed and libfabric is 2.4.0" in message
    assert "Install them with the EFA installer, which ships the libnccl-ofi package" in message
    # the environment the earlier runs wrote for the node's plugin is left as it was
    env = remote.run(state, 0, "head -3 /etc/fsdp-cluster/nccl.env").stdout
    assert "aws-ofi-nccl 1.18.0" in env, env
