"""The scripts fsdpctl runs on the nodes (fsdpctl/scripts.py): every template renders, in each of its
branches, to a script that shellcheck passes (a warning or an error fails), rendering is strict, the
templates ship in the fsdpctl wheel, and the short scripts do what they say when run here.

Scripts sent over SSH run in the SSH user's login shell, bash on every node image (Debian on local
nodes, Ubuntu and Amazon Linux on AWS), so shellcheck reads them as bash; the batch script says so
itself."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path

import jinja2
import pytest

from fsdpctl import deploy, slurm
from fsdpctl.checks import nodes, torchrun
from fsdpctl.scripts import PACKAGE_DIR, render_script
from tests.stand_ins import stand_in_commands

REPO = PACKAGE_DIR.parent
SHELLCHECK_MISSING = ("shellcheck is not installed, and the tests lint every node script with it: run "
                      "`make host-packages` (as root; apt-get install shellcheck)")


def _job(**overrides) -> slurm.TrainJob:
    fields = {"name": "tiny-run", "job_dir": "/shared/fsdp-cluster/jobs/tiny-run", "config": "tiny",
              "nodes": 2, "nproc": 8, "gpus": 8, "venv": "/root/.fsdp-cluster/venv", "port": 29500}
    return slurm.TrainJob(**{**fields, **overrides})


def _bundle() -> deploy.Bundle:
    return deploy.Bundle(wheelhouse_key="0123abcd", wheelhouse=Path("/cache/wheelhouse-0123abcd"),
                         trainer_key="4567ef01", trainer_dir=Path("/cache/trainer-4567ef01"),
                         trainer_wheel="fsdp_trainer-0.1.0-py3-none-any.whl", includes_torch=True)


# (template, case, render): each template with representative values, once per branch. A template
# that the product renders through a function is rendered through that function.
CASES: list[tuple[str, str, Callable[[], str]]] = [
    ("templates/slurm_job.sbatch.j2", "gpu-job-every-option",
     lambda: slurm.render_batch_script(_job(steps=50, checkpoint_interval=10,
                                            overrides=["optim.lr=1e-3", "data.source=it's a b"],
                                            env={"FSDP_X": "1 2", "NCCL_DEBUG": "INFO"}))),
    ("templates/slurm_job.sbatch.j2", "cpu-job-no-options",
     lambda: slurm.render_batch_script(_job(gpus=0))),
    ("templates/slurm_job.sbatch.j2", "smoke-check-job",
     lambda: slurm.render_batch_script(_job(module_args=["-m", "trainer", "--config", "smoke"],
                                            max_requeues=0, env={"FSDP_FAULT": "kill"}))),
    ("templates/slurm_job.sbatch.j2", "users-command-job",
     lambda: slurm.render_batch_script(_job(config="", command="torchrun --nnodes $NNODES --nproc-per-node "
                                            "$NPROC_PER_NODE --rdzv-endpoint \"$MASTER_ADDR:$MASTER_PORT\" "
                                            "train.py --out 'a b'"))),
    ("templates/slurm_job.sbatch.j2", "users-python-script-job",
     lambda: slurm.render_batch_script(_job(config="", module_args=["/shared/jobs/x/my train.py"]))),
    ("templates/slurm_jobs_probe.sh.j2", "jobs",
     lambda: render_script("templates/slurm_jobs_probe.sh.j2", root="/shared/fsdp-cluster/jobs")),
    ("templates/slurm_history_probe.sh.j2", "jobs --all",
     lambda: render_script("templates/slurm_history_probe.sh.j2", limit=5000,
                           queue_format="%i|%j|%u|%T|%N|%D|%S|%e|%Z")),
    ("templates/deploy_probe.sh.j2", "probe", lambda: render_script("templates/deploy_probe.sh.j2")),
    ("templates/deploy_install.sh.j2", "install",
     lambda: deploy._install_script(_bundle(), "/shared/fsdp-cluster/wheelhouse/0123abcd",
                                    "/shared/fsdp-cluster/trainer/4567ef01", "/root/.fsdp-cluster/venv",
                                    "2.13.0+cpu")),
    ("templates/follow_job_log.sh.j2", "follow",
     lambda: render_script("templates/follow_job_log.sh.j2",
                           log_file="/shared/fsdp-cluster/jobs/tiny-run/slurm-7.out", job_id=7)),
    ("checks/templates/inventory_probe.sh.j2", "inventory", lambda: nodes._inventory_probe("10.0.0.5")),
    ("checks/templates/stop_leftover_jobs.sh.j2", "leftovers",
     lambda: render_script("checks/templates/stop_leftover_jobs.sh.j2", pid_files=torchrun.LEFTOVER_JOBS)),
    ("targets/local/templates/boot_settle.sh.j2", "boot",
     lambda: render_script("targets/local/templates/boot_settle.sh.j2")),
]


def test_every_template_is_linted():
    templates = {str(p.relative_to(PACKAGE_DIR)) for p in PACKAGE_DIR.rglob("templates/*.j2")}
    assert templates == {template for template, _, _ in CASES}


@pytest.fixture(scope="module")
def shellcheck() -> str:
    path = shutil.which("shellcheck")
    if path is None:
        pytest.fail(SHELLCHECK_MISSING)
    return path


@pytest.mark.parametrize(("template", "case", "render"), CASES, ids=[f"{t}:{c}" for t, c, _ in CASES])
def test_rendered_script_passes_shellcheck(shellcheck, tmp_path, template, case, render):
    script = tmp_path / Path(template).name.removesuffix(".j2")
    script.write_text(render())
    proc = subprocess.run([shellcheck, "--shell=bash", "--severity=warning", "--format=gcc", str(script)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"shellcheck on {template} ({case}):\n{proc.stdout}{proc.stderr}"


def test_shellcheck_catches_what_the_templates_must_not_hold(shellcheck, tmp_path):
    """The lint above can fail: an unused loop variable is a warning at its severity."""
    script = tmp_path / "bad.sh"
    script.write_text("for i in $(seq 3); do echo x; done\n")
    proc = subprocess.run([shellcheck, "--shell=bash", "--severity=warning", "--format=gcc", str(script)],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "SC2034" in proc.stdout


def test_rendering_is_strict_about_missing_values():
    with pytest.raises(jinja2.UndefinedError, match="'address' is undefined"):
        render_script("checks/templates/inventory_probe.sh.j2")


def test_data_values_reach_the_shell_as_they_are(tmp_path):
    """A path with a space and a quote stays one word; the torch version stays a Python string."""
    venv, wheelhouse = "/home/o'brien/my venv", "/shared/wheel house"
    text = deploy._install_script(_bundle(), wheelhouse, "/t", venv, "2.13.0+cpu")
    head = "\n".join(text.splitlines()[1:3])  # the venv= and wheelhouse= lines, after `set -e`
    out = subprocess.run(["bash", "-c", head + '\nprintf "%s\\n" "$venv" "$wheelhouse"'],
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [venv, wheelhouse]
    assert "split(\"+\")[0] != \"2.13.0\")' 2>/dev/null; then" in text


def test_batch_script_asks_for_gpus_and_exports_the_jobs_environment_only_when_given():
    gpu = slurm.render_batch_script(_job(env={"B": "2", "A": "x y"}))
    cpu = slurm.render_batch_script(_job(gpus=0))
    assert "#SBATCH --gres=gpu:8\nset -u\n" in gpu
    assert "#SBATCH --chdir=/shared/fsdp-cluster/jobs/tiny-run\nset -u\n" in cpu
    assert "fi\nexport A='x y'\nexport B=2\n\nlog() {" in gpu
    assert "    export FSDP_MODEL_CACHE=/scratch/fsdp-cluster/models\nfi\n\nlog() {" in cpu
    assert gpu.startswith("#!/bin/bash\n")


def test_leftover_agents_are_stopped_and_their_pid_files_removed(tmp_path):
    # An agent of job a (its command line carries the job's rendezvous id, as torchrun's does), and a
    # process that got the pid of job c's agent after that job ended by itself: only the agent is stopped.
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--rdzv-id", "a",
                              "--max-restarts", "0"])
    other = subprocess.Popen(["sleep", "60"])
    # Reaped as soon as it dies, as the nodes' agents are (a zombie would still answer `kill -0`).
    reaper = threading.Thread(target=agent.wait)
    reaper.start()
    try:
        (tmp_path / "fsdp-a.pid").write_text(f"{agent.pid}\n")
        (tmp_path / "fsdp-b.pid").write_text("999999999\n")  # an agent that is gone already
        (tmp_path / "fsdp-c.pid").write_text(f"{other.pid}\n")
        script = render_script("checks/templates/stop_leftover_jobs.sh.j2",
                               pid_files=f"{tmp_path}/fsdp-*.pid")
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
        assert proc.stdout.split() == [f"{tmp_path}/fsdp-a.pid"]
        reaper.join(timeout=5)
        assert agent.returncode == -signal.SIGTERM
        assert other.poll() is None
        assert not list(tmp_path.glob("fsdp-*.pid"))
    finally:
        agent.kill()
        other.kill()
        other.wait()
        reaper.join()


def test_following_a_log_prints_it_and_ends_with_the_job(tmp_path):
    log = tmp_path / "jobs dir" / "slurm-7.out"
    log.parent.mkdir()
    log.write_text("step 1\n")
    env = stand_in_commands(tmp_path, squeue=f'echo "$*" >> {tmp_path}/squeue.args')  # the job is gone
    script = render_script("templates/follow_job_log.sh.j2", log_file=str(log), job_id=7)
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 0 and proc.stdout == "step 1\n"
    assert (tmp_path / "squeue.args").read_text().split()[:3] == ["--noheader", "--jobs", "7"]


def test_boot_settle_restarts_each_failed_unit_once_and_reports_the_state(tmp_path):
    # systemctl stand-in: two units failed until reset-failed; every call is recorded
    env = stand_in_commands(tmp_path, systemctl=f"""echo "$*" >> {tmp_path}/calls
case "$1" in
  is-system-running) echo running ;;
  --failed) [ -e {tmp_path}/reset ] || printf '%s loaded failed failed\\n' a.service b.service ;;
  reset-failed) touch {tmp_path}/reset ;;
esac""")
    script = render_script("targets/local/templates/boot_settle.sh.j2")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, env=env)
    assert proc.stdout == "running\na.service b.service\n"  # the state, what was started again, none failed
    assert (tmp_path / "calls").read_text().splitlines() == [
        "is-system-running --wait", "--failed --no-legend --plain", "reset-failed",
        "start a.service b.service", "is-system-running", "--failed --no-legend --plain"]


def test_the_templates_ship_in_the_fsdpctl_wheel(tmp_path):
    """Build the operator tool's wheel from a copy of this checkout (keeping build/ out of it)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in ("infra", "fsdpctl", "trainer"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("fsdp_cluster-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"fsdpctl/{template}" for template, _, _ in CASES} <= names


def test_only_failed_steps_count_against_the_requeue_limit(tmp_path):
    """The batch script run here with stand-in srun/scontrol: Slurm's restart count also counts the
    requeues of a lost node or a SIGUSR1 checkpoint, which must not use up MAX_REQUEUES; failed steps
    do, and the one past the limit fails the job (issue 22: three notices and one crash failed it)."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    script = job_dir / "job.sbatch"
    script.write_text(slurm.render_batch_script(_job(job_dir=str(job_dir), max_requeues=1)))
    env = stand_in_commands(tmp_path, srun=f"exit $(cat {tmp_path}/step_rc)", scancel="true",
                         scontrol='case "$2" in hostnames) echo node0;; *) echo "NodeAddr=10.0.0.1 x";; esac')

    def run(restart_count: int, step_rc: int) -> tuple[int, str]:
        (tmp_path / "step_rc").write_text(str(step_rc))
        proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30,
                              env={**env, "SLURM_RESTART_COUNT": str(restart_count), "SLURM_JOB_ID": "7",
                                   "SLURM_JOB_NODELIST": "node0", "SLURM_NNODES": "1"})
        return proc.returncode, (job_dir / "status").read_text().strip()

    # Run 2 (two requeues by Slurm, say lost nodes) fails: its first failed step, so it is requeued.
    assert run(2, 1) == (slurm.REQUEUE_EXIT, "requeued 1")
    assert (job_dir / "failures").read_text().strip() == "1"
    # The next failure is past the limit of 1: the job fails with the step's status.
    assert run(3, 1) == (1, "failed 1")
    assert run(4, 0) == (0, "completed 0")


def test_an_allocation_with_a_node_drained_by_its_prolog_starts_nothing(tmp_path):
    """Slurm launches the batch script once every node's prolog ended, also when one failed (the
    health check drained that node) and requeues the job just after: the script starts no step,
    writes no status and counts no failure (issue 22, health checks)."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    script = job_dir / "job.sbatch"
    script.write_text(slurm.render_batch_script(_job(job_dir=str(job_dir))))
    env = stand_in_commands(tmp_path, srun=f"touch {tmp_path}/srun-ran", scancel="true",
                         scontrol='case "$2" in hostnames) echo node0;; *) echo "NodeAddr=10.0.0.1 x";; esac',
                         sinfo=f'echo "$*" > {tmp_path}/sinfo.args; echo node1')
    allocation = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_NNODES": "2"}
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30,
                          env={**env, **allocation})
    assert proc.returncode == slurm.REQUEUE_EXIT
    assert "job 7 run 0: node1 drained before the start: requeued" in proc.stdout
    assert (tmp_path / "sinfo.args").read_text().split()[:3] == ["--noheader", "--nodes", "node[0-1]"]
    assert not (tmp_path / "srun-ran").exists()
    assert sorted(p.name for p in job_dir.iterdir()) == ["job.sbatch"]
