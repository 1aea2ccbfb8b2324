"""Slurm without nodes: the batch script `fsdpctl train` writes (bash syntax, every contract value),
slurm.conf / gres.conf rendered by Ansible's templating for a p4d node pair, the node image carrying
the role's packages, and bad `fsdpctl train` input rejected with the field and a fix."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from fsdpctl import slurm
from fsdpctl.errors import UsageError
from fsdpctl.targets.local import rootfs
from tests.ansible.conftest import ROLES_DIR, detect_hardware, node_variables, render_template, sysfs_tree

DEFAULTS = yaml.safe_load((ROLES_DIR / "slurm/defaults/main.yml").read_text())


def _job(**overrides) -> slurm.TrainJob:
    fields = {"name": "tiny-run", "job_dir": "/shared/fsdp-cluster/jobs/tiny-run", "config": "tiny",
              "nodes": 2, "nproc": 8, "gpus": 8, "venv": "/root/.fsdp-cluster/venv", "port": 29500,
              "steps": 50, "checkpoint_interval": 10, "overrides": ["optim.lr=1e-3"]}
    return slurm.TrainJob(**{**fields, **overrides})


def test_batch_script_is_valid_bash_with_the_job_contract(tmp_path):
    text = slurm.render_batch_script(_job())
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    directives = dict(line[len("#SBATCH --"):].partition("=")[::2] for line in text.splitlines()
                      if line.startswith("#SBATCH --"))
    assert directives == {
        "job-name": "tiny-run", "nodes": "2", "ntasks-per-node": "1", "exclusive": "", "requeue": "",
        "signal": "B:USR1@120", "open-mode": "append", "gres": "gpu:8",
        "output": "/shared/fsdp-cluster/jobs/tiny-run/slurm-%j.out",
        "chdir": "/shared/fsdp-cluster/jobs/tiny-run"}
    # torchrun: the job's node count, the GPUs per node, c10d on the first node, no in-place restarts
    assert '"$VENV/bin/torchrun" --nnodes "$SLURM_NNODES" --nproc-per-node "$NPROC_PER_NODE"' in text
    assert "NPROC_PER_NODE=8\n" in text and "RDZV_PORT=29500\n" in text
    assert '--rdzv-backend c10d --rdzv-endpoint "$FSDP_HEAD_ADDR:$RDZV_PORT"' in text
    assert "--max-restarts 0" in text
    args = re.search(r"^TRAINER_ARGS=\((.*)\)$", text, re.MULTILINE).group(1).split()
    assert args == ["-m", "trainer", "--config", "tiny", "--checkpoint-dir",
                    "/shared/fsdp-cluster/jobs/tiny-run/checkpoints", "--metrics-file",
                    "/shared/fsdp-cluster/jobs/tiny-run/metrics.jsonl", "--resume", "auto", "--steps", "50",
                    "--checkpoint-interval", "10", "--set", "optim.lr=1e-3"]
    # the nccl role's environment, the USR1 trap forwarded to the step, the requeue status
    nccl = "/etc/fsdp-cluster/nccl.env"
    assert f"if [ -r {nccl} ]; then set -a; . {nccl}; set +a; fi" in text
    assert 'scancel --signal=USR1 "$SLURM_JOB_ID"\' USR1' in text
    assert "trap '' USR1\n    exec " in text  # torchrun starts with USR1 ignored
    assert f"REQUEUE_EXIT={slurm.REQUEUE_EXIT} " in text and f"MAX_REQUEUES={slurm.MAX_REQUEUES}\n" in text


def test_batch_script_on_cpu_nodes_asks_for_no_gpus_and_quotes_values():
    text = slurm.render_batch_script(_job(gpus=0, overrides=["data.source=a b"], env={"X": "1 2"}))
    assert "--gres" not in text
    assert "'data.source=a b'" in text and "export X='1 2'" in text


def test_requeue_exit_matches_the_role():
    assert DEFAULTS["slurm_requeue_exit"] == slurm.REQUEUE_EXIT


def test_node_image_carries_the_role_packages():
    assert set(DEFAULTS["slurm_packages"]) <= set(rootfs.image_packages())


@pytest.fixture
def p4d_node(tmp_path):
    hardware = detect_hardware(sysfs_tree(tmp_path / "sysfs", "p4d.24xlarge"))
    line = ("NodeName={host} CPUs=96 Boards=1 SocketsPerBoard=2 CoresPerSocket=24 ThreadsPerCore=2 "
            "RealMemory=1160000\n{gpus}")

    def make(**overrides):
        variables = node_variables(tmp_path / "state", "p4d.24xlarge", hardware)
        hosts = variables["groups"]["nodes"]
        results = [{"item": h, "stdout": line.format(host=h, gpus=8 - 8 * i),
                    "stdout_lines": line.format(host=h, gpus=8 - 8 * i).splitlines()}
                   for i, h in enumerate(hosts)]
        return {**variables, "slurm_hardware": {"results": results}, "slurm_use_cgroup": True, **overrides}

    return make


def test_slurm_conf_from_inventory_and_hardware(p4d_node):
    variables = p4d_node()
    hosts = variables["groups"]["nodes"]
    text = render_template("slurm", "slurm.conf.j2", variables)
    conf = [line for line in text.splitlines() if line and not line.startswith("#")]
    settings = dict(line.split("=", 1) for line in conf
                    if not line.startswith(("NodeName=", "PartitionName=")))
    address = variables["hostvars"][hosts[0]]["ansible_host"]
    assert settings["SlurmctldHost"] == f"{hosts[0]}({address})"
    assert settings["SlurmctldPort"] == "6817" and settings["SlurmdPort"] == "6818"
    assert settings["ReturnToService"] == "2" and settings["RequeueExit"] == "75"
    assert settings["ProctrackType"] == "proctrack/cgroup"
    assert settings["TaskPlugin"] == "task/cgroup,task/affinity"
    assert settings["AuthType"] == "auth/munge" and settings["AuthInfo"] == "cred_expire=30"
    assert settings["UnkillableStepTimeout"] == "180"
    assert settings["JobCompType"] == "jobcomp/filetxt"
    assert settings["JobCompLoc"] == "/var/log/slurm/jobcomp.log"
    nodes = [line for line in conf if line.startswith("NodeName=")]
    assert nodes[0] == (f"NodeName={hosts[0]} NodeAddr={address} CPUs=96 Boards=1 SocketsPerBoard=2 "
                        "CoresPerSocket=24 ThreadsPerCore=2 RealMemory=1160000 Gres=gpu:8 State=UNKNOWN")
    assert "Gres=" not in nodes[1]  # its slurmd -C probe found no /dev/nvidia*
    assert conf[-1] == ("PartitionName=train Nodes=ALL Default=YES MaxTime=INFINITE OverSubscribe=EXCLUSIVE "
                        "State=UP")


def test_controller_moves_with_the_rank_and_containers_track_by_parentage(p4d_node):
    variables = p4d_node(slurm_controller_rank=1, slurm_use_cgroup=False)
    hosts = variables["groups"]["nodes"]
    text = render_template("slurm", "slurm.conf.j2", variables)
    assert f"SlurmctldHost={hosts[1]}(" in text
    assert "ProctrackType=proctrack/linuxproc" in text and "TaskPlugin=task/none" in text


def test_gres_conf_lists_the_gpus(p4d_node):
    text = render_template("slurm", "gres.conf.j2", p4d_node())
    assert "Name=gpu File=/dev/nvidia[0-7]" in text


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": "bad name"}, "--name 'bad name': use 1-64 letters"),
    ({"nodes": 3}, "--nodes 3: the cluster has 2 usable node(s); pass --nodes 1 to 2"),
    ({"steps": 0}, "--steps 0: train for at least 1 step"),
    ({"overrides": ["lr"]}, "--set 'lr': expected KEY=VALUE"),
    ({"checkpoint_interval": 0}, "--checkpoint-interval 0: at least 1 step"),
])
def test_bad_train_input_names_the_field_and_the_fix(kwargs, message):
    request = {"name": None, "nodes": None, "steps": None, "overrides": [], "checkpoint_interval": None,
               **kwargs}
    with pytest.raises(UsageError, match=re.escape(message)):
        slurm.validate_request(available=2, **request)
