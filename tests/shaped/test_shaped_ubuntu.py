"""The nvidia role's install path for real on a local node shaped like a plain Ubuntu 22.04 p4d
(tests/shaped/ubuntu.py): nothing NVIDIA installed, Ubuntu's archive the only package source. `fsdpctl
configure --tags nvidia` installs the driver branch's `-server-open` packages, loads the module DKMS built
(a container is never rebooted), reads the hardware again, and installs Ubuntu's Fabric Manager at exactly
the installed `nvidia-kernel-common-<branch>-server` version; the second run changes nothing. What the play
left for the roles after it (the hardware fact) is read from the facts ansible-runner cached for the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdpctl import remote
from fsdpctl.state import cluster_state
from tests.local.conftest import fsdpctl, spec_file
from tests.shaped import dlami, ubuntu
from tests.shaped.test_shaped_cluster import RECAP, results

pytestmark = [pytest.mark.root, pytest.mark.slow]

NAME = "hw-ubuntu"
SUBNET = "198.18.41.0/24"
NODE = f"{NAME}-node0"
EXTRA_ARGS = [
    a
    for k, v in {
        "fsdp_sysfs_root": dlami.SHAPE,  # hardware_facts reads the shaped tree
        "fsdp_offline": False,  # the stand-in archive is the node's package source
        "hardware_required": True,  # absent hardware fails, as on AWS
    }.items()
    for a in ("-e", f"{k}={json.dumps(v)}")
]
PACKAGES = "dpkg-query -W -f '${Package}=${Version} ${db:Status-Want}\\n' "


@pytest.fixture(scope="module")
def cluster(prerequisites, tmp_path_factory):
    layer = ubuntu.build_layer(tmp_path_factory.mktemp("shape") / "layer", "p4d.24xlarge")
    home = tmp_path_factory.mktemp("home")
    spec = spec_file(
        tmp_path_factory.mktemp("spec"),
        NAME,
        node_count=1,
        local={"subnet_cidr": SUBNET},
        software={"nvidia_driver_branch": ubuntu.BRANCH},
    )
    try:
        fsdpctl(home, "up", str(spec), "--target", "local", env={"FSDPCTL_LOCAL_NODE_LAYER": str(layer)})
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FSDPCTL_HOME", str(home))
            state = cluster_state(NAME)
            remote.run_all(state, ubuntu.BAKE, timeout=120)  # the image as it boots
            yield home, state
    finally:
        fsdpctl(home, "down", "--yes", "--cluster", NAME, check=False)


def configure(home: Path):
    return fsdpctl(home, "configure", "--tags", "nvidia", *EXTRA_ARGS, check=False)


def cached_facts(home: Path, run: int) -> dict:
    """The facts a configure run (0: the first) left for its host: ansible-runner keeps Ansible's jsonfile
    fact cache in the run's artifacts (one file per host, the facts as a JSON payload)."""
    runs = sorted((home / "reports" / NAME).glob("*-configure"))
    (cache,) = (runs[run] / "artifacts/ansible/fact_cache").glob(f"*{NODE}")
    stored = json.loads(cache.read_text())
    return json.loads(stored["__payload__"]) if "__payload__" in stored else stored


@pytest.fixture(scope="module")
def first_run(cluster):
    home, _ = cluster
    return configure(home)


@pytest.fixture(scope="module")
def second_run(cluster, first_run):
    home, _ = cluster
    return configure(home)


def test_first_run_installs_the_driver_and_loads_it_without_a_reboot(first_run):
    run = first_run
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    found = results(run.stdout)
    for task, statuses in {
        "Install the driver packages of the branch": {"changed"},
        "Reboot to load the new driver": {"skipped"},  # a container: never rebooted
        "Load the new driver where the node was not rebooted": {"changed"},
        "Check the driver version and persistence mode on every GPU": {"ok"},
    }.items():
        assert found.get((NODE, "nvidia", task)) == statuses, (task, found.get((NODE, "nvidia", task)))


def test_fabric_manager_comes_from_ubuntus_archive_at_the_drivers_exact_version(cluster, first_run):
    run = first_run
    assert run.returncode == 0, run.stdout[-6000:]
    found = results(run.stdout)
    assert found[(NODE, "nvidia", "Install Fabric Manager at the driver's version")] == {"changed"}
    assert found[(NODE, "nvidia", "Check Fabric Manager matches the driver")] == {"ok"}
    _, state = cluster
    b, v = ubuntu.BRANCH, ubuntu.VERSION
    names = f"nvidia-kernel-common-{b}-server nvidia-fabricmanager-{b} libnvidia-nscq-{b}"
    installed = remote.run(state, 0, PACKAGES + names).stdout.splitlines()
    assert sorted(installed) == sorted(
        f"{name}={v} hold" for name in names.split()  # and held after the change, with the driver
    )
    # NVIDIA's naming (its CUDA repository, not configured on a plain image) was never asked for
    nvidias = remote.run(state, 0, "dpkg-query -W nvidia-fabricmanager libnvidia-nscq", check=False)
    assert nvidias.returncode == 1, nvidias.stdout
    assert remote.run(state, 0, "systemctl is-active nvidia-fabricmanager").stdout.strip() == "active"


def test_the_roles_after_the_driver_see_its_loaded_module(cluster, first_run):
    # the hardware fact gathered before the install said no module; the play refreshed it once the module was
    # loaded, so gpudirect's dma-buf fall-back (open kernel module) is open to the roles that follow
    assert first_run.returncode == 0, first_run.stdout[-6000:]
    home, state = cluster
    assert cached_facts(home, 0)["fsdp_hardware"]["nvidia_kernel_module"] == "open"
    banner = remote.run(state, 0, f"cat {dlami.SHAPE}/proc/driver/nvidia/version").stdout
    assert banner == dlami.nvrm_banner(ubuntu.UPSTREAM)


def test_second_run_changes_nothing(second_run):
    out = second_run.stdout
    assert second_run.returncode == 0, out[-6000:]
    recap = {m[0]: tuple(map(int, m[1:])) for m in RECAP.findall(out)}
    assert set(recap) == {NODE}
    changed = [line for line in out.splitlines() if line.lstrip().startswith("changed ")]
    assert all(c == 0 for _, c, _, _ in recap.values()), changed
