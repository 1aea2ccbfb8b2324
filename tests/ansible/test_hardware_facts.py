"""The hardware detection every hardware-bound role relies on, on sysfs trees shaped like p4d/p5 instances
and like a local-target container."""

from __future__ import annotations

import pytest

from infra import catalog
from tests.ansible.conftest import detect_hardware, sysfs_tree


@pytest.mark.parametrize("instance_type", ["p4d.24xlarge", "p5.48xlarge"])
def test_gpu_instance_hardware_matches_the_catalog(tmp_path, instance_type):
    facts = catalog.CATALOG[instance_type]
    found = detect_hardware(sysfs_tree(tmp_path, instance_type))
    assert found["gpu_count"] == facts.gpus and len(found["gpus"]) == facts.gpus
    assert found["nvswitch_count"] == 6
    assert found["efa_count"] == facts.efa_interfaces
    assert found["efa_devices"][0] == "rdmap16s27"
    # the EBS root volume (nvme0) is not instance storage
    assert found["nvme_instance_store"] == [f"/dev/nvme{n}n1" for n in range(1, facts.nvme_devices + 1)]
    assert found["container"] == "" and found["cap_sys_resource"] is True


def test_nvme_devices_sort_by_number_not_by_text(tmp_path):
    found = detect_hardware(sysfs_tree(tmp_path, "p4d.24xlarge", ebs_volumes=3))
    assert found["nvme_instance_store"][-3:] == ["/dev/nvme8n1", "/dev/nvme9n1", "/dev/nvme10n1"]


def test_container_without_hardware_or_cap_sys_resource(tmp_path):
    (tmp_path / "run/systemd").mkdir(parents=True)
    (tmp_path / "run/systemd/container").write_text("systemd-nspawn\n")
    (tmp_path / "proc/self").mkdir(parents=True)
    # CAP_SYS_RESOURCE is bit 24; fcecbfff (a systemd-nspawn node's CapEff) lacks it
    (tmp_path / "proc/self/status").write_text("CapEff:\t00000000fcecbfff\n")
    nic = tmp_path / "sys/bus/pci/devices/0000:00:03.0"
    nic.mkdir(parents=True)
    (nic / "vendor").write_text("0x1af4\n")
    (nic / "class").write_text("0x020000\n")
    found = detect_hardware(tmp_path)
    assert found == {
        "gpus": [],
        "gpu_count": 0,
        "nvswitch_count": 0,
        "efa_devices": [],
        "efa_count": 0,
        "nvme_instance_store": [],
        "nvme_holders": {},
        "peermem_modules": [],
        "nvidia_kernel_module": "",
        "container": "systemd-nspawn",
        "cap_sys_resource": False,
    }


def test_infiniband_device_of_another_driver_is_not_an_efa(tmp_path):
    driver = tmp_path / "sys/bus/pci/drivers/mlx5_core"
    driver.mkdir(parents=True)
    dev = tmp_path / "sys/devices/mlx0"
    dev.mkdir(parents=True)
    (dev / "driver").symlink_to(driver)
    (tmp_path / "sys/class/infiniband/mlx5_0").mkdir(parents=True)
    (tmp_path / "sys/class/infiniband/mlx5_0/device").symlink_to(dev)
    assert detect_hardware(tmp_path)["efa_count"] == 0


def test_gpudirect_and_instance_store_use_are_detected(tmp_path):
    # a Deep Learning AMI: the instance store held by one md array, efa_nv_peermem loaded, open modules
    root = sysfs_tree(tmp_path, "p4d.24xlarge")
    for n in range(1, 9):
        (root / f"sys/class/block/nvme{n}n1/holders/md127").mkdir(parents=True)
    (root / "sys/module/efa_nv_peermem").mkdir(parents=True)
    (root / "proc/driver/nvidia").mkdir(parents=True)
    (root / "proc/driver/nvidia/version").write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  595.71.05  Release Build\n"
    )
    found = detect_hardware(root)
    assert found["nvme_holders"] == {f"/dev/nvme{n}n1": ["md127"] for n in range(1, 9)}
    assert found["peermem_modules"] == ["efa_nv_peermem"]
    assert found["nvidia_kernel_module"] == "open"
