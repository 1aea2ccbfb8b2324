"""The local target's power agent: Slurm's power saving, exercised for real on local nodes.

On AWS the controller's ResumeProgram/SuspendProgram (ansible/roles/slurm/files/fsdp-power) start and
stop EC2 instances. Local nodes are processes on this host, which a node cannot start or stop, so
the same program writes one request per node into the shared directory (`.fsdp-power/` under the
cluster's shared dir, /shared on the nodes) and this agent, started by `fsdpctl up` for a cluster
with power saving and stopped first by `fsdpctl down`, carries it out:

    <id>.request   "resume NODE" or "suspend NODE", written by the power program
    <id>.answer    "ok", or "error: WHY" (the power program then sets the node DOWN with WHY)

A resumed node boots from its own files (same identity, configuration and trainer), so nothing has
to be configured again, as with a stopped and started EC2 instance. The ranks it stopped are kept in
the state (`local.powered_down`): `fsdpctl status` shows them powered down, not missing.

Run by `up` as `python -m fsdpctl.targets.local.power_agent STATE_DIR`; logs to
STATE_DIR/power-agent.log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from fsdpctl.console import Out
from fsdpctl.errors import CommandError
from fsdpctl.processes import processes, terminate
from fsdpctl.state import ClusterRecord, ClusterState, LocalNode, LocalRecord
from fsdpctl.targets.local import nodes

REQUEST_DIR = ".fsdp-power"
POLL_S = 0.2
STOP_TIMEOUT_S = 10
AGENT_MODULE = "fsdpctl.targets.local.power_agent"


def request_dir(plan: LocalRecord) -> Path:
    return Path(plan.shared_host_dir) / REQUEST_DIR


def log_path(state: ClusterState) -> Path:
    return state.root / "power-agent.log"


class Agent:
    """Carries out the power program's requests for one cluster until SIGTERM."""

    def __init__(self, state: ClusterState):
        self.state = state
        plan = state.read().local
        if plan is None:
            raise CommandError(f"cluster {state.name} has no local nodes: nothing to power")
        # The node list is read again for each request (the record is the one source of truth); the
        # request directory, under the cluster's shared directory, does not move.
        self.requests = request_dir(plan)
        self.stopping = False
        # Nodes this agent booted: reaped when they stop, so no zombie is left behind.
        self.children: dict[int, subprocess.Popen] = {}

    def say(self, message: str) -> None:
        with open(log_path(self.state), "a") as log:
            log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {message}\n")

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        requests = self.requests
        self.say(f"serving {requests} for cluster {self.state.name} (pid {os.getpid()})")
        while not self.stopping:
            if not self.state.exists():  # removed without `down` (a killed test run's temporary home)
                self.say(f"{self.state.state_path} is gone: no cluster left to serve")
                break
            for request in sorted(requests.glob("*.request")):
                answer = self.handle(request.read_text())
                partial = request.with_name(f".{request.stem}.answer")
                partial.write_text(answer + "\n")
                partial.rename(request.with_suffix(".answer"))
                request.unlink(missing_ok=True)
            for rank, proc in list(self.children.items()):
                if proc.poll() is not None:
                    del self.children[rank]
            time.sleep(POLL_S)
        self.say("stopped")

    def _stop(self, signum: int, frame: object) -> None:
        del signum, frame
        self.stopping = True

    def handle(self, request: str) -> str:
        """Carry out one request; the answer line for the power program."""
        words = request.split()
        if len(words) != 2 or words[0] not in ("resume", "suspend"):
            return f"error: not a power request: {request.strip()[:100]!r}"
        action, name = words
        started = time.monotonic()
        try:
            # Read for each request: `fsdpctl replace` gives a node a new identity (machine-id) meanwhile.
            plan = self.state.read().local
            if plan is None:
                return (f"error: cluster {self.state.name} has no local nodes any more (`fsdpctl down` "
                        "under way)")
            node = next((n for n in plan.nodes if n.name == name), None)
            if node is None:
                return f"error: {name} is not a node of cluster {self.state.name}"
            if action == "resume":
                self._resume(plan, node)
            else:
                self._suspend(plan, node)
        # The agent outlives a failed request: the power program sets that node DOWN with the answer.
        except (CommandError, OSError, subprocess.SubprocessError) as e:
            self.say(f"{action} {name} failed: {type(e).__name__}: {e}")
            return f"error: {(str(e) or type(e).__name__).splitlines()[0][:200]}"
        self.say(f"{action} {name}: done in {time.monotonic() - started:.1f} s")
        return "ok"

    def _resume(self, plan: LocalRecord, node: LocalNode) -> None:
        if node.rank not in nodes.running_ranks(plan):
            keeper = nodes.power_on(plan, node)
            self.children[node.rank] = keeper
            # As `up` does, but beside the requests that come meanwhile: a unit that failed while booting
            # is started again (a failed systemd-user-sessions would shut the login user out).
            threading.Thread(target=self._settle, args=(node, keeper), name=f"settle-{node.name}",
                             daemon=True).start()
        self._record(node.rank, powered_down=False)

    def _settle(self, node: LocalNode, keeper: subprocess.Popen) -> None:
        try:
            nodes.settle_boot(node, keeper, time.monotonic() + nodes.BOOT_TIMEOUT_S, self.say)
        except (CommandError, OSError, subprocess.SubprocessError) as e:
            self.say(f"resume {node.name}: its boot did not settle: {e}")

    def _suspend(self, plan: LocalRecord, node: LocalNode) -> None:
        left = nodes.power_off(plan, node, self.say)
        if left:
            raise CommandError(f"{node.name} did not stop: {'; '.join(left)}")
        self._record(node.rank, powered_down=True)

    def _record(self, rank: int, *, powered_down: bool) -> None:
        def change(record: ClusterRecord | None) -> dict[str, LocalRecord]:
            plan = record.local if record else None
            if plan is None:  # taken down meanwhile: nothing to record, nothing to bring back
                return {}
            ranks = set(plan.powered_down) | {rank} if powered_down else set(plan.powered_down) - {rank}
            return {"local": plan.model_copy(update={"powered_down": sorted(ranks)})}
        self.state.change(change)


def _agent_pids(state: ClusterState) -> list[int]:
    """Power agents of this cluster, found by their command line (a killed `up` may not have recorded
    the pid)."""
    return [pid for pid, argv, _ in processes() if AGENT_MODULE in argv and str(state.root) in argv]


def start(state: ClusterState, progress: Out) -> None:
    """Start the cluster's agent in its own session, record its pid, and make the request directory
    (the power program on the controller writes there as SlurmUser, so the slurm role sets its owner)."""
    plan = state.read().local
    assert plan is not None, "start the power agent after the nodes are planned"
    request_dir(plan).mkdir(parents=True, exist_ok=True)
    with open(log_path(state), "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", AGENT_MODULE, str(state.root)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    state.update(local=plan.model_copy(update={"power_agent_pid": proc.pid}))
    progress(f"local: power agent started (pid {proc.pid}, log {log_path(state)}): Slurm powers nodes "
             "down and up through it")


def stop(state: ClusterState, progress: Out) -> None:
    """Stop the cluster's agent, if one runs; safe to repeat."""
    pids = _agent_pids(state)
    if not pids:
        return
    progress(f"local: stopping the power agent (pid {', '.join(map(str, pids))})")
    terminate(pids, STOP_TIMEOUT_S)
