"""Training runs as Slurm jobs: the batch script `fsdpctl train` writes, and the Slurm commands
`train`, `jobs`, `logs`, `cancel`, `exclude` and `replace` run on the cluster's first node.

Every job gets a directory on the cluster's shared file system, `<shared>/fsdp-cluster/jobs/<name>`,
that holds everything about it: the batch script (`job.sbatch`, which is also the per-node step),
`job.json` (what was asked, and the Slurm job id), Slurm's output `slurm-<id>.out`, the trainer's
`metrics.jsonl`, `checkpoints/`, and `status` (the batch script's last word: running, requeued,
completed, cancelled or failed, and the step's exit status). Plain Slurm commands (squeue, scontrol,
scancel) see the same jobs.

A job runs the trainer (`fsdpctl train CONFIG`: torchrun on every node) or the user's own command
(`fsdpctl train --command`: once per node, with the rendezvous, the job's directories, the cluster's
NCCL environment and the deployed venv in its environment); both are requeued and signalled alike.

Signals: the batch script traps SIGUSR1 (`--signal=B:USR1@120` before a time limit, or the spot
watcher's `scancel --batch --signal=USR1`) and forwards it to the job's step with
`scancel --signal=USR1`; slurmstepd delivers it to every process of the step, torchrun ignores it
(it is started with SIGUSR1 ignored) and the trainer workers write a checkpoint and exit 0; the job
is then requeued and resumes (`--resume auto`) wherever Slurm places it. `scancel` (and
`fsdpctl cancel`) sends SIGTERM to every process of the job, which the trainer handles the same way;
the job is not requeued. A training step that fails (a worker crashed, or the job watcher ended a
step that stopped making progress) is retried at once in the same allocation when every node passes
its health check, and otherwise ends the batch script with REQUEUE_EXIT, which slurm.conf's
RequeueExit turns into a requeue on other nodes; up to MAX_REQUEUES failed steps in all (the job
directory's `failures` file; checkpoint requeues and lost nodes do not count).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shlex
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fsdpctl import remote
from fsdpctl.checks.context import nproc_per_node
from fsdpctl.deploy import deployed_venv
from fsdpctl.errors import UsageError
from fsdpctl.scripts import render_script
from fsdpctl.slurm_nodes import SLURM_TIMEOUT_S, run_slurm, slurm_rank
from fsdpctl.state import ClusterRecord
from infra.spec import ClusterSpec

REQUEUE_EXIT = 75
"""The batch script's exit status for "requeue me"; the slurm role's `slurm_requeue_exit` (RequeueExit)."""
MAX_REQUEUES = 3
"""Failed training steps retried (in the allocation or by a requeue) before a job is left failed."""
SIGNAL_LEAD_S = 120
"""Seconds before a job's time limit at which its batch script gets SIGUSR1 (checkpoint and requeue)."""
JOBS_DIR = "fsdp-cluster/jobs"
"""Under the cluster's shared directory."""
NCCL_ENV_FILE = "/etc/fsdp-cluster/nccl.env"
"""The nccl role's environment file (absent where the role skipped, e.g. local nodes)."""
PROMETHEUS_TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
"""The monitoring role's `monitoring_textfile_dir` (node exporter's textfile collector; absent where the role
did not run): the trainer's ranks export their metrics there (`metrics.prometheus_dir`), and the slurm
role's epilog removes what a killed rank left (`slurm_trainer_textfile_dir`)."""
NODE_HEALTH_SCRIPT = "/usr/local/libexec/fsdp-cluster/node-health"
"""The slurm role's node health check (`slurm_health_script`), which the batch script runs on its nodes
after a failed step to choose between a retry in the allocation and a requeue."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*=.*$")


@dataclass
class TrainJob:
    """What one `fsdpctl train` run asks Slurm for."""

    name: str
    job_dir: str
    config: str
    nodes: int
    nproc: int
    gpus: int
    venv: str
    port: int
    steps: int | None = None
    checkpoint_interval: int | None = None
    overrides: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    max_requeues: int = MAX_REQUEUES
    module_args: list[str] | None = None
    """torchrun's program and its arguments verbatim (the smoke checks' trainer command line, or a
    user's Python script); None: the trainer, with the fields above."""
    command: str | None = None
    """The user's own command line (`fsdpctl train --command`), run once per node instead of torchrun."""
    prometheus_dir: str | None = None
    """Node exporter's textfile directory: on each node where it exists, the trainer's ranks export their
    metrics into it (`--set metrics.prometheus_dir`). None: not asked (a user's program, or a run that
    chooses metrics.prometheus_dir itself)."""

    @property
    def script_path(self) -> str:
        return f"{self.job_dir}/job.sbatch"

    @property
    def metrics_path(self) -> str:
        return f"{self.job_dir}/metrics.jsonl"

    @property
    def checkpoint_dir(self) -> str:
        return f"{self.job_dir}/checkpoints"

    def trainer_args(self) -> list[str]:
        if self.module_args is not None:
            return list(self.module_args)
        args = ["-m", "trainer", "--config", self.config, "--checkpoint-dir", self.checkpoint_dir,
                "--metrics-file", self.metrics_path, "--resume", "auto"]
        if self.steps is not None:
            args += ["--steps", str(self.steps)]
        if self.checkpoint_interval is not None:
            args += ["--checkpoint-interval", str(self.checkpoint_interval)]
        for override in self.overrides:
            args += ["--set", override]
        return args


def render_batch_script(job: TrainJob) -> str:
    """The sbatch script of a job: the batch part, and (with --node) the step each node runs."""
    return render_script("templates/slurm_job.sbatch.j2", job=job, trainer_args=job.trainer_args(),
                         requeue_exit=REQUEUE_EXIT, signal_lead_s=SIGNAL_LEAD_S, nccl_env_file=NCCL_ENV_FILE,
                         node_health_script=NODE_HEALTH_SCRIPT)


@dataclass(frozen=True)
class JobRow:
    """One job `fsdpctl train` submitted, as `fsdpctl jobs` shows it (`--json`: these fields)."""

    job_id: int
    name: str
    state: str
    """Slurm's state (PENDING, RUNNING, COMPLETED, ...), or the status file's once slurmctld forgot it."""
    nodes: str
    """The job's node list ("" before it has nodes)."""
    node_count: int | None
    reason: str | None
    """Why Slurm keeps it pending, if it does."""
    status: str | None
    """The batch script's last word (`running 0`, `requeued 1`, `completed 0`, ...)."""
    last_step: int | None
    steps: int | None
    loss: float | None
    tokens_per_s: float | None
    """From the last line of the trainer's metrics; None for a --command job (no metrics file)."""
    job_dir: str

    @property
    def log_file(self) -> str:
        return f"{self.job_dir}/slurm-{self.job_id}.out"


def jobs_root(record: ClusterRecord) -> str:
    shared = record.shared_dir
    if not shared:
        raise UsageError(f"cluster {record.name} has no shared file system: Slurm jobs keep their script, "
                         "logs and checkpoints on it. Enable storage.fsx in the spec (the local target "
                         "always has /shared)")
    return f"{shared}/{JOBS_DIR}"


def validate_request(*, config: str | None, command: str | None, name: str | None, nodes: int | None,
                     steps: int | None, overrides: list[str], available: int,
                     checkpoint_interval: int | None) -> None:
    if config is not None and command is not None:
        raise UsageError(f"CONFIG {config!r} and --command both given: a job runs the trainer with CONFIG "
                         "or your own command; drop one")
    if config is None and command is None:
        raise UsageError("give a trainer CONFIG (tiny, smoke, gpt-1b, ... or a YAML file) or your own "
                         "program with --command 'torchrun ... train.py' (or --command a script path)")
    if command is not None and not command.strip():
        raise UsageError("--command is empty: give the command every node runs, e.g. --command 'torchrun "
                         "--nnodes $NNODES --nproc-per-node $NPROC_PER_NODE ... train.py', or a script path")
    if command is not None:
        trainer_flags = {"--steps": steps, "--checkpoint-interval": checkpoint_interval,
                         "--set": overrides or None}
        for flag, value in trainer_flags.items():
            if value is not None:
                raise UsageError(f"{flag} is a setting of the trainer's CONFIG, not of --command: pass your "
                                 "program its own arguments inside the command")
    if name is not None and not _NAME.match(name):
        raise UsageError(f"--name {name!r}: use 1-64 letters, digits, '.', '_' or '-' (it names the job "
                         "and its directory), e.g. --name tiny-run1")
    if nodes is not None and not 1 <= nodes <= available:
        raise UsageError(f"--nodes {nodes}: the cluster has {available} usable node(s); pass --nodes 1 to "
                         f"{available}")
    if steps is not None and steps < 1:
        raise UsageError(f"--steps {steps}: train for at least 1 step, e.g. --steps 100")
    if checkpoint_interval is not None and checkpoint_interval < 1:
        raise UsageError(f"--checkpoint-interval {checkpoint_interval}: at least 1 step, e.g. 50")
    for override in overrides:
        if not _OVERRIDE.match(override):
            raise UsageError(f"--set {override!r}: expected KEY=VALUE with a dotted key, e.g. "
                             "--set optim.lr=1e-3")


def submit(record: ClusterRecord, spec: ClusterSpec, config: str | None, *, command: str | None = None,
           nodes: int | None = None, steps: int | None = None, overrides: list[str] | None = None,
           name: str | None = None, checkpoint_interval: int | None = None, env: dict[str, str] | None = None,
           max_requeues: int = MAX_REQUEUES) -> tuple[int, TrainJob]:
    """Write the job's directory and batch script on the shared file system and sbatch it; returns
    the Slurm job id and the job. The job runs the trainer with `config`, or `command`: a command
    line, or a local script (copied into the job's directory; a `.py` file runs under the job's
    torchrun, anything else with bash)."""
    overrides = list(overrides or [])
    available = len(remote.cluster_nodes(record))
    validate_request(config=config, command=command, name=name, nodes=nodes, steps=steps, overrides=overrides,
                     available=available, checkpoint_interval=checkpoint_interval)
    venv = deployed_venv(record)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    local_file = Path(config if config is not None else str(command).strip())
    # os.path: a command line longer than a file name is not one (Path.is_file raises for it)
    is_script = command is not None and os.path.isfile(local_file)
    if config is not None:
        default_name = local_file.stem if local_file.suffix else config
    else:
        default_name = local_file.stem if is_script else "command"
    name = name or f"{default_name}-{stamp}"
    job_dir = f"{jobs_root(record)}/{name}"
    rank = slurm_rank(record)
    exists = remote.run(record, rank, f"test -e {shlex.quote(job_dir)}", timeout=SLURM_TIMEOUT_S, check=False)
    if exists.returncode == 0:
        raise UsageError(f"a job named {name} already exists ({job_dir}); pick another --name")
    module_args = None
    if config is not None and local_file.suffix in (".yaml", ".yml"):
        if not local_file.is_file():
            raise UsageError(f"trainer config {config}: no such file; give a YAML file or a shipped config "
                             "name (tiny, smoke, gpt-1b, ...)")
        remote.copy_to(record, rank, local_file, f"{job_dir}/config.yaml")
        config = f"{job_dir}/config.yaml"
    elif is_script:
        script = f"{job_dir}/{local_file.name}"
        remote.copy_to(record, rank, local_file, script)
        if local_file.suffix == ".py":
            module_args, command = [script], None
        else:
            command = f"bash {shlex.quote(script)}"
    job = TrainJob(name=name, job_dir=job_dir, config=config or "", nodes=nodes or available,
                   nproc=nproc_per_node(record, spec), gpus=_gpus_per_node(record, spec), venv=venv,
                   port=spec.trainer.master_port, steps=steps, checkpoint_interval=checkpoint_interval,
                   overrides=overrides, env=env or {}, max_requeues=max_requeues, module_args=module_args,
                   command=command, prometheus_dir=metrics_export_dir(config, overrides))
    return submit_job(record, job), job


def metrics_export_dir(config: str | None, overrides: list[str]) -> str | None:
    """Where a job's trainer exports its metrics for Prometheus: node exporter's textfile directory for a
    trainer run that does not choose metrics.prometheus_dir itself; None for a user's program."""
    if config is None or any(o.startswith("metrics.prometheus_dir=") for o in overrides):
        return None
    return PROMETHEUS_TEXTFILE_DIR


def _gpus_per_node(record: ClusterRecord, spec: ClusterSpec) -> int:
    """GPUs a job asks for per node (--gres): the instance type's; local nodes have none."""
    return 0 if record.target == "local" else spec.instance.gpus


def submit_job(record: ClusterRecord, job: TrainJob) -> int:
    """Write the job's batch script into its directory and sbatch it; returns the Slurm job id."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "job.sbatch"
        script.write_text(render_batch_script(job))
        script.chmod(0o755)
        remote.copy_to(record, slurm_rank(record), script, job.script_path)
    result = run_slurm(record, f"sbatch --parsable {shlex.quote(job.script_path)}")
    job_id = int(result.stdout.strip().split(";")[0])
    asked = {"job_id": job_id, "name": job.name, "job_dir": job.job_dir, "config": job.config,
             "command": job.command, "program": job.module_args, "nodes": job.nodes,
             "nproc_per_node": job.nproc, "steps": job.steps, "overrides": job.overrides,
             "submitted_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    run_slurm(record, f"echo {shlex.quote(json.dumps(asked))} > {shlex.quote(job.job_dir)}/job.json")
    return job_id


def list_jobs(record: ClusterRecord) -> list[JobRow]:
    """Every job `fsdpctl train` submitted on the cluster, oldest first: Slurm state, nodes, last step,
    loss and tokens/s (from its metrics file)."""
    root = jobs_root(record)
    result = run_slurm(record, render_script("templates/slurm_jobs_probe.sh.j2", root=root), timeout=60)
    rows = []
    for job in json.loads(result.stdout or "[]"):
        slurm, status, last = job.get("slurm") or {}, job.get("status") or [], job.get("last") or {}
        state_word = slurm.get("state") or (status[0].upper() if status else "UNKNOWN")
        rows.append(JobRow(job_id=job["job_id"], name=job["name"], state=state_word,
                           nodes=slurm.get("node_list") or "", node_count=job.get("nodes"),
                           reason=slurm.get("reason") if slurm.get("reason") not in (None, "None") else None,
                           status=" ".join(status) or None, last_step=last.get("step"),
                           steps=job.get("steps"), loss=last.get("loss"),
                           tokens_per_s=last.get("tokens_per_s"), job_dir=job["job_dir"]))
    return sorted(rows, key=lambda r: r.job_id)


def find_job(record: ClusterRecord, job_id: int) -> JobRow:
    for job in list_jobs(record):
        if job.job_id == job_id:
            return job
    raise UsageError(f"cluster {record.name} has no job {job_id} submitted by `fsdpctl train`; "
                     "`fsdpctl jobs` lists them")


def job_state(record: ClusterRecord, job_id: int) -> str | None:
    """The job's Slurm state (PENDING, RUNNING, COMPLETED, ...), None once slurmctld forgot it."""
    result = run_slurm(record, f"squeue --noheader --states=all --jobs {job_id} --format %T", check=False)
    words = result.stdout.split()
    return words[0] if result.returncode == 0 and words else None


def cancel(record: ClusterRecord, job_id: int) -> None:
    find_job(record, job_id)
    run_slurm(record, f"scancel {job_id}")


FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE"}
POLL_S = 1.0


class SlurmJob:
    """A trainer run as a Slurm batch job, with the interface of checks.torchrun.TorchrunJob (the
    smoke checks run either): exit codes by rank, worker pids and kills on one node, a failure text."""

    def __init__(self, record: ClusterRecord, spec: ClusterSpec, ranks: list[int], module_args: list[str], *,
                 nproc: int, port: int, log_dir: Path, name: str, work_dir: str,
                 env: dict[str, str] | None = None, max_requeues: int = MAX_REQUEUES):
        self.record, self.ranks, self.name, self.log_dir = record, ranks, name, log_dir
        self.job = TrainJob(name=name, job_dir=f"{work_dir}/{name}-job", config="", nodes=len(ranks),
                            nproc=nproc, gpus=_gpus_per_node(record, spec),
                            venv=deployed_venv(record), port=port, env=env or {}, max_requeues=max_requeues,
                            module_args=module_args)
        run_slurm(record, f"mkdir -p {shlex.quote(self.job.job_dir)}")
        self.job_id = submit_job(record, self.job)
        self.agent_file = f"/tmp/fsdp-job-{self.job_id}.agent"

    @property
    def log_path(self) -> str:
        return f"{self.job.job_dir}/slurm-{self.job_id}.out"

    def poll(self) -> dict[int, int | None]:
        state = job_state(self.record, self.job_id)
        code = None if state not in FINISHED else (0 if state == "COMPLETED" else 1)
        return {rank: code for rank in self.ranks}

    def wait(self, timeout: float) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = self.poll()
            if all(c is not None for c in codes.values()):
                self._keep_log()
                return {r: int(c or 0) for r, c in codes.items()}
            time.sleep(POLL_S)
        self.stop()
        self._keep_log()
        return {rank: remote.TIMEOUT_RC for rank in self.ranks}

    def _node_name(self, rank: int) -> str:
        return remote.node_by_rank(self.record, rank).name

    def worker_pids(self, rank: int) -> set[int]:
        proc = remote.run(self.record, rank, f"pgrep -P $(cat {self.agent_file} 2>/dev/null) 2>/dev/null",
                          timeout=SLURM_TIMEOUT_S, check=False)
        return {int(p) for p in proc.stdout.split() if p.isdigit()}

    def kill_workers(self, rank: int) -> set[int]:
        proc = remote.run(self.record, rank, f"pids=$(pgrep -P $(cat {self.agent_file})) && kill -KILL $pids "
                          "&& echo $pids", timeout=SLURM_TIMEOUT_S)
        return {int(p) for p in proc.stdout.split() if p.isdigit()}

    def stop(self) -> None:
        run_slurm(self.record, f"scancel {self.job_id}", check=False)

    def _keep_log(self) -> None:
        """A copy of Slurm's output of the job in the check's run directory."""
        result = run_slurm(self.record, f"cat {shlex.quote(self.log_path)}", check=False)
        self._kept_log.write_text(result.stdout or "")

    @property
    def _kept_log(self) -> Path:
        return self.log_dir / f"{self.name}-slurm-{self.job_id}.out"

    def logs(self) -> str:
        """The finished job's output: srun gathers every node's torchrun output into Slurm's one file."""
        return self._kept_log.read_text(errors="replace") if self._kept_log.exists() else ""

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.logs().splitlines()[-lines:])

    def failure(self, codes: dict[int, int]) -> str | None:
        if all(c == 0 for c in codes.values()):
            return None
        what = "timed out" if remote.TIMEOUT_RC in codes.values() else \
            f"ended {job_state(self.record, self.job_id) or 'unsuccessfully'}"
        return (f"Slurm job {self.job_id} {what} (log {self._kept_log}, {self.log_path} on the nodes):\n"
                + self.log_tail())
