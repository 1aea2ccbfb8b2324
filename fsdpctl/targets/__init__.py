"""Where a cluster's nodes come from. Every target is a package offering the same verbs, so
`fsdpctl.lifecycle` picks one by name and never asks which it has:

    check_prerequisites(action)                    raise UsageError when this machine lacks what `up`
                                                   needs (root, commands, the pulumi CLI).
    up(state, spec, *, node_count, approve, out)   create (or update) the nodes and record them in the
                                                   state: nodes, ssh, shared_dir. `approve(question)`
                                                   is called before anything that costs money.
    down(state, spec, *, force, out)               remove everything the target created; raise
                                                   CommandError naming what is left, if anything.
    health(state) -> list[str]                     what makes the cluster unusable ([]: every node
                                                   answers).
    replace_node(state, spec, rank, *, out)        a new node in place of the one with `rank`, same
                                                   rank and name, recorded in the state.
    destruction(state, spec) -> list[str]          what `down` destroys, for its question.
    node_destruction(state, rank) -> str           what `replace` destroys.
    UPDATES_IN_PLACE                               whether `up` of an existing cluster with another
                                                   spec updates it (aws) or refuses (local).

Targets never configure or deploy: lifecycle does that after them (`replace` configures and deploys
the new node).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol

from fsdpctl.console import Out
from fsdpctl.state import TARGET_NAMES, ClusterState
from infra.spec import ClusterSpec


class Target(Protocol):
    NAME: str
    UPDATES_IN_PLACE: bool

    def check_prerequisites(self, action: str) -> None: ...

    def up(self, state: ClusterState, spec: ClusterSpec, *, node_count: int,
           approve: Callable[[str], None], out: Out) -> None: ...

    def down(self, state: ClusterState, spec: ClusterSpec, *, force: bool, out: Out) -> None: ...

    def health(self, state: ClusterState) -> list[str]: ...

    def replace_node(self, state: ClusterState, spec: ClusterSpec, rank: int, *, out: Out) -> None: ...

    def destruction(self, state: ClusterState, spec: ClusterSpec) -> list[str]: ...

    def node_destruction(self, state: ClusterState, rank: int) -> str: ...


def get(name: str) -> Target:
    """The target package for a name in TARGET_NAMES (imported on first use: the local target never loads
    boto3 or Pulumi)."""
    if name not in TARGET_NAMES:
        raise ValueError(f"unknown target {name!r}; targets are {', '.join(TARGET_NAMES)}")
    return importlib.import_module(f"fsdpctl.targets.{name}")  # type: ignore[return-value]


__all__ = ["Target", "get"]
