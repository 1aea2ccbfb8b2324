"""`fsdpctl train CONFIG` or `fsdpctl train --command CMD`: submit a training run, of the trainer or
of the user's own program, to the cluster's Slurm as a requeueable batch job (fsdpctl/slurm.py writes
the script; docs/slurm.md)."""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Sequence
from dataclasses import dataclass

from fsdpctl import slurm
from fsdpctl.console import say
from fsdpctl.slurm import TrainJob
from fsdpctl.state import resolve_cluster


@dataclass(frozen=True)
class SubmittedJob:
    """A job `train` handed to Slurm: its id and what it runs where."""

    job_id: int
    job: TrainJob


def train(cluster: str | None = None, config: str | None = None, *, command: str | None = None,
          nodes: int | None = None, steps: int | None = None, overrides: Sequence[str] = (),
          name: str | None = None, checkpoint_interval: int | None = None) -> SubmittedJob:
    """Submit a run of the trainer with `config` (a shipped name or a YAML file; `overrides` as
    KEY=VALUE), or of `command` (a command line or a local script), to the cluster's Slurm as a
    requeueable job on `nodes` nodes (default: every usable one); bad input is refused before
    anything is submitted."""
    _state, record, spec = resolve_cluster(cluster)
    job_id, job = slurm.submit(record, spec, config, command=command, nodes=nodes, steps=steps,
                               overrides=list(overrides), name=name, checkpoint_interval=checkpoint_interval)
    if job.command is None and job.module_args is None:
        say(f"submitted job {job_id} ({job.name}) on {job.nodes} node(s) x {job.nproc} process(es); its "
            f"script, log, metrics and checkpoints are in {job.job_dir}")
    else:
        runs = (f"your command once per node (NPROC_PER_NODE={job.nproc})" if job.command is not None
                else f"your script under torchrun x {job.nproc} process(es) per node")
        say(f"submitted job {job_id} ({job.name}) on {job.nodes} node(s), {runs}; its script and log are "
            f"in {job.job_dir}, CHECKPOINT_DIR is {job.checkpoint_dir}")
    say(f"next: fsdpctl jobs   fsdpctl logs {job_id} --follow   fsdpctl cancel {job_id}")
    return SubmittedJob(job_id, job)


def cmd_train(args: Namespace) -> int:
    train(args.cluster, args.config, command=args.user_command, nodes=args.nodes, steps=args.steps,
          overrides=args.overrides, name=args.name, checkpoint_interval=args.checkpoint_interval)
    return 0
