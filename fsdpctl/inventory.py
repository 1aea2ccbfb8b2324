"""The Ansible inventory of a cluster, for both targets, from its spec and state.

One group `nodes`; host names are `spec.node_name(rank)`; host vars carry the address, `node_rank` and
the SSH settings (bastion hop included); group vars are the `fsdp_*` contract the roles read.
Excluded nodes (`fsdpctl exclude`) are left out. The INI form (written to the state dir, used by
`fsdpctl configure`) writes every value as a Python literal, which Ansible's INI parser reads back with
its type (true stays a boolean, 9000 an integer); the JSON form is the YAML-inventory layout, so both
work with plain `ansible-playbook -i`.
"""

from __future__ import annotations

import ast
import os
import shlex
from argparse import Namespace
from pathlib import Path
from typing import Any

from fsdpctl import state as state_mod
from fsdpctl.console import print_json, say
from fsdpctl.errors import UsageError
from fsdpctl.remote import ssh_options
from fsdpctl.state import ClusterRecord, ClusterState, resolve_cluster
from infra.spec import ClusterSpec

GROUP = "nodes"


def group_vars(record: ClusterRecord, spec: ClusterSpec) -> dict[str, Any]:
    target = record.target
    outputs = record.stack_outputs
    fsx_enabled = target == "aws" and spec.storage.fsx.enabled
    instance = spec.instance
    software = spec.software
    return {
        "fsdp_cluster_name": spec.name,
        "fsdp_target": target,
        "fsdp_offline": target == "local",
        # A local node is a container that its keeper starts again when it reboots, as a machine boots
        # again (fsdpctl/targets/local/keeper.py): a role that needs a reboot may reboot it.
        "fsdp_container_reboots": target == "local",
        "fsdp_mtu": spec.network.mtu,
        "fsdp_instance_type": spec.instance_type,
        "fsdp_gpus_per_node": instance.gpus,
        "fsdp_gpu_model": instance.gpu_model,
        "fsdp_efa_count": instance.efa_interfaces,
        "fsdp_nvme_devices": instance.nvme_devices,
        "fsdp_nvswitch": instance.nvswitch,
        "fsdp_scratch_mount": spec.storage.scratch_mount,
        "fsdp_shared_dir": record.shared_dir,
        "fsdp_fsx_enabled": fsx_enabled,
        "fsdp_fsx_dns_name": outputs.get("fsx_dns_name") if fsx_enabled else None,
        "fsdp_fsx_mount_name": outputs.get("fsx_mount_name") if fsx_enabled else None,
        "fsdp_fsx_mount_point": spec.storage.fsx.mount_point,
        "fsdp_region": spec.region,
        "fsdp_checkpoint_bucket": outputs.get("checkpoint_bucket"),
        "fsdp_nvidia_driver_branch": software.nvidia_driver_branch,
        "fsdp_cuda_version": software.cuda_version,
        "fsdp_gdrcopy_version": software.gdrcopy_version,
        "fsdp_efa_installer_version": software.efa_installer_version,
        "fsdp_efa_installer_sha256": software.efa_installer_sha256,
        "fsdp_nccl_version": software.nccl_version,
        "fsdp_nccl_tests_version": software.nccl_tests_version,
        # Power saving (spec `scaling:`): ranks below this never power down; the others after idling.
        "fsdp_static_node_count": spec.static_node_count,
        "fsdp_suspend_after_s": spec.scaling.suspend_after_s,
        # The job watcher (spec `recovery:`): when a training step with no new metrics has stalled,
        # and when a job whose GPUs idle is asked to checkpoint and requeue.
        "fsdp_stall_factor": spec.recovery.stall_factor,
        "fsdp_stall_min_s": spec.recovery.stall_min_s,
        "fsdp_gpu_idle_pct": spec.recovery.gpu_idle_pct,
        "fsdp_gpu_idle_s": spec.recovery.gpu_idle_s,
    }


def host_vars(record: ClusterRecord) -> dict[str, dict[str, Any]]:
    ssh, nodes = record.ssh, record.active_nodes()
    if not ssh or not nodes:
        raise UsageError(f"cluster {record.name} has no nodes in "
                         f"{state_mod.cluster_state(record.name).state_path} (all excluded, or "
                         "`fsdpctl up` did not finish): run `fsdpctl up` again")
    options = ssh_options(ssh)
    # The key goes to its own variable; the rest are shared by every ssh Ansible starts.
    key_at = options.index("-i")
    common_args = options[:key_at] + options[key_at + 2:]
    return {
        node.name: {
            "ansible_host": node.address,
            "node_rank": node.rank,
            "ansible_user": ssh.user,
            "ansible_ssh_private_key_file": ssh.key_file,
            "ansible_ssh_common_args": shlex.join(common_args),
            "ansible_python_interpreter": "/usr/bin/python3",
            # The power program on the controller starts and stops AWS nodes by instance id.
            **({"instance_id": node.instance_id} if node.instance_id else {}),
        }
        for node in nodes
    }


def build_inventory(record: ClusterRecord, spec: ClusterSpec) -> dict[str, Any]:
    """The inventory in Ansible's YAML-inventory layout (valid as JSON too)."""
    return {"all": {"children": {GROUP: {"hosts": host_vars(record), "vars": group_vars(record, spec)}}}}


def _ini_value(value: Any) -> str:
    # Ansible's INI parser runs ast.literal_eval on each value: Python literals keep their types.
    return repr(value)


def _ini_host_value(value: Any) -> str:
    """A host-line value: Ansible shell-splits the line first, then literal_evals each value."""
    if isinstance(value, str):
        try:
            ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return shlex.quote(value)  # not a literal, so Ansible keeps it as this string
    return shlex.quote(_ini_value(value))


def render_ini(inventory: dict[str, Any]) -> str:
    group = inventory["all"]["children"][GROUP]
    lines = ["# Written by fsdpctl from the cluster spec and state; regenerate with `fsdpctl inventory`.",
             f"[{GROUP}]"]
    for host, variables in group["hosts"].items():
        # Host lines are split like a shell command line, then each value is literal_eval'd.
        lines.append(" ".join([host, *(f"{k}={_ini_host_value(v)}" for k, v in variables.items())]))
    lines += ["", f"[{GROUP}:vars]"]
    lines += [f"{k}={_ini_value(v)}" for k, v in group["vars"].items()]
    return "\n".join(lines) + "\n"


def write_inventory(state: ClusterState) -> Path:
    """Write inventory.ini into the state dir (after up, exclude) and return its path: the state as
    it is now, read once."""
    text = render_ini(build_inventory(state.read(), state.spec()))
    tmp = state.inventory_path.with_name(f"inventory.ini.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(state.inventory_path)
    return state.inventory_path


def cmd_inventory(args: Namespace) -> int:
    _state, record, spec = resolve_cluster(args.cluster)
    inventory = build_inventory(record, spec)
    if args.format == "json":
        print_json(inventory)
    else:
        say(render_ini(inventory).rstrip("\n"))
    return 0
