"""The node health check (the slurm role's fsdp-node-health: Prolog, Epilog and HealthCheckProgram),
run here against stand-in nvidia-smi, dmesg and scontrol and an instance-shaped sys tree: what each
check finds, the drain reason it gives Slurm, its exit status per hook, and the expectations file
the role renders for a p4d node and for a local node. Shellcheck passes it (a warning fails)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.ansible.conftest import ROLES_DIR, detect_hardware, node_variables, render_template, sysfs_tree
from tests.shaped import dlami

SCRIPT = ROLES_DIR / "slurm/files/fsdp-node-health"
P4D_GPUS, P4D_EFA = 8, 4
XID_79 = "[ 812.3] NVRM: Xid (PCI:0000:10:1c): 79, pid=4242, name=python, GPU has fallen off the bus.\n"
XID_13 = "[ 90.1] NVRM: Xid (PCI:0000:20:1c): 13, pid=77, name=python, Graphics Exception: ESR 0x1\n"


def gpu_rows(count: int = P4D_GPUS, **overrides: str) -> str:
    """nvidia-smi's answer to the check's query (csv, noheader, nounits); overrides by GPU index."""
    rows = [overrides.get(str(i), f"{i}, 00000000:{16 + i:02X}:1C.0, 0, No, No") for i in range(count)]
    return "".join(f"{row}\n" for row in rows)


class Node:
    """A node for the check: its expectations file, its sys tree and stand-in commands; run() runs
    the check as one hook and returns (exit status, the reason it drained with or None, stderr)."""

    def __init__(self, tmp_path: Path, **settings: object):
        self.tmp = tmp_path
        self.sysfs = sysfs_tree(tmp_path / "shape", "p4d.24xlarge")
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.scratch = tmp_path / "scratch"
        self.scratch.mkdir()
        self.settings = {"NODE_NAME": "rt-node1", "EXPECTED_GPUS": P4D_GPUS, "EXPECTED_EFA": P4D_EFA,
                         "DRAIN_XIDS": "'48 64 74 79 95 119 120 143'", "SYSFS_ROOT": self.sysfs,
                         "SCRATCH_DIR": self.scratch, "SCRATCH_MUST_BE_MOUNTED": "no",
                         "SCRATCH_MIN_FREE_GIB": 0, "DCGM_DIAG_LEVEL": 0, "PROBE_TIMEOUT_S": 5, **settings}
        self.nvidia_smi(gpu_rows())
        self.command("dmesg", "echo '[    0.000000] Linux version 6.8.0-1021-aws'")
        # scontrol: `show node` answers from the file `node`; `update` is recorded
        (tmp_path / "node").write_text("NodeName=rt-node1 State=IDLE Reason=(null)\n")
        self.command("scontrol", f'case "$2" in show) cat {tmp_path}/node ;; '
                                 f'*) echo "$@" >> {tmp_path}/updates ;; esac')

    def command(self, name: str, body: str) -> None:
        (self.bin / name).write_text(f"#!/bin/bash\n{body}\n")
        (self.bin / name).chmod(0o755)

    def nvidia_smi(self, answer: str, status: int = 0) -> None:
        (self.tmp / "smi.out").write_text(answer)
        self.command("nvidia-smi", f"cat {self.tmp}/smi.out; exit {status}")

    def run(self, hook: str | None = "prolog", **env: str) -> tuple[int, str | None, str]:
        conf = self.tmp / "node-health.conf"
        conf.write_text("".join(f"{key}={value}\n" for key, value in self.settings.items()))
        # The commands the check needs and nothing else: no nvidia-smi or dcgmi from this machine.
        path = f"{self.bin}:{self._system_tools()}"
        proc = subprocess.run(["bash", str(SCRIPT), *([hook] if hook else [])], capture_output=True,
                              text=True, timeout=60,
                              env={"PATH": path, "FSDP_NODE_HEALTH_CONF": str(conf), **env})
        updates = self.tmp / "updates"
        drained = updates.read_text().splitlines() if updates.exists() else []
        updates.unlink(missing_ok=True)
        assert len(drained) <= 1
        reason = drained[0].split("reason=", 1)[1] if drained else None
        if drained:
            assert drained[0].startswith("update nodename=rt-node1 state=DRAIN reason=")
        return proc.returncode, reason, proc.stderr

    def _system_tools(self) -> str:
        tools = self.tmp / "system"
        if not tools.exists():
            tools.mkdir()
            for name in ("bash", "timeout", "awk", "sed", "grep", "sort", "head", "df", "mountpoint", "date",
                         "readlink", "basename", "dirname", "hostname", "logger", "cat", "sleep", "tr", "rm"):
                found = shutil.which(name)
                if found:
                    (tools / name).symlink_to(found)
        return str(tools)


@pytest.fixture(scope="module")
def shellcheck() -> str:
    path = shutil.which("shellcheck")
    if path is None:
        pytest.fail("shellcheck is not installed: run `make host-packages` (apt-get install shellcheck)")
    return path


def test_the_script_passes_shellcheck(shellcheck):
    proc = subprocess.run([shellcheck, "--shell=bash", "--severity=warning", "--format=gcc", str(SCRIPT)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert os.access(SCRIPT, os.X_OK)


def test_a_healthy_gpu_node_passes_every_hook_without_draining(tmp_path):
    node = Node(tmp_path)
    for hook in ("prolog", "epilog", "periodic"):
        assert node.run(hook) == (0, None, "")


def test_a_gpu_that_fell_off_the_bus_drains_the_node_and_fails_the_prolog(tmp_path):
    node = Node(tmp_path)
    lost = "Unable to determine the device handle for GPU0000:17:1C.0: Unknown Error\n"
    node.nvidia_smi(gpu_rows(7) + lost, status=15)
    status, reason, stderr = node.run("prolog")
    assert status == 1
    assert reason == ("health (prolog): 7 of 8 GPUs answer nvidia-smi (Unable to determine the device handle "
                      "for GPU0000:17:1C.0: Unknown Error)")
    assert "prolog on rt-node1: FAILED in " in stderr and stderr.rstrip().endswith("drained")


def test_the_step_hook_of_a_jobs_retry_reports_a_fault_but_leaves_the_draining_to_the_epilog(tmp_path):
    """Run by the batch script (srun, as the job's user) after a failed step: exit 1 makes the job
    requeue instead of retrying in its allocation; the epilog, as root, drains the node after it."""
    node = Node(tmp_path)
    assert node.run("step") == (0, None, "")
    node.nvidia_smi(gpu_rows(**{"3": "3, 00000000:13:1C.0, 2, No, No"}))
    status, reason, stderr = node.run("step")
    assert (status, reason) == (1, None)
    assert stderr.rstrip().endswith("GPU 3 (00000000:13:1C.0) has 2 uncorrected ECC errors; not drained "
                                    "(the epilog drains it)")
    drained = node.run("epilog")[:2]
    assert drained == (1, "health (epilog): GPU 3 (00000000:13:1C.0) has 2 uncorrected ECC errors")


@pytest.mark.parametrize(("row", "problem"), [
    ("3, 00000000:13:1C.0, 2, No, No", "GPU 3 (00000000:13:1C.0) has 2 uncorrected ECC errors"),
    ("3, 00000000:13:1C.0, 0, Yes, No", "GPU 3 (00000000:13:1C.0) has a row remap pending (reset the GPU)"),
    ("3, 00000000:13:1C.0, 0, No, Yes", "GPU 3 (00000000:13:1C.0) row remapping failed"),
    ("3, 00000000:13:1C.0, [GPU requires reset], [GPU requires reset], [GPU requires reset]",
     "GPU 3 (00000000:13:1C.0) needs a reset"),
])
def test_a_gpu_reporting_a_fault_drains_the_node_after_the_job(tmp_path, row, problem):
    node = Node(tmp_path)
    node.nvidia_smi(gpu_rows(**{"3": row}))
    assert node.run("epilog")[:2] == (1, f"health (epilog): {problem}")


def test_gpus_without_ecc_or_row_remapping_report_not_applicable_and_pass(tmp_path):
    node = Node(tmp_path)
    node.nvidia_smi(gpu_rows(**{str(i): f"{i}, 00000000:{16 + i:02X}:1C.0, [N/A], [N/A], [N/A]"
                                for i in range(P4D_GPUS)}))
    assert node.run("prolog")[:2] == (0, None)


def test_nvidia_smi_missing_or_hanging_is_a_failure_the_reason_names(tmp_path):
    node = Node(tmp_path)
    (node.bin / "nvidia-smi").unlink()
    assert node.run("prolog")[1] == "health (prolog): nvidia-smi not found (8 GPUs expected)"
    node.command("nvidia-smi", "sleep 30")
    node.settings["PROBE_TIMEOUT_S"] = 1
    assert node.run("prolog")[1] == "health (prolog): nvidia-smi did not answer within 1 s"


def test_an_xid_that_needs_a_reset_drains_and_an_applications_xid_does_not(tmp_path):
    node = Node(tmp_path)
    node.command("dmesg", f"printf '%s' '{XID_13}'")
    assert node.run("periodic")[:2] == (0, None)
    node.command("dmesg", f"printf '%s' '{XID_13}{XID_79}{XID_79}'")
    assert node.run("prolog")[:2] == (1, "health (prolog): XID 79 on PCI:0000:10:1c since boot")


def test_a_missing_efa_device_and_a_full_or_unmounted_scratch_are_named_with_their_values(tmp_path):
    node = Node(tmp_path, SCRATCH_MIN_FREE_GIB=10**9)
    shutil.rmtree(next((node.sysfs / "sys/class/infiniband").iterdir()))
    status, reason, _ = node.run("prolog")
    assert status == 1 and reason.startswith("health (prolog): 3 of 4 EFA devices present; scratch ")
    assert reason.endswith(f"GiB free, {10**9} GiB needed")
    node.settings["SCRATCH_MUST_BE_MOUNTED"] = "yes"
    assert node.run("prolog")[1] == (f"health (prolog): 3 of 4 EFA devices present; scratch {node.scratch} "
                                     "is not mounted")


def test_the_periodic_check_drains_but_exits_0_and_a_drained_node_keeps_its_first_reason(tmp_path):
    """slurmd runs the periodic check before it registers and waits for an exit 0; a node drained
    already, by an operator or an earlier check, keeps that reason."""
    node = Node(tmp_path)
    (node.bin / "nvidia-smi").unlink()
    assert node.run("periodic")[:2] == (0, "health (periodic): nvidia-smi not found (8 GPUs expected)")
    assert node.run(None)[:2] == (0, "health (periodic): nvidia-smi not found (8 GPUs expected)")
    (tmp_path / "node").write_text("NodeName=rt-node1 State=IDLE+DRAIN Reason=fsdpctl exclude: ECC [root]\n")
    status, reason, stderr = node.run("prolog")
    assert (status, reason) == (1, None) and "already drained: fsdpctl exclude: ECC [root]" in stderr
    (tmp_path / "node").write_text("NodeName=rt-node1 State=DOWN+DRAIN Reason=health (prolog): x [root]\n")
    assert node.run("epilog")[:2] == (1, None)
    (tmp_path / "node").write_text("NodeName=rt-node1 State=DOWN Reason=Not responding [slurm]\n")
    assert node.run("epilog")[:2] == (1, "health (epilog): nvidia-smi not found (8 GPUs expected)")


def test_slurmd_s_script_context_names_the_hook(tmp_path):
    node = Node(tmp_path)
    (node.bin / "nvidia-smi").unlink()
    status, reason, stderr = node.run(None, SLURM_SCRIPT_CONTEXT="prolog_slurmd", SLURM_JOB_ID="12",
                                      SLURMD_NODENAME="rt-node1")
    assert (status, reason) == (1, "health (prolog): nvidia-smi not found (8 GPUs expected)")
    assert "prolog job 12 on rt-node1: FAILED" in stderr
    assert node.run(None, SLURM_SCRIPT_CONTEXT="epilog_slurmd")[:2] == (
        1, "health (epilog): nvidia-smi not found (8 GPUs expected)")


def test_a_node_without_gpus_or_efa_checks_its_scratch_only(tmp_path):
    node = Node(tmp_path, EXPECTED_GPUS=0, EXPECTED_EFA=0)
    for name in ("nvidia-smi", "dmesg"):  # a container may not read the kernel log: never asked
        node.command(name, "exit 99")
    assert node.run("prolog")[:2] == (0, None)


def test_the_shaped_nodes_stand_in_nvidia_smi_with_a_gpu_gone_from_the_bus(tmp_path):
    """The DLAMI-shaped node's stand-in nvidia-smi (tests/shaped) lists one GPU per NVIDIA display
    controller on its PCI tree: take one off the bus and the check drains the node."""
    node = Node(tmp_path)
    stand_in = dlami.NVIDIA_SMI.removeprefix("#!/bin/sh\n").replace(dlami.SHAPE, str(node.sysfs))
    node.command("nvidia-smi", stand_in)
    assert node.run("prolog")[:2] == (0, None)
    gpu = next(p.parent for p in sorted((node.sysfs / "sys/bus/pci/devices").glob("*/class"))
               if p.read_text().startswith("0x0302"))
    shutil.rmtree(gpu)
    assert node.run("prolog")[:2] == (1, "health (prolog): 7 of 8 GPUs answer nvidia-smi")


def test_the_epilog_removes_the_trainer_metrics_a_killed_rank_left_of_that_job_only(tmp_path):
    textfiles = tmp_path / "node-exporter"
    textfiles.mkdir()
    node = Node(tmp_path, TRAINER_TEXTFILE_DIR=textfiles)
    left = ["fsdp-trainer-41-rank3.prom", "fsdp-trainer-41-rank4.prom.tmp"]
    others = ["fsdp-trainer-4-rank3.prom", "fsdp-trainer-410-rank3.prom", "fsdp-trainer-run7-rank0.prom",
              "efa.prom"]
    for name in left + others:
        (textfiles / name).write_text("fsdp_trainer_step 12\n")
    assert node.run("prolog", SLURM_JOB_ID="41") == (0, None, "")
    assert node.run("periodic") == (0, None, "")
    assert sorted(p.name for p in textfiles.iterdir()) == sorted(left + others)  # only the epilog removes
    assert node.run("epilog", SLURM_JOB_ID="41") == (0, None, "")
    assert sorted(p.name for p in textfiles.iterdir()) == sorted(others)
    assert node.run("epilog", SLURM_JOB_ID="41") == (0, None, "")  # nothing left: nothing to do


def _conf(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_the_role_expects_a_p4d_nodes_gpus_efa_and_mounted_scratch(tmp_path):
    hardware = detect_hardware(sysfs_tree(tmp_path / "sysfs", "p4d.24xlarge"))
    variables = node_variables(tmp_path / "s", "p4d.24xlarge", hardware)
    text = render_template("slurm", "node-health.conf.j2", variables)
    conf = _conf(text)
    # read by bash as the script reads it
    sourced = subprocess.run(["bash", "-c", f'{text}\necho "$DRAIN_XIDS|$SCRATCH_DIR"'], capture_output=True,
                             text=True, check=True).stdout
    assert sourced == "48 64 74 79 95 119 120 143|/scratch\n"
    assert conf == {"NODE_NAME": "rt-node0", "EXPECTED_GPUS": "8", "EXPECTED_EFA": "4",
                    "DRAIN_XIDS": "'48 64 74 79 95 119 120 143'", "SYSFS_ROOT": "/",
                    "SCRATCH_DIR": "/scratch", "SCRATCH_MUST_BE_MOUNTED": "yes",
                    "SCRATCH_MIN_FREE_GIB": "200", "DCGM_DIAG_LEVEL": "0", "PROBE_TIMEOUT_S": "10",
                    "TRAINER_TEXTFILE_DIR": "/var/lib/prometheus/node-exporter"}


def test_on_aws_a_node_missing_a_gpu_at_configure_time_is_still_expected_to_have_them_all(tmp_path):
    hardware = detect_hardware(sysfs_tree(tmp_path / "sysfs", "p4d.24xlarge"))
    hardware = {**hardware, "gpu_count": 7, "efa_count": 3}
    variables = node_variables(tmp_path / "s", "p4d.24xlarge", hardware, hardware_required=True)
    conf = _conf(render_template("slurm", "node-health.conf.j2", variables))
    assert (conf["EXPECTED_GPUS"], conf["EXPECTED_EFA"]) == ("8", "4")


def test_a_local_node_expects_what_it_has_and_free_space_in_tmp(tmp_path):
    """Local nodes (hardware_required false) have no GPU, EFA or instance store."""
    hardware = detect_hardware(tmp_path / "empty")
    variables = node_variables(tmp_path / "s", "p4d.24xlarge", hardware, hardware_required=False)
    conf = _conf(render_template("slurm", "node-health.conf.j2", variables))
    assert (conf["EXPECTED_GPUS"], conf["EXPECTED_EFA"], conf["SCRATCH_DIR"], conf["SCRATCH_MUST_BE_MOUNTED"],
            conf["SCRATCH_MIN_FREE_GIB"]) == ("0", "0", "/tmp", "no", "1")


def test_slurm_conf_runs_the_check_as_prolog_epilog_and_health_check(tmp_path):
    hardware = detect_hardware(sysfs_tree(tmp_path / "sysfs", "p4d.24xlarge"))
    variables = node_variables(tmp_path / "s", "p4d.24xlarge", hardware, slurm_use_cgroup=True,
                               slurm_hardware={"results": []})
    settings = _conf(render_template("slurm", "slurm.conf.j2", variables))
    script = "/usr/local/libexec/fsdp-cluster/node-health"
    expected = {"Prolog": script, "Epilog": script, "HealthCheckProgram": script,
                "PrologFlags": "Alloc,DeferBatch", "HealthCheckInterval": "300",
                "HealthCheckNodeState": "ANY",
                "SchedulerParameters": "nohold_on_prolog_fail,sched_interval=10"}
    assert {key: settings[key] for key in expected} == expected
    off = _conf(render_template("slurm", "slurm.conf.j2", {**variables, "slurm_health_enabled": False}))
    assert "Prolog" not in off and "HealthCheckProgram" not in off
    assert off["SchedulerParameters"] == "nohold_on_prolog_fail,sched_interval=10"
