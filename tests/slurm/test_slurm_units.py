"""Slurm without nodes: the batch script `fsdpctl train` writes (bash syntax, every contract value),
slurm.conf / gres.conf rendered by Ansible's templating for a p4d node pair, the node image carrying
the role's packages, and bad `fsdpctl train` input rejected with the field and a fix."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from fsdpctl import slurm, slurm_nodes
from fsdpctl.errors import UsageError
from fsdpctl.targets.local import rootfs
from tests.ansible.conftest import (
    ROLES_DIR,
    detect_hardware,
    node_variables,
    render,
    render_template,
    sysfs_tree,
)
from tests.stand_ins import stand_in_commands

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
                        "CoresPerSocket=24 ThreadsPerCore=2 RealMemory=1160000 Gres=gpu:a100:8 State=UNKNOWN")
    assert "Gres=" not in nodes[1]  # its slurmd -C probe found no /dev/nvidia*
    assert conf[-1] == ("PartitionName=train Nodes=ALL Default=YES MaxTime=INFINITE OverSubscribe=EXCLUSIVE "
                        "State=UP")


def test_controller_moves_with_the_rank_and_containers_track_by_parentage(p4d_node):
    variables = p4d_node(slurm_controller_rank=1, slurm_use_cgroup=False)
    hosts = variables["groups"]["nodes"]
    text = render_template("slurm", "slurm.conf.j2", variables)
    assert f"SlurmctldHost={hosts[1]}(" in text
    assert "ProctrackType=proctrack/linuxproc" in text and "TaskPlugin=task/none" in text


def _gres_lines(variables) -> list[str]:
    text = render_template("slurm", "gres.conf.j2", variables)
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_gres_conf_lists_each_gpu_typed_with_the_cores_of_its_socket(p4d_node):
    # The p4d's two sockets of 24 cores x 2 hyper-threads: GPUs 0-3 near CPUs 0-23,48-71, which are
    # Slurm's cores 0-23, GPUs 4-7 near 24-47,72-95, its cores 24-47 (the layout: tests/ansible/conftest.py
    # sysfs_tree, from the NCCL topology file AWS ships for the p4d). Linux CPU numbers would be wrong:
    # Slurm has no core 48 on a node of 48 cores.
    assert _gres_lines(p4d_node()) == [
        *(f"Name=gpu Type=a100 File=/dev/nvidia{n} Cores=0-23" for n in range(4)),
        *(f"Name=gpu Type=a100 File=/dev/nvidia{n} Cores=24-47" for n in range(4, 8))]


def test_a_node_without_affinity_facts_gets_no_cores(tmp_path, p4d_node):
    # a GPU instance whose sysfs says nothing about NUMA (no local_cpulist, numa_node -1)
    root = sysfs_tree(tmp_path / "no-numa", "p4d.24xlarge")
    for gpu in root.glob("sys/bus/pci/devices/*/local_cpulist"):
        gpu.unlink()
        (gpu.parent / "numa_node").write_text("-1\n")
    lines = _gres_lines(p4d_node(fsdp_hardware=detect_hardware(root)))
    assert lines == [f"Name=gpu Type=a100 File=/dev/nvidia{n}" for n in range(8)]


@pytest.mark.parametrize(("instance_type", "gres_type"), [
    ("p4d.24xlarge", "a100"), ("p4de.24xlarge", "a100"), ("p5.48xlarge", "h100"), ("p5e.48xlarge", "h200"),
    ("p5en.48xlarge", "h200")])
def test_the_gres_type_on_aws_is_the_catalog_gpu_model(tmp_path, instance_type, gres_type):
    # no driver loaded (the facts know no model): the instance catalog names it
    hardware = detect_hardware(sysfs_tree(tmp_path / "sysfs", instance_type))
    variables = node_variables(tmp_path / "state", instance_type, hardware)
    assert render("{{ slurm_gpu_type }}", variables) == gres_type


def test_elsewhere_the_gres_type_is_the_model_the_driver_reports_and_untyped_without_one(tmp_path, p4d_node):
    root = sysfs_tree(tmp_path / "with-driver", "p4d.24xlarge")
    hardware = detect_hardware(root)
    off_aws = {"hardware_required": False, "fsdp_hardware": hardware}
    assert _gres_lines(p4d_node(**off_aws))[0] == "Name=gpu File=/dev/nvidia0 Cores=0-23"
    text = render_template("slurm", "slurm.conf.j2", p4d_node(**off_aws))
    assert " Gres=gpu:8 State=UNKNOWN" in text
    for n, address in enumerate(hardware["gpus"]):
        information = root / "proc/driver/nvidia/gpus" / address / "information"
        information.parent.mkdir(parents=True)
        information.write_text(f"Model: \t\t NVIDIA H100 80GB HBM3\nDevice Minor: \t {n}\n")
    off_aws["fsdp_hardware"] = detect_hardware(root)
    assert _gres_lines(p4d_node(**off_aws))[-1] == "Name=gpu Type=h100 File=/dev/nvidia7 Cores=24-47"
    text = render_template("slurm", "slurm.conf.j2", p4d_node(**off_aws))
    assert " Gres=gpu:h100:8 State=UNKNOWN" in text


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": "bad name"}, "--name 'bad name': use 1-64 letters"),
    ({"nodes": 3}, "--nodes 3: the cluster has 2 usable node(s); pass --nodes 1 to 2"),
    ({"steps": 0}, "--steps 0: train for at least 1 step"),
    ({"overrides": ["lr"]}, "--set 'lr': expected KEY=VALUE"),
    ({"checkpoint_interval": 0}, "--checkpoint-interval 0: at least 1 step"),
    ({"command": "torchrun x.py"}, "CONFIG 'tiny' and --command both given: a job runs the trainer with "
                                   "CONFIG or your own command; drop one"),
    ({"config": None}, "give a trainer CONFIG (tiny, smoke, gpt-1b, ... or a YAML file) or your own program "
                       "with --command"),
    ({"config": None, "command": "  "}, "--command is empty: give the command every node runs"),
    ({"config": None, "command": "x.sh", "steps": 5}, "--steps is a setting of the trainer's CONFIG, not of "
                                                       "--command: pass your program its own arguments"),
    ({"config": None, "command": "x.sh", "overrides": ["optim.lr=1"]}, "--set is a setting of the trainer's"),
    ({"config": None, "command": "x.sh", "checkpoint_interval": 5}, "--checkpoint-interval is a setting"),
])
def test_bad_train_input_names_the_field_and_the_fix(kwargs, message):
    request = {"config": "tiny", "command": None, "name": None, "nodes": None, "steps": None, "overrides": [],
               "checkpoint_interval": None, **kwargs}
    with pytest.raises(UsageError, match=re.escape(message)):
        slurm.validate_request(available=2, **request)


def test_a_command_or_a_config_alone_is_a_good_request():
    base = {"name": None, "nodes": 2, "steps": None, "overrides": [], "checkpoint_interval": None,
            "available": 2}
    slurm.validate_request(config=None, command="torchrun --nnodes $NNODES x.py", **base)
    slurm.validate_request(config="tiny", command=None, **base)


def test_a_command_job_runs_the_users_command_on_each_node_with_the_job_environment(tmp_path):
    """The node part of a `--command` job, run here as srun runs it on node 1 of 2: the user's command
    sees the rendezvous, the job's directories, the deployed venv first on PATH, the node's address as
    torchrun's --local-addr, and SIGUSR1 ignored (as torchrun gets it: Slurm signals every process of
    the step)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/torchrun").write_text("#!/bin/sh\n")
    (venv / "bin/torchrun").chmod(0o755)
    job = _job(job_dir=str(tmp_path / "job"), venv=str(venv), nproc=4, config="", steps=None,
               checkpoint_interval=None, overrides=[],
               command='printf "%s\\n" "$MASTER_ADDR:$MASTER_PORT" "$NNODES" "$NODE_RANK" "$NPROC_PER_NODE" '
                       '"$CHECKPOINT_DIR" "$JOB_DIR" "$(command -v torchrun)" "$PWD" "$PET_LOCAL_ADDR" '
                       '"$(awk \'/^SigIgn/ {print $2}\' /proc/self/status)"')
    Path(job.job_dir).mkdir()
    script = Path(job.script_path)
    script.write_text(slurm.render_batch_script(job))
    env = stand_in_commands(tmp_path, scontrol='echo "NodeName=$3 NodeAddr=10.0.0.12 State=ALLOCATED"')
    job_id = f"unit{os.getpid()}"
    try:
        slurm_env = {"SLURMD_NODENAME": "node1", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
                     "SLURM_JOB_ID": job_id, "FSDP_HEAD_ADDR": "10.0.0.11"}
        proc = subprocess.run(["bash", str(script), "--node"], capture_output=True, text=True, timeout=30,
                              cwd=job.job_dir, env={**env, **slurm_env})
    finally:
        Path(f"/tmp/fsdp-job-{job_id}.agent").unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stderr
    seen = proc.stdout.split("\n")
    rendezvous, nnodes, node_rank, nproc, checkpoints, job_dir, torchrun, cwd, advertised, ignored = seen[:10]
    assert (rendezvous, nnodes, node_rank, nproc) == ("10.0.0.11:29500", "2", "1", "4")
    assert (checkpoints, job_dir, cwd) == (f"{job.job_dir}/checkpoints", job.job_dir, job.job_dir)
    assert torchrun == str(venv / "bin/torchrun")
    assert advertised == "10.0.0.12"  # the node's own address, for a torchrun the command starts
    assert int(ignored, 16) & (1 << (signal.SIGUSR1 - 1))


def test_a_command_job_keeps_the_batch_part_and_a_python_script_runs_under_torchrun():
    command = slurm.render_batch_script(_job(command="torchrun --nnodes $NNODES train.py", config="",
                                             steps=None, checkpoint_interval=None, overrides=[]))
    trainer = slurm.render_batch_script(_job())
    # everything but the node's program is the trainer job's: requeue, signals, environment
    def settings(text: str) -> str:
        head = text.split("node_main() {")[0]
        return re.sub(r"^(USER_COMMAND|TRAINER_ARGS)=.*\n", "", head, flags=re.MULTILINE)

    assert settings(command) == settings(trainer)
    assert command.split("batch_main() {")[1] == trainer.split("batch_main() {")[1]
    assert "TRAINER_ARGS" not in command and 'exec bash -c "$USER_COMMAND"' in command
    script = slurm.render_batch_script(_job(module_args=["/shared/jobs/x/train.py"]))
    assert "TRAINER_ARGS=(/shared/jobs/x/train.py)\n" in script and '"$VENV/bin/torchrun"' in script


def _trainer_args_on_a_node(tmp_path, job: slurm.TrainJob) -> list[str]:
    """The node part of a trainer job (its directory under tmp_path), run as srun runs it on node 1 of 2,
    with a torchrun that prints its arguments: what it gave the trainer beyond job.trainer_args()."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/torchrun").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (venv / "bin/torchrun").chmod(0o755)
    job = dataclasses.replace(job, job_dir=str(tmp_path / "job"), venv=str(venv))
    Path(job.job_dir).mkdir()
    Path(job.script_path).write_text(slurm.render_batch_script(job))
    env = stand_in_commands(tmp_path, scontrol='echo "NodeName=$3 NodeAddr=10.0.0.12 State=ALLOCATED"')
    job_id = f"unit{os.getpid()}"
    try:
        slurm_env = {"SLURMD_NODENAME": "node1", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
                     "SLURM_JOB_ID": job_id, "FSDP_HEAD_ADDR": "10.0.0.11", "FSDP_ATTEMPT": "0"}
        proc = subprocess.run(["bash", job.script_path, "--node"], capture_output=True, text=True, timeout=30,
                              cwd=job.job_dir, env={**env, **slurm_env})
    finally:
        Path(f"/tmp/fsdp-job-{job_id}.agent").unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stderr
    args = proc.stdout.splitlines()
    given = args[args.index("trainer") - 1:]
    assert given[:len(job.trainer_args())] == job.trainer_args()
    return given[len(job.trainer_args()):]


def test_a_trainer_job_exports_its_metrics_where_the_node_has_node_exporters_textfile_directory(tmp_path):
    textfiles = tmp_path / "node-exporter"
    job = _job(prometheus_dir=str(textfiles))
    assert _trainer_args_on_a_node(tmp_path / "absent", job) == []  # the monitoring role did not run
    textfiles.mkdir()
    exported = _trainer_args_on_a_node(tmp_path / "present", job)
    assert exported == ["--set", f"metrics.prometheus_dir={textfiles}"]
    assert _trainer_args_on_a_node(tmp_path / "not-asked", _job()) == []


@pytest.mark.parametrize(("config", "overrides", "expected"), [
    ("tiny", [], slurm.PROMETHEUS_TEXTFILE_DIR),
    ("/shared/jobs/x/config.yaml", ["optim.lr=1e-3"], slurm.PROMETHEUS_TEXTFILE_DIR),
    ("tiny", ["metrics.prometheus_dir=/srv/metrics"], None),  # the run's own choice stands
    (None, [], None),  # a user's command or script: not our trainer
])
def test_which_jobs_export_the_trainers_metrics(config, overrides, expected):
    assert slurm.metrics_export_dir(config, overrides) == expected


SINFO = ("st-node0|idle|none\n"
         "st-node1|drained|health (prolog): GPU 0 (00000000:10:1C.0) has 2 uncorrected ECC errors\n")


def test_sinfo_rows_become_typed_node_states():
    nodes = slurm_nodes.parse_node_states(SINFO + "st-node0|idle|none\n")  # a node in two partitions: once
    assert list(nodes) == ["st-node0", "st-node1"]
    assert nodes["st-node0"] == slurm_nodes.NodeState(name="st-node0", state="idle", reason=None)
    assert nodes["st-node0"].in_service and not nodes["st-node1"].in_service
    assert not slurm_nodes.parse_node_states("st-node0|idle*|Not responding\n")["st-node0"].in_service


@pytest.mark.parametrize(("returncode", "stdout", "controller"), [
    (0, "Slurmctld(primary) at st-node0 is UP\n", "st-node0"),
    (0, "Slurmctld(primary) at st-node1 is UP\nSlurmctld(backup) at st-node0 is UP\n", "st-node1"),
    (1, "Slurmctld(primary) at st-node0 is DOWN\n*****\n** RESTORE SLURMCTLD DAEMON TO SERVICE **\n", None),
])
def test_the_controller_is_the_node_scontrol_ping_names(tmp_path, monkeypatch, returncode, stdout,
                                                         controller):
    from fsdpctl import remote
    from tests.fsdpctl.test_cli import local_cluster

    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    state = local_cluster(tmp_path, "st")
    monkeypatch.setattr(remote, "run", lambda record, rank, command, **kwargs:
                        subprocess.CompletedProcess(command, returncode, stdout, ""))
    assert slurm_nodes.controller_name(state.read()) == controller


@pytest.fixture
def status_of(tmp_path, monkeypatch, capsys):
    """`fsdpctl status` (text and --json) of a 2-node local cluster whose nodes all answer and whose
    first node's `sinfo` answers as given (exit status, output)."""
    from fsdpctl import remote
    from fsdpctl.cli import main
    from fsdpctl.targets.local import nodes
    from tests.fsdpctl.test_cli import local_cluster

    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    local_cluster(tmp_path, "st")
    monkeypatch.setattr(nodes, "health", lambda state: [])

    def run(returncode: int, stdout: str, stderr: str = "") -> tuple[str, dict]:
        def sinfo(state, rank, command, **kwargs):
            assert rank == 0 and command.startswith("sinfo ")
            return subprocess.CompletedProcess(command, returncode, stdout, stderr)

        monkeypatch.setattr(remote, "run", sinfo)
        assert main(["status", "--cluster", "st"]) == 0
        text = capsys.readouterr().out
        assert main(["status", "--cluster", "st", "--json"]) == 0
        return text, json.loads(capsys.readouterr().out)

    return run


def test_status_shows_why_slurm_drained_a_node(status_of):
    text, status = status_of(0, SINFO)
    assert ("slurm: 1 of 2 node(s) in service\n"
            "  st-node1 drained: health (prolog): GPU 0 (00000000:10:1C.0) has 2 uncorrected ECC errors\n"
            "  once the cause is fixed: fsdpctl ssh 0 -- sudo scontrol update nodename=NAME "
            "state=resume") in text
    assert [(n["slurm_state"], n["slurm_reason"]) for n in status["node_list"]] == [
        ("idle", None), ("drained", "health (prolog): GPU 0 (00000000:10:1C.0) has 2 uncorrected ECC errors")]
    assert status["slurm_not_asked"] is None


def test_status_points_at_heal_for_a_node_a_spot_notice_drained(status_of):
    notice = 'spot interruption notice: {"action": "terminate", "time": "2026-12-03T08:00:00Z"}'
    text, _ = status_of(0, f"st-node0|idle|none\nst-node1|drained|{notice}\n")
    assert (f"  st-node1 drained: {notice}\n"
            "  a node a spot notice drained: `fsdpctl heal` replaces it once its jobs have left "
            "(docs/slurm.md)\n") in text
    text, _ = status_of(0, SINFO)  # a health check's drain: no such line
    assert "fsdpctl heal" not in text


def test_status_counts_a_node_power_saving_stopped_apart_from_the_faulty_ones(status_of):
    text, status = status_of(0, "st-node0|idle|none\nst-node1|idle~|none\n")
    assert ("slurm: 1 of 2 node(s) in service; powered down while idle (a job's need powers them up): "
            "st-node1\n") in text
    assert "state=resume" not in text
    assert [n["slurm_state"] for n in status["node_list"]] == ["idle", "idle~"]
    # a node whose power-up failed is down, with the reason, and not counted as resting
    text, _ = status_of(0, "st-node0|idle|none\nst-node1|down~|power resume: InsufficientInstanceCapacity\n")
    assert ("slurm: 1 of 2 node(s) in service\n"
            "  st-node1 down~: power resume: InsufficientInstanceCapacity") in text


def test_status_says_when_it_could_not_ask_slurm_and_is_silent_without_it(status_of):
    refused = "slurm_load_partitions: Unable to contact slurm controller (connect failure)"
    text, status = status_of(1, "", refused)
    assert f"slurm: not asked (`sinfo` exited 1: {refused})" in text
    assert status["slurm_not_asked"] == f"`sinfo` exited 1: {refused}"
    assert status["node_list"][1]["slurm_state"] is None
    text, status = status_of(127, "", "bash: sinfo: command not found")  # a cluster without the slurm role
    assert "slurm:" not in text and status["slurm_not_asked"] is None


# The batch part against stand-in Slurm commands: srun's training step exits with the next status of
# $JOB_DIR/step-exits (one per attempt), after sending the batch script SIGUSR1 when $STEP_USR1 is set
# (`watcher`: as the job watcher does, with its reason in underused first); its health step exits with
# $HEALTH_EXIT; every srun call is logged.
BATCH_STAND_INS = {
    "srun": ('echo "$*" >> "$JOB_DIR/srun.log"\n'
             'case "$*" in\n'
             '  *--node*) code=$(head -n 1 "$JOB_DIR/step-exits"); sed -i 1d "$JOB_DIR/step-exits"\n'
             '            if [ -n "${STEP_USR1:-}" ]; then\n'
             '                sleep 0.05  # past the resolution of the file times of status\n'
             '                [ "$STEP_USR1" != watcher ] || echo "GPUs idle" > "$JOB_DIR/underused"\n'
             '                kill -USR1 "$PPID"; sleep 0.2\n'
             '            fi\n'
             '            exit "$code" ;;\n'
             '  *node-health*) [ -z "${HEALTH_SIGNAL:-}" ] || kill "-$HEALTH_SIGNAL" "$PPID"\n'
             '                exit "${HEALTH_EXIT:-0}" ;;\n'
             'esac'),
    "sinfo": "true",
    "scontrol": ('case "$2" in hostnames) echo node0; echo node1 ;; '
                 '*) echo "NodeName=$3 NodeAddr=10.0.0.11" ;; esac'),
    "scancel": "true",
}


def _run_batch(tmp_path, step_exits: list[int], *, health_exit: int = 0, failures: int = 0,
               stalled: str | None = None, signal_during_check: str = "", step_usr1: str = "",
               underused: str | None = None) -> tuple[int, str, Path]:
    job = _job(job_dir=str(tmp_path / "job"))
    job_dir = Path(job.job_dir)
    job_dir.mkdir()
    (job_dir / "job.sbatch").write_text(slurm.render_batch_script(job))
    (job_dir / "step-exits").write_text("".join(f"{code}\n" for code in step_exits))
    if failures:
        (job_dir / "failures").write_text(f"{failures}\n")
    if stalled:
        (job_dir / "stalled").write_text(stalled)
    if underused:
        (job_dir / "underused").write_text(underused)
    env = {**stand_in_commands(tmp_path, **BATCH_STAND_INS), "JOB_DIR": job.job_dir,
           "HEALTH_EXIT": str(health_exit), "HEALTH_SIGNAL": signal_during_check, "STEP_USR1": step_usr1,
           "SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "node[0-1]"}
    proc = subprocess.run(["bash", str(job_dir / "job.sbatch")], capture_output=True, text=True, timeout=30,
                          cwd=job_dir, env=env)
    return proc.returncode, proc.stdout + proc.stderr, job_dir


def test_a_failed_step_on_healthy_nodes_is_retried_at_once_in_the_allocation(tmp_path):
    rc, log, job_dir = _run_batch(tmp_path, [1, 0])
    assert rc == 0 and (job_dir / "status").read_text() == "completed 0\n", log
    assert "step exit 1: retried in this allocation (run 0 attempt 1, failed step 1 of at most 3 retried)" \
        in log
    assert (job_dir / "failures").read_text() == "1\n"
    calls = (job_dir / "srun.log").read_text().splitlines()
    # the step, the health check on every node (as a step: it drains nothing), the step again
    kinds = [("training" if "--node" in c else "health" if "node-health" in c else c) for c in calls]
    assert kinds == ["training", "health", "training"]
    assert calls[1].endswith(f"node-health {slurm.NODE_HEALTH_SCRIPT}")


def test_a_failed_step_with_a_node_failing_its_health_check_is_requeued(tmp_path):
    rc, log, job_dir = _run_batch(tmp_path, [1], health_exit=1)
    assert rc == slurm.REQUEUE_EXIT and (job_dir / "status").read_text() == "requeued 1\n", log
    assert "step exit 1: a node failed its health check: requeued (run 0, failed step 1 of at most 3" in log
    assert (job_dir / "failures").read_text() == "1\n"


def test_failed_steps_beyond_max_requeues_fail_the_job_counting_earlier_runs(tmp_path):
    rc, log, job_dir = _run_batch(tmp_path, [3, 3, 3], failures=1)
    assert rc == 3 and (job_dir / "status").read_text() == "failed 3\n", log
    assert "retried in this allocation (run 0 attempt 2, failed step 3 of at most 3 retried)" in log
    assert "step exit 3 after 3 failed steps retried: failed" in log
    assert len([c for c in (job_dir / "srun.log").read_text().splitlines() if "--node" in c]) == 3


def test_a_step_the_job_watcher_ended_is_logged_with_its_reason_and_retried(tmp_path):
    reason = "no step for 130 s (10 x its usual 13 s between records): ended at step 12"
    rc, log, job_dir = _run_batch(tmp_path, [137, 0], stalled=reason)
    assert rc == 0, log
    assert f"step ended by the job watcher: {reason}" in log and not (job_dir / "stalled").exists()
    assert "step exit 137: retried in this allocation" in log


def test_the_job_watchers_sigusr1_is_logged_with_its_reason_and_requeues_without_counting_a_failure(tmp_path):
    """The job watcher found the job's GPUs idle: it wrote why into underused, then sent SIGUSR1. The
    step ends (here with SIGKILL's status, as when the watcher ends a step that did not checkpoint in
    time) and the job is requeued, its failures untouched; underused stays (once per job)."""
    rc, log, job_dir = _run_batch(tmp_path, [137], step_usr1="watcher")
    assert (rc, (job_dir / "status").read_text()) == (slurm.REQUEUE_EXIT, "requeued 137\n"), log
    assert "SIGUSR1 from the job watcher: GPUs idle" in log
    assert "step exit 137 after SIGUSR1: requeued (run 0; a checkpoint on request, not a failure)" in log
    assert not (job_dir / "failures").exists() and (job_dir / "underused").exists()


def test_a_later_sigusr1_does_not_repeat_the_job_watchers_old_reason(tmp_path):
    """underused from an earlier run (older than this attempt's status): a time limit's SIGUSR1 now is
    not the watcher's."""
    rc, log, job_dir = _run_batch(tmp_path, [0], step_usr1="time limit", underused="GPUs idle")
    assert (rc, (job_dir / "status").read_text()) == (slurm.REQUEUE_EXIT, "requeued 0\n"), log
    assert "SIGUSR1: asking the workers to checkpoint" in log and "from the job watcher" not in log


@pytest.mark.parametrize(("signal_name", "rc", "status", "said"), [
    ("USR1", slurm.REQUEUE_EXIT, "requeued 1",
     "step exit 1, SIGUSR1 before a retry: requeued (run 0, failed step 1"),
    ("TERM", 0, "cancelled 1", "cancelled before a retry"),
])
def test_a_signal_during_the_health_check_starts_no_new_attempt(tmp_path, signal_name, rc, status, said):
    """A spot notice (USR1) or a cancel (TERM) while the nodes are checked: a step started after it
    would never see it."""
    code, log, job_dir = _run_batch(tmp_path, [1, 0], signal_during_check=signal_name)
    assert (code, (job_dir / "status").read_text()) == (rc, f"{status}\n"), log
    assert said in log
    calls = (job_dir / "srun.log").read_text().splitlines()
    assert sum("--node" in c for c in calls) == 1  # the failed step only: no new attempt
