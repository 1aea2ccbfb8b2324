"""`fsdpctl heal`: a fresh node in the place of each node a spot notice took out of service.

On an interruption notice or a rebalance recommendation the spot watcher on the node
(ansible/roles/slurm/files/spot-watcher.py) drains it and asks its jobs to checkpoint; they requeue.
EC2 takes a one-time spot instance back two minutes after an interruption notice, and only the Pulumi
stack, which lives where `fsdpctl up` ran, can launch another. So heal runs there, once or with
`--watch`: each node drained by a notice is replaced once no job is left on it (`fsdpctl replace`: a
new instance of the same rank and name, configured, deployed to and back in service in Slurm), and the
requeued jobs start on it. Nodes drained for anything else (a failed health check, `fsdpctl exclude`)
are left to the operator, who knows whether a new instance is the fix. So is a node whose replacement
runs but failed its configure or deploy (drained `fsdpctl replace failed: ...`): another instance would
fail the same way. A replacement that never started (no capacity) or never answered SSH keeps the
notice as its reason, and the next pass tries again.
"""

from __future__ import annotations

import time
from argparse import Namespace
from dataclasses import dataclass

from fsdpctl import slurm_nodes
from fsdpctl import state as state_mod
from fsdpctl.console import line_buffered, say, warn
from fsdpctl.errors import CommandError, Interrupted, StateError, UsageError
from fsdpctl.slurm_nodes import NodeState
from fsdpctl.state import ClusterState, Node


@dataclass(frozen=True)
class HealPlan:
    """What one pass over the Slurm node states finds."""

    ready: tuple[Node, ...]
    """Drained by a notice and no job left there: replaced now."""
    waiting: tuple[Node, ...]
    """Drained by a notice, its jobs still checkpointing (`draining`): replaced on a later pass."""
    failed: tuple[Node, ...]
    """A replacement of it runs but failed its configure or deploy: left to the operator."""
    controller: Node | None
    """Slurm's controller, if a notice drained it: left to the operator (a new controller starts with
    an empty queue and a new munge key, which every node must then be configured with)."""


def plan_heal(nodes: list[Node], states: dict[str, NodeState], controller: str | None) -> HealPlan:
    """The cluster's nodes (excluded ones left out) that a spot notice drained, by whether they can be
    replaced now. A node whose instance EC2 already took back does not answer: Slurm then shows it
    `drained*` or `down*` with the notice still as its reason, and no job can be left on it."""
    ready, waiting, failed, drained_controller = [], [], [], None
    for node in nodes:
        seen = states.get(node.name)
        if seen is not None and seen.replace_failed:
            failed.append(node)
        if seen is None or not seen.spot_notice:
            continue
        if node.name == controller:
            drained_controller = node
        elif seen.state.startswith("draining"):
            waiting.append(node)
        elif seen.state.startswith(("drained", "down")):
            ready.append(node)
    return HealPlan(ready=tuple(ready), waiting=tuple(waiting), failed=tuple(failed),
                    controller=drained_controller)


def heal(state: ClusterState, *, yes: bool) -> HealPlan:
    """One pass: replace every node a spot notice drained that has no job left; what it found."""
    from fsdpctl.lifecycle import replace

    record = state.read()
    excluded = record.excluded_ranks()
    states = slurm_nodes.node_states(record)
    if states is None:
        raise CommandError(f"Slurm is not installed on cluster {state.name}, so no spot watcher drains its "
                           "nodes: run `fsdpctl configure` first (docs/slurm.md)")
    found = plan_heal([n for n in record.nodes if n.rank not in excluded], states,
                      slurm_nodes.controller_name(record))
    if found.controller is not None:
        rank = found.controller.rank
        say(f"{found.controller.name}: {states[found.controller.name].reason}; it runs Slurm's controller, "
            "which heal leaves alone (a new one starts with an empty queue): when no job needs the "
            f"cluster, `fsdpctl replace {rank}`, then `fsdpctl configure --tags slurm`")
    for node in found.waiting:
        say(f"{node.name}: {states[node.name].reason}; its jobs are still checkpointing, replaced once they "
            "have left")
    for node in found.failed:
        say(f"{node.name}: {states[node.name].reason}; left to you (another instance would fail the same "
            f"way): once fixed, `{slurm_nodes.resume_hint(node.name)}`, "
            f"or `fsdpctl replace {node.rank}` again")
    for node in found.ready:
        say(f"{node.name}: {states[node.name].reason}; replacing it")
        replace(state, node.rank, yes=yes)
    if not found.ready and not found.waiting and not found.failed and found.controller is None:
        say(f"cluster {state.name}: no node drained by a spot notice")
    return found


def cmd_heal(args: Namespace) -> int:
    line_buffered()
    if args.watch is not None and args.watch < 10:
        raise UsageError(f"--watch {args.watch:g}: give the seconds between passes, at least 10 "
                         "(e.g. --watch 60)")
    if args.watch is not None and not args.yes:
        raise UsageError("--watch replaces nodes with nobody there to answer: add --yes")
    state = state_mod.resolve(args.cluster)
    if args.watch is None:
        heal(state, yes=args.yes)
        return 0
    say(f"fsdpctl heal: a pass over cluster {state.name} every {args.watch:g} s (Ctrl-C ends it)")
    while True:
        try:
            heal(state, yes=True)
        except (Interrupted, StateError):  # Ctrl-C in a replace; the cluster taken down or its state broken
            raise
        except CommandError as e:  # Slurm not answering, a replace that failed: the next pass tries again
            warn(f"this pass did not finish: {e}; trying again in {args.watch:g} s")
        time.sleep(args.watch)
