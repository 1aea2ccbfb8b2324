"""`fsdpctl jobs`, `fsdpctl logs JOB` and `fsdpctl cancel JOB`: the training jobs `fsdpctl train`
submitted to the cluster's Slurm (fsdpctl/slurm.py; docs/slurm.md)."""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
from argparse import Namespace
from typing import Any

from fsdpctl import remote, slurm, slurm_history, slurm_nodes
from fsdpctl.console import print_json, say
from fsdpctl.scripts import render_script
from fsdpctl.slurm import JobRow
from fsdpctl.slurm_history import HistoryRow
from fsdpctl.state import resolve_cluster


def _figure(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def jobs(cluster: str | None = None) -> list[JobRow]:
    """The cluster's training jobs, newest first: Slurm state, nodes, and the last step, loss and
    tokens/s of the trainer's metrics (none for a job of the user's own command)."""
    _state, record, _spec = resolve_cluster(cluster)
    return slurm.list_jobs(record)


def job_history(cluster: str | None = None) -> list[HistoryRow]:
    """Every Slurm job of the cluster, fsdpctl's or not, oldest first: the queue's and the controller's
    job-completion log's (fsdpctl/slurm_history.py)."""
    _state, record, _spec = resolve_cluster(cluster)
    return slurm_history.job_history(record)


def _print_history(rows: list[HistoryRow], cluster: str) -> None:
    if not rows:
        say(f"no Slurm jobs in the queue or the job-completion log of cluster {cluster}")
        return
    say(f"{'JOB':>6} {'NAME':<24} {'USER':<8} {'STATE':<11} {'NODES':<20} {'START':<19} {'END':<19} "
        f"{'EXIT':<6} {'RUNS':>4}")
    for row in rows:
        say(f"{row.job_id:>6} {row.name[:24]:<24} {row.user[:8]:<8} {row.state[:11]:<11} "
            f"{(row.nodes or '-')[:20]:<20} {row.start or '-':<19} {row.end or '-':<19} "
            f"{row.exit_code or '-':<6} {row.runs:>4}")


def cmd_jobs(args: Namespace) -> int:
    _state, record, _spec = resolve_cluster(args.cluster)
    if args.all:
        history = slurm_history.job_history(record)
        if args.json:
            print_json([dataclasses.asdict(row) for row in history])
        else:
            _print_history(history, record.name)
        return 0
    rows = slurm.list_jobs(record)
    if args.json:
        print_json([dataclasses.asdict(row) for row in rows])
        return 0
    if not rows:
        say(f"no jobs on cluster {record.name}; submit one with `fsdpctl train CONFIG` or "
            "`fsdpctl train --command CMD`")
        return 0
    say(f"{'JOB':>6} {'NAME':<24} {'STATE':<11} {'NODES':<24} {'STEP':>9} {'LOSS':>8} {'TOKENS/S':>10}")
    for row in rows:
        step = "-" if row.last_step is None else f"{row.last_step}/{row.steps or '?'}"
        say(f"{row.job_id:>6} {row.name[:24]:<24} {row.state:<11} {(row.nodes or '-')[:24]:<24} "
            f"{step:>9} {_figure(row.loss, '.4f'):>8} {_figure(row.tokens_per_s, ',.0f'):>10}")
    return 0


def logs(cluster: str | None, job_id: int) -> str:
    """A job's output so far (Slurm's slurm-JOB.out in the job's directory)."""
    _state, record, _spec = resolve_cluster(cluster)
    job = slurm.find_job(record, job_id)
    path = shlex.quote(job.log_file)
    return slurm_nodes.run_slurm(record, f"cat {path} 2>/dev/null || echo '(no output yet)'").stdout


def cmd_logs(args: Namespace) -> int:
    if not args.follow:
        sys.stdout.write(logs(args.cluster, args.job))
        return 0
    _state, record, _spec = resolve_cluster(args.cluster)
    job = slurm.find_job(record, args.job)
    command = render_script("templates/follow_job_log.sh.j2", log_file=job.log_file, job_id=job.job_id)
    sys.stdout.flush()
    node = remote.node_by_rank(record, slurm_nodes.slurm_rank(record))
    return subprocess.call(remote.ssh_argv(record, node, command))


def cancel(cluster: str | None, job_id: int) -> None:
    """Cancel a job: its workers get SIGTERM and write a checkpoint first."""
    _state, record, _spec = resolve_cluster(cluster)
    slurm.cancel(record, job_id)
    say(f"cancelled job {job_id}: its workers get SIGTERM and write a checkpoint; `fsdpctl train` with "
        "the same config and a new --name does not resume it (its checkpoints stay in its directory)")


def cmd_cancel(args: Namespace) -> int:
    cancel(args.cluster, args.job)
    return 0
