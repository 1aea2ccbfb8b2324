"""What every check gets: the cluster, its record and spec (read once, by the command), the ranks to
run on, a run directory for logs and the report, a work directory on the nodes; and what every check
returns, a frozen result.

A check never changes the context or another check's result: `run_smoke` hands a later check what
an earlier one measured as an argument (the monitoring check gets the fsdp check's run), and a new
context where one changes (the inventory check's interfaces, `dataclasses.replace`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from fsdpctl import remote
from fsdpctl.checks.errors import CheckError
from fsdpctl.checks.torchrun import TorchrunJob, stop_leftover_jobs
from fsdpctl.console import Out, say
from fsdpctl.state import ClusterRecord, ClusterState
from infra.spec import ClusterSpec

Status = Literal["pass", "fail", "skip"]
CheckName = Literal["inventory", "bandwidth", "fsdp", "monitoring", "recovery"]
"""The smoke test's checks, in the order they run."""


class Frozen(BaseModel):
    """A check's result, or a part of one: frozen once made; unknown fields are refused (also when
    report.json is read back). NaN and infinity are written as Python's json module writes them, so
    a figure reads back as it was."""

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")


class Details(Frozen):
    """What a check measured, as the report shows it under the check. Each check's own type says
    which check it is (`check`), so report.json reads back into the right one."""

    check: CheckName


class CheckResult(Frozen):
    """What a check found: its verdict and one line on it. Each check's own result type narrows
    `details` to its own and adds what later checks and the plots need."""

    status: Status = "pass"
    summary: str = ""
    details: Details | None = None
    """None where the check did not get as far as measuring."""


def nproc_per_node(record: ClusterRecord, spec: ClusterSpec) -> int:
    if spec.trainer.nproc_per_node:
        return spec.trainer.nproc_per_node
    if record.target == "local":
        return spec.local.nproc_per_node
    return spec.instance.gpus


@dataclass(frozen=True)
class CheckContext:
    state: ClusterState
    record: ClusterRecord
    """The cluster's record as the command read it at its start: the checks run on its nodes."""
    spec: ClusterSpec
    ranks: list[int]
    run_dir: Path
    work_dir: str  # on the nodes; shared when the cluster has a shared file system
    shared: bool
    steps: int
    interfaces: Mapping[int, str] = field(default_factory=dict)
    """The cluster interface of each node (the inventory check finds them): gloo binds to it."""
    slurm: bool = False  # Slurm runs on the cluster: the training checks run as Slurm jobs

    @property
    def nproc(self) -> int:
        return nproc_per_node(self.record, self.spec)

    @property
    def world_size(self) -> int:
        """Ranks of a run on every node of the context."""
        return len(self.ranks) * self.nproc

    @property
    def on_gpu(self) -> bool:
        return self.spec.instance.gpus > 0 and self.record.target != "local"

    def job(self, name: str, module_args: list[str], *, ranks: list[int] | None = None,
            **kwargs: Any) -> TorchrunJob:
        return TorchrunJob(self.record, ranks or self.ranks, module_args, nproc=self.nproc,
                           port=self.spec.trainer.master_port, log_dir=self.run_dir, name=name,
                           interfaces=dict(self.interfaces), **kwargs)


def check_context(state: ClusterState, record: ClusterRecord, spec: ClusterSpec, kind: str, *, steps: int,
                  out: Out = say) -> CheckContext:
    """A context for runs on every non-excluded node of `record` (the cluster's record and `spec` its
    spec, as the command read them), with a fresh run dir (logs, report) under the cluster's reports
    and a work dir on the nodes (shared when the cluster has a shared file system). Jobs that an
    earlier, killed check left on the nodes are stopped first (the caller holds the cluster's
    operation lock, so none of them can still be wanted)."""
    ranks = [n.rank for n in remote.cluster_nodes(record)]
    if not ranks:
        raise CheckError(f"cluster {state.name!r} has no (non-excluded) nodes: run `fsdpctl up` first")
    for rank, pidfiles in stop_leftover_jobs(record, ranks).items():
        out(f"node {rank}: stopped {len(pidfiles)} job(s) an earlier, interrupted run left behind")
    shared_dir = record.shared_dir
    run_dir = state.new_run_dir(kind)
    return CheckContext(state=state, record=record, spec=spec, ranks=ranks, run_dir=run_dir,
                        work_dir=f"{shared_dir or '/tmp'}/fsdp-cluster/{kind}/{run_dir.name}",
                        shared=bool(shared_dir), steps=steps)
