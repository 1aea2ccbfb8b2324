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
from datetime import UTC, datetime
from typing import Any

from fsdpctl import remote
from fsdpctl.checks.bandwidth import check_bandwidth
from fsdpctl.checks.context import CheckContext, CheckError, CheckResult, check_context
from fsdpctl.checks.monitoring import check_monitoring
from fsdpctl.checks.nodes import check_inventory
from fsdpctl.checks.report import PLOTS_MISSING, check_table, plots_available, write_report
from fsdpctl.checks.torchrun import NODE_TIMEOUT_S
from fsdpctl.checks.training import check_fsdp, check_recovery
from fsdpctl.console import Out, say, stage
from fsdpctl.deploy import DeployError, deployed_venv
from fsdpctl.errors import CommandError, UsageError
from fsdpctl.slurm import slurm_status
from fsdpctl.state import ClusterState, resolve

CHECKS = ("inventory", "bandwidth", "fsdp", "monitoring", "recovery")


CHECK_FUNCTIONS: dict[str, Callable[[CheckContext, CheckResult], None]] = {
    "inventory": check_inventory,
    "bandwidth": check_bandwidth,
    "fsdp": check_fsdp,
    "monitoring": check_monitoring,
    "recovery": check_recovery,
}


def run_smoke(state: ClusterState, *, skip: list[str] | None = None, steps: int | None = None,
              out: Out | None = None) -> dict[str, Any]:
    """Run the checks and write the report into the run's directory under the cluster's reports
    (kept after `fsdpctl down`); returns the report dict."""
    out = out or stage("smoke")
    unknown = sorted(set(skip or []) - set(CHECKS))
    if unknown:
        raise UsageError(f"unknown check(s) to skip: {', '.join(unknown)}; checks are {', '.join(CHECKS)}")
    plots = plots_available()
    if not plots:
        out(f"note: {PLOTS_MISSING}")
    ctx = check_context(state, "smoke", steps=steps or 20, out=out)
    slurm_up, slurm_problem = slurm_status(state)
    ctx.slurm = bool(ctx.shared) and slurm_up
    if ctx.slurm:
        out("Slurm runs on the cluster: the fsdp and recovery checks run as Slurm jobs")
    elif slurm_problem:
        out(f"note: Slurm is installed but {slurm_problem}; the fsdp and recovery checks run under "
            "torchrun instead (`fsdpctl configure --tags slurm` starts it)")
    spec, record, ranks, work_dir = ctx.spec, state.read(), ctx.ranks, ctx.work_dir
    started = datetime.now(UTC).isoformat(timespec="seconds")
    results: list[CheckResult] = []
    blocked: str | None = None
    for name in CHECKS:
        result = CheckResult(name)
        if name in (skip or []):
            result.status, result.summary = "skip", "skipped on request (--skip)"
        elif blocked:
            result.status, result.summary = "skip", f"not run: {blocked}"
        else:
            out(f"{name} ...")
            t0 = time.monotonic()
            try:
                if name != "inventory":
                    deployed_venv(state)
                    remote.run_all(state, f"mkdir -p {shlex.quote(work_dir)}", timeout=NODE_TIMEOUT_S)
                wall_start = time.time()
                CHECK_FUNCTIONS[name](ctx, result)
                if name == "fsdp":  # the monitoring check reads Prometheus over this window
                    ctx.training["window"] = [wall_start, time.time()]
            except (DeployError, CheckError, remote.RemoteCommandFailed) as e:
                result.fail(str(e))
            result.duration_s = time.monotonic() - t0
            out(f"{name}: {result.status} ({result.duration_s:.1f} s) {result.summary}")
            if name == "inventory" and result.status == "fail":
                blocked = "the inventory check failed (every node must answer first)"
        results.append(result)

    failed = [r.name for r in results if r.status == "fail"]
    report = {
        "cluster": state.name, "target": record.target, "instance_type": spec.instance_type,
        "nodes": len(ranks), "nproc_per_node": ctx.nproc, "started_at": started,
        # how the fsdp and recovery checks ran: as Slurm jobs, or torchrun agents started over SSH
        "scheduler": "slurm" if ctx.slurm else "torchrun",
        "passed": not failed, "failed": failed,
        "checks": [r.as_dict() for r in results],
        "bandwidth": ctx.bandwidth,
        "bandwidth_gate_gbps": next((r.details.get("gate_gbps") for r in results if r.name == "bandwidth"),
                                    None),
        "training": ctx.training,
        "logs": str(ctx.run_dir),
    }
    json_path, html_path = write_report(ctx.run_dir, report, with_plots=plots)
    report["report_paths"] = [str(json_path), str(html_path)]
    state.update(last_report=str(ctx.run_dir))
    # Checkpoints of a smoke run are only evidence; the report keeps the figures.
    remote.run_all(state, f"rm -rf {shlex.quote(work_dir)}", timeout=120, check=False)
    return report


def cmd_smoke(args) -> int:
    state = resolve(args.cluster)
    try:
        with state.operation("smoke"):
            report = run_smoke(state, skip=args.skip, steps=args.steps)
    except CheckError as e:
        raise CommandError(f"smoke test of cluster {state.name!r} could not run: {e}") from None
    say(check_table(report["checks"]))
    say(f"report: {report['report_paths'][1]} (kept after `fsdpctl down`)")
    if report["failed"]:
        raise CommandError(f"smoke test failed: {', '.join(report['failed'])} (see the table above and "
                           f"{report['report_paths'][1]}; node logs in {report['logs']}). Fix the cause "
                           "and rerun `fsdpctl smoke`.")
    return 0
