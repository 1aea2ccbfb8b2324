"""A cluster's life, the same for every target: `fsdpctl up`, `down`, `status`, `list`, `exclude`,
`replace` and (aws) `extend`.

The target (`fsdpctl.targets`: aws or local) makes and removes nodes; this module decides what to
ask, records the result, writes the inventory and, for `replace`, configures and deploys the new
node. Anything that costs or destroys money asks first (`--yes` answers for scripts).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import signal
import time
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpctl import state as state_mod
from fsdpctl import targets
from fsdpctl.configure import stop_orphaned_playbooks
from fsdpctl.console import confirm, line_buffered, print_json, say, warn
from fsdpctl.errors import CommandError, UsageError, missing_package
from fsdpctl.inventory import write_inventory
from fsdpctl.plan.cost import amount_text
from fsdpctl.state import ClusterRecord, ClusterState, Exclusion
from infra.spec import ClusterSpec, load_spec

if TYPE_CHECKING:
    from fsdpctl.slurm import NodeState


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


def _differences(state: ClusterState, record: ClusterRecord, spec: ClusterSpec, node_count: int) -> list[str]:
    """How an existing cluster differs from the one asked for (empty: it is the same)."""
    differences = []
    if state.spec() != spec:
        differences.append(f"its spec ({state.spec_path}) differs from the one given")
    if record.node_count != node_count:
        differences.append(f"it has {record.node_count} node(s), not {node_count}")
    return differences


def _print_nodes(record: ClusterRecord) -> None:
    excluded = {e.rank: e for e in record.excluded}
    say(f"{'RANK':<5} {'NAME':<28} {'ADDRESS':<16} NOTE")
    for node in sorted(record.nodes, key=lambda n: n.rank):
        note = f"excluded: {excluded[node.rank].reason}" if node.rank in excluded else ""
        say(f"{node.rank:<5} {node.name:<28} {node.address:<16} {note}".rstrip())


def cmd_up(args: Namespace) -> int:
    line_buffered()
    spec = load_spec(args.spec)
    for warning in spec.warnings():
        warn(warning)
    if args.target == "aws" and args.nodes is not None:
        raise UsageError(f"--nodes applies to the local target only; on aws set node_count in {args.spec}")
    if args.nodes is not None and args.nodes < 1:
        raise UsageError(f"--nodes {args.nodes}: a cluster needs at least 1 node; use e.g. --nodes 2")
    node_count = args.nodes or spec.node_count
    target = targets.get(args.target)
    target.check_prerequisites(f"fsdpctl up --target {target.NAME}")
    state = state_mod.cluster_state(spec.name)
    with state.operation("up"):
        if state.exists():
            record = state.read()
            if record.target != target.NAME:
                raise UsageError(f"cluster {spec.name} already exists on the {record.target} target; run "
                                 f"`fsdpctl down --cluster {spec.name}` first, or give the spec another name")
            if not target.UPDATES_IN_PLACE:
                differences = _differences(state, record, spec, node_count)
                if differences:
                    raise UsageError(f"cluster {spec.name} already exists and differs: "
                                     f"{'; '.join(differences)}. Run `fsdpctl down --cluster {spec.name}` "
                                     "first, or give the spec another name")
                problems = target.health(state)
                if problems:
                    raise UsageError(f"cluster {spec.name} already exists but is not healthy: "
                                     f"{'; '.join(problems)}. Run `fsdpctl down --cluster {spec.name}`, "
                                     "then `fsdpctl up` again")
                state_mod.set_current(spec.name)
                say(f"cluster {spec.name} is already up with {node_count} healthy node(s); nothing to do")
                return 0
            state_mod.set_current(spec.name)
            existing = True
        else:
            state = state_mod.create(args.spec, spec, target.NAME, node_count=node_count)
            existing = False

        def approve(question: str) -> None:
            confirm(question, yes=args.yes)
            if existing:  # the cluster's spec copy (what extend, replace and down read) changes on a yes
                state_mod.write_kept(state.spec_path, args.spec.read_text())
                state.update(node_count=node_count)

        try:
            with _sigterm_as_interrupt():
                target.up(state, spec, node_count=node_count, out=say, approve=approve)
        except BaseException:
            record = state.read()
            if record.local is None and record.pulumi_stack is None:  # nothing was created
                state.remove()
            raise
    path = write_inventory(state)
    _print_nodes(state.read())
    say(f"inventory: {path}\nnext: fsdpctl configure   (or: fsdpctl ssh 0 -- hostname)")
    return 0


def cmd_down(args: Namespace) -> int:
    line_buffered()
    state = state_mod.resolve(args.cluster, readable=not args.force)
    with state.operation("down"):  # held before any repair: a running command may still write
        if args.force:  # gets through a truncated or garbled state.json or spec copy
            state.restore_unreadable(warn)
        record, spec = state.read(), state.spec()
        target = targets.get(record.target)
        lines = "\n".join(f"  - {line}" for line in target.destruction(state, spec))
        say(f"fsdpctl down destroys cluster {state.name} ({record.target}):\n{lines}")
        confirm(f"Destroy cluster {state.name}?", yes=args.yes)
        stop_orphaned_playbooks(state)  # a killed configure's playbook must not outlive its nodes
        target.down(state, spec, force=args.force, out=say)
        state.remove()
    kept = f"; its reports stay in {state.reports_dir}" if state.reports_dir.exists() else ""
    say(f"cluster {state.name} is down; its state dir {state.root} is removed{kept}")
    return 0


def _age(seconds: float) -> str:
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours < 48 else f"{hours // 24}d{hours % 24:02d}h"


def expiry_text(expires_at: str | None, now: dt.datetime | None = None, *, left: bool = False) -> str:
    """How `status` (left=True: with the time left) and `list` show the expiry: the time, and
    whether it has passed."""
    if not expires_at:
        return "-"
    when = dt.datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    remaining = when - (now or dt.datetime.now(dt.UTC))
    if remaining.total_seconds() <= 0:
        return f"{expires_at} (EXPIRED)"
    return f"{expires_at} (in {_age(remaining.total_seconds())})" if left else expires_at


def _summary(state: ClusterState, record: ClusterRecord) -> dict[str, Any]:
    """What `list` and `status` show of a cluster, as plain values."""
    spec = state.spec()
    return {"name": state.name, "target": record.target, "instance_type": spec.instance_type,
            "nodes": len(record.nodes), "excluded": sorted(record.excluded_ranks()),
            "created_at": dt.datetime.fromtimestamp(record.created_at, dt.UTC).isoformat(timespec="seconds"),
            "age": _age(time.time() - record.created_at), "expires_at": record.expires_at,
            "expired": bool(record.expires_at) and expiry_text(record.expires_at).endswith("(EXPIRED)"),
            "cost_per_hour": 0.0 if record.target == "local" else record.cost_per_hour,
            "cost_per_hour_max": None if record.target == "local" else record.cost_per_hour_max,
            # `up` recorded an estimate (the cluster may bill); without a total, its cap or nothing.
            "cost_recorded": record.target == "aws" and record.pulumi_stack is not None}


def _hourly(summary: dict[str, Any]) -> str:
    """The list's USD/HOUR column: the estimate, "<=" its cap, "unknown", or "-" (none recorded)."""
    if summary["cost_per_hour"] is not None:
        return f"{summary['cost_per_hour']:,.2f}"
    if summary["cost_per_hour_max"] is not None:
        return f"<={summary['cost_per_hour_max']:,.2f}"
    return "unknown" if summary["cost_recorded"] else "-"


def _live_health(state: ClusterState, record: ClusterRecord) -> tuple[list[str] | None, str | None]:
    """(what makes the cluster unusable, None) from the target's live check; (None, why) where it could
    not be asked (no AWS credentials, AWS refused, the aws extra not installed): `status` still shows
    everything the state file knows."""
    if not record.nodes:
        return ["no nodes yet"], None
    try:
        return targets.get(record.target).health(state), None
    except CommandError as e:
        return None, str(e)
    except ModuleNotFoundError as e:
        missing = missing_package(e)
        if missing is None:
            raise
        return None, str(missing)


def _slurm_fields(slurm_nodes: dict[str, NodeState] | None, name: str) -> dict[str, str | None]:
    """A node's Slurm state and reason for `status --json` (None: not known)."""
    node = (slurm_nodes or {}).get(name)
    return {"slurm_state": node.state if node else None, "slurm_reason": node.reason if node else None}


def _slurm_nodes(state: ClusterState, record: ClusterRecord,
                 problems: list[str] | None) -> tuple[dict[str, NodeState] | None, str | None]:
    """(each node as Slurm sees it, by name, or None where Slurm is not installed; None) once every
    node answered the live check, else (None, why Slurm was not asked); (None, None) without nodes."""
    from fsdpctl import slurm

    if not record.nodes:
        return None, None
    if problems is None:
        return None, "the nodes' health was not refreshed"
    if problems:
        return None, "not every node answers"
    try:
        return slurm.node_states(state), None
    except (CommandError, UsageError) as e:
        return None, str(e)


def _print_slurm_nodes(slurm_nodes: dict[str, NodeState] | None, not_asked: str | None) -> None:
    """How many nodes Slurm runs jobs on, and each other one's state and reason (a drain's)."""
    if not_asked is not None:
        say(f"slurm: not asked ({not_asked})")
    if not slurm_nodes:
        return
    out_of_service = [n for n in slurm_nodes.values() if not n.in_service]
    say(f"slurm: {len(slurm_nodes) - len(out_of_service)} of {len(slurm_nodes)} node(s) in service")
    for node in out_of_service:
        say(f"  {node.name} {node.state}: {node.reason or 'no reason given'}")
    if out_of_service:
        say("  once the cause is fixed: fsdpctl ssh 0 -- scontrol update nodename=NAME state=resume "
            "(docs/slurm.md, node health checks)")


def cmd_status(args: Namespace) -> int:
    state = state_mod.resolve(args.cluster)
    record = state.read()
    summary = _summary(state, record)
    problems, not_refreshed = _live_health(state, record)
    health = "unknown" if problems is None else problems or "ok"
    slurm_nodes, slurm_not_asked = _slurm_nodes(state, record, problems)
    summary.update(state_dir=str(state.root), shared_dir=record.shared_dir, health=health,
                   health_not_refreshed=not_refreshed, slurm_not_asked=slurm_not_asked,
                   node_list=[{**n.model_dump(), "excluded": n.rank in record.excluded_ranks(),
                               **_slurm_fields(slurm_nodes, n.name)} for n in record.nodes],
                   last_configure=record.last_configure.model_dump() if record.last_configure else None,
                   last_report=record.last_report, reports_dir=str(state.reports_dir))
    if args.json:
        print_json(summary)
        return 0
    say(f"cluster {state.name}: target {record.target}, {len(record.nodes)} node(s), created "
        f"{summary['age']} ago, state {state.root}")
    if record.expires_at:
        if summary["expired"]:
            say(f"EXPIRED at {record.expires_at}: the expiry schedules stopped "
                f"{state.spec().stopped_at_expiry()}; `fsdpctl up {state.spec_path}` brings them back, "
                f"`fsdpctl down --cluster {state.name}` removes the rest")
        else:
            say(f"expires at {expiry_text(record.expires_at, left=True)}; `fsdpctl extend --hours N` "
                "moves it")
    hourly = amount_text(summary["cost_per_hour"], summary["cost_per_hour_max"]) + " per hour"
    if summary["cost_recorded"] and summary["expired"]:
        say(f"cost: only the checkpoint bucket's S3 storage since the expiry ({hourly} once `up` brings "
            "it back)")
    elif summary["cost_recorded"]:
        say(f"cost: {hourly} (the plan's estimate at `up`; `fsdpctl plan` shows why)")
    if record.shared_dir:
        say(f"shared dir on every node: {record.shared_dir}")
    _print_nodes(record)
    _print_slurm_nodes(slurm_nodes, slurm_not_asked)
    if problems is None:
        say(f"health: not refreshed ({not_refreshed}); the above is what the state file recorded")
    else:
        say("health: " + ("every node answers over SSH" if not problems else "; ".join(problems)))
    last = record.last_configure
    if last:
        say(f"last configure: {'ok' if last.ok else 'FAILED'} at {last.time} ({last.run_dir})")
        for host, counts in last.hosts.items():
            say("  " + host + " " + " ".join(f"{k}={v}" for k, v in counts.model_dump().items()))
    if record.last_report:
        say(f"last smoke report: {record.last_report}/report.html")
    return 0


def cmd_list(args: Namespace) -> int:
    current = (state_mod.home() / "current")
    current_name = current.read_text().strip() if current.exists() else None
    rows = []
    for state in state_mod.known_clusters():
        try:
            rows.append({**_summary(state, state.read()), "current": state.name == current_name})
        except (UsageError, OSError) as e:  # a broken cluster is listed, not a reason to fail the list
            rows.append({"name": state.name, "error": str(e), "current": state.name == current_name})
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        say(f"no clusters under {state_mod.home()}; create one with `fsdpctl up SPEC.yaml`")
        return 0
    say(f"  {'NAME':<20} {'TARGET':<6} {'NODES':>5} {'AGE':>7} {'EXPIRES (UTC)':<34} {'USD/HOUR':>9}")
    for row in rows:
        mark = "*" if row["current"] else " "
        if "error" in row:
            say(f"{mark} {row['name']:<20} {row['error']}")
            continue
        cost = "-" if row["expired"] else _hourly(row)
        say(f"{mark} {row['name']:<20} {row['target']:<6} {row['nodes']:>5} {row['age']:>7} "
            f"{expiry_text(row['expires_at']):<34} {cost:>9}")
    return 0


def cmd_exclude(args: Namespace) -> int:
    state = state_mod.resolve(args.cluster)
    record = state.read()
    ranks = [n.rank for n in record.nodes]
    if args.rank not in ranks:
        raise UsageError(f"cluster {state.name} has no node with rank {args.rank} (ranks: "
                         f"{', '.join(map(str, ranks)) or 'none'})")
    reason = args.reason.strip()
    if not reason:
        raise UsageError("--reason is empty; say why the node is excluded, e.g. --reason 'ECC errors'")
    entry = Exclusion(rank=args.rank, reason=reason,
                      time=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    record = state.change(lambda current: {"excluded": sorted(
        [e for e in current.excluded if e.rank != args.rank] + [entry], key=lambda e: e.rank)})
    say(f"excluded rank {args.rank} from cluster {state.name}: {reason}")
    _slurm_node(state, next(n.name for n in record.nodes if n.rank == args.rank), drain_reason=reason)
    # another exclude may have taken the last nodes since: decide on the state as it is now
    if state.read().active_nodes():
        with contextlib.suppress(UsageError):  # ... or between this read and the rewrite
            say(f"inventory rewritten without it: {write_inventory(state)}")
            return 0
    state.inventory_path.unlink(missing_ok=True)  # a stale inventory would still list the node
    say("every node is now excluded; later stages have nothing to run on")
    return 0


def _slurm_node(state: ClusterState, node_name: str, *, drain_reason: str | None) -> None:
    """Drain a node in Slurm (`exclude`), or return it to service (`replace`), where Slurm runs."""
    from fsdpctl import slurm

    try:
        if not slurm.slurm_configured(state):
            return
        if drain_reason is not None:
            slurm.drain(state, node_name, f"fsdpctl exclude: {drain_reason}")
            say(f"drained {node_name} in Slurm (running jobs finish, no new ones start there)")
        else:
            if slurm.run_slurm(state, f"scontrol show node {node_name}", check=False).returncode:
                # A configure while the node was excluded wrote slurm.conf without it: add it back
                # on every node.
                from fsdpctl.configure import run_configure

                say(f"Slurm does not know {node_name}: `fsdpctl configure --tags slurm` on every node")
                if not run_configure(state, tags="slurm").ok:
                    raise CommandError("`fsdpctl configure --tags slurm` failed; run it again")
            slurm.resume(state, node_name)
            say(f"{node_name} is back in service in Slurm")
    except CommandError as e:
        warn(f"Slurm did not take the change for {node_name}: {e}")


def cmd_replace(args: Namespace) -> int:
    """A new node in place of rank N (same rank and name), configured and, when the trainer was
    deployed, deployed to."""
    line_buffered()
    state = state_mod.resolve(args.cluster)
    record = state.read()
    nodes = {n.rank: n for n in record.nodes}
    if args.rank not in nodes:
        raise UsageError(f"cluster {state.name} has no node with rank {args.rank} "
                         f"(ranks: {', '.join(map(str, sorted(nodes))) or 'none'}); see `fsdpctl status`")
    target, spec, node = targets.get(record.target), state.spec(), nodes[args.rank]
    with state.operation(f"replace {args.rank}"):
        say(f"fsdpctl replace {args.rank}: {target.node_destruction(state, args.rank)}; a new "
            f"{node.name} takes its place")
        confirm(f"Replace {node.name}?", yes=args.yes)
        started = time.monotonic()
        target.replace_node(state, spec, args.rank, out=say)

        from fsdpctl.configure import print_summary, run_configure
        from fsdpctl.deploy import DeployError, deploy

        # The blacklist entry was about the old node; the new one must be in the inventory to be
        # configured and deployed.
        record = state.change(lambda now: {"excluded": [e for e in now.excluded if e.rank != args.rank]})
        write_inventory(state)
        # The new node is brought to where the others are: a cluster never configured stays so (the
        # roles on one node of it would wait for services, such as slurmctld, the others never got).
        configured = run_configure(state, limit=node.name) if record.last_configure else None
        if configured is None:
            say(f"cluster {state.name} was never configured: {node.name} is left as booted (`fsdpctl "
                "configure` configures every node)")
        elif not configured.ok:
            print_summary(configured)
            raise CommandError(f"the new {node.name} failed configuration ({configured.status}, logs in "
                               f"{configured.run_dir}). Fix it, then run `fsdpctl configure --limit "
                               f"{node.name}`" + (" and `fsdpctl deploy`." if record.deploy else "."))
        if record.deploy is not None:
            try:
                deploy(state, ranks=[args.rank])
            except DeployError as e:
                raise CommandError(f"deploying the trainer to the new {node.name} failed: {e}. Fix it, then "
                                   "run `fsdpctl deploy`.") from None
        _slurm_node(state, node.name, drain_reason=None)
    say(f"{node.name} replaced" + (" and configured" if configured else "")
        + (", and the trainer deployed" if record.deploy else "")
        + f" in {time.monotonic() - started:.0f} s; rank {args.rank} is back in the cluster")
    return 0


def cmd_extend(args: Namespace) -> int:
    """Move an aws cluster's expiry N hours later (the schedules on AWS's side move with it)."""
    line_buffered()
    if args.hours < 1:
        raise UsageError(f"--hours {args.hours}: extend by at least 1 hour, e.g. --hours 4")
    state = state_mod.resolve(args.cluster)
    record = state.read()
    if record.target != "aws":
        raise UsageError(f"cluster {state.name} is on the {record.target} target, which has no expiry; "
                         "`fsdpctl extend` applies to aws clusters")
    from fsdpctl.targets.aws import stack

    with state.operation("extend"):
        stack.extend(state, state.spec(), hours=args.hours, out=say,
                     approve=lambda question: confirm(question, yes=args.yes))
    return 0
