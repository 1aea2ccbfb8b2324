"""What every check gets: the cluster, its spec, the ranks to run on, a run directory for logs and
the report, a work directory on the nodes, and the figures earlier checks measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpctl import remote
from fsdpctl.checks.torchrun import TorchrunJob, stop_leftover_jobs
from fsdpctl.console import Out, say
from fsdpctl.errors import CommandError
from fsdpctl.state import ClusterState
from infra.spec import ClusterSpec


class CheckError(CommandError):
    """A check (or the set-up before the checks) could not run at all."""


@dataclass
class CheckResult:
    name: str
    status: str = "pass"  # pass | fail | skip
    summary: str = ""
    duration_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def fail(self, summary: str) -> CheckResult:
        self.status, self.summary = "fail", summary
        return self

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "summary": self.summary,
                "duration_s": round(self.duration_s, 2), "details": self.details}



def nproc_per_node(state: ClusterState, spec: ClusterSpec) -> int:
    if spec.trainer.nproc_per_node:
        return spec.trainer.nproc_per_node
    if state.read().target == "local":
        return spec.local.nproc_per_node
    return spec.instance.gpus



@dataclass
class CheckContext:
    state: ClusterState
    spec: ClusterSpec
    ranks: list[int]
    run_dir: Path
    work_dir: str  # on the nodes; shared when the cluster has a shared file system
    shared: bool
    steps: int
    interfaces: dict[int, str] = field(default_factory=dict)
    bandwidth: dict[str, Any] | None = None
    training: dict[str, Any] = field(default_factory=dict)
    slurm: bool = False  # Slurm runs on the cluster: the training checks run as Slurm jobs

    @property
    def nproc(self) -> int:
        return nproc_per_node(self.state, self.spec)

    @property
    def world_size(self) -> int:
        """Ranks of a run on every node of the context."""
        return len(self.ranks) * self.nproc

    @property
    def on_gpu(self) -> bool:
        return self.spec.instance.gpus > 0 and self.state.read().target != "local"

    def job(self, name: str, module_args: list[str], *, ranks: list[int] | None = None,
            **kwargs: Any) -> TorchrunJob:
        return TorchrunJob(self.state, ranks or self.ranks, module_args, nproc=self.nproc,
                           port=self.spec.trainer.master_port, log_dir=self.run_dir, name=name,
                           interfaces=self.interfaces, **kwargs)


def check_context(state: ClusterState, kind: str, *, steps: int, out: Out = say) -> CheckContext:
    """A context for runs on every non-excluded node, with a fresh run dir (logs, report) under the
    cluster's reports and a work dir on the nodes (shared when the cluster has a shared file system).
    Jobs that an earlier, killed check left on the nodes are stopped first (the caller holds the
    cluster's operation lock, so none of them can still be wanted)."""
    ranks = [n.rank for n in remote.cluster_nodes(state)]
    if not ranks:
        raise CheckError(f"cluster {state.name!r} has no (non-excluded) nodes: run `fsdpctl up` first")
    for rank, pidfiles in stop_leftover_jobs(state, ranks).items():
        out(f"node {rank}: stopped {len(pidfiles)} job(s) an earlier, interrupted run left behind")
    shared_dir = state.read().shared_dir
    run_dir = state.new_run_dir(kind)
    return CheckContext(state=state, spec=state.spec(), ranks=ranks, run_dir=run_dir,
                        work_dir=f"{shared_dir or '/tmp'}/fsdp-cluster/{kind}/{run_dir.name}",
                        shared=bool(shared_dir), steps=steps)

