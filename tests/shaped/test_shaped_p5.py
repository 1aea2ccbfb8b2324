"""The DLAMI layer shaped as a p5.48xlarge (tests/shaped/dlami.py): one node with 8 H100s, 4 NVSwitches,
32 EFA devices and the p5's 8 NVMe instance-store namespaces held by the image's md array, in a cluster
whose spec names p5.48xlarge (the inventory's expected counts are the catalog's p5 ones). `fsdpctl
configure` with the roles and extra variables of test_shaped_cluster.py, twice. The p4d module proves
the roles' decisions on a DLAMI; this one proves what differs on a p5: the hardware the play worked with
(the H100 model from the driver, four NVSwitches, 32 EFAs, the GPUs' affinity to the p5's 96 cores), the
roles' checks passing against the p5's counts (every EFA seen by libfabric, GPU memory on all 32), the
environment file for that node, and /scratch bound from the image's /opt/dlami/nvme."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from fsdpctl import remote
from tests.local.conftest import LOGIN_USER, fsdpctl, spec_file
from tests.shaped import dlami
from tests.shaped.conftest import cached_facts, shaped_cluster
from tests.shaped.test_shaped_cluster import CONFIGURED_ROLES, EXTRA_ARGS, RECAP, results

pytestmark = [pytest.mark.root, pytest.mark.slow]

NAME = "hw-p5"
SUBNET = "198.18.42.0/24"
NODE = f"{NAME}-node0"
INSTANCE_TYPE = "p5.48xlarge"


@dataclass(frozen=True)
class ConfigureRun:
    """One `fsdpctl configure` and the run directory it kept its artifacts in."""

    run: subprocess.CompletedProcess
    run_dir: Path


@pytest.fixture(scope="module")
def cluster(prerequisites, tmp_path_factory):
    work = tmp_path_factory.mktemp("shape")
    layer = dlami.build_layer(work / "layer", INSTANCE_TYPE, work)
    home = tmp_path_factory.mktemp("home")
    # logged in to as on AWS: the roles run as root through the login user's sudo, and the user reads
    # what they leave (the NCCL environment, nvidia-smi)
    spec = spec_file(tmp_path_factory.mktemp("spec"), NAME, node_count=1,
                     local={"subnet_cidr": SUBNET, "login_user": LOGIN_USER}, instance_type=INSTANCE_TYPE)
    with shaped_cluster(home, NAME, spec, layer, dlami.BAKE) as home_and_state:
        yield home_and_state


def configure(cluster) -> ConfigureRun:
    home, state = cluster
    run = fsdpctl(home, "configure", "--tags", ",".join(CONFIGURED_ROLES), *EXTRA_ARGS, check=False)
    return ConfigureRun(run=run, run_dir=Path(state.read().last_configure.run_dir))


@pytest.fixture(scope="module")
def first_run(cluster) -> ConfigureRun:
    return configure(cluster)


@pytest.fixture(scope="module")
def second_run(cluster, first_run) -> ConfigureRun:
    return configure(cluster)


def test_the_roles_check_the_p5s_counts_and_pass(first_run):
    out = first_run.run.stdout
    assert first_run.run.returncode == 0, out[-6000:] + first_run.run.stderr[-2000:]
    found = results(out)
    for role, task in [
        # against the catalog's p5.48xlarge: the inventory's fsdp_gpus_per_node, fsdp_efa_count and
        # fsdp_nvme_devices (8, 32, 8)
        ("nvidia", "Check the node has every GPU of its instance type"),
        ("efa", "Check the node has every EFA of its instance type"),
        ("storage", "Check the node has every NVMe instance-store device of its instance type"),
        # against the 32 EFA devices the hardware facts found
        ("efa", "Check libfabric sees every EFA device"),
        ("gpudirect", "Check libfabric offers GPU memory on every EFA device"),
        ("nvidia", "Check Fabric Manager matches the driver"),  # an NVSwitch system: four on a p5
    ]:
        assert found.get((NODE, role, task)) == {"ok"}, (role, task, found.get((NODE, role, task)))


def test_the_play_saw_eight_h100s_four_nvswitches_and_32_efas(first_run):
    assert first_run.run.returncode == 0, first_run.run.stdout[-6000:]
    hardware = cached_facts(first_run.run_dir, NODE)["fsdp_hardware"]
    assert (hardware["gpu_count"], hardware["nvswitch_count"], hardware["efa_count"]) == (8, 4, 32)
    # the driver's name for the GPU, which Slurm's GRES type reads off local nodes
    assert hardware["gpu_model"] == "NVIDIA H100 80GB HBM3"
    # four GPUs per socket, each near its socket's 48 of the p5's 96 cores
    assert [d["cores"] for d in hardware["gpu_devices"]] == ["0-47"] * 4 + ["48-95"] * 4
    assert len(hardware["nvme_instance_store"]) == 8
    assert set(map(tuple, hardware["nvme_holders"].values())) == {("md127",)}  # the image's array


def test_the_node_has_the_environment_and_scratch_of_a_p5(cluster, first_run):
    assert first_run.run.returncode == 0, first_run.run.stdout[-6000:]
    _, state = cluster
    script = (
        "nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | sed 's/^ *//'; "
        "grep -h NCCL_NET_PLUGIN /etc/fsdp-cluster/nccl.env; grep -c '^FI_' /etc/fsdp-cluster/nccl.env; "
        f"stat -c %d:%i /scratch {dlami.DLAMI_MOUNT} | uniq | wc -l; findmnt -n -o SOURCE /scratch | tail -1"
    )
    lines = remote.run(state, 0, script, timeout=30, check=False).stdout.splitlines()
    assert lines[0] == "8 NVIDIA H100 80GB HBM3", lines
    # aws-ofi-nccl loaded by name; no libfabric variable: aws-ofi-nccl 1.18 picks the efa provider itself
    # (FI_PROVIDER=efa is for aws-ofi-nccl <= 1.5) and huge pages stay on unless asked
    assert lines[1:3] == ['NCCL_NET_PLUGIN="ofi"', "0"], lines
    assert lines[3:5] == ["1", "dlami-nvme"], lines  # /scratch is the image's volume itself, bound


def test_second_run_changes_nothing(second_run):
    out = second_run.run.stdout
    assert second_run.run.returncode == 0, out[-6000:]
    recap = {m[0]: tuple(map(int, m[1:])) for m in RECAP.findall(out)}
    assert set(recap) == {NODE}
    changed = [line for line in out.splitlines() if line.lstrip().startswith("changed ")]
    assert all(c == 0 for _, c, _, _ in recap.values()), changed
