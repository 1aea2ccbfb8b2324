"""`fsdpctl jobs`, `fsdpctl logs JOB` and `fsdpctl cancel JOB`: the training jobs `fsdpctl train`
submitted to the cluster's Slurm (fsdpctl/slurm.py; docs/slurm.md)."""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
from argparse import Namespace
from typing import Any

from fsdpctl import remote, slurm
from fsdpctl.console import print_json, say
from fsdpctl.scripts import render_script
from fsdpctl.state import resolve


def _figure(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def cmd_jobs(args: Namespace) -> int:
    state = resolve(args.cluster)
    rows = slurm.list_jobs(state)
    if args.json:
        print_json([dataclasses.asdict(row) for row in rows])
        return 0
    if not rows:
        say(f"no jobs on cluster {state.name}; submit one with `fsdpctl train CONFIG` or "
            "`fsdpctl train --command CMD`")
        return 0
    say(f"{'JOB':>6} {'NAME':<24} {'STATE':<11} {'NODES':<24} {'STEP':>9} {'LOSS':>8} {'TOKENS/S':>10}")
    for row in rows:
        step = "-" if row.last_step is None else f"{row.last_step}/{row.steps or '?'}"
        say(f"{row.job_id:>6} {row.name[:24]:<24} {row.state:<11} {(row.nodes or '-')[:24]:<24} "
            f"{step:>9} {_figure(row.loss, '.4f'):>8} {_figure(row.tokens_per_s, ',.0f'):>10}")
    return 0


def cmd_logs(args: Namespace) -> int:
    state = resolve(args.cluster)
    job = slurm.find_job(state, args.job)
    path = shlex.quote(job.log_file)
    if not args.follow:
        result = slurm.run_slurm(state, f"cat {path} 2>/dev/null || echo '(no output yet)'")
        sys.stdout.write(result.stdout)
        return 0
    command = render_script("templates/follow_job_log.sh.j2", log_file=job.log_file, job_id=job.job_id)
    sys.stdout.flush()
    return subprocess.call(remote.ssh_argv(state, remote.node_by_rank(state, slurm.slurm_rank(state)),
                                           command))


def cmd_cancel(args: Namespace) -> int:
    state = resolve(args.cluster)
    slurm.cancel(state, args.job)
    say(f"cancelled job {args.job}: its workers get SIGTERM and write a checkpoint; `fsdpctl train` with "
        "the same config and a new --name does not resume it (its checkpoints stay in its directory)")
    return 0
