"""Every role template, and the Jinja expressions the tasks compute from hardware facts, rendered by
Ansible's own templating with the variables of a p4d and a p5 node (inventory from the real builder,
hardware detected from an instance-like sysfs)."""

from __future__ import annotations

import configparser
import re
import subprocess

import pytest
import yaml

from infra import catalog
from tests.ansible.conftest import ROLES_DIR, render, render_template, task_expression

INSTANCE_TYPES = ["p4d.24xlarge", "p5.48xlarge"]
TEMPLATES = sorted(str(p.relative_to(ROLES_DIR)) for p in ROLES_DIR.glob("*/templates/*.j2"))
# Facts a role sets before it renders a template (set_fact in its tasks).
SET_FACTS = {
    "gpudirect_module": "efa_nv_peermem",
    "network_sysctls_skipped": {},
    "network_macaddress": "0a:1b:2c:3d:4e:5f",
    "monitoring_volume": {"stdout_lines": ["1M-blocks", "  100000"]},
    "monitoring_retention_mb": 20000,
    "slurm_use_cgroup": True,
    "slurm_hardware": {"results": [{"item": "node-0", "stdout_lines": ["NodeName=node-0 CPUs=96", "8"],
                                    "stdout": "NodeName=node-0 CPUs=96 Boards=1 SocketsPerBoard=2 "
                                              "CoresPerSocket=24 ThreadsPerCore=2 RealMemory=1160000\n8"}]},
}


def with_applied_sysctls(variables):
    return {**variables, "network_sysctls_applied": render("{{ network_sysctls }}", variables)}


@pytest.mark.parametrize("instance_type", INSTANCE_TYPES)
@pytest.mark.parametrize("template", TEMPLATES)
def test_every_template_renders(gpu_node, instance_type, template):
    role, _, name = template.split("/")
    text = render_template(role, name, with_applied_sysctls(gpu_node(instance_type, **SET_FACTS)))
    assert text.strip() and "{{" not in text and "{%" not in text
    managed = text.startswith(("# Ansible managed", "// Ansible managed"))
    assert managed or name == "hosts-block.j2"  # a block inside /etc/hosts, marked by blockinfile


@pytest.mark.parametrize("instance_type", INSTANCE_TYPES)
def test_nccl_environment_for_the_pinned_versions(gpu_node, instance_type):
    text = render_template("nccl", "nccl.env.j2", gpu_node(instance_type))
    env = dict(re.findall(r'^([A-Z_]+)="([^"]*)"$', text, re.MULTILINE))
    # current pins (EFA installer 1.47.0: libfabric >= 2.1, aws-ofi-nccl >= 1.14; NCCL 2.29): only these;
    # FI_EFA_USE_HUGE_PAGE only when asked for (nccl_efa_disable_huge_pages)
    assert env == {
        "NCCL_SOCKET_IFNAME": "^docker,lo,veth",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    assert "EFA installer 1.47.0" in text and "NCCL 2.29.3-1" in text
    assert not [line for line in text.splitlines() if line.startswith("RDMAV")]


@pytest.mark.parametrize(
    ("installer", "libfabric", "ofi", "nccl", "expected"),
    [
        # aws-ofi-nccl 1.6.x: GPUDirect RDMA requested; installer < 1.29.1 with NCCL >= 2.19: sync memops off
        (
            "1.25.0",
            "1.18.1",
            "1.6.0",
            "2.19.3-1",
            {"FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_SET_CUDA_SYNC_MEMOPS": "0"},
        ),
        # aws-ofi-nccl <= 1.5: efa provider and simple protocol pinned; no sync-memops switch before NCCL 2.19
        ("1.15.0", "1.15.1", "1.5.0", "2.12.12-1", {"FI_PROVIDER": "efa", "NCCL_PROTO": "simple"}),
        # libfabric >= 1.18 and aws-ofi-nccl >= 1.7, installer >= 1.29.1: nothing beyond the defaults
        ("1.30.0", "1.19.0", "1.7.4", "2.21.5-1", {}),
    ],
)
def test_nccl_environment_conditions(gpu_node, installer, libfabric, ofi, nccl, expected):
    variables = gpu_node(
        "p4d.24xlarge",
        fsdp_efa_installer_version=installer,
        efa_libfabric_version=libfabric,
        nccl_aws_ofi_nccl_version=ofi,
        fsdp_nccl_version=nccl,
    )
    env = dict(
        re.findall(r'^([A-Z_]+)="([^"]*)"$', render_template("nccl", "nccl.env.j2", variables), re.MULTILINE)
    )
    assert env == {
        **expected,
        "NCCL_SOCKET_IFNAME": "^docker,lo,veth",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


@pytest.mark.parametrize("instance_type", INSTANCE_TYPES)
def test_huge_pages_are_turned_off_only_when_asked_for(gpu_node, instance_type):
    # AWS: FI_EFA_USE_HUGE_PAGE=0 only when os.fork() fails with ENOMEM (it costs performance)
    variables = gpu_node(instance_type)
    for asked, expected in ((False, None), (True, "0")):
        text = render_template("nccl", "nccl.env.j2", {**variables, "nccl_efa_disable_huge_pages": asked})
        env = dict(re.findall(r'^([A-Z_]+)="([^"]*)"$', text, re.MULTILINE))
        assert env.get("FI_EFA_USE_HUGE_PAGE") == expected


def test_old_efa_installer_needs_explicit_plugin_versions(gpu_node):
    variables = gpu_node("p4d.24xlarge", fsdp_efa_installer_version="1.25.0")
    assert render("{{ nccl_aws_ofi_nccl_version | trim }}", variables) == ""


def test_profile_script_exports_the_environment_file(gpu_node, tmp_path):
    env_file, profile = tmp_path / "nccl.env", tmp_path / "nccl.sh"
    variables = gpu_node(
        "p5.48xlarge",
        nccl_environment_file=str(env_file),
        nccl_extra_environment={"NCCL_DEBUG": "INFO"},
        nccl_efa_disable_huge_pages=True,
    )
    env_file.write_text(render_template("nccl", "nccl.env.j2", variables))
    profile.write_text(render_template("nccl", "nccl-profile.sh.j2", variables))
    out = subprocess.run(
        ["sh", "-c", f". {profile} && sh -c 'env'"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    ).stdout
    assert "NCCL_SOCKET_IFNAME=^docker,lo,veth" in out.splitlines()
    assert "NCCL_DEBUG=INFO" in out.splitlines() and "FI_EFA_USE_HUGE_PAGE=0" in out.splitlines()


def test_persistence_daemon_unit_turns_persistence_mode_on_from_boot(gpu_node):
    # Ubuntu's and NVIDIA's unit: static, StopWhenUnneeded=true, --no-persistence-mode (nvidia-smi: Disabled)
    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str
    unit.read_string(render_template("nvidia", "nvidia-persistenced.service.j2", gpu_node("p4d.24xlarge")))
    command = unit["Service"]["ExecStart"].split()
    assert command[0] == "/usr/bin/nvidia-persistenced" and "--persistence-mode" in command
    assert "--no-persistence-mode" not in command
    assert unit["Unit"]["StopWhenUnneeded"] == "false"
    assert unit["Install"]["WantedBy"] == "multi-user.target"  # started at boot once enabled
    # Type=forking: systemd follows the daemon through the pid file it writes
    assert unit["Service"]["Type"] == "forking"
    assert unit["Service"]["PIDFile"] == "/run/nvidia-persistenced/nvidia-persistenced.pid"


def test_ssh_keepalive_survives_thirty_idle_minutes(gpu_node):
    variables = gpu_node("p4d.24xlarge")
    server = render_template("common", "sshd-keepalive.conf.j2", variables)
    client = render_template("common", "ssh-client-keepalive.conf.j2", variables)
    interval = int(re.search(r"^ClientAliveInterval (\d+)$", server, re.MULTILINE)[1])
    count = int(re.search(r"^ClientAliveCountMax (\d+)$", server, re.MULTILINE)[1])
    assert interval * count == 30 * 60
    assert f"ServerAliveInterval {interval}" in client and f"ServerAliveCountMax {count}" in client


def test_hosts_block_lists_every_node_and_chrony_uses_amazon_time_sync(gpu_node):
    variables = gpu_node("p5.48xlarge")
    assert render_template("common", "hosts-block.j2", variables).splitlines() == [
        "10.42.1.10 rt-node0",
        "10.42.1.11 rt-node1",
    ]
    assert "server 169.254.169.123 prefer iburst" in render_template("common", "chrony-sources.j2", variables)


@pytest.mark.parametrize("instance_type", INSTANCE_TYPES)
def test_mtu_persisted_for_every_network_manager(gpu_node, instance_type):
    variables = gpu_node(instance_type, network_macaddress="0a:1b:2c:3d:4e:5f")
    netplan = yaml.safe_load(render_template("network", "netplan-mtu.yaml.j2", variables))
    assert netplan == {"network": {"version": 2, "ethernets": {"ens32": {"mtu": 9000}}}}
    assert "MTUBytes=9000" in render_template("network", "networkd-mtu.conf.j2", variables).splitlines()
    link = render_template("network", "mtu.link.j2", variables)
    assert "MACAddress=0a:1b:2c:3d:4e:5f" in link and "MTUBytes=9000" in link and "NamePolicy=" in link


def test_sysctl_file_on_a_gpu_instance_sets_every_key(gpu_node):
    variables = with_applied_sysctls(gpu_node("p4d.24xlarge", network_sysctls_skipped={}))
    text = render_template("network", "sysctl.conf.j2", variables)
    settings = dict(line.split(" = ") for line in text.splitlines() if line and not line.startswith("#"))
    assert settings["net.core.rmem_max"] == "67108864"
    assert settings["net.ipv4.tcp_rmem"] == "4096 87380 67108864"
    assert len(settings) == len(render("{{ network_sysctls }}", variables))


def test_sysctls_a_container_cannot_set_are_listed_not_set(gpu_node):
    probe = [
        "net.core.rmem_max=host-wide, read-only in a container",
        "net.core.netdev_max_backlog=not in this network namespace",
    ]
    variables = gpu_node("p4d.24xlarge", network_sysctl_probe={"stdout_lines": probe})
    split_task = "Split the sysctls into those set here and those left to the host"
    unsettable = render(
        task_expression("network", "sysctl.yml", split_task, "vars", "network_unsettable"), variables
    )
    assert unsettable == {
        "net.core.rmem_max": "host-wide, read-only in a container",
        "net.core.netdev_max_backlog": "not in this network namespace",
    }
    applied_expression = task_expression(
        "network", "sysctl.yml", split_task, "ansible.builtin.set_fact", "network_sysctls_applied"
    )
    applied = render(applied_expression, {**variables, "network_unsettable": unsettable})
    assert "net.core.rmem_max" not in applied and applied["net.core.somaxconn"] == 8192
    text = render_template(
        "network",
        "sysctl.conf.j2",
        {
            **variables,
            "network_sysctls_applied": applied,
            "network_sysctls_skipped": unsettable,
            "fsdp_hardware": {"container": "systemd-nspawn"},
        },
    )
    assert "\nnet.core.somaxconn = 8192\n" in text
    assert "#   net.core.rmem_max = 67108864  (host-wide, read-only in a container)" in text
    assert not re.search(r"^net\.core\.(rmem_max|netdev_max_backlog)", text, re.MULTILINE)


def test_limits_for_sessions_and_services(gpu_node):
    variables = gpu_node("p5.48xlarge")
    pam = render_template("limits", "limits.conf.j2", variables).splitlines()
    for domain in ("*", "root"):
        for kind in ("soft", "hard"):
            assert f"{domain} {kind} memlock unlimited" in pam and f"{domain} {kind} nofile 1048576" in pam
    systemd = render_template("limits", "system-limits.conf.j2", variables).splitlines()
    assert "DefaultLimitMEMLOCK=infinity" in systemd and "DefaultLimitNOFILE=1048576" in systemd
    kib = render_template("limits", "system-limits.conf.j2", {**variables, "limits_memlock": "65536"})
    assert "DefaultLimitMEMLOCK=67108864" in kib.splitlines()


@pytest.mark.parametrize("instance_type", INSTANCE_TYPES)
def test_fi_info_device_count_check(gpu_node, instance_type):
    efa = catalog.CATALOG[instance_type].efa_interfaces
    fi_info = "".join(
        f"provider: efa\n    fabric: efa\n    domain: rdmap{n}s27-rdm\n    version: 122.0\n"
        f"    type: FI_EP_RDM\n    protocol: FI_PROTO_EFA\n"
        for n in range(efa)
    )
    variables = gpu_node(instance_type, efa_fi_info_out={"stdout": fi_info})
    expression = task_expression(
        "efa", "verify.yml", "Check libfabric sees every EFA device", "vars", "efa_fi_domains"
    )
    domains = render(expression, variables)
    assert len(domains) == efa == render("{{ efa_expected_count }}", variables)
    assert domains[0] == "rdmap0s27"


def test_nvidia_smi_check_parses_every_gpu(gpu_node):
    rows = [f"{n}, 580.95.05, Enabled" for n in range(8)]
    variables = gpu_node("p5.48xlarge", nvidia_smi_query={"stdout_lines": rows})
    gpus = render(
        task_expression(
            "nvidia",
            "driver.yml",
            "Check the driver version and persistence mode on every GPU",
            "vars",
            "nvidia_gpus",
        ),
        variables,
    )
    assert len(gpus) == render("{{ fsdp_hardware.gpu_count }}", variables) == 8
    assert {g[1].split(".")[0] for g in gpus} == {render("{{ nvidia_driver_branch }}", variables)}
    assert render("{{ nvidia_nvswitch }}", variables) is True
