"""Jobs across the nodes: one torchrun agent per node over SSH, and the files they write read back
through their types (the trainer's metrics records, trainer/records.py)."""

from __future__ import annotations

import shlex
import subprocess
import time
import uuid
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from fsdpctl import remote
from fsdpctl.checks.errors import CheckError
from fsdpctl.deploy import deployed_venv
from fsdpctl.scripts import render_script
from fsdpctl.state import ClusterRecord
from trainer.records import MetricsFormatError, MetricsLog, parse_metrics

M = TypeVar("M", bound=BaseModel)

NODE_TIMEOUT_S = 20
"""A short command on a node (a probe, a file read) must answer within this."""
RUN_TIMEOUT_S = 600
"""A whole check's job must end within this."""


class TorchrunJob:
    """One torchrun agent per node (c10d rendezvous on the first node), started over SSH.

    Each agent writes its pid to a file on its node, so the job can be stopped, and single workers
    killed, by exact pid rather than by name.
    """

    def __init__(self, record: ClusterRecord, ranks: list[int], module_args: list[str], *, nproc: int,
                 port: int, log_dir: Path, name: str, max_restarts: int = 0,
                 env: dict[str, str] | None = None, interfaces: dict[int, str] | None = None):
        self.record, self.ranks, self.name = record, ranks, name
        self.run_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.pidfile = f"/tmp/fsdp-{self.run_id}.pid"
        self.log_dir = log_dir
        nodes = {n.rank: n for n in remote.cluster_nodes(record, include_excluded=True)}
        venv = deployed_venv(record)
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
            self.procs[rank] = remote.popen(record, rank, command, stdout=log, stderr=subprocess.STDOUT,
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
        proc = remote.run(self.record, rank, f"pgrep -P $(cat {self.pidfile})", timeout=NODE_TIMEOUT_S,
                          check=False)
        return {int(p) for p in proc.stdout.split() if p.isdigit()}

    def kill_workers(self, rank: int) -> set[int]:
        """SIGKILL the training processes on one node (a crashed worker); returns their pids."""
        proc = remote.run(self.record, rank, f"pids=$(pgrep -P $(cat {self.pidfile})) && kill -KILL $pids "
                          "&& echo $pids", timeout=NODE_TIMEOUT_S)
        return {int(p) for p in proc.stdout.split() if p.isdigit()}

    def stop(self) -> None:
        """Stop every agent (it stops its workers) and the local ssh processes."""
        for rank in self.procs:
            remote.run(self.record, rank, f"test -f {self.pidfile} && kill -TERM $(cat {self.pidfile}) "
                       f"2>/dev/null; rm -f {self.pidfile}", timeout=NODE_TIMEOUT_S, check=False)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def logs(self) -> str:
        """Every node's log of the finished job, concatenated."""
        paths = [self.log_dir / f"{self.name}-node{rank}.log" for rank in self.ranks]
        return "\n".join(p.read_text(errors="replace") for p in paths if p.exists())

    def log_tail(self, rank: int, lines: int = 20) -> str:
        path = self.log_dir / f"{self.name}-node{rank}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def failure(self, codes: dict[int, int]) -> str | None:
        bad = {r: c for r, c in codes.items() if c != 0}
        if not bad:
            return None
        rank = min(bad)
        what = "timed out" if bad[rank] == remote.TIMEOUT_RC else f"exited {bad[rank]}"
        return (self._unreachable_nodes()
                + f"torchrun on node {rank} {what} (log {self.log_dir / f'{self.name}-node{rank}.log'}):\n"
                + self.log_tail(rank))

    def _unreachable_nodes(self) -> str:
        """A node that no longer answers is the likely cause of every other node's failure (its peers
        only see their collectives time out): name it first."""
        answers = remote.run_all(self.record, "true", ranks=list(self.procs), timeout=NODE_TIMEOUT_S,
                                 check=False)
        nodes = {n.rank: n for n in remote.cluster_nodes(self.record, include_excluded=True)}
        silent = [f"node {r} ({nodes[r].name}, {nodes[r].address})" for r, proc in sorted(answers.items())
                  if proc.returncode]
        if not silent:
            return ""
        return (f"{', '.join(silent)} does not answer over SSH: its network link or the node itself is "
                "down (the others' collectives timed out waiting for it). ")


LEFTOVER_JOBS = "/tmp/fsdp-*.pid"
"""The pid files of every TorchrunJob's agents (`TorchrunJob.pidfile`)."""


def stop_leftover_jobs(record: ClusterRecord, ranks: list[int]) -> dict[int, list[str]]:
    """Stop the torchrun agents (and so their workers) that an earlier check left running: a SIGKILLed
    `fsdpctl smoke` cannot stop its job, whose agent still holds the rendezvous port. Only call it
    under the cluster's operation lock, when no other check can be running; returns the pid files
    found, by rank (an unreachable node is left to the inventory check to report)."""
    script = render_script("checks/templates/stop_leftover_jobs.sh.j2", pid_files=LEFTOVER_JOBS)
    results = remote.run_all(record, script, ranks=ranks, timeout=NODE_TIMEOUT_S, check=False)
    return {rank: proc.stdout.split() for rank, proc in results.items()
            if proc.returncode == 0 and proc.stdout.strip()}


def read_remote_metrics(record: ClusterRecord, rank: int, path: str) -> MetricsLog:
    """The trainer's metrics file on a node, as its records; empty while the run has written none.
    CheckError naming the node, the file and the line when a line is not one of the trainer's records."""
    proc = remote.run(record, rank, f"cat {shlex.quote(path)} 2>/dev/null || true", timeout=NODE_TIMEOUT_S,
                      check=False)
    try:
        return parse_metrics(proc.stdout or "", source=f"node {rank}:{path}")
    except MetricsFormatError as e:
        raise CheckError(str(e)) from None


def read_remote_model(record: ClusterRecord, rank: int, path: str, model: type[M]) -> M | None:
    """A JSON file a job wrote on a node, as `model`; None when the file is not there. CheckError
    naming the node and the file when it is there but not a `model`."""
    proc = remote.run(record, rank, f"cat {shlex.quote(path)}", timeout=NODE_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        return None
    try:
        return model.model_validate_json(proc.stdout)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise CheckError(f"node {rank}:{path} is not a {model.__name__} ({where + ': ' if where else ''}"
                         f"{error['msg']}): deploy this checkout's trainer (`fsdpctl deploy`) and "
                         "rerun") from None

