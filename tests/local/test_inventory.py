"""The inventory for both targets, built from state files shaped like the ones `up` writes, and read
back by Ansible itself (INI and JSON must mean the same thing, types included)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdpctl import remote
from fsdpctl import state as state_mod
from fsdpctl.errors import CommandError
from fsdpctl.inventory import build_inventory, group_vars, render_ini, write_inventory
from tests.local.conftest import fsdpctl, spec_file

BASTION = "ubuntu@203.0.113.10"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def local_state(tmp_path: Path):
    spec_path = spec_file(tmp_path, "inv-local")
    state = state_mod.create(spec_path, state_mod.load_spec(spec_path), "local")
    state.update(nodes=[{"rank": r, "name": f"inv-local-node{r}", "address": f"198.18.1.{2 + r}"}
                        for r in range(2)],
                 ssh={"user": "root", "key_file": str(state.keys_dir / "id_ed25519"),
                      "known_hosts": str(state.root / "known_hosts"), "proxy_jump": None},
                 shared_dir="/shared", excluded=[])
    return state


def aws_state(tmp_path: Path):
    spec_path = spec_file(tmp_path, "inv-aws", node_count=3,
                          storage={"fsx": {"enabled": True, "mount_point": "/fsx"}})
    state = state_mod.create(spec_path, state_mod.load_spec(spec_path), "aws")
    state.update(
        nodes=[{"rank": r, "name": f"inv-aws-node{r}", "address": f"10.42.1.{10 + r}",
                "instance_id": f"i-0000000000000000{r}"} for r in range(3)],
        ssh={"user": "ubuntu", "key_file": str(tmp_path / "id_ed25519"),
             "known_hosts": str(tmp_path / "known_hosts"), "proxy_jump": BASTION},
        shared_dir="/fsx", excluded=[{"rank": 2, "reason": "XID 79", "time": "2026-01-01T00:00:00+00:00"}],
        stack_outputs={"fsx_dns_name": "fs-0123.fsx.us-east-1.amazonaws.com", "fsx_mount_name": "abcdefgh",
                       "checkpoint_bucket": "inv-aws-checkpoints", "bastion_public_ip": "203.0.113.10"})
    return state


def test_local_inventory_has_nodes_ranks_and_contract_vars(home, tmp_path):
    state = local_state(tmp_path)
    inventory = build_inventory(state.read(), state.spec())
    group = inventory["all"]["children"]["nodes"]
    assert list(group["hosts"]) == ["inv-local-node0", "inv-local-node1"]
    node1 = group["hosts"]["inv-local-node1"]
    assert (node1["ansible_host"], node1["node_rank"], node1["ansible_user"]) == ("198.18.1.3", 1, "root")
    assert "ProxyCommand" not in node1["ansible_ssh_common_args"]
    assert "UserKnownHostsFile=" in node1["ansible_ssh_common_args"]
    v = group["vars"]
    assert (v["fsdp_target"], v["fsdp_offline"], v["fsdp_mtu"]) == ("local", True, 9000)
    assert v["fsdp_container_reboots"] is True  # the keeper boots a rebooted node again
    assert (v["fsdp_gpus_per_node"], v["fsdp_efa_count"], v["fsdp_nvme_devices"]) == (8, 4, 8)
    assert v["fsdp_shared_dir"] == "/shared" and v["fsdp_fsx_enabled"] is False
    assert v["fsdp_nccl_version"] == "2.29.3-1" and v["fsdp_efa_installer_sha256"] is None
    contract = {"fsdp_cluster_name", "fsdp_target", "fsdp_offline", "fsdp_container_reboots", "fsdp_mtu",
                "fsdp_instance_type", "fsdp_gpus_per_node", "fsdp_gpu_model", "fsdp_efa_count",
                "fsdp_nvme_devices", "fsdp_nvswitch", "fsdp_scratch_mount", "fsdp_shared_dir",
                "fsdp_fsx_enabled", "fsdp_fsx_dns_name",
                "fsdp_fsx_mount_name", "fsdp_fsx_mount_point", "fsdp_region", "fsdp_checkpoint_bucket",
                "fsdp_nvidia_driver_branch", "fsdp_cuda_version", "fsdp_gdrcopy_version",
                "fsdp_efa_installer_version", "fsdp_efa_installer_sha256", "fsdp_nccl_version",
                "fsdp_nccl_tests_version", "fsdp_static_node_count", "fsdp_suspend_after_s",
                "fsdp_stall_factor", "fsdp_stall_min_s", "fsdp_gpu_idle_pct", "fsdp_gpu_idle_s"}
    assert set(v) == contract
    assert (v["fsdp_stall_factor"], v["fsdp_stall_min_s"]) == (10, 300)
    assert (v["fsdp_gpu_idle_pct"], v["fsdp_gpu_idle_s"]) == (5, 1800)
    # a fixed cluster: every node static; local nodes have no instance id
    assert (v["fsdp_static_node_count"], v["fsdp_suspend_after_s"]) == (2, 600)
    assert "instance_id" not in node1


def test_aws_inventory_goes_through_the_bastion_and_leaves_excluded_nodes_out(home, tmp_path):
    state = aws_state(tmp_path)
    inventory = build_inventory(state.read(), state.spec())
    group = inventory["all"]["children"]["nodes"]
    assert list(group["hosts"]) == ["inv-aws-node0", "inv-aws-node1"]
    args = group["hosts"]["inv-aws-node0"]["ansible_ssh_common_args"]
    assert "ProxyCommand=" in args and f"-W %h:%p {BASTION}" in args
    assert str(tmp_path / "id_ed25519") in args, "the hop must use the cluster key too"
    v = group["vars"]
    assert (v["fsdp_target"], v["fsdp_offline"], v["fsdp_fsx_enabled"]) == ("aws", False, True)
    assert v["fsdp_container_reboots"] is False
    assert v["fsdp_fsx_dns_name"] == "fs-0123.fsx.us-east-1.amazonaws.com"
    assert v["fsdp_fsx_mount_name"] == "abcdefgh" and v["fsdp_checkpoint_bucket"] == "inv-aws-checkpoints"
    # the controller's power program starts and stops nodes by instance id
    assert group["hosts"]["inv-aws-node1"]["instance_id"] == "i-00000000000000001"


def test_an_elastic_cluster_tells_the_roles_which_ranks_stay_on_and_how_long_others_idle(home, tmp_path):
    spec_path = spec_file(tmp_path, "inv-elastic", node_count=4, capacity={"all_or_nothing": False},
                          scaling={"min_nodes": 2, "suspend_after_s": 900})
    state = state_mod.create(spec_path, state_mod.load_spec(spec_path), "aws")
    v = group_vars(state.read(), state.spec())
    assert (v["fsdp_static_node_count"], v["fsdp_suspend_after_s"]) == (2, 900)


def test_ssh_uses_the_bastion_as_proxy(home, tmp_path):
    state = aws_state(tmp_path)
    argv = remote.ssh_argv(state, remote.node_by_rank(state, 1), "hostname")
    # `ssh -G` prints the configuration ssh would use, without connecting anywhere.
    config = subprocess.run(["ssh", "-G", *argv[1:-1]], capture_output=True, text=True, check=True).stdout
    settings = dict(line.split(" ", 1) for line in config.splitlines() if " " in line)
    assert settings["hostname"] == "10.42.1.11" and settings["user"] == "ubuntu"
    assert settings["proxycommand"].startswith("ssh ") and settings["proxycommand"].endswith(BASTION)
    assert settings["stricthostkeychecking"] in ("accept-new", "true")
    assert settings["batchmode"] == "yes"


@pytest.mark.parametrize("make_state", [local_state, aws_state])
def test_ini_and_json_mean_the_same_to_ansible(home, tmp_path, make_state):
    state = make_state(tmp_path)
    ini = write_inventory(state)
    as_json = tmp_path / "inventory.json"
    inventory = build_inventory(state.read(), state.spec())
    as_json.write_text(json.dumps(inventory))
    assert ini.read_text() == render_ini(inventory)
    bin_dir = Path(sys.executable).parent

    def ansible_view(path: Path) -> dict:
        out = subprocess.run([str(bin_dir / "ansible-inventory"), "-i", str(path), "--list"], check=True,
                             capture_output=True, text=True,
                             env={"PATH": f"{bin_dir}:/usr/bin:/bin", "ANSIBLE_HOME": str(tmp_path / "ah"),
                                  "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ah/tmp")}).stdout
        return json.loads(out)

    from_ini, from_json = ansible_view(ini), ansible_view(as_json)
    assert from_ini["_meta"]["hostvars"] == from_json["_meta"]["hostvars"]
    assert from_ini["nodes"]["hosts"] == from_json["nodes"]["hosts"]
    first = from_ini["_meta"]["hostvars"][from_ini["nodes"]["hosts"][0]]
    assert first["node_rank"] == 0 and first["fsdp_mtu"] == 9000
    assert first["fsdp_offline"] is (state.read().target == "local")
    assert first["fsdp_efa_installer_sha256"] is None


def test_inventory_of_a_cluster_without_nodes_is_a_clear_error(home, tmp_path):
    spec_path = spec_file(tmp_path, "inv-empty")
    state = state_mod.create(spec_path, state_mod.load_spec(spec_path), "local")
    with pytest.raises(CommandError, match="no nodes"):
        build_inventory(state.read(), state.spec())


@pytest.mark.slow
def test_exclude_validates_rank_and_reason_and_drops_a_fully_excluded_inventory(home, tmp_path):
    state = local_state(tmp_path)
    write_inventory(state)
    unknown = fsdpctl(home, "exclude", "5", "--reason", "bad", check=False)
    assert unknown.returncode == 2 and "no node with rank 5 (ranks: 0, 1)" in unknown.stderr
    blank = fsdpctl(home, "exclude", "0", "--reason", "  ", check=False)
    assert blank.returncode == 2 and "--reason is empty" in blank.stderr
    fsdpctl(home, "exclude", "0", "--reason", "ECC errors")
    assert "inv-local-node0" not in state.inventory_path.read_text()
    last = fsdpctl(home, "exclude", "1", "--reason", "XID 79")
    assert "every node is now excluded" in last.stdout and not state.inventory_path.exists()
    assert [e.rank for e in state.read().excluded] == [0, 1]
