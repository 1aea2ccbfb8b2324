"""fsdpctl's Python API: each verb of the CLI as a function with typed arguments.

    from pathlib import Path
    from fsdpctl import api

    api.up(Path("examples/local.yaml"), target="local", nodes=2)
    api.configure("local-demo")
    api.deploy("local-demo")
    report = api.smoke("local-demo", steps=30)
    submitted = api.train("local-demo", "tiny", steps=50)
    print(api.status("local-demo").health, api.jobs("local-demo"))
    api.down("local-demo", yes=True)

The CLI (`fsdpctl/cli.py`) is a parser over these functions, and `fsdpctl demo` is a program written
with them. They print the same progress a command prints, return what they made or measured as typed
records, and raise the errors in `fsdpctl.errors` (every one a `CommandError` with the exit status the
CLI would end with) or `infra.spec.SpecError` for a bad spec, before anything is created. A `cluster`
argument is a cluster's name; None means the cluster brought up last (`fsdpctl list` marks it).
Whatever costs or destroys money asks on the terminal first unless `yes=True`; without a terminal it
stops with a UsageError.

docs/python-api.md lists them with what each returns.
"""

from __future__ import annotations

from fsdpctl.checks.smoke import smoke
from fsdpctl.configure import configure
from fsdpctl.deploy import deploy_cluster as deploy
from fsdpctl.jobs import cancel, job_history, jobs, logs
from fsdpctl.lifecycle import down, list_clusters, status, up
from fsdpctl.plan import plan
from fsdpctl.train import train

__all__ = ["cancel", "configure", "deploy", "down", "job_history", "jobs", "list_clusters", "logs", "plan",
           "smoke", "status", "train", "up"]
