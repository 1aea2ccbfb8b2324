"""The cluster's nodes as Slurm sees them: a Slurm command run on the cluster, each node's state and
why it is drained or down, drain and resume, and powering up the nodes power saving stopped.

`configure`, `deploy`, `smoke` and `scale-test` change or test every node, and a node Slurm powered
down (the spec's `scaling:`, docs/slurm.md "Power saving") is neither reachable nor up to date after
it: it would come back without what changed meanwhile. `configure` and `deploy` hold the free nodes
with a job that sleeps on them while they run (`nodes_held_up`): Slurm powers up those that are down
for it, as for any job, and powers none down in the middle of the command. `smoke` and `scale-test`
run Slurm jobs of their own on every node, which such a job would block: they power the nodes up
(`power_up_all`) and their own jobs keep them busy. The nodes bill while the command runs and power
down again after `scaling.suspend_after_s` idle.

A leaf below fsdpctl.slurm (the jobs): it needs only SSH to the nodes, so `deploy` may use it.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

from fsdpctl import remote
from fsdpctl.console import Out
from fsdpctl.errors import CommandError, UsageError
from fsdpctl.state import ClusterRecord
from infra.spec import ClusterSpec

SLURM_TIMEOUT_S = 30

IN_SERVICE = {"idle", "allocated", "mixed", "completing", "reserved", "planned"}
"""Node states in which a node runs or takes jobs."""
SPOT_NOTICE_REASONS = ("spot interruption notice", "rebalance recommendation notice")
"""How the spot watcher's drain reasons begin (`act` in ansible/roles/slurm/files/spot-watcher.py)."""
REPLACE_FAILED_REASON = "fsdpctl replace failed"
"""How the drain reason of a node begins whose new instance runs but failed its configure or deploy
(`fsdpctl replace`): `fsdpctl heal` leaves it to the operator."""


@dataclass(frozen=True)
class NodeState:
    """A node as Slurm sees it (sinfo)."""

    name: str
    state: str
    """sinfo's extended state: idle, allocated, mixed, drained, draining, down, ... (a trailing `*`:
    slurmctld gets no answer from its slurmd)."""
    reason: str | None
    """Why it was drained or went down (`health (prolog): ...`, `fsdpctl exclude: ...`), if it was."""

    @property
    def in_service(self) -> bool:
        return self.state in IN_SERVICE

    @property
    def spot_notice(self) -> bool:
        """Drained by the spot watcher on an interruption notice or a rebalance recommendation."""
        return (self.reason or "").startswith(SPOT_NOTICE_REASONS)

    @property
    def replace_failed(self) -> bool:
        """Drained by `fsdpctl replace` after its new instance failed its configure or deploy."""
        return (self.reason or "").startswith(REPLACE_FAILED_REASON)

    @property
    def powered_down(self) -> bool:
        """Power saving stopped the node (`idle~`); a pending job's need powers it up."""
        return self.state.endswith("~")

    @property
    def powering(self) -> bool:
        """On its way up (`#`) or down (`%`)."""
        return self.state.endswith(("#", "%"))

    @property
    def power_saved(self) -> bool:
        """Powered down, or on its way up or down, by power saving and nothing else: not a fault."""
        return (self.powered_down or self.powering) and not self.state.startswith(("down", "drain", "fail"))


def slurm_rank(record: ClusterRecord) -> int:
    """The node the Slurm commands run on: the first non-excluded node (every node has the client)."""
    nodes = remote.cluster_nodes(record)
    if not nodes:
        raise UsageError(f"cluster {record.name} has no (non-excluded) nodes: run `fsdpctl up` first")
    return nodes[0].rank


def run_slurm(record: ClusterRecord, command: str, *, check: bool = True, timeout: float = SLURM_TIMEOUT_S):
    """A Slurm (or any) command on the cluster's first node; a missing Slurm says how to install it."""
    result = remote.run(record, slurm_rank(record), command, timeout=timeout, check=False)
    if result.returncode == 127 or "command not found" in (result.stderr or ""):
        raise CommandError(f"Slurm is not installed on cluster {record.name}: run "
                           "`fsdpctl configure --tags slurm` first (docs/slurm.md)")
    if check and result.returncode:
        output = (result.stderr or result.stdout).strip()[-800:]
        raise CommandError(f"`{command}` on cluster {record.name} exited {result.returncode}: {output}. Is "
                           "Slurm configured (`fsdpctl configure --tags slurm`; `fsdpctl ssh 0 -- sinfo`)?")
    return result


def _scontrol_ping(record: ClusterRecord) -> subprocess.CompletedProcess:
    """`scontrol ping` on the cluster: "Slurmctld(primary) at HOST is UP" (or DOWN), per controller."""
    return remote.run(record, slurm_rank(record), "scontrol ping", timeout=SLURM_TIMEOUT_S, check=False)


def controller_name(record: ClusterRecord) -> str | None:
    """The node slurmctld runs on, as `scontrol ping` names it; None where it does not answer."""
    found = re.search(r"^Slurmctld\(primary\) at (\S+) is UP", _scontrol_ping(record).stdout, re.MULTILINE)
    return found[1] if found else None


def slurm_status(record: ClusterRecord) -> tuple[bool, str]:
    """(whether slurmctld answers, why not): the reason is empty where Slurm is not installed at all
    (a cluster configured without the slurm role), and says what `scontrol ping` saw otherwise."""
    try:
        result = _scontrol_ping(record)
    except UsageError:
        return False, ""
    if result.returncode == 0 and " is UP" in result.stdout:
        return True, ""
    if result.returncode == 127:  # no scontrol on the node
        return False, ""
    seen = (result.stdout + result.stderr).strip().splitlines()
    last = seen[-1] if seen else f"exit {result.returncode}"
    return False, f"slurmctld does not answer (`scontrol ping`: {last})"


def slurm_configured(record: ClusterRecord) -> bool:
    """Whether slurmctld answers (the smoke checks then run as Slurm jobs)."""
    return slurm_status(record)[0]


def update_nodes(node_names: str, change: str) -> str:
    """The command that changes nodes' state in Slurm. slurmctld takes it only from root or SlurmUser
    (anyone else gets "Invalid user id"), and AWS nodes log in as the image's user (`ssh_user`, e.g.
    ubuntu), who has passwordless sudo; local nodes log in as root."""
    return f"sudo -n scontrol update nodename={node_names} {change}"


def resume_hint(node_name: str) -> str:
    """The command that returns a drained node to service, as fsdpctl tells the operator to run it."""
    return f"fsdpctl ssh 0 -- sudo scontrol update nodename={node_name} state=resume"


def drain(record: ClusterRecord, node_name: str, reason: str) -> None:
    """Take a node out of scheduling (running jobs finish; none start)."""
    run_slurm(record, update_nodes(shlex.quote(node_name), f"state=DRAIN reason={shlex.quote(reason)}"))


def resume(record: ClusterRecord, node_name: str) -> None:
    """Return a node to service (after `fsdpctl replace`)."""
    result = run_slurm(record, update_nodes(shlex.quote(node_name), "state=RESUME"), check=False)
    # A node that is not drained or down is already in service: nothing to undo.
    if result.returncode and "Invalid node state specified" not in result.stderr:
        raise CommandError(f"returning {node_name} to service in Slurm failed: {result.stderr.strip()}")


def parse_node_states(sinfo_output: str) -> dict[str, NodeState]:
    """Nodes by name from `sinfo --noheader --Node --format '%N|%T|%E'` (a node in two partitions is
    listed twice; "none" is sinfo's word for no reason)."""
    nodes = {}
    for line in sinfo_output.splitlines():
        name, _, rest = line.strip().partition("|")
        value, _, reason = rest.partition("|")
        if name and value:
            nodes[name] = NodeState(name=name, state=value, reason=None if reason in ("", "none") else reason)
    return nodes


def node_states(record: ClusterRecord) -> dict[str, NodeState] | None:
    """Every node as Slurm sees it, by name; None where Slurm is not installed. A CommandError where
    slurmctld does not answer."""
    result = remote.run(record, slurm_rank(record), "sinfo --noheader --Node --format '%N|%T|%E'",
                        timeout=SLURM_TIMEOUT_S, check=False)
    if result.returncode == 127:
        return None
    if result.returncode:
        seen = (result.stderr or result.stdout).strip().splitlines()
        raise CommandError(f"`sinfo` exited {result.returncode}: {seen[-1] if seen else 'no output'}")
    return parse_node_states(result.stdout)


POWER_UP_TIMEOUT_S = 900
"""At most Slurm's ResumeTimeout (600 s by default) plus a SuspendTimeout for a node that was on its
way down."""
POLL_S = 2.0
HOLD_JOB_NAME = "fsdpctl-hold"
# The job the slurm role holds the idle dynamic nodes with while the first configure's play runs
# (ansible/roles/slurm/defaults/main.yml, slurm_play_hold_job_name); the play cancels it at its end.
PLAY_HOLD_JOB_NAME = "fsdp-configure-hold"


def power_up_all(record: ClusterRecord, spec: ClusterSpec, out: Out, *, what: str) -> None:
    """Power up every node Slurm powered down, and wait until all are in service; a CommandError
    naming the nodes that did not come (with Slurm's reason) and how to go on without them."""
    if not spec.power_saving:
        return
    if not slurm_configured(record):  # before the first configure: nothing is powered down
        return
    states = node_states(record) or {}
    waiting = sorted(name for name, node in states.items() if node.powered_down or node.powering)
    if not waiting:
        return
    out(f"{what}: powering up {', '.join(waiting)} (Slurm powered them down while idle); they power "
        "down again once idle")
    asked: set[str] = set()
    seen_powering: set[str] = set()
    deadline = time.monotonic() + POWER_UP_TIMEOUT_S
    while True:
        states = node_states(record) or {}
        # A node on its way down can be powered up only once it is down (after SuspendTimeout).
        down_now = sorted(n for n in waiting if states[n].powered_down and n not in asked)
        if down_now:
            run_slurm(record, update_nodes(",".join(down_now), "state=power_up"))
            asked.update(down_now)
        seen_powering.update(n for n in asked if states[n].powering)
        # The resume program sets a node it cannot start DOWN (`down#` while Slurm still counts it as
        # powering up); one that fell back to powered down after powering up did not come either.
        failed = {n: states[n] for n in asked if states[n].state.startswith(("down", "drain", "fail"))
                  or (states[n].powered_down and n in seen_powering)}
        if failed:
            reasons = "; ".join(f"{n}: {s.reason or s.state}" for n, s in failed.items())
            raise CommandError(f"{what}: could not power up {reasons}. Run `fsdpctl {what}` again once "
                               "they can start, or leave them out with `fsdpctl exclude RANK`")
        if all(states[n].in_service for n in waiting):
            out(f"{what}: {', '.join(waiting)} powered up")
            return
        if time.monotonic() > deadline:
            left = ", ".join(f"{n} ({states[n].state})" for n in waiting if not states[n].in_service)
            raise CommandError(f"{what}: {left} did not power up within {POWER_UP_TIMEOUT_S} s; see "
                               "`fsdpctl status`, then run it again or `fsdpctl exclude RANK`")
        time.sleep(POLL_S)


@contextlib.contextmanager
def nodes_held_up(record: ClusterRecord, spec: ClusterSpec, out: Out, *, what: str) -> Iterator[None]:
    """While a command changes or tests every node: the free nodes power saving may stop are held by a
    job that sleeps on them, which powers up those that are down (Slurm runs the resume program for
    it) and keeps Slurm from powering any of them down in the middle of the command; the job is
    cancelled afterwards, and they power down again after scaling.suspend_after_s idle. Nodes that
    run a job are up and stay up. A CommandError names the nodes that did not come, with Slurm's
    reason, and how to go on without them."""
    if not spec.power_saving or not slurm_configured(record):  # before the first configure: all up
        try:
            yield
        finally:
            if spec.power_saving:  # a play that stopped before its end left the role's hold running
                with contextlib.suppress(CommandError):
                    run_slurm(record, f"scancel --name={PLAY_HOLD_JOB_NAME}", check=False)
        return
    states = node_states(record) or {}
    names = [n.name for n in record.active_nodes() if n.rank >= spec.static_node_count]
    free = [n for n in names if n in states and (states[n].power_saved or states[n].state == "idle")]
    if not free:
        yield
        return
    asleep = [n for n in free if states[n].power_saved]
    job_id = int(run_slurm(record, (
        f"sbatch --parsable --job-name={HOLD_JOB_NAME}-{what} --nodelist={','.join(free)} -N{len(free)} "
        "--exclusive --no-requeue --output=/dev/null --wrap 'sleep infinity'")).stdout.strip().split(";")[0])
    try:
        out(f"{what}: Slurm job {job_id} holds {', '.join(free)} while it runs"
            + (f", powering up {', '.join(asleep)} (powered down while idle)" if asleep else ""))
        _wait_running(record, job_id, free, what)
        yield
    finally:
        run_slurm(record, f"scancel {job_id}", check=False)


def _wait_running(record: ClusterRecord, job_id: int, held: list[str], what: str) -> None:
    deadline = time.monotonic() + POWER_UP_TIMEOUT_S
    while True:
        job = run_slurm(record, f"squeue --noheader --jobs {job_id} --format %T", check=False).stdout.strip()
        if job == "RUNNING":
            return
        states = node_states(record) or {}
        # The resume program sets a node it cannot start DOWN with the reason.
        failed = {n: states[n] for n in held if n in states and states[n].state.startswith(("down", "drain"))}
        if failed or not job:
            reasons = "; ".join(f"{n}: {s.state}, {s.reason or 'no reason given'}" for n, s in failed.items())
            raise CommandError(f"{what}: could not bring up {reasons or ', '.join(held)}. Run `fsdpctl "
                               f"{what}` again once they can start, or leave them out with `fsdpctl exclude "
                               "RANK`")
        if time.monotonic() > deadline:
            left = ", ".join(f"{n} ({states[n].state})" for n in held if n in states)
            raise CommandError(f"{what}: {left} did not come up within {POWER_UP_TIMEOUT_S} s; see "
                               "`fsdpctl status`, then run it again or `fsdpctl exclude RANK`")
        time.sleep(POLL_S)
