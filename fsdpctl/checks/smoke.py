"""`fsdpctl smoke`: the deployment guide's acceptance checks on every (non-excluded) node.

Checks, in order (a check whose prerequisite failed is reported as skipped, with the reason):

1. `inventory`  every node answers within a timeout; the MTU of the interface carrying the node's
                address equals `network.mtu`; GPU and EFA device counts match the instance type (the
                local target has neither: skipped, and said so).
2. `bandwidth`  all-reduce bus bandwidth across all nodes: nccl-tests' all_reduce_perf through mpirun
                on GPU nodes (the torch.distributed figure kept as detail; `trainer.collectives`
                under torchrun where nccl-tests is missing), gated at the catalog's
                `allreduce_busbw_gate_gbps`; `trainer.collectives` on gloo/CPU, gated at a low floor
                (`GLOO_BUSBW_FLOOR_GBPS`).
3. `fsdp`       a short multi-node FSDP run: loss decreases, memory balanced across ranks, gradient
                sync share (gated on GPUs), a checkpoint written and verified, then resumed.
   `monitoring` what Prometheus recorded during those runs: GPU utilisation (GPU nodes), peak network
                use against the link capacity, and per-rank memory growth after warm-up (leaks).
4. `recovery`   an elastic run with `--max-restarts`; one node's workers are killed mid-run; the time
                from the kill to the first metrics line of the restarted workers is measured; the run
                must complete.

The thresholds and how each figure is measured are in docs/smoke-test.md. Results go to
`report.json` and `report.html` in the run's directory, `$FSDPCTL_HOME/reports/<cluster>/<time>-smoke/`,
which `fsdpctl down` leaves in place.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import TypeVar, get_args

from fsdpctl import remote
from fsdpctl.checks.bandwidth import check_bandwidth
from fsdpctl.checks.context import CheckError, CheckName, CheckResult, check_context
from fsdpctl.checks.monitoring import MonitoringResult, check_monitoring
from fsdpctl.checks.nodes import check_inventory
from fsdpctl.checks.report import (
    PLOTS_MISSING,
    CheckEntry,
    SmokeReport,
    TrainingReport,
    check_table,
    plots_available,
    write_report,
)
from fsdpctl.checks.torchrun import NODE_TIMEOUT_S
from fsdpctl.checks.training import FsdpResult, check_fsdp, check_recovery
from fsdpctl.console import Out, say, stage
from fsdpctl.deploy import DeployError, deployed_venv
from fsdpctl.errors import CommandError, UsageError
from fsdpctl.slurm_nodes import power_up_all, slurm_status
from fsdpctl.state import ClusterRecord, ClusterState, cluster_operation
from infra.spec import ClusterSpec

CHECKS: tuple[CheckName, ...] = get_args(CheckName)
R = TypeVar("R", bound=CheckResult)


def run_smoke(state: ClusterState, record: ClusterRecord, spec: ClusterSpec, *, skip: list[str] | None = None,
              steps: int | None = None, out: Out | None = None) -> SmokeReport:
    """Run the checks on the nodes of `record` (the cluster's record and `spec` its spec, as the command
    read them) and write the report into the run's directory under the cluster's reports (kept after
    `fsdpctl down`); returns the report."""
    out = out or stage("smoke")
    unknown = sorted(set(skip or []) - set(CHECKS))
    if unknown:
        raise UsageError(f"unknown check(s) to skip: {', '.join(unknown)}; checks are {', '.join(CHECKS)}")
    plots = plots_available()
    if not plots:
        out(f"note: {PLOTS_MISSING}")
    ctx = check_context(state, record, spec, "smoke", steps=steps or 20, out=out)
    slurm_up, slurm_problem = slurm_status(record)
    ctx = replace(ctx, slurm=bool(ctx.shared) and slurm_up)
    if ctx.slurm:
        out("Slurm runs on the cluster: the fsdp and recovery checks run as Slurm jobs")
    elif slurm_problem:
        out(f"note: Slurm is installed but {slurm_problem}; the fsdp and recovery checks run under "
            "torchrun instead (`fsdpctl configure --tags slurm` starts it)")
    work_dir = ctx.work_dir
    started = datetime.now(UTC).isoformat(timespec="seconds")
    checks = _Checks(record, work_dir, skip or [], out)
    inventory = checks.run("inventory", lambda: check_inventory(ctx))
    if inventory:  # later jobs bind gloo to the interface carrying each node's cluster address
        ctx = replace(ctx, interfaces=inventory.interfaces)
    if checks.status("inventory") == "fail":
        checks.block("the inventory check failed (every node must answer first)")
    bandwidth = checks.run("bandwidth", lambda: check_bandwidth(ctx))
    fsdp = checks.run("fsdp", lambda: check_fsdp(ctx))
    monitoring = checks.run("monitoring", lambda: check_monitoring(ctx, fsdp.training if fsdp else None))
    checks.run("recovery", lambda: check_recovery(ctx))
    entries = checks.entries

    report = SmokeReport(
        cluster=state.name, target=record.target, instance_type=spec.instance_type, nodes=len(ctx.ranks),
        nproc_per_node=ctx.nproc, started_at=started, scheduler="slurm" if ctx.slurm else "torchrun",
        passed=all(e.status != "fail" for e in entries),
        failed=[e.name for e in entries if e.status == "fail"], checks=entries,
        bandwidth=bandwidth.measurement if bandwidth else None,
        bandwidth_gate_gbps=bandwidth.details.gate_gbps if bandwidth and bandwidth.details else None,
        training=_training_report(fsdp, monitoring), logs=str(ctx.run_dir))
    write_report(ctx.run_dir, report, with_plots=plots)
    recorded = state.update(last_report=str(ctx.run_dir))
    # Checkpoints of a smoke run are only evidence; the report keeps the figures.
    remote.run_all(recorded, f"rm -rf {shlex.quote(work_dir)}", timeout=120, check=False)
    return report


class _Checks:
    """Runs the checks in order, each unless skipped on request or blocked by an earlier one, and
    keeps the report's line of each."""

    def __init__(self, record: ClusterRecord, work_dir: str, skip: list[str], out: Out):
        self.record, self.work_dir, self.skip, self.out = record, work_dir, skip, out
        self.entries: list[CheckEntry] = []
        self.blocked: str | None = None

    def block(self, why: str) -> None:
        """The checks after this are not run, for this reason."""
        self.blocked = why

    def status(self, name: CheckName) -> str | None:
        return next((e.status for e in self.entries if e.name == name), None)

    def run(self, name: CheckName, check: Callable[[], R]) -> R | None:
        """The check's result; None where it did not run or could not finish (its line says why)."""
        if name in self.skip:
            self._add(name, CheckResult(status="skip", summary="skipped on request (--skip)"), 0.0)
            return None
        if self.blocked:
            self._add(name, CheckResult(status="skip", summary=f"not run: {self.blocked}"), 0.0)
            return None
        self.out(f"{name} ...")
        t0 = time.monotonic()
        result: R | None = None
        try:
            if name != "inventory":
                deployed_venv(self.record)
                remote.run_all(self.record, f"mkdir -p {shlex.quote(self.work_dir)}", timeout=NODE_TIMEOUT_S)
            result = check()
            line: CheckResult = result
        except (DeployError, CheckError, remote.RemoteCommandFailed) as e:
            line = CheckResult(status="fail", summary=str(e))
        duration_s = time.monotonic() - t0
        self.out(f"{name}: {line.status} ({duration_s:.1f} s) {line.summary}")
        self._add(name, line, duration_s)
        return result

    def _add(self, name: CheckName, result: CheckResult, duration_s: float) -> None:
        self.entries.append(CheckEntry(name=name, status=result.status, summary=result.summary,
                                       duration_s=round(duration_s, 2), details=result.details))


def _training_report(fsdp: FsdpResult | None, monitoring: MonitoringResult | None) -> TrainingReport:
    """What the fsdp check trained and the monitoring check's series of it, for the report."""
    series = monitoring.series if monitoring else None
    if fsdp is None:
        return TrainingReport(monitoring=series)
    run = fsdp.training
    return TrainingReport(steps=run.steps, summary=run.summary, per_rank=run.per_rank, window=run.window,
                          monitoring=series)


def smoke(cluster: str | None = None, *, skip: list[str] | None = None, steps: int | None = None
          ) -> SmokeReport:
    """`fsdpctl smoke`: the checks on the cluster's nodes (default: the cluster brought up last), the
    pass/fail table printed, the report returned. CommandError when a check failed (the report is
    written all the same) or the checks could not run."""
    try:
        with cluster_operation(cluster, "smoke") as (state, record, spec):
            power_up_all(record, spec, say, what="smoke")
            report = run_smoke(state, record, spec, skip=skip, steps=steps)
    except CheckError as e:
        raise CommandError(f"smoke test of cluster {record.name!r} could not run: {e}") from None
    say(check_table(report.checks))
    say(f"report: {report.html_path} (kept after `fsdpctl down`)")
    if report.failed:
        raise CommandError(f"smoke test failed: {', '.join(report.failed)} (see the table above and "
                           f"{report.html_path}; node logs in {report.logs}). Fix the cause "
                           "and rerun `fsdpctl smoke`.")
    return report


def cmd_smoke(args) -> int:
    smoke(args.cluster, skip=args.skip, steps=args.steps)
    return 0
