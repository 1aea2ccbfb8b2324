"""Helpers for the Ansible tests: the roles' own variables and templates rendered by Ansible's templating
engine with the facts of real GPU instances (p4d, p5), and ansible-playbook runs on localhost that change
nothing (syntax check, input validation)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

from fsdpctl.inventory import group_vars
from fsdpctl.state import ClusterState
from infra import catalog

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_DIR = REPO / "ansible"
ROLES_DIR = ANSIBLE_DIR / "roles"
BIN = Path(sys.executable).parent
# The roles site.yml applies, in its order (a role added there is rendered here too).
ROLES = tuple(entry["role"] for entry in yaml.safe_load((ANSIBLE_DIR / "site.yml").read_text())[0]["roles"])
NODE_ADDRESSES = ("10.42.1.10", "10.42.1.11")
_loader = DataLoader()


def _load(path: Path) -> dict[str, Any]:
    return (_loader.load_from_file(str(path), trusted_as_template=True) or {}) if path.exists() else {}


SOCKETS = 2
"""Sockets (and NUMA nodes) of every catalog type: two Intel Xeons on a p4d, two AMD EPYCs on a p5."""
NVSWITCHES = {"A100": 6, "H100": 4, "H200": 4}
"""NVSwitch chips on each GPU generation's 8-GPU baseboard: HGX A100 has six (second generation), HGX
H100 and H200 four (third generation), each a PCI function of the NVIDIA vendor."""


def _cpu_topology(root: Path, vcpus: int) -> None:
    """The CPUs of a two-socket instance with two hyper-threads per core, numbered as Linux numbers them on
    a p4d (lscpu: NUMA node0 CPUs 0-23,48-71, node1 24-47,72-95): the first thread of every core, socket 0's
    cores first, then the second threads in the same order. Core ids count from 0 in each socket."""
    cores = vcpus // 2
    per_socket = cores // SOCKETS
    for cpu in range(vcpus):
        core = cpu % cores
        topology = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{core // per_socket}\n")
        (topology / "core_id").write_text(f"{core % per_socket}\n")
        (topology / "thread_siblings_list").write_text(f"{core},{core + cores}\n")
    for node in range(SOCKETS):
        first, last = node * per_socket, (node + 1) * per_socket - 1
        cpulist = root / f"sys/devices/system/node/node{node}/cpulist"
        cpulist.parent.mkdir(parents=True)
        cpulist.write_text(f"{first}-{last},{first + cores}-{last + cores}\n")


def sysfs_tree(root: Path, instance_type: str, *, ebs_volumes: int = 1) -> Path:
    """A sysfs/proc layout like an EC2 instance of that type: its GPUs and NVSwitches on the PCI bus, its
    EFA devices bound to the efa driver, its NVMe instance store next to EBS volumes, its CPUs in two
    sockets, each GPU with the NUMA node and CPUs near it (local_cpulist)."""
    facts = catalog.CATALOG[instance_type]
    _cpu_topology(root, facts.vcpus)
    pci = root / "sys/bus/pci/devices"
    nvswitches = NVSWITCHES[facts.gpu_model.split("-")[0]] if facts.nvswitch else 0
    functions = [("0x10de", "0x030200")] * facts.gpus + [("0x10de", "0x068000")] * nvswitches
    functions += [("0x1d0f", "0x020000"), ("0x8086", "0x060000")]  # ENA NIC, host bridge
    for n, (vendor, pci_class) in enumerate(functions):
        dev = pci / f"0000:{n + 16:02x}:00.0"
        dev.mkdir(parents=True)
        (dev / "vendor").write_text(vendor + "\n")
        (dev / "class").write_text(pci_class + "\n")
    # The first half of the GPUs hang off socket 0, the rest off socket 1: on a p4d GPUs 0-3 are near
    # CPUs 0-23,48-71 and GPUs 4-7 near 24-47,72-95 (aws/aws-ofi-nccl topology/p4d-24xl-topo.xml, the
    # NCCL topology AWS ships for the p4d: cpu numaid 0 affinity 000000ff,ffff0000,00ffffff over GPUs
    # 0000:10:1c.0 to 0000:20:1d.0, numaid 1 ffffff00,0000ffff,ff000000 over the other four); on a p5 four
    # GPUs per socket (its topology/p5.48xl-topo.xml: four PCIe switches, one GPU each, under each socket).
    for n in range(facts.gpus):
        dev = pci / f"0000:{n + 16:02x}:00.0"
        node = n * SOCKETS // facts.gpus
        (dev / "numa_node").write_text(f"{node}\n")
        (dev / "local_cpulist").write_text((root / f"sys/devices/system/node/node{node}/cpulist").read_text())
    driver = root / "sys/bus/pci/drivers/efa"
    driver.mkdir(parents=True)
    for n in range(facts.efa_interfaces):
        dev = root / f"sys/devices/efa{n}"
        dev.mkdir(parents=True)
        (dev / "driver").symlink_to(driver)
        ib = root / f"sys/class/infiniband/rdmap{n + 16}s27"
        ib.mkdir(parents=True)
        (ib / "device").symlink_to(dev)
    models = ["Amazon Elastic Block Store"] * ebs_volumes + [
        "Amazon EC2 NVMe Instance Storage"
    ] * facts.nvme_devices
    for n, model in enumerate(models):
        ctrl = root / f"sys/class/nvme/nvme{n}"
        (ctrl / f"nvme{n}n1").mkdir(parents=True)
        (ctrl / "model").write_text(model.ljust(40) + "\n")
    status = root / "proc/self/status"
    status.parent.mkdir(parents=True)
    status.write_text("Name:\tpython3\nCapEff:\t000001ffffffffff\n")
    return root


def cluster_group_vars(tmp_path: Path, instance_type: str, **spec_overrides: Any) -> dict[str, Any]:
    """The `fsdp_*` group vars the real inventory builder writes for an AWS cluster of that type."""
    spec = {
        "name": "rt",
        "region": "us-east-1",
        "availability_zone": "us-east-1b",
        "instance_type": instance_type,
        "node_count": 2,
        "ssh_cidr": "203.0.113.0/24",
        **spec_overrides,
    }
    state = ClusterState(name="rt", root=tmp_path / "rt")
    state.root.mkdir(parents=True)
    state.spec_path.write_text(yaml.safe_dump(spec))
    state.update(
        name="rt",
        target="aws",
        created_at=0.0,
        shared_dir="/fsx",
        stack_outputs={
            "fsx_dns_name": "fs-0123.fsx.us-east-1.amazonaws.com",
            "fsx_mount_name": "abcd1234",
            "checkpoint_bucket": "rt-checkpoints",
        },
    )
    return group_vars(state.read(), state.spec())


def node_variables(
    tmp_path: Path, instance_type: str, hardware: dict[str, Any], **overrides: Any
) -> dict[str, Any]:
    """Every variable a role sees on node 0 of a two-node cluster: role defaults < inventory < role vars <
    facts, as Ansible orders them."""
    defaults: dict[str, Any] = {}
    role_vars: dict[str, Any] = {}
    for role in ("hardware", *ROLES):
        defaults.update(_load(ROLES_DIR / role / "defaults/main.yml"))
        role_vars.update(_load(ROLES_DIR / role / "vars/main.yml"))
    nodes = {
        f"rt-node{rank}": {"ansible_host": address, "node_rank": rank}
        for rank, address in enumerate(NODE_ADDRESSES)
    }
    facts = {
        "default_ipv4": {"interface": "ens32", "address": NODE_ADDRESSES[0]},
        "ens32": {"mtu": 9001, "macaddress": "0a:1b:2c:3d:4e:5f"},
        "distribution": "Ubuntu",
        "distribution_version": "22.04",
        "distribution_major_version": "22",
        "distribution_release": "jammy",
        "architecture": "x86_64",
        "kernel": "6.8.0-1021-aws",
        "os_family": "Debian",
        "processor_vcpus": 96,
    }
    return {
        **defaults,
        **cluster_group_vars(tmp_path, instance_type),
        **role_vars,
        "groups": {"nodes": list(nodes)},
        "hostvars": nodes,
        "inventory_hostname": "rt-node0",
        "ansible_facts": facts,
        "fsdp_hardware": hardware,
        "ansible_managed": "Ansible managed",
        **overrides,
    }


def render(text: str, variables: dict[str, Any]) -> Any:
    """Template `text` as Ansible does (trusted template, lazily templated variables, Ansible's filters)."""
    return Templar(loader=_loader, variables=variables).template(trust_as_template(text))


def render_template(role: str, name: str, variables: dict[str, Any]) -> str:
    return render((ROLES_DIR / role / "templates" / name).read_text(), variables)


def role_tasks(role: str, tasks_file: str) -> list[dict[str, Any]]:
    """A role's tasks file as written, each block followed by the tasks of its `block` and `rescue`."""
    flat = []
    for task in yaml.safe_load((ROLES_DIR / role / "tasks" / tasks_file).read_text()):
        flat += [task, *task.get("block", []), *task.get("rescue", [])]
    return flat


def task_expression(role: str, tasks_file: str, task_name: str, *path: str) -> str:
    """A Jinja expression exactly as written in a role's task (e.g. a command's argv)."""
    task = next(t for t in role_tasks(role, tasks_file) if t.get("name") == task_name)
    value: Any = task
    for key in path:
        value = value[key]
    return value


def ansible_env(tmp_path: Path) -> dict[str, str]:
    """Environment for ansible-playbook: the project's ansible.cfg; Ansible writes only under tmp_path."""
    home = tmp_path / "ansible-home"
    return {
        **os.environ,
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"),
        "ANSIBLE_HOME": str(home),
        "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
        "ANSIBLE_REMOTE_TEMP": str(home / "remote-tmp"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_DEPRECATION_WARNINGS": "False",
    }


def run_playbook(tmp_path: Path, playbook: str, *args: str) -> subprocess.CompletedProcess:
    """Run a playbook against the implicit localhost (connection local)."""
    path = tmp_path / "play.yml"
    path.write_text(playbook)
    return subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            "localhost,",
            "-c",
            "local",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            str(path),
            *args,
        ],
        cwd=REPO,
        env=ansible_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )


def detect_hardware(root: Path) -> dict[str, Any]:
    """The `fsdp.cluster.hardware_facts` module's detection, run on a sysfs tree."""
    path = ANSIBLE_DIR / "collections/ansible_collections/fsdp/cluster/plugins/modules/hardware_facts.py"
    spec = importlib.util.spec_from_file_location("fsdp_hardware_facts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.detect(str(root))


@pytest.fixture
def gpu_node(tmp_path):
    """Variables of node 0 of a p4d or p5 cluster, its hardware detected from an instance-like sysfs."""

    def make(instance_type: str, **overrides: Any) -> dict[str, Any]:
        root = tmp_path / f"sysfs-{instance_type}"
        hardware = detect_hardware(root if root.exists() else sysfs_tree(root, instance_type))
        return node_variables(tmp_path / f"state-{instance_type}", instance_type, hardware, **overrides)

    return make
