"""The playbook as Ansible and ansible-lint see it: syntax, the production lint profile, inputs rejected
before any role changes anything, and hardware skips counted as skipped. Runs against localhost only
through tasks that read and validate (nothing on this machine changes)."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.ansible.conftest import ANSIBLE_DIR, BIN, REPO, ansible_env, run_playbook, sysfs_tree

RECAP = re.compile(
    r"^localhost\s+: ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)\s+skipped=(\d+)",
    re.MULTILINE,
)
# The validation entry point of a role (what site.yml runs for every role before any role runs).
VALIDATE = """
- name: Validate one role's settings
  hosts: all
  gather_facts: false
  tasks:
    - name: Check {role}
      ansible.builtin.include_role:
        name: {role}
        tasks_from: validate
"""


def test_site_playbook_syntax(tmp_path):
    result = subprocess.run(
        [str(BIN / "ansible-playbook"), "--syntax-check", "-i", "localhost,", "ansible/site.yml"],
        cwd=REPO,
        env=ansible_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_ansible_lint_production_profile_is_clean(tmp_path):
    result = subprocess.run(
        [str(BIN / "ansible-lint"), "--offline", "--profile", "production", "--nocolor"],
        cwd=ANSIBLE_DIR,
        env=ansible_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Failed" not in result.stderr


@pytest.mark.parametrize(
    ("role", "extra_vars", "message"),
    [
        (
            "network",
            ["fsdp_mtu=70000"],
            "network_mtu (from fsdp_mtu) is 70000: an MTU must be between 576 and 9001 "
            "(9001 is the AWS VPC maximum). Set fsdp_mtu: 9000.",
        ),
        ("network", ["fsdp_mtu=jumbo"], "argument 'network_mtu' is of type str"),
        ("limits", ["limits_nofile=64"], "limits_nofile between 1024 and 1073741816"),
        ("efa", ["fsdp_efa_installer_sha256=not-a-checksum"], "must be 64 hex digits or empty"),
        (
            "nccl",
            ["fsdp_efa_installer_version=1.25.0"],
            "set nccl_libfabric_version and nccl_aws_ofi_nccl_version",
        ),
    ],
)
def test_bad_input_is_rejected_with_a_clear_message(tmp_path, role, extra_vars, message):
    args = [a for v in [*extra_vars, "network_interface=lo"] for a in ("-e", v)]
    result = run_playbook(tmp_path, VALIDATE.format(role=role), *args)
    assert result.returncode == 2, result.stdout[-3000:]
    output = " ".join(result.stdout.split())
    assert message in output, result.stdout[-3000:]
    assert RECAP.search(result.stdout)[4] == "1"


def test_good_input_passes_validation(tmp_path):
    playbook = "\n".join(
        VALIDATE.format(role=role) for role in ("network", "limits", "efa", "nccl", "gpudirect")
    )
    result = run_playbook(tmp_path, playbook, "-e", "fsdp_mtu=9001", "-e", "network_interface=lo")
    assert result.returncode == 0, result.stdout[-3000:]


def test_skip_reports_skipped_with_its_reason(tmp_path):
    result = run_playbook(
        tmp_path,
        """
- name: Skip
  hosts: all
  gather_facts: false
  tasks:
    - name: Skip the driver
      fsdp.cluster.skip:
        reason: no NVIDIA GPU on this node
    - name: Skip without a reason
      fsdp.cluster.skip:
        reason: ""
      ignore_errors: true
""",
    )
    assert result.returncode == 0, result.stdout[-3000:]
    # shown without -v, as the recap's skipped count
    assert re.search(
        r"^skipping: \[localhost\] => \n(    .*\n)*    skip_reason: no NVIDIA GPU on this node$",
        result.stdout,
        re.MULTILINE,
    ), result.stdout
    assert "needs a non-empty 'reason'" in result.stdout
    _, changed, _, failed, skipped = map(int, RECAP.search(result.stdout).groups())
    assert (skipped, failed, changed) == (1, 0, 0)


def test_hardware_facts_module_sets_the_fact(tmp_path):
    root = sysfs_tree(tmp_path / "sysfs", "p5.48xlarge")
    result = run_playbook(
        tmp_path,
        f"""
- name: Detect
  hosts: all
  gather_facts: false
  tasks:
    - name: Detect the hardware of a p5-shaped sysfs
      fsdp.cluster.hardware_facts:
        sysfs_root: {root}
    - name: Show the fact
      ansible.builtin.debug:
        msg: >-
          counts {{{{ fsdp_hardware.gpu_count }}}} {{{{ fsdp_hardware.efa_count }}}}
          {{{{ fsdp_hardware.nvme_instance_store | length }}}}
""",
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "counts 8 32 8" in result.stdout
