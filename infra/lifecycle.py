"""`fsdpctl up`, `down`, `status` and `exclude`: a cluster's life, for both targets.

The aws target is the AWS stack (`infra.aws.stack`, imported only there, so the local target never
loads Pulumi); the local target is systemd-nspawn nodes on this machine (`infra.local.nodes`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import io
import signal
import sys
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from infra import state as state_mod
from infra.cli import CommandError
from infra.inventory import write_inventory
from infra.spec import ClusterSpec, load_spec
from infra.state import ClusterState, StateError


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """A SIGTERM (CI timeout, `kill`) unwinds like Ctrl-C, so half-made clusters are torn down."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _one_at_a_time(cluster: str) -> Iterator[None]:
    """One up/down per cluster at a time: a second `up` failing half-way would tear down the
    resources the first is still building (they have the same names)."""
    lock_dir = state_mod.home() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{cluster}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CommandError(f"another `fsdpctl up` or `fsdpctl down` is running on cluster {cluster}; "
                               "wait for it to finish, then run this again") from None
        yield


def _same_cluster(state: ClusterState, spec: ClusterSpec, target: str, node_count: int | None) -> list[str]:
    """How an existing cluster differs from the one asked for (empty: it is the same)."""
    data = state.read()
    differences = []
    if data.get("target") != target:
        differences.append(f"target is {data.get('target')}, not {target}")
    if state.spec() != spec:
        differences.append(f"its spec ({state.spec_path}) differs from the one given")
    if node_count is not None and data.get("node_count") != node_count:
        differences.append(f"it has {data.get('node_count')} node(s), not {node_count}")
    return differences


def show_progress_live() -> None:
    """Progress lines reach a pipe (tee, CI logs) as they happen, not when the buffer fills."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)


def cmd_up(args: Namespace) -> int:
    show_progress_live()
    spec = load_spec(args.spec)
    for warning in spec.warnings():
        print(f"warning: {warning}")
    if args.target == "aws":
        if args.nodes is not None:
            raise CommandError("--nodes applies to the local target only; on aws set node_count in "
                               f"{args.spec}")
        with _one_at_a_time(spec.name):
            return _up_aws(args.spec, spec)
    if args.nodes is not None and args.nodes < 1:
        raise CommandError(f"--nodes {args.nodes}: a cluster needs at least 1 node; use e.g. --nodes 2")
    with _one_at_a_time(spec.name):
        return _up_local(args.spec, spec, args.nodes or spec.node_count)


def _up_local(spec_file: Path, spec: ClusterSpec, node_count: int) -> int:
    from infra.local import nodes
    from infra.local.host import require_host

    require_host("fsdpctl up --target local")
    existing = state_mod.cluster_state(spec.name)
    if existing.exists():
        differences = _same_cluster(existing, spec, "local", node_count)
        if differences:
            raise CommandError(f"cluster {spec.name} already exists and differs: {'; '.join(differences)}."
                               f" Run `fsdpctl down --cluster {spec.name}` first, or give the spec another "
                               "name")
        problems = nodes.health(existing)
        if problems:
            raise CommandError(f"cluster {spec.name} already exists but is not healthy: "
                               f"{'; '.join(problems)}. Run `fsdpctl down --cluster {spec.name}`, then "
                               "`fsdpctl up` again")
        state_mod.set_current(spec.name)
        print(f"cluster {spec.name} is already up with {node_count} healthy node(s); nothing to do")
        return 0
    state = state_mod.create(spec_file, spec, "local")
    state.update(node_count=node_count)
    try:
        with _sigterm_as_interrupt():
            nodes.up(state, spec, node_count)
    except BaseException:
        if not state.read().get("local"):  # nodes.up removed everything it made
            state.remove()
        raise
    path = write_inventory(state)
    _print_nodes(state)
    print(f"inventory: {path}\nnext: fsdpctl configure   (or: fsdpctl ssh 0 -- hostname)")
    return 0


def _up_aws(spec_file: Path, spec: ClusterSpec) -> int:
    from infra.aws import stack

    existing = state_mod.cluster_state(spec.name)
    if existing.exists() and existing.read().get("target") != "aws":
        raise CommandError(f"cluster {spec.name} already exists on the {existing.read().get('target')} "
                           f"target; run `fsdpctl down --cluster {spec.name}` first")
    state = state_mod.create(spec_file, spec, "aws")
    stack.up(state, spec)
    path = write_inventory(state)
    _print_nodes(state)
    print(f"inventory: {path}\nnext: fsdpctl configure")
    return 0


def cmd_down(args: Namespace) -> int:
    show_progress_live()
    try:
        state = state_mod.resolve(args.cluster)
    except StateError as e:
        print(f"nothing to tear down: {e}")
        return 0
    with _one_at_a_time(state.name):
        if state.read().get("target") == "aws":
            from infra.aws import stack

            stack.down(state, state.spec(), force=args.force)
        else:
            from infra.local import nodes
            from infra.local.host import require_host

            require_host("fsdpctl down (local target)")
            nodes.down(state)
        state.remove()
    print(f"cluster {state.name} is down; its state dir {state.root} is removed")
    return 0


def _print_nodes(state: ClusterState) -> None:
    data = state.read()
    excluded = {e["rank"]: e for e in data.get("excluded", [])}
    print(f"{'RANK':<5} {'NAME':<28} {'ADDRESS':<16} NOTE")
    for node in data.get("nodes", []):
        note = f"excluded: {excluded[node['rank']]['reason']}" if node["rank"] in excluded else ""
        print(f"{node['rank']:<5} {node['name']:<28} {node['address']:<16} {note}".rstrip())


def cmd_status(args: Namespace) -> int:
    state = state_mod.resolve(args.cluster)
    data = state.read()
    print(f"cluster {state.name}: target {data.get('target')}, {len(data.get('nodes', []))} node(s), "
          f"state {state.root}")
    if data.get("shared_dir"):
        print(f"shared dir on every node: {data['shared_dir']}")
    _print_nodes(state)
    if data.get("target") == "local" and data.get("local"):
        from infra.local import nodes

        problems = nodes.health(state)
        print("health: " + ("every node answers over SSH" if not problems else "; ".join(problems)))
    last = data.get("last_configure")
    if last:
        print(f"last configure: {'ok' if last['ok'] else 'FAILED'} at {last['time']} ({last['run_dir']})")
        for host, counts in last.get("hosts", {}).items():
            print("  " + host + " " + " ".join(f"{k}={v}" for k, v in counts.items()))
    report = state.root / "report.json"
    if report.exists():
        print(f"last smoke report: {report}")
    return 0


def cmd_exclude(args: Namespace) -> int:
    state = state_mod.resolve(args.cluster)
    data = state.read()
    ranks = [n["rank"] for n in data.get("nodes", [])]
    if args.rank not in ranks:
        raise CommandError(f"cluster {state.name} has no node with rank {args.rank} (ranks: "
                           f"{', '.join(map(str, ranks)) or 'none'})")
    reason = args.reason.strip()
    if not reason:
        raise CommandError("--reason is empty; say why the node is excluded, e.g. --reason 'ECC errors'")
    entry = {"rank": args.rank, "reason": reason,
             "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    excluded = [e for e in data.get("excluded", []) if e["rank"] != args.rank] + [entry]
    state.update(excluded=sorted(excluded, key=lambda e: e["rank"]))
    print(f"excluded rank {args.rank} from cluster {state.name}: {reason}")
    if len(excluded) < len(ranks):
        print(f"inventory rewritten without it: {write_inventory(state)}")
    else:
        state.inventory_path.unlink(missing_ok=True)  # a stale inventory would still list the node
        print("every node is now excluded; later stages have nothing to run on")
    return 0
