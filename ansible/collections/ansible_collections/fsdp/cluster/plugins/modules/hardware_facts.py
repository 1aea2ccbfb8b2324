#!/usr/bin/python
"""Detect the GPU/EFA/NVMe hardware of a node from sysfs (the fact `fsdp_hardware`)."""

from __future__ import annotations

import os
import re

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
---
module: hardware_facts
short_description: Detect NVIDIA GPUs, NVSwitches, EFA devices and NVMe instance storage
description:
  - Reads sysfs only; loads no driver and needs no vendor tool, so it works before any driver is
    installed and inside containers.
  - NVIDIA GPUs are PCI functions with vendor 0x10de and a display-controller class (0x0300, 0x0302);
    NVSwitches are vendor 0x10de bridges (class 0x0680).
  - EFA devices are C(/sys/class/infiniband) entries whose device is bound to the C(efa) driver.
  - NVMe instance-store devices are namespaces of controllers whose model is
    "Amazon EC2 NVMe Instance Storage" (EBS volumes report "Amazon Elastic Block Store"); each one's
    holders (an md array or device-mapper volume built on it, e.g. the Deep Learning AMI's) are reported.
  - GPUDirect RDMA support, from which peer-memory modules are loaded (C(/sys/module)), and whether the
    NVIDIA kernel module is the open one (C(/proc/driver/nvidia/version)), which can share GPU memory
    through dma-buf instead of a peer-memory module.
  - Each GPU's device file and the CPU cores near it, for Slurm's gres.conf. The device file's minor
    number and the GPU model are what the loaded NVIDIA driver reports
    (C(/proc/driver/nvidia/gpus/ADDRESS/information)); without a loaded driver (no device files yet)
    the GPUs are numbered in PCI order and the model is unknown.
  - The cores near a GPU are its PCI device's C(local_cpulist) (else its C(numa_node)'s C(cpulist)),
    Linux CPU numbers, turned into logical core indices from C(/sys/devices/system/cpu/cpuN/topology):
    the cores of the first socket, then those of the next, each socket's in CPU order, one index per
    core whatever its hyper-threads. That is hwloc's logical core number (C(lstopo -l) "Core L#"), the
    numbering slurmd uses for gres.conf C(Cores=). Empty where sysfs gives no affinity or no CPU
    topology, or where the GPU is near every core.
options:
  sysfs_root:
    description: Directory that holds C(sys/), C(proc/) and C(run/); the node's C(/) unless testing.
    type: path
    default: /
author:
  - fsdp-cluster contributors
"""

EXAMPLES = r"""
- name: Detect the node's accelerators, EFAs and instance storage
  fsdp.cluster.hardware_facts:
"""

RETURN = r"""
ansible_facts:
  description: C(fsdp_hardware), a dictionary with the keys below.
  returned: always
  type: dict
  contains:
    fsdp_hardware:
      description: gpus (PCI addresses), gpu_count, gpu_devices (per GPU, in PCI order, its
        pci address, device file and the logical indices of the cores near it, e.g. "0-23", or ""),
        gpu_model (as the NVIDIA driver names it, e.g. "NVIDIA A100-SXM4-40GB"; empty without a loaded
        driver), nvswitch_count, efa_devices, efa_count,
        nvme_instance_store (device paths), nvme_holders (device path -> holder names),
        peermem_modules (loaded peer-memory modules), nvidia_kernel_module (open, proprietary or
        empty when none is loaded), container (empty when not in one), cap_sys_resource.
      type: dict
"""

NVIDIA_VENDOR = "0x10de"
GPU_CLASS_PREFIXES = ("0x0300", "0x0302")
NVSWITCH_CLASS_PREFIX = "0x0680"
INSTANCE_STORE_MODEL = "Amazon EC2 NVMe Instance Storage"
CAP_SYS_RESOURCE_BIT = 24
PEERMEM_MODULES = ("efa_nv_peermem", "nvidia_peermem")


def _read(path, default=""):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def _listdir(path):
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _pci_functions(root):
    base = os.path.join(root, "sys/bus/pci/devices")
    for address in _listdir(base):
        dev = os.path.join(base, address)
        yield address, _read(os.path.join(dev, "vendor")).lower(), _read(os.path.join(dev, "class")).lower()


def _efa_devices(root):
    base = os.path.join(root, "sys/class/infiniband")
    found = []
    for name in _listdir(base):
        driver = os.path.join(base, name, "device/driver")
        if os.path.basename(os.path.realpath(driver)) == "efa":
            found.append(name)
    return found


def _instance_store_devices(root):
    base = os.path.join(root, "sys/class/nvme")
    found = []
    for ctrl in _listdir(base):
        if _read(os.path.join(base, ctrl, "model")) != INSTANCE_STORE_MODEL:
            continue
        namespaces = [n for n in _listdir(os.path.join(base, ctrl)) if n.startswith(ctrl + "n")]
        found.extend("/dev/" + n for n in namespaces)
    # nvme10n1 after nvme9n1: compare the numbers as numbers
    return sorted(found, key=lambda dev: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", dev)])


def _holders(root, devices):
    base = os.path.join(root, "sys/class/block")
    return {dev: _listdir(os.path.join(base, os.path.basename(dev), "holders")) for dev in devices}


def _nvidia_kernel_module(root):
    version = _read(os.path.join(root, "proc/driver/nvidia/version"))
    if not version:
        return ""
    return "open" if "Open Kernel Module" in version else "proprietary"


def _cpu_numbers(cpulist):
    """The CPU numbers of a Linux CPU list ("0-23,48-71")."""
    numbers = set()
    for part in filter(None, cpulist.split(",")):
        first, _, last = part.partition("-")
        numbers.update(range(int(first), int(last or first) + 1))
    return numbers


def _ranges(numbers):
    """Numbers as a sorted range list ("0-23,48"), the form gres.conf's Cores= takes."""
    spans = []
    for n in sorted(numbers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _logical_cores(root):
    """Linux CPU number -> logical core index: the cores of each socket in turn, sockets and the cores of
    one socket ordered by their lowest CPU number (hwloc's order, which slurmd's Cores= follows); the
    hyper-threads of a core share its index. Empty where a CPU's topology is missing."""
    base = os.path.join(root, "sys/devices/system/cpu")
    cpus = [int(name[3:]) for name in _listdir(base) if re.fullmatch(r"cpu\d+", name)]
    socket_cores = {}  # socket -> the cores in it, each a frozenset of its CPU numbers
    for cpu in cpus:
        topology = os.path.join(base, f"cpu{cpu}", "topology")
        socket = _read(os.path.join(topology, "physical_package_id"))
        siblings = _read(os.path.join(topology, "thread_siblings_list"))
        if not socket or not siblings:
            return {}
        socket_cores.setdefault(socket, set()).add(frozenset(_cpu_numbers(siblings)))
    index, logical = 0, {}
    for cores in sorted(socket_cores.values(), key=lambda cores: min(min(core) for core in cores)):
        for core in sorted(cores, key=min):
            logical.update((cpu, index) for cpu in core)
            index += 1
    return logical


def _near_cpus(root, address):
    """The CPU numbers near a PCI device: its local_cpulist, else its NUMA node's CPUs."""
    dev = os.path.join(root, "sys/bus/pci/devices", address)
    cpulist = _read(os.path.join(dev, "local_cpulist"))
    if cpulist:
        return _cpu_numbers(cpulist)
    node = _read(os.path.join(dev, "numa_node"), "-1")
    if node.lstrip("-").isdigit() and int(node) >= 0:
        return _cpu_numbers(_read(os.path.join(root, f"sys/devices/system/node/node{node}/cpulist")))
    return set()


def _driver_information(root, address):
    """The NVIDIA driver's fields for a GPU ("Model", "Device Minor", ...); empty without a loaded driver."""
    text = _read(os.path.join(root, "proc/driver/nvidia/gpus", address, "information"))
    return {key.strip(): value.strip() for key, _, value in
            (line.partition(":") for line in text.splitlines()) if value}


def _gpu_devices(root, gpus):
    logical = _logical_cores(root)
    all_cores = set(logical.values())
    devices = []
    for position, address in enumerate(gpus):
        minor = _driver_information(root, address).get("Device Minor", str(position))
        cores = {logical[cpu] for cpu in _near_cpus(root, address) if cpu in logical}
        # Near every core is no affinity: Slurm schedules faster with no Cores= at all.
        devices.append({"pci": address, "file": f"/dev/nvidia{minor}",
                        "cores": _ranges(cores) if cores != all_cores else ""})
    return devices


def _container(root):
    marker = _read(os.path.join(root, "run/systemd/container"))
    if marker:
        return marker
    if os.path.exists(os.path.join(root, ".dockerenv")):
        return "docker"
    environ = _read(os.path.join(root, "proc/1/environ"))
    for item in environ.split("\0"):
        if item.startswith("container="):
            return item.split("=", 1)[1]
    return ""


def _cap_sys_resource(root):
    for line in _read(os.path.join(root, "proc/self/status")).splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE_BIT & 1)
    return False


def detect(root="/"):
    """The hardware facts of the node whose filesystem is rooted at `root`."""
    gpus, nvswitches = [], 0
    for address, vendor, pci_class in _pci_functions(root):
        if vendor != NVIDIA_VENDOR:
            continue
        if pci_class.startswith(GPU_CLASS_PREFIXES):
            gpus.append(address)
        elif pci_class.startswith(NVSWITCH_CLASS_PREFIX):
            nvswitches += 1
    efa = _efa_devices(root)
    nvme = _instance_store_devices(root)
    return {
        "gpus": gpus,
        "gpu_count": len(gpus),
        "gpu_devices": _gpu_devices(root, gpus),
        "gpu_model": _driver_information(root, gpus[0]).get("Model", "") if gpus else "",
        "nvswitch_count": nvswitches,
        "efa_devices": efa,
        "efa_count": len(efa),
        "nvme_instance_store": nvme,
        "nvme_holders": _holders(root, nvme),
        "peermem_modules": [m for m in PEERMEM_MODULES if os.path.isdir(os.path.join(root, "sys/module", m))],
        "nvidia_kernel_module": _nvidia_kernel_module(root),
        "container": _container(root),
        "cap_sys_resource": _cap_sys_resource(root),
    }


def main():
    module = AnsibleModule(
        argument_spec={"sysfs_root": {"type": "path", "default": "/"}}, supports_check_mode=True
    )
    module.exit_json(changed=False, ansible_facts={"fsdp_hardware": detect(module.params["sysfs_root"])})


if __name__ == "__main__":
    main()
