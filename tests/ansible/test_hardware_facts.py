"""The hardware detection every hardware-bound role relies on, on sysfs trees shaped like p4d/p5 instances
and like a local-target container."""

from __future__ import annotations

import pytest

from infra import catalog
from tests.ansible.conftest import detect_hardware, sysfs_tree


@pytest.mark.parametrize(("instance_type", "nvswitches"), [("p4d.24xlarge", 6), ("p5.48xlarge", 4)])
def test_gpu_instance_hardware_matches_the_catalog(tmp_path, instance_type, nvswitches):
    facts = catalog.CATALOG[instance_type]
    found = detect_hardware(sysfs_tree(tmp_path, instance_type))
    assert found["gpu_count"] == facts.gpus and len(found["gpus"]) == facts.gpus
    assert found["nvswitch_count"] == nvswitches  # HGX A100: six NVSwitch chips, HGX H100: four
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
        "gpu_devices": [],
        "gpu_model": "",
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


def test_each_gpu_has_its_device_file_and_the_slurm_cores_of_its_socket(tmp_path):
    # a p4d: 96 CPUs, 2 sockets x 24 cores x 2 threads; GPUs 0-3 near CPUs 0-23,48-71 (socket 0's cores,
    # both threads), GPUs 4-7 near 24-47,72-95 (tests/ansible/conftest.py sysfs_tree: AWS's p4d topology)
    found = detect_hardware(sysfs_tree(tmp_path, "p4d.24xlarge"))
    assert found["gpu_devices"] == [
        {"pci": address, "file": f"/dev/nvidia{n}", "cores": "0-23" if n < 4 else "24-47"}
        for n, address in enumerate(found["gpus"])]
    assert found["gpu_model"] == ""  # no driver loaded


def _cpus(root, sockets_of_cpus):
    """CPU n in socket sockets_of_cpus[n][0], core id sockets_of_cpus[n][1], siblings as given."""
    for cpu, (socket, core_id, siblings) in enumerate(sockets_of_cpus):
        topology = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{socket}\n")
        (topology / "core_id").write_text(f"{core_id}\n")
        (topology / "thread_siblings_list").write_text(siblings + "\n")


def _gpu(root, address, **files):
    dev = root / "sys/bus/pci/devices" / address
    dev.mkdir(parents=True)
    (dev / "vendor").write_text("0x10de\n")
    (dev / "class").write_text("0x030200\n")
    for name, text in files.items():
        (dev / name).write_text(text + "\n")


def test_interleaved_cpus_and_sparse_core_ids_become_slurm_core_indices(tmp_path):
    # 16 CPUs numbered socket by socket in turn (even: socket 0, odd: socket 1), core ids with gaps,
    # hyper-threads 8 apart: socket 0's cores are those of CPUs 0,2,4,6 (+8), Slurm's cores 0-3.
    _cpus(tmp_path, [(n % 2, [0, 0, 4, 4, 9, 9, 12, 12][n % 8], f"{n % 8},{n % 8 + 8}") for n in range(16)])
    _gpu(tmp_path, "0000:10:1c.0", local_cpulist="0,2,4,6,8,10,12,14")
    _gpu(tmp_path, "0000:90:1c.0", local_cpulist="1,3,5,7,9,11,13,15")
    found = detect_hardware(tmp_path)
    assert [gpu["cores"] for gpu in found["gpu_devices"]] == ["0-3", "4-7"]


def test_the_numa_node_gives_the_cpus_without_a_local_cpulist_and_nothing_is_no_affinity(tmp_path):
    _cpus(tmp_path, [(n // 4 % 2, n % 4, f"{n % 8},{n % 8 + 8}") for n in range(16)])
    node1 = tmp_path / "sys/devices/system/node/node1/cpulist"
    node1.parent.mkdir(parents=True)
    node1.write_text("4-7,12-15\n")
    _gpu(tmp_path, "0000:10:1c.0", numa_node="1")
    _gpu(tmp_path, "0000:20:1c.0", numa_node="-1")  # a VM that hides NUMA
    _gpu(tmp_path, "0000:30:1c.0", local_cpulist="0-15")  # near every core: no affinity either
    found = detect_hardware(tmp_path)
    assert [gpu["cores"] for gpu in found["gpu_devices"]] == ["4-7", "", ""]


def test_without_cpu_topology_no_gpu_has_cores(tmp_path):
    _gpu(tmp_path, "0000:10:1c.0", local_cpulist="0-23,48-71")
    assert detect_hardware(tmp_path)["gpu_devices"] == [
        {"pci": "0000:10:1c.0", "file": "/dev/nvidia0", "cores": ""}]


def test_the_loaded_driver_gives_the_model_and_each_gpus_device_minor(tmp_path):
    root = sysfs_tree(tmp_path, "p5.48xlarge")
    found = detect_hardware(root)
    for n, address in enumerate(found["gpus"]):
        information = root / "proc/driver/nvidia/gpus" / address / "information"
        information.parent.mkdir(parents=True)
        # the driver numbered them in reverse (made up here, to tell its numbers from PCI order)
        information.write_text(f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ: \t\t 42\n"
                               f"Bus Location: \t {address}\nDevice Minor: \t {7 - n}\n")
    found = detect_hardware(root)
    assert found["gpu_model"] == "NVIDIA H100 80GB HBM3"
    assert [(gpu["file"], gpu["cores"]) for gpu in found["gpu_devices"]] == [
        (f"/dev/nvidia{7 - n}", "0-47" if n < 4 else "48-95") for n in range(8)]
