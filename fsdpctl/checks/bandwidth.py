"""The `bandwidth` check: all-reduce bus bandwidth across the nodes, gated per instance type.

nccl-tests' all_reduce_perf through mpirun on GPU nodes (the torch.distributed figure kept as
detail; `trainer.collectives` under torchrun where nccl-tests is missing), `trainer.collectives` on
gloo/CPU, gated at a low floor.
"""

from __future__ import annotations

from typing import Literal

from fsdpctl import remote
from fsdpctl.checks import nccl_tests
from fsdpctl.checks.context import CheckContext, CheckResult, Details, Frozen
from fsdpctl.checks.torchrun import NODE_TIMEOUT_S, RUN_TIMEOUT_S, read_remote_model

# gloo over TCP on CPU nodes: far below any GPU fabric; under this, the nodes' link is broken
# (e.g. a 10 Mbit/s fallback or heavy packet loss), not merely slow.
GLOO_BUSBW_FLOOR_GBPS = 0.02

NCCL_TESTS_MISSING = "nccl-tests not installed: rerun `fsdpctl configure --tags nccl`"


class AllReduceRow(Frozen):
    """The figures of one message size."""

    bytes: int
    algbw_gbps: float
    busbw_gbps: float
    size: str | None = None
    """The size as text (trainer.collectives only)."""
    time_us: float | None = None
    """Time of one all-reduce (trainer.collectives only)."""


class AllReduceMeasurement(Frozen):
    """`python -m trainer.collectives --output`'s result, or nccl-tests' table in its shape: what the
    check gates and the report plots."""

    backend: str
    """nccl, gloo, or nccl-tests."""
    world_size: int
    results: list[AllReduceRow]
    peak_busbw_gbps: float
    avg_busbw_gbps: float | None = None
    """nccl-tests' `# Avg bus bandwidth`."""
    # trainer.collectives' run facts (None for nccl-tests).
    nnodes: int | None = None
    device: str | None = None
    iters: int | None = None
    warmup: int | None = None


class TorchDistributedFigure(Frozen):
    """On GPU nodes, the torch.distributed benchmark beside nccl-tests (not gated): its peak, or why it
    failed."""

    peak_busbw_gbps: float | None = None
    world_size: int | None = None
    error: str | None = None


class BandwidthDetails(Details):
    check: Literal["bandwidth"] = "bandwidth"
    backend: str
    world_size: int
    gate_gbps: float
    gate_basis: str
    """What the gate is: the instance type's, or the gloo/CPU floor."""
    peak_busbw_gbps: float
    results: list[AllReduceRow]
    torch_distributed: TorchDistributedFigure | None = None
    note: str | None = None


class BandwidthResult(CheckResult):
    details: BandwidthDetails | None = None
    measurement: AllReduceMeasurement | None = None
    """What was measured (the report's `bandwidth`), also where the gate failed."""


def bandwidth_verdict(peak_gbps: float, *, world_size: int, nodes: int, backend: str,
                      gate_gbps: float, basis: str) -> tuple[bool, str]:
    """(passed, summary) for a peak all-reduce bus bandwidth against its gate (a single rank has no bus
    bandwidth: never failed)."""
    if nodes == 1:
        # all-reduce inside one node runs over NVLink or shared memory, not the fabric
        basis += " (one node: inter-node bandwidth not measured)"
    summary = (f"peak bus bandwidth {peak_gbps:.3g} GB/s over {world_size} ranks ({backend}); "
               f"{basis} {gate_gbps:g} GB/s")
    if peak_gbps >= gate_gbps or world_size <= 1:
        return True, summary
    hint = (" - fewer EFAs than the instance has, or NCCL fell back to TCP sockets "
            "(NCCL_DEBUG=INFO shows 'Using network Socket')") if backend != "gloo" else ""
    return False, f"{summary}: below the gate{hint}"


def as_measurement(rows: list[nccl_tests.AllReducePerfRow], world_size: int,
                   average_gbps: float | None) -> AllReduceMeasurement:
    """nccl-tests' parsed rows in the shape of `trainer.collectives`' result."""
    return AllReduceMeasurement(
        backend="nccl-tests", world_size=world_size,
        results=[AllReduceRow(bytes=r.size_bytes, algbw_gbps=r.algbw_gbps, busbw_gbps=r.busbw_gbps)
                 for r in rows],
        peak_busbw_gbps=max(r.busbw_gbps for r in rows), avg_busbw_gbps=average_gbps)


def _torch_bandwidth(ctx: CheckContext) -> tuple[AllReduceMeasurement | None, str | None]:
    """trainer.collectives under torchrun on every node: (result, None) or (None, why it failed)."""
    output = f"{ctx.work_dir}/collectives.json"
    job = ctx.job("bandwidth", ["-m", "trainer.collectives", "--output", output])
    failure = job.failure(job.wait(RUN_TIMEOUT_S))
    if failure:
        return None, f"benchmark failed: {failure}"
    data = read_remote_model(ctx.record, ctx.ranks[0], output, AllReduceMeasurement)
    if not data:
        return None, f"benchmark wrote no result to {output} on node {ctx.ranks[0]}"
    return data, None


def _nccl_tests_bandwidth(ctx: CheckContext) -> tuple[AllReduceMeasurement | None, str | None]:
    """all_reduce_perf through mpirun from the first node, one rank per GPU on every node."""
    addresses = {n.rank: n.address for n in remote.cluster_nodes(ctx.record)}
    gpus = ctx.spec.instance.gpus
    command = nccl_tests.mpirun_command([addresses[r] for r in ctx.ranks], gpus)
    log = ctx.run_dir / "nccl-tests.log"
    proc = remote.run(ctx.record, ctx.ranks[0], command, timeout=RUN_TIMEOUT_S, check=False)
    log.write_text(f"$ {command}\n{proc.stdout}{proc.stderr}")
    if proc.returncode != 0:
        what = "timed out" if proc.returncode == remote.TIMEOUT_RC else f"exited {proc.returncode}"
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        return None, f"nccl-tests (mpirun on node {ctx.ranks[0]}) {what} (log {log}):\n{tail}"
    try:
        rows = nccl_tests.parse_all_reduce_perf(proc.stdout)
    except nccl_tests.NcclTestsError as e:
        return None, f"{e} (log {log})"
    return as_measurement(rows, len(ctx.ranks) * gpus, nccl_tests.average_bus_bandwidth(proc.stdout)), None


def check_bandwidth(ctx: CheckContext) -> BandwidthResult:
    note, torch_detail = "", None
    if ctx.on_gpu:
        probe = remote.run(ctx.record, ctx.ranks[0], f"test -x {nccl_tests.ALL_REDUCE_PERF}",
                           timeout=NODE_TIMEOUT_S, check=False)
        if probe.returncode == 0:
            data, failure = _nccl_tests_bandwidth(ctx)
            if failure:
                return BandwidthResult(status="fail", summary=failure)
            # The PyTorch path training uses, as detail: not gated, nccl-tests is the fabric's figure.
            torch_data, torch_failure = _torch_bandwidth(ctx)
            if torch_data is None:
                torch_detail = TorchDistributedFigure(error=torch_failure)
                note = "; the torch.distributed benchmark failed (details.torch_distributed in report.json)"
            else:
                torch_detail = TorchDistributedFigure(peak_busbw_gbps=torch_data.peak_busbw_gbps,
                                                      world_size=torch_data.world_size)
        else:
            note = f"; {NCCL_TESTS_MISSING}"
            data, failure = _torch_bandwidth(ctx)
    else:
        data, failure = _torch_bandwidth(ctx)
    if data is None:
        return BandwidthResult(status="fail", summary=f"{failure}{note}")
    if data.backend == "gloo":
        gate, basis = GLOO_BUSBW_FLOOR_GBPS, "gloo/CPU floor"
    else:
        gate, basis = ctx.spec.instance.allreduce_busbw_gate_gbps, f"{ctx.spec.instance_type} gate"
    details = BandwidthDetails(backend=data.backend, world_size=data.world_size, gate_gbps=gate,
                               gate_basis=basis, peak_busbw_gbps=data.peak_busbw_gbps, results=data.results,
                               torch_distributed=torch_detail, note=note.removeprefix("; ") or None)
    passed, summary = bandwidth_verdict(data.peak_busbw_gbps, world_size=data.world_size,
                                        nodes=len(ctx.ranks), backend=data.backend, gate_gbps=gate,
                                        basis=basis)
    return BandwidthResult(status="pass" if passed else "fail", summary=summary + note, details=details,
                           measurement=data)
