"""`fsdpctl train CONFIG`: submit a training run to the cluster's Slurm as a requeueable batch job
(fsdpctl/slurm.py writes the script; docs/slurm.md)."""

from __future__ import annotations

from argparse import Namespace

from fsdpctl import slurm
from fsdpctl.console import say
from fsdpctl.state import resolve


def cmd_train(args: Namespace) -> int:
    state = resolve(args.cluster)
    job_id, job = slurm.submit(state, args.config, nodes=args.nodes, steps=args.steps,
                               overrides=args.overrides, name=args.name,
                               checkpoint_interval=args.checkpoint_interval)
    say(f"submitted job {job_id} ({job.name}) on {job.nodes} node(s) x {job.nproc} process(es); its "
        f"script, log, metrics and checkpoints are in {job.job_dir}")
    say(f"next: fsdpctl jobs   fsdpctl logs {job_id} --follow   fsdpctl cancel {job_id}")
    return 0
