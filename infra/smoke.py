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
4. `recovery`   an elastic run with `--max-restarts`; one node's workers are killed mid-run; the time
                from the kill to the first metrics line of the restarted workers is measured; the run
                must complete.

The thresholds and how each figure is measured are in docs/smoke-test.md. Results go to
`report.json` and `report.html` in the cluster's state directory.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from infra import nccl_tests, remote
from infra.deploy import DeployError, deployed_venv
from infra.report import check_table, write_report
from infra.spec import ClusterSpec
from infra.state import ClusterState, resolve

CHECKS = ("inventory", "bandwidth", "fsdp", "recovery")
NODE_TIMEOUT_S = 20
# gloo over TCP on CPU nodes: far below any GPU fabric; under this, the nodes' link is broken
# (e.g. a 10 Mbit/s fallback or heavy packet loss), not merely slow.
GLOO_BUSBW_FLOOR_GBPS = 0.02
# FSDP shards parameters evenly; peak memory of the most loaded rank over the least loaded one.
MEMORY_BALANCE_BOUND = 1.25
# The guide: gradient synchronisation under 15% of the step time (gated on GPUs only: on gloo/CPU,
# communication and computation share the same two cores).
GRAD_SYNC_SHARE_BOUND = 0.15
RUN_TIMEOUT_S = 600
RECOVERY_TIMEOUT_S = 300
POLL_S = 0.25


class SmokeError(RuntimeError):
    pass


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


def _log(message: str) -> None:
    print(f"[smoke] {message}", flush=True)


def nproc_per_node(state: ClusterState, spec: ClusterSpec) -> int:
    if spec.trainer.nproc_per_node:
        return spec.trainer.nproc_per_node
    if state.read().get("target") == "local":
        return spec.local.nproc_per_node
    return spec.instance.gpus


# ---- torchrun across nodes ---------------------------------------------------------------------

class TorchrunJob:
    """One torchrun agent per node (c10d rendezvous on the first node), started over SSH.

    Each agent writes its pid to a file on its node, so the job can be stopped, and single workers
    killed, by exact pid rather than by name.
    """

    def __init__(self, state: ClusterState, ranks: list[int], module_args: list[str], *, nproc: int,
                 port: int, log_dir: Path, name: str, max_restarts: int = 0,
                 env: dict[str, str] | None = None, interfaces: dict[int, str] | None = None):
        self.state, self.ranks, self.name = state, ranks, name
        self.run_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.pidfile = f"/tmp/fsdp-{self.run_id}.pid"
        self.log_dir = log_dir
        nodes = {n.rank: n for n in remote.cluster_nodes(state, include_excluded=True)}
        venv = deployed_venv(state)
        head = nodes[ranks[0]].address
        self.procs: dict[int, subprocess.Popen] = {}
        self._logs = {}
        base_env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        for rank in ranks:
            node_env = dict(base_env)
            if interfaces and rank in interfaces:
                # Bind gloo (and NCCL's bootstrap) to the cluster interface, not whatever the host
                # name resolves to.
                node_env.setdefault("GLOO_SOCKET_IFNAME", interfaces[rank])
            exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in node_env.items())
            argv = [f"{venv}/bin/torchrun", "--nnodes", str(len(ranks)), "--nproc-per-node", str(nproc),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{head}:{port}", "--rdzv-id", self.run_id,
                    # Advertise the node's cluster address, not its host name: the workers'
                    # MASTER_ADDR must resolve on every node even where no /etc/hosts lists them.
                    "--local-addr", nodes[rank].address,
                    "--max-restarts", str(max_restarts), *module_args]
            command = (f"cd /tmp && echo $$ > {self.pidfile} && exec env {exports} "
                       + " ".join(shlex.quote(a) for a in argv))
            log = open(log_dir / f"{name}-node{rank}.log", "w")  # noqa: SIM115 - closed in wait()
            self._logs[rank] = log
            self.procs[rank] = remote.popen(state, rank, command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)

    def poll(self) -> dict[int, int | None]:
        return {rank: p.poll() for rank, p in self.procs.items()}

    def wait(self, timeout: float) -> dict[int, int]:
        """Exit codes by rank; on timeout, stop the job and report 124 for nodes still running."""
        deadline = time.monotonic() + timeout
        codes: dict[int, int] = {}
        try:
            for rank, proc in self.procs.items():
                try:
                    codes[rank] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    codes[rank] = remote.TIMEOUT_RC
        finally:
            if any(c == remote.TIMEOUT_RC for c in codes.values()) or len(codes) < len(self.procs):
                self.stop()
            for log in self._logs.values():
                log.close()
        return codes

    def worker_pids(self, rank: int) -> set[int]:
        """The pids of the training processes (the agent's children) on one node."""
        proc = remote.run(self.state, rank, f"pgrep -P $(cat {self.pidfile})", timeout=NODE_TIMEOUT_S,
                          check=False)
        return {int(p) for p in proc.stdout.split() if p.isdigit()}

    def kill_workers(self, rank: int) -> set[int]:
        """SIGKILL the training processes on one node (a crashed worker); returns their pids."""
        proc = remote.run(self.state, rank, f"pids=$(pgrep -P $(cat {self.pidfile})) && kill -KILL $pids "
                          "&& echo $pids", timeout=NODE_TIMEOUT_S)
        return {int(p) for p in proc.stdout.split() if p.isdigit()}

    def stop(self) -> None:
        """Stop every agent (it stops its workers) and the local ssh processes."""
        for rank in self.procs:
            remote.run(self.state, rank, f"test -f {self.pidfile} && kill -TERM $(cat {self.pidfile}) "
                       f"2>/dev/null; rm -f {self.pidfile}", timeout=NODE_TIMEOUT_S, check=False)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def log_tail(self, rank: int, lines: int = 20) -> str:
        path = self.log_dir / f"{self.name}-node{rank}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def failure(self, codes: dict[int, int]) -> str | None:
        bad = {r: c for r, c in codes.items() if c != 0}
        if not bad:
            return None
        rank = min(bad)
        what = "timed out" if bad[rank] == remote.TIMEOUT_RC else f"exited {bad[rank]}"
        return (f"torchrun on node {rank} {what} (log {self.log_dir / f'{self.name}-node{rank}.log'}):\n"
                + self.log_tail(rank))


def read_remote_jsonl(state: ClusterState, rank: int, path: str) -> list[dict[str, Any]]:
    proc = remote.run(state, rank, f"cat {shlex.quote(path)} 2>/dev/null || true", timeout=NODE_TIMEOUT_S,
                      check=False)
    rows = []
    for line in (proc.stdout or "").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line being written while we read
    return rows


def read_remote_json(state: ClusterState, rank: int, path: str) -> dict[str, Any] | None:
    proc = remote.run(state, rank, f"cat {shlex.quote(path)}", timeout=NODE_TIMEOUT_S, check=False)
    try:
        return json.loads(proc.stdout) if proc.returncode == 0 else None
    except ValueError:
        return None


def step_lines(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "event" not in r and "step" in r]


# ---- the checks --------------------------------------------------------------------------------

@dataclass
class SmokeContext:
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

    @property
    def nproc(self) -> int:
        return nproc_per_node(self.state, self.spec)

    @property
    def on_gpu(self) -> bool:
        return self.spec.instance.gpus > 0 and self.state.read().get("target") != "local"

    def job(self, name: str, module_args: list[str], *, ranks: list[int] | None = None,
            **kwargs: Any) -> TorchrunJob:
        return TorchrunJob(self.state, ranks or self.ranks, module_args, nproc=self.nproc,
                           port=self.spec.trainer.master_port, log_dir=self.run_dir, name=name,
                           interfaces=self.interfaces, **kwargs)


_INVENTORY_PROBE = r"""addr={address}
iface=$(ip -o -4 addr show | awk -v a="$addr" '{{split($4, p, "/"); if (p[1] == a) print $2}}' | head -n1)
echo "iface=$iface"
echo "mtu=$(cat /sys/class/net/$iface/mtu 2>/dev/null)"
if command -v nvidia-smi >/dev/null; then echo "gpus=$(nvidia-smi -L | grep -c '^GPU ')"
else echo "gpus="; fi
if [ -d /sys/class/infiniband ]; then echo "efa=$(ls /sys/class/infiniband | wc -l)"; else echo "efa="; fi
"""


def check_inventory(ctx: SmokeContext, result: CheckResult) -> None:
    nodes = {n.rank: n for n in remote.cluster_nodes(ctx.state)}
    expected_mtu = ctx.spec.network.mtu
    instance = ctx.spec.instance
    local = ctx.state.read().get("target") == "local"
    problems, per_node = [], {}
    with ThreadPoolExecutor(max_workers=min(32, len(ctx.ranks))) as pool:
        futures = {r: pool.submit(remote.run, ctx.state, r, _INVENTORY_PROBE.format(address=nodes[r].address),
                                  timeout=NODE_TIMEOUT_S, check=False) for r in ctx.ranks}
        answers = {r: f.result() for r, f in futures.items()}
    for rank, proc in sorted(answers.items()):
        if proc.returncode != 0:
            why = f"no answer within {NODE_TIMEOUT_S} s" if proc.returncode == remote.TIMEOUT_RC \
                else f"ssh exit {proc.returncode}: {(proc.stderr or '').strip()[-200:]}"
            problems.append(f"node {rank} ({nodes[rank].address}) does not answer: {why}")
            per_node[rank] = {"answers": False, "error": why}
            continue
        facts = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
        info: dict[str, Any] = {"answers": True, "interface": facts.get("iface") or None,
                                "mtu": int(facts["mtu"]) if facts.get("mtu", "").isdigit() else None}
        if info["interface"]:
            ctx.interfaces[rank] = info["interface"]
        if info["mtu"] != expected_mtu:
            problems.append(f"node {rank}: MTU of {info['interface'] or 'its interface'} is {info['mtu']}, "
                            f"spec network.mtu is {expected_mtu} (rerun `fsdpctl configure --tags network`)")
        for key, want, label in (("gpus", instance.gpus, "GPU"), ("efa", instance.efa_interfaces, "EFA")):
            raw = facts.get(key, "")
            if local:
                info[key] = "skipped: local node, no hardware"
            elif not raw.isdigit():
                info[key] = None
                problems.append(f"node {rank}: no {label} devices visible (expected {want} on "
                                f"{instance.name}); is the {'driver' if key == 'gpus' else 'EFA installer'} "
                                "installed? rerun `fsdpctl configure`")
            else:
                info[key] = int(raw)
                if int(raw) != want:
                    problems.append(f"node {rank}: {int(raw)} {label} device(s), expected {want} on "
                                    f"{instance.name}")
        per_node[rank] = info
    result.details = {"expected_mtu": expected_mtu, "nodes": per_node,
                      "hardware_checks": "skipped (local target has no GPU/EFA)" if local
                      else f"{instance.gpus} GPUs and {instance.efa_interfaces} EFA per node"}
    if problems:
        result.fail("; ".join(problems))
    else:
        result.summary = (f"{len(ctx.ranks)} node(s) answer, MTU {expected_mtu}"
                          + ("; GPU/EFA counts skipped (local target)" if local
                             else f"; {instance.gpus} GPUs, {instance.efa_interfaces} EFA each"))


NCCL_TESTS_MISSING = "nccl-tests not installed: rerun `fsdpctl configure --tags nccl`"


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


def _torch_bandwidth(ctx: SmokeContext) -> tuple[dict[str, Any] | None, str | None]:
    """trainer.collectives under torchrun on every node: (result, None) or (None, why it failed)."""
    output = f"{ctx.work_dir}/collectives.json"
    job = ctx.job("bandwidth", ["-m", "trainer.collectives", "--output", output])
    failure = job.failure(job.wait(RUN_TIMEOUT_S))
    if failure:
        return None, f"benchmark failed: {failure}"
    data = read_remote_json(ctx.state, ctx.ranks[0], output)
    if not data:
        return None, f"benchmark wrote no result to {output} on node {ctx.ranks[0]}"
    return data, None


def _nccl_tests_bandwidth(ctx: SmokeContext) -> tuple[dict[str, Any] | None, str | None]:
    """all_reduce_perf through mpirun from the first node, one rank per GPU on every node."""
    addresses = {n.rank: n.address for n in remote.cluster_nodes(ctx.state)}
    gpus = ctx.spec.instance.gpus
    command = nccl_tests.mpirun_command([addresses[r] for r in ctx.ranks], gpus)
    log = ctx.run_dir / "nccl-tests.log"
    proc = remote.run(ctx.state, ctx.ranks[0], command, timeout=RUN_TIMEOUT_S, check=False)
    log.write_text(f"$ {command}\n{proc.stdout}{proc.stderr}")
    if proc.returncode != 0:
        what = "timed out" if proc.returncode == remote.TIMEOUT_RC else f"exited {proc.returncode}"
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        return None, f"nccl-tests (mpirun on node {ctx.ranks[0]}) {what} (log {log}):\n{tail}"
    try:
        rows = nccl_tests.parse_all_reduce_perf(proc.stdout)
    except nccl_tests.NcclTestsError as e:
        return None, f"{e} (log {log})"
    data = nccl_tests.as_bandwidth_result(rows, len(ctx.ranks) * gpus)
    data["avg_busbw_gbps"] = nccl_tests.average_bus_bandwidth(proc.stdout)
    return data, None


def check_bandwidth(ctx: SmokeContext, result: CheckResult) -> None:
    note, torch_detail = "", None
    if ctx.on_gpu:
        probe = remote.run(ctx.state, ctx.ranks[0], f"test -x {nccl_tests.ALL_REDUCE_PERF}",
                           timeout=NODE_TIMEOUT_S, check=False)
        if probe.returncode == 0:
            data, failure = _nccl_tests_bandwidth(ctx)
            if failure:
                result.fail(failure)
                return
            # The PyTorch path training uses, as detail: not gated, nccl-tests is the fabric's figure.
            torch_data, torch_failure = _torch_bandwidth(ctx)
            if torch_failure:
                torch_detail = {"error": torch_failure}
                note = "; the torch.distributed benchmark failed (details.torch_distributed in report.json)"
            else:
                torch_detail = {"peak_busbw_gbps": torch_data["peak_busbw_gbps"],
                                "world_size": torch_data["world_size"]}
        else:
            note = f"; {NCCL_TESTS_MISSING}"
            data, failure = _torch_bandwidth(ctx)
    else:
        data, failure = _torch_bandwidth(ctx)
    if failure:
        result.fail(failure + note)
        return
    ctx.bandwidth = data
    if data["backend"] == "gloo":
        gate, basis = GLOO_BUSBW_FLOOR_GBPS, "gloo/CPU floor"
    else:
        gate, basis = ctx.spec.instance.allreduce_busbw_gate_gbps, f"{ctx.spec.instance_type} gate"
    peak = data["peak_busbw_gbps"]
    result.details = {"backend": data["backend"], "world_size": data["world_size"], "gate_gbps": gate,
                      "gate_basis": basis, "peak_busbw_gbps": peak, "results": data["results"]}
    if torch_detail:
        result.details["torch_distributed"] = torch_detail
    if note:
        result.details["note"] = note.removeprefix("; ")
    passed, summary = bandwidth_verdict(peak, world_size=data["world_size"], nodes=len(ctx.ranks),
                                        backend=data["backend"], gate_gbps=gate, basis=basis)
    if passed:
        result.summary = summary + note
    else:
        result.fail(summary + note)


def _trainer_args(ctx: SmokeContext, *, steps: int, checkpoint_dir: str | None, interval: int,
                  metrics: str, resume: str) -> list[str]:
    checkpointing = ["--checkpoint-dir", checkpoint_dir, "--checkpoint-interval", str(interval)] \
        if checkpoint_dir else []
    return ["-m", "trainer", "--config", ctx.spec.trainer.config, "--steps", str(steps), *checkpointing,
            "--metrics-file", metrics, "--resume", resume, "--seed", "0"]


def _list_checkpoints(ctx: SmokeContext, checkpoint_dir: str) -> list[dict[str, Any]]:
    venv = deployed_venv(ctx.state)
    proc = remote.run(ctx.state, ctx.ranks[0], f"{venv}/bin/python -m trainer.checkpoint list --json "
                      f"{shlex.quote(checkpoint_dir)}", timeout=120, check=False)
    try:
        return json.loads(proc.stdout) if proc.returncode == 0 else []
    except ValueError:
        return []


def check_fsdp(ctx: SmokeContext, result: CheckResult) -> None:
    steps = ctx.steps
    interval = max(1, steps // 2)
    # Every rank writes into one checkpoint directory, so checkpoints need the shared file system.
    ckpt = f"{ctx.work_dir}/fsdp-checkpoints" if ctx.shared else None
    metrics = f"{ctx.work_dir}/fsdp-metrics.jsonl"
    job = ctx.job("fsdp", _trainer_args(ctx, steps=steps, checkpoint_dir=ckpt, interval=interval,
                                        metrics=metrics, resume="none"))
    failure = job.failure(job.wait(RUN_TIMEOUT_S))
    if failure:
        result.fail(f"training run failed: {failure}")
        return
    rows = read_remote_jsonl(ctx.state, ctx.ranks[0], metrics)
    lines = step_lines(rows)
    summary_event = next((r for r in rows if r.get("event") == "summary"), {})
    ctx.training = {"steps": lines, "summary": summary_event, "per_rank": per_rank_figures(lines)}
    problems, facts = [], {"steps": len(lines), "world_size": len(ctx.ranks) * ctx.nproc}
    if len(lines) < steps:
        result.fail(f"the run logged {len(lines)} of {steps} steps to {metrics}")
        return

    quarter = max(1, len(lines) // 4)
    first = sum(r["loss"] for r in lines[:quarter]) / quarter
    last = sum(r["loss"] for r in lines[-quarter:]) / quarter
    facts.update(loss_first=first, loss_last=last)
    if not last < first:
        problems.append(f"loss did not decrease (mean of the first {quarter} steps {first:.4f}, "
                        f"of the last {quarter} {last:.4f})")

    ratio = max((r.get("mem_max_min_ratio") or 1.0) for r in lines)
    facts["mem_max_min_ratio"] = ratio
    if ratio > MEMORY_BALANCE_BOUND:
        problems.append(f"memory unbalanced: max/min peak memory across ranks {ratio:.2f} > "
                        f"{MEMORY_BALANCE_BOUND}")

    timed = lines[1:] or lines  # the first step includes start-up work
    shares = [r["grad_sync_share"] for r in timed if r.get("grad_sync_share") is not None]
    share = sum(shares) / len(shares) if shares else None
    facts["grad_sync_share"] = share
    facts["tokens_per_s"] = sum(r["tokens_per_s"] for r in timed) / len(timed)
    if ctx.on_gpu and share is None:
        problems.append("gradient-sync share not measured: the trainer config needs "
                        "training.gradient_accumulation >= 2")
    elif ctx.on_gpu and share >= GRAD_SYNC_SHARE_BOUND:
        problems.append(f"gradient sync takes {share:.0%} of the step (bound {GRAD_SYNC_SHARE_BOUND:.0%})")

    checkpoints = _list_checkpoints(ctx, ckpt) if ckpt else []
    facts["checkpoints"] = [{k: c.get(k) for k in ("step", "verified", "bytes", "problems")}
                            for c in checkpoints]
    verified = [c for c in checkpoints if c.get("verified")]
    if ckpt is None:
        checkpoint_note = ("checkpoint and resume skipped: the cluster has no shared file system "
                           "(enable storage.fsx)")
    elif not checkpoints:
        problems.append(f"no checkpoint written under {ckpt}")
    elif len(verified) != len(checkpoints):
        bad = [p for c in checkpoints for p in c.get("problems", [])]
        problems.append("checkpoint manifest does not verify: " + "; ".join(bad[:3]))

    if verified:
        resume_steps = steps + max(2, steps // 4)
        resumed_metrics = f"{ctx.work_dir}/fsdp-resume-metrics.jsonl"
        job = ctx.job("fsdp-resume", _trainer_args(ctx, steps=resume_steps, checkpoint_dir=ckpt,
                                                   interval=interval, metrics=resumed_metrics,
                                                   resume="auto"))
        failure = job.failure(job.wait(RUN_TIMEOUT_S))
        resumed = step_lines(read_remote_jsonl(ctx.state, ctx.ranks[0], resumed_metrics))
        latest = max(c["step"] for c in verified)
        facts["resume"] = {"from_step": latest, "first_step": resumed[0]["step"] if resumed else None,
                           "last_step": resumed[-1]["step"] if resumed else None}
        if failure:
            problems.append(f"resume run failed: {failure}")
        elif not resumed or resumed[0]["step"] != latest + 1 or resumed[-1]["step"] != resume_steps:
            problems.append(f"resume did not continue from the checkpoint at step {latest}: "
                            f"{facts['resume']}")
        checkpoint_note = (f"{len(verified)} checkpoint(s) verified; resumed at step "
                           f"{facts['resume']['first_step']}")

    result.details = facts
    if problems:
        result.fail("; ".join(problems))
    else:
        sync_note = "" if ctx.on_gpu else " (reported, not gated, on gloo)"
        sync = "not measured" if share is None else f"{share:.0%}"
        result.summary = (f"loss {first:.3f} -> {last:.3f}; memory max/min {ratio:.2f}; grad sync "
                          f"{sync}{sync_note}; {checkpoint_note}")


def per_rank_figures(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Peak memory of each rank over the run, and throughput per rank (steps are synchronous across
    ranks, so each rank's tokens/s is the global figure divided by the world size; the first step,
    start-up included, is left out)."""
    per_step = [r["mem_bytes_per_rank"] for r in lines if r.get("mem_bytes_per_rank")]
    if not per_step:
        return []
    timed = lines[1:] or lines
    world = len(per_step[-1])
    tokens = sum(r["tokens_per_s"] for r in timed) / len(timed) / world
    return [{"rank": rank, "max_mem_bytes": max(m[rank] for m in per_step if len(m) == world),
             "tokens_per_s": tokens} for rank in range(world)]


def check_recovery(ctx: SmokeContext, result: CheckResult) -> None:
    if not ctx.shared:
        result.status = "skip"
        result.summary = "no shared file system: restarted ranks cannot load checkpoints"
        return
    steps, interval = max(16, ctx.steps), 4
    ckpt, metrics = f"{ctx.work_dir}/recovery-checkpoints", f"{ctx.work_dir}/recovery-metrics.jsonl"
    victim = ctx.ranks[-1]
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: with the shared store, gloo reconnects to the previous
    # round's addresses after a restart and the job hangs (pytorch/pytorch#135712).
    job = ctx.job("recovery", _trainer_args(ctx, steps=steps, checkpoint_dir=ckpt, interval=interval,
                                            metrics=metrics, resume="auto"),
                  max_restarts=3, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    try:
        facts = _kill_and_time_recovery(ctx, job, victim, metrics, interval)
    except SmokeError as e:
        job.stop()
        result.fail(str(e))
        return
    failure = job.failure(job.wait(RUN_TIMEOUT_S))
    lines = step_lines(read_remote_jsonl(ctx.state, ctx.ranks[0], metrics))
    facts["last_step"] = lines[-1]["step"] if lines else None
    result.details = facts
    if failure:
        result.fail(f"the run did not complete after the restart: {failure}")
    elif facts["last_step"] != steps:
        result.fail(f"the run stopped at step {facts['last_step']} of {steps}")
    else:
        result.summary = (f"killed node {victim}'s workers after step {facts['killed_after_step']}; training "
                          f"continued at step {facts['resumed_at_step']} (from the checkpoint of step "
                          f"{facts['resumed_at_step'] - 1}) after "
                          f"{facts['recovery_time_s']:.1f} s; completed {steps} steps")


def _kill_and_time_recovery(ctx: SmokeContext, job: TorchrunJob, victim: int, metrics: str,
                            interval: int) -> dict[str, Any]:
    """Wait for a checkpoint and a step after it, kill the victim's workers, and time the recovery:
    from the kill to the first metrics line written by the restarted workers.

    Lines the old workers were still writing when the kill landed must not count: torchrun starts
    new workers only after a new rendezvous round, which every agent joins only after stopping its
    old workers; so once the victim has new worker pids, every later metrics line is the new
    workers'."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        lines = step_lines(read_remote_jsonl(ctx.state, ctx.ranks[0], metrics))
        last_step = lines[-1]["step"] if lines else 0
        if last_step > interval and last_step % interval:
            break
        if any(code is not None for code in job.poll().values()):
            raise SmokeError("the run ended before a checkpoint was written: "
                             + (job.failure({r: c or 0 for r, c in job.poll().items()}) or "no metrics"))
        if time.monotonic() > deadline:
            raise SmokeError(f"no step after the first checkpoint within {RUN_TIMEOUT_S} s")
        time.sleep(POLL_S)
    killed_pids = job.kill_workers(victim)
    killed = time.monotonic()
    _log(f"recovery: killed the workers on node {victim} (pids {sorted(killed_pids)}) after step {last_step}")
    lines_before_restart: int | None = None
    restart_s = None
    while time.monotonic() - killed < RECOVERY_TIMEOUT_S:
        if lines_before_restart is None:
            if job.worker_pids(victim) - killed_pids:
                restart_s = time.monotonic() - killed
                lines_before_restart = len(step_lines(read_remote_jsonl(ctx.state, ctx.ranks[0], metrics)))
        else:
            lines = step_lines(read_remote_jsonl(ctx.state, ctx.ranks[0], metrics))
            if len(lines) > lines_before_restart:
                return {"victim_node": victim, "killed_after_step": last_step,
                        "resumed_at_step": lines[lines_before_restart]["step"],
                        "workers_restarted_after_s": round(restart_s, 2),
                        "recovery_time_s": round(time.monotonic() - killed, 2),
                        "checkpoint_interval": interval, "poll_interval_s": POLL_S}
        if all(code is not None for code in job.poll().values()):
            raise SmokeError("the job exited after the kill instead of restarting: "
                             + (job.failure({r: c or 0 for r, c in job.poll().items()}) or "no error"))
        time.sleep(POLL_S)
    raise SmokeError(f"training did not continue within {RECOVERY_TIMEOUT_S} s of the kill")


def smoke_context(state: ClusterState, kind: str, *, steps: int) -> SmokeContext:
    """A context for runs on every non-excluded node, with a fresh run dir (logs) in the state dir and
    a work dir on the nodes (shared when the cluster has a shared file system)."""
    ranks = [n.rank for n in remote.cluster_nodes(state)]
    if not ranks:
        raise SmokeError(f"cluster {state.name!r} has no (non-excluded) nodes: run `fsdpctl up` first")
    shared_dir = state.read().get("shared_dir")
    run_dir = state.new_run_dir(kind)
    return SmokeContext(state=state, spec=state.spec(), ranks=ranks, run_dir=run_dir,
                        work_dir=f"{shared_dir or '/tmp'}/fsdp-cluster/{kind}/{run_dir.name}",
                        shared=bool(shared_dir), steps=steps)


CHECK_FUNCTIONS: dict[str, Callable[[SmokeContext, CheckResult], None]] = {
    "inventory": check_inventory,
    "bandwidth": check_bandwidth,
    "fsdp": check_fsdp,
    "recovery": check_recovery,
}


def run_smoke(state: ClusterState, *, skip: list[str] | None = None,
              steps: int | None = None) -> dict[str, Any]:
    """Run the checks and write the report; returns the report dict."""
    unknown = sorted(set(skip or []) - set(CHECKS))
    if unknown:
        raise SmokeError(f"unknown check(s) to skip: {', '.join(unknown)}; checks are {', '.join(CHECKS)}")
    ctx = smoke_context(state, "smoke", steps=steps or 20)
    spec, data, ranks, work_dir = ctx.spec, state.read(), ctx.ranks, ctx.work_dir
    run_dir = ctx.run_dir
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
            _log(f"{name} ...")
            t0 = time.monotonic()
            try:
                if name != "inventory":
                    deployed_venv(state)
                    remote.run_all(state, f"mkdir -p {shlex.quote(work_dir)}", timeout=NODE_TIMEOUT_S)
                CHECK_FUNCTIONS[name](ctx, result)
            except (DeployError, remote.RemoteCommandFailed) as e:
                result.fail(str(e))
            result.duration_s = time.monotonic() - t0
            _log(f"{name}: {result.status} ({result.duration_s:.1f} s) {result.summary}")
            if name == "inventory" and result.status == "fail":
                blocked = "the inventory check failed (every node must answer first)"
        results.append(result)

    failed = [r.name for r in results if r.status == "fail"]
    report = {
        "cluster": state.name, "target": data.get("target"), "instance_type": spec.instance_type,
        "nodes": len(ranks), "nproc_per_node": ctx.nproc, "started_at": started,
        "passed": not failed, "failed": failed,
        "checks": [r.as_dict() for r in results],
        "bandwidth": ctx.bandwidth,
        "bandwidth_gate_gbps": next((r.details.get("gate_gbps") for r in results if r.name == "bandwidth"),
                                    None),
        "training": ctx.training,
        "logs": str(run_dir),
    }
    json_path, html_path = write_report(state.root, report)
    report["report_paths"] = [str(json_path), str(html_path)]
    # Checkpoints of a smoke run are only evidence; the report keeps the figures.
    remote.run_all(state, f"rm -rf {shlex.quote(work_dir)}", timeout=120, check=False)
    return report


def cmd_smoke(args) -> int:
    from infra.cli import CommandError

    state = resolve(args.cluster)
    try:
        report = run_smoke(state, skip=args.skip, steps=args.steps)
    except SmokeError as e:
        raise CommandError(f"smoke test of cluster {state.name!r} could not run: {e}") from None
    print(check_table(report["checks"]))
    print(f"report: {report['report_paths'][1]}")
    if report["failed"]:
        raise CommandError(f"smoke test failed: {', '.join(report['failed'])} (see the table above and "
                           f"{report['report_paths'][1]}; node logs in {report['logs']}). Fix the cause "
                           "and rerun `fsdpctl smoke`.")
    return 0
