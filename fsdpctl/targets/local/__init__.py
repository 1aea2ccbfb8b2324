"""The local target: systemd-nspawn nodes on this machine, each a full Debian host on one bridge
(docs/local-target.md). It costs nothing, so `up` asks nothing; see `fsdpctl.targets` for the verbs."""

from __future__ import annotations

from collections.abc import Callable

from fsdpctl.console import Out
from fsdpctl.state import ClusterState
from fsdpctl.targets.local import nodes, power
from fsdpctl.targets.local.host import require_host
from infra.spec import ClusterSpec

NAME = "local"
UPDATES_IN_PLACE = False
"""A local cluster with another spec or node count is refused: `down` it, then `up` again."""


def check_prerequisites(action: str) -> None:
    require_host(action)


def up(state: ClusterState, spec: ClusterSpec, *, node_count: int, approve: Callable[[str], None],
       out: Out) -> None:
    del approve  # local nodes cost nothing
    nodes.up(state, spec, node_count, out)
    if spec.power_saving:
        power.start(state, out)


def down(state: ClusterState, spec: ClusterSpec, *, force: bool, out: Out) -> None:
    del spec, force  # everything local is recorded before it is made: there is nothing to sweep for
    require_host("fsdpctl down (local target)")
    power.stop(state, out)  # first: it would boot a node again if Slurm asked in the meantime
    nodes.down(state, out)


def health(state: ClusterState) -> list[str]:
    return nodes.health(state)


def replace_node(state: ClusterState, spec: ClusterSpec, rank: int, *, out: Out) -> None:
    del spec
    nodes.replace_node(state, rank, out)


def destruction(state: ClusterState, spec: ClusterSpec) -> list[str]:
    record = state.read()
    plan = record.local
    if plan is None:
        return ["the cluster's state directory (no node was created)"]
    return [f"{len(plan.nodes)} local node(s) ({', '.join(n.name for n in plan.nodes)}) and everything "
            f"written on them", f"the shared directory {plan.shared_host_dir} (/shared on the nodes)",
            f"the bridge {plan.bridge}"]


def node_destruction(state: ClusterState, rank: int) -> str:
    node = next(n for n in state.read().nodes if n.rank == rank)
    return f"local node {node.name} and everything written on it (/shared stays)"
