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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from fsdpctl import slurm_nodes, targets
from fsdpctl import state as state_mod
from fsdpctl.configure import ConfigureResult, stop_orphaned_playbooks
from fsdpctl.console import confirm, line_buffered, print_json, say, warn
from fsdpctl.errors import CommandError, Interrupted, UsageError, missing_package
from fsdpctl.inventory import write_inventory
from fsdpctl.plan.cost import amount_text
from fsdpctl.slurm_nodes import NodeState
from fsdpctl.state import ClusterRecord, ClusterState, ConfigureRecord, Exclusion, Node, Target
from infra.spec import ClusterSpec, load_spec


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


def up(spec_file: Path, *, target: Target = "aws", nodes: int | None = None,
       yes: bool = False) -> ClusterRecord:
    """Create the cluster `spec_file` describes on `target` (or find it already up) and write its
    inventory; returns its record (nodes, addresses). `nodes` overrides node_count on the local
    target. What costs money is asked first, unless `yes`."""
    line_buffered()
    spec = load_spec(spec_file)
    for warning in spec.warnings():
        warn(warning)
    if target == "aws" and nodes is not None:
        raise UsageError(f"--nodes applies to the local target only; on aws set node_count in {spec_file}")
    if nodes is not None and nodes < 1:
        raise UsageError(f"--nodes {nodes}: a cluster needs at least 1 node; use e.g. --nodes 2")
    node_count = nodes or spec.node_count
    provider = targets.get(target)
    provider.check_prerequisites(f"fsdpctl up --target {provider.NAME}")
    state = state_mod.cluster_state(spec.name)
    with state.operation("up"):
        if state.exists():
            record = state.read()
            if record.target != provider.NAME:
                raise UsageError(f"cluster {spec.name} already exists on the {record.target} target; run "
                                 f"`fsdpctl down --cluster {spec.name}` first, or give the spec another name")
            if not provider.UPDATES_IN_PLACE:
                differences = _differences(state, record, spec, node_count)
                if differences:
                    raise UsageError(f"cluster {spec.name} already exists and differs: "
                                     f"{'; '.join(differences)}. Run `fsdpctl down --cluster {spec.name}` "
                                     "first, or give the spec another name")
                problems = provider.health(state)
                if problems:
                    raise UsageError(f"cluster {spec.name} already exists but is not healthy: "
                                     f"{'; '.join(problems)}. Run `fsdpctl down --cluster {spec.name}`, "
                                     "then `fsdpctl up` again")
                state_mod.set_current(spec.name)
                say(f"cluster {spec.name} is already up with {node_count} healthy node(s); nothing to do")
                return record
            state_mod.set_current(spec.name)
            existing = True
        else:
            state = state_mod.create(spec_file, spec, provider.NAME, node_count=node_count)
            existing = False

        def approve(question: str) -> None:
            confirm(question, yes=yes)
            if existing:  # the cluster's spec copy (what extend, replace and down read) changes on a yes
                state_mod.write_kept(state.spec_path, spec_file.read_text())
                state.update(node_count=node_count)

        try:
            with _sigterm_as_interrupt():
                provider.up(state, spec, node_count=node_count, out=say, approve=approve)
        except BaseException:
            record = state.read()
            if record.local is None and record.pulumi_stack is None:  # nothing was created
                state.remove()
            raise
    path = write_inventory(state)
    record = state.read()
    _print_nodes(record)
    say(f"inventory: {path}\nnext: fsdpctl configure   (or: fsdpctl ssh 0 -- hostname)")
    return record


def cmd_up(args: Namespace) -> int:
    up(args.spec, target=args.target, nodes=args.nodes, yes=args.yes)
    return 0


def down(cluster: str | None = None, *, force: bool = False, yes: bool = False) -> None:
    """Tear the cluster down (default: the one brought up last) and sweep for leftovers, after asking
    unless `yes`; `force` also gets through a garbled state and (aws) deletes what the sweep finds.
    Its reports are kept."""
    line_buffered()
    state = state_mod.resolve(cluster, readable=not force)
    with state.operation("down"):  # held before any repair: a running command may still write
        if force:  # gets through a truncated or garbled state.json or spec copy
            state.restore_unreadable(warn)
        record, spec = state.read(), state.spec()
        provider = targets.get(record.target)
        lines = "\n".join(f"  - {line}" for line in provider.destruction(state, spec))
        say(f"fsdpctl down destroys cluster {state.name} ({record.target}):\n{lines}")
        confirm(f"Destroy cluster {state.name}?", yes=yes)
        stop_orphaned_playbooks(state)  # a killed configure's playbook must not outlive its nodes
        provider.down(state, spec, force=force, out=say)
        state.remove()
    kept = f"; its reports stay in {state.reports_dir}" if state.reports_dir.exists() else ""
    say(f"cluster {state.name} is down; its state dir {state.root} is removed{kept}")


def cmd_down(args: Namespace) -> int:
    down(args.cluster, force=args.force, yes=args.yes)
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


class ClusterSummary(BaseModel):
    """What `list` and `status` show of a cluster (`--json` writes these fields)."""

    model_config = ConfigDict(frozen=True)

    name: str
    target: Target
    instance_type: str
    nodes: int
    excluded: list[int]
    """The ranks `fsdpctl exclude` took out of service."""
    created_at: str
    age: str
    expires_at: str | None
    expired: bool
    cost_per_hour: float | None
    """The plan's estimate recorded at `up` (0 on the local target; None: not a fixed price)."""
    cost_per_hour_max: float | None
    """Its cap where the price varies (spot), else None."""
    cost_recorded: bool
    """`up` recorded an estimate: the cluster may bill."""

    @classmethod
    def of(cls, state: ClusterState, record: ClusterRecord) -> ClusterSummary:
        spec = state.spec()
        created = dt.datetime.fromtimestamp(record.created_at, dt.UTC).isoformat(timespec="seconds")
        return cls(name=state.name, target=record.target, instance_type=spec.instance_type,
                   nodes=len(record.nodes), excluded=sorted(record.excluded_ranks()), created_at=created,
                   age=_age(time.time() - record.created_at), expires_at=record.expires_at,
                   expired=bool(record.expires_at) and expiry_text(record.expires_at).endswith("(EXPIRED)"),
                   cost_per_hour=0.0 if record.target == "local" else record.cost_per_hour,
                   cost_per_hour_max=None if record.target == "local" else record.cost_per_hour_max,
                   cost_recorded=record.target == "aws" and record.pulumi_stack is not None)

    def hourly(self) -> str:
        """The list's USD/HOUR column: the estimate, "<=" its cap, "unknown", or "-" (none recorded)."""
        if self.cost_per_hour is not None:
            return f"{self.cost_per_hour:,.2f}"
        if self.cost_per_hour_max is not None:
            return f"<={self.cost_per_hour_max:,.2f}"
        return "unknown" if self.cost_recorded else "-"


class ListedCluster(ClusterSummary):
    """A row of `fsdpctl list`."""

    current: bool
    """The cluster commands act on without --cluster."""


class UnreadableCluster(BaseModel):
    """A row of `fsdpctl list` for a cluster whose state cannot be read (listed, not a reason to fail)."""

    model_config = ConfigDict(frozen=True)

    name: str
    error: str
    current: bool


class NodeStatus(Node):
    """A node as `status` shows it: the state's record, whether it is excluded, and Slurm's view."""

    excluded: bool
    slurm_state: str | None
    """Slurm's state of the node (idle, allocated, drained, ...); None where Slurm was not asked."""
    slurm_reason: str | None
    """Why Slurm has it drained or down (a health check's finding, `fsdpctl exclude`'s reason)."""


class ClusterStatus(ClusterSummary):
    """What `fsdpctl status` knows of a cluster: the state file's record and, where the target and
    the nodes could be asked, their live health and Slurm's view of each node."""

    state_dir: str
    shared_dir: str | None
    health: Literal["ok", "unknown"] | list[str]
    """ok, what makes the cluster unusable, or unknown where it could not be asked."""
    health_not_refreshed: str | None
    """Why the live health could not be asked (no credentials, the extra not installed, ...)."""
    slurm_not_asked: str | None
    node_list: list[NodeStatus]
    last_configure: ConfigureRecord | None
    last_report: str | None
    reports_dir: str


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


def _slurm_nodes(record: ClusterRecord,
                 problems: list[str] | None) -> tuple[dict[str, NodeState] | None, str | None]:
    """(each node as Slurm sees it, by name, or None where Slurm is not installed; None) once every
    node answered the live check, else (None, why Slurm was not asked); (None, None) without nodes."""
    if not record.nodes:
        return None, None
    if problems is None:
        return None, "the nodes' health was not refreshed"
    if problems:
        return None, "not every node answers"
    try:
        return slurm_nodes.node_states(record), None
    except (CommandError, UsageError) as e:
        return None, str(e)


def _print_slurm_nodes(nodes: dict[str, NodeState] | None, not_asked: str | None) -> None:
    """How many nodes Slurm runs jobs on, how many power saving stopped, and each other one's state and
    reason (a drain's)."""
    if not_asked is not None:
        say(f"slurm: not asked ({not_asked})")
    if not nodes:
        return
    power_saved = [n.name for n in nodes.values() if n.power_saved]
    out_of_service = [n for n in nodes.values() if not n.in_service and not n.power_saved]
    in_service = len(nodes) - len(out_of_service) - len(power_saved)
    say(f"slurm: {in_service} of {len(nodes)} node(s) in service"
        + (f"; powered down while idle (a job's need powers them up): {', '.join(power_saved)}"
           if power_saved else ""))
    for node in out_of_service:
        say(f"  {node.name} {node.state}: {node.reason or 'no reason given'}")
    if any(n.spot_notice for n in out_of_service):
        say("  a node a spot notice drained: `fsdpctl heal` replaces it once its jobs have left "
            "(docs/slurm.md)")
    if out_of_service:
        say(f"  once the cause is fixed: {slurm_nodes.resume_hint('NAME')} "
            "(docs/slurm.md, node health checks)")


def status(cluster: str | None = None) -> ClusterStatus:
    """The cluster's record, with its live health and each node's Slurm state where they can be asked
    (else what the state file knows, and why it was not refreshed)."""
    state = state_mod.resolve(cluster)
    return _status(state, state.read())


def _status(state: ClusterState, record: ClusterRecord) -> ClusterStatus:
    problems, not_refreshed = _live_health(state, record)
    slurm_nodes, slurm_not_asked = _slurm_nodes(record, problems)
    excluded = record.excluded_ranks()

    def node_status(node: Node) -> NodeStatus:
        seen = (slurm_nodes or {}).get(node.name)
        return NodeStatus(**node.model_dump(), excluded=node.rank in excluded, slurm_state=seen.state if seen
                          else None, slurm_reason=seen.reason if seen else None)

    return ClusterStatus(**ClusterSummary.of(state, record).model_dump(), state_dir=str(state.root),
                         shared_dir=record.shared_dir,
                         health="unknown" if problems is None else problems or "ok",
                         health_not_refreshed=not_refreshed, slurm_not_asked=slurm_not_asked,
                         node_list=[node_status(n) for n in record.nodes],
                         last_configure=record.last_configure, last_report=record.last_report,
                         reports_dir=str(state.reports_dir))


def cmd_status(args: Namespace) -> int:
    state = state_mod.resolve(args.cluster)
    record = state.read()
    summary = _status(state, record)
    if args.json:
        print_json(summary.model_dump(mode="json"))
        return 0
    say(f"cluster {state.name}: target {record.target}, {len(record.nodes)} node(s), created "
        f"{summary.age} ago, state {state.root}")
    if record.expires_at:
        if summary.expired:
            say(f"EXPIRED at {record.expires_at}: the expiry schedules stopped "
                f"{state.spec().stopped_at_expiry()}; `fsdpctl up {state.spec_path}` brings them back, "
                f"`fsdpctl down --cluster {state.name}` removes the rest")
        else:
            say(f"expires at {expiry_text(record.expires_at, left=True)}; `fsdpctl extend --hours N` "
                "moves it")
    hourly = amount_text(summary.cost_per_hour, summary.cost_per_hour_max) + " per hour"
    if summary.cost_recorded and summary.expired:
        say(f"cost: only the checkpoint bucket's S3 storage since the expiry ({hourly} once `up` brings "
            "it back)")
    elif summary.cost_recorded:
        say(f"cost: {hourly} (the plan's estimate at `up`; `fsdpctl plan` shows why)")
    if record.shared_dir:
        say(f"shared dir on every node: {record.shared_dir}")
    _print_nodes(record)
    seen = {n.name: NodeState(n.name, n.slurm_state, n.slurm_reason) for n in summary.node_list
            if n.slurm_state is not None}
    _print_slurm_nodes(seen or None, summary.slurm_not_asked)
    if summary.health == "unknown":
        say(f"health: not refreshed ({summary.health_not_refreshed}); the above is what the state file "
            "recorded")
    else:
        problems = "every node answers over SSH" if summary.health == "ok" else "; ".join(summary.health)
        say(f"health: {problems}")
    last = record.last_configure
    if last:
        say(f"last configure: {'ok' if last.ok else 'FAILED'} at {last.time} ({last.run_dir})")
        for host, counts in last.hosts.items():
            say("  " + host + " " + " ".join(f"{k}={v}" for k, v in counts.model_dump().items()))
    if record.last_report:
        say(f"last smoke report: {record.last_report}/report.html")
    return 0


def list_clusters() -> list[ListedCluster | UnreadableCluster]:
    """Every cluster under FSDPCTL_HOME, the one commands act on by default marked current."""
    current = (state_mod.home() / "current")
    current_name = current.read_text().strip() if current.exists() else None
    rows: list[ListedCluster | UnreadableCluster] = []
    for state in state_mod.known_clusters():
        try:
            summary = ClusterSummary.of(state, state.read())
            rows.append(ListedCluster(**summary.model_dump(), current=state.name == current_name))
        except (UsageError, OSError) as e:  # a broken cluster is listed, not a reason to fail the list
            rows.append(UnreadableCluster(name=state.name, error=str(e), current=state.name == current_name))
    return rows


def cmd_list(args: Namespace) -> int:
    rows = list_clusters()
    if args.json:
        print_json([row.model_dump(mode="json") for row in rows])
        return 0
    if not rows:
        say(f"no clusters under {state_mod.home()}; create one with `fsdpctl up SPEC.yaml`")
        return 0
    say(f"  {'NAME':<20} {'TARGET':<6} {'NODES':>5} {'AGE':>7} {'EXPIRES (UTC)':<34} {'USD/HOUR':>9}")
    for row in rows:
        mark = "*" if row.current else " "
        if isinstance(row, UnreadableCluster):
            say(f"{mark} {row.name:<20} {row.error}")
            continue
        cost = "-" if row.expired else row.hourly()
        say(f"{mark} {row.name:<20} {row.target:<6} {row.nodes:>5} {row.age:>7} "
            f"{expiry_text(row.expires_at):<34} {cost:>9}")
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
    _slurm_node(state, record, next(n.name for n in record.nodes if n.rank == args.rank),
                drain_reason=f"fsdpctl exclude: {reason}")
    # another exclude may have taken the last nodes since: decide on the state as it is now
    if state.read().active_nodes():
        with contextlib.suppress(UsageError):  # ... or between this read and the rewrite
            say(f"inventory rewritten without it: {write_inventory(state)}")
            return 0
    state.inventory_path.unlink(missing_ok=True)  # a stale inventory would still list the node
    say("every node is now excluded; later stages have nothing to run on")
    return 0


def _slurm_node(state: ClusterState, record: ClusterRecord, node_name: str, *, drain_reason: str | None
                ) -> None:
    """Drain a node in Slurm with a reason (`exclude`, a failed `replace`), or return it to service
    (`replace`), where Slurm runs."""
    try:
        if not slurm_nodes.slurm_configured(record):
            return
        if drain_reason is not None:
            slurm_nodes.drain(record, node_name, drain_reason)
            say(f"drained {node_name} in Slurm ({drain_reason}): running jobs finish, no new ones start "
                "there")
        else:
            if slurm_nodes.run_slurm(record, f"scontrol show node {node_name}", check=False).returncode:
                # A configure while the node was excluded wrote slurm.conf without it: add it back
                # on every node.
                from fsdpctl.configure import run_configure

                say(f"Slurm does not know {node_name}: `fsdpctl configure --tags slurm` on every node")
                if not run_configure(state, tags="slurm").ok:
                    raise CommandError("`fsdpctl configure --tags slurm` failed; run it again")
            slurm_nodes.resume(record, node_name)
            say(f"{node_name} is back in service in Slurm")
    except CommandError as e:
        warn(f"Slurm did not take the change for {node_name}: {e}")


def cmd_replace(args: Namespace) -> int:
    line_buffered()
    replace(state_mod.resolve(args.cluster), args.rank, yes=args.yes)
    return 0


def replace(state: ClusterState, rank: int, *, yes: bool) -> None:
    """A new node in place of rank N (same rank and name), configured and, when the trainer was
    deployed, deployed to, and back in service in Slurm (`fsdpctl replace`, and `fsdpctl heal`)."""
    record = state.read()
    nodes = {n.rank: n for n in record.nodes}
    if rank not in nodes:
        raise UsageError(f"cluster {state.name} has no node with rank {rank} "
                         f"(ranks: {', '.join(map(str, sorted(nodes))) or 'none'}); see `fsdpctl status`")
    target, spec, node = targets.get(record.target), state.spec(), nodes[rank]
    with state.operation(f"replace {rank}"):
        say(f"fsdpctl replace {rank}: {target.node_destruction(state, rank)}; a new "
            f"{node.name} takes its place")
        confirm(f"Replace {node.name}?", yes=yes)
        started = time.monotonic()
        # A failure up to here (no capacity, an instance that never answers SSH) keeps the node's drain
        # reason: for a spot node `fsdpctl heal` tries again with another instance on its next pass.
        target.replace_node(state, spec, rank, out=say)
        try:
            record, configured = _bring_up_to_date(state, node)
        except CommandError as e:
            # The new instance runs but is not fit for service, and another one would fail the same way
            # (the configure or the deploy is at fault): out of service with a reason of its own, which
            # heal leaves to the operator instead of replacing it again on every pass.
            what = str(e).split(". ")[0][:160]  # a drain reason is one line of `sinfo -R`
            _slurm_node(state, state.read(), node.name,
                        drain_reason=f"{slurm_nodes.REPLACE_FAILED_REASON}: {what}")
            raise type(e)(f"{str(e).rstrip('.')}. {node.name} stays drained in Slurm and bills as a running "
                          "instance until then; `fsdpctl heal` leaves it to you. Once it is fixed: "
                          f"`{slurm_nodes.resume_hint(node.name)}` (or `fsdpctl replace {rank}` again, or "
                          f"`fsdpctl exclude {rank}`).") from None
        _slurm_node(state, record, node.name, drain_reason=None)
    say(f"{node.name} replaced" + (" and configured" if configured else "")
        + (", and the trainer deployed" if record.deploy else "")
        + f" in {time.monotonic() - started:.0f} s; rank {rank} is back in the cluster")


def _bring_up_to_date(state: ClusterState, node: Node) -> tuple[ClusterRecord, ConfigureResult | None]:
    """The new instance of `node` configured and deployed to as the others are, and the others told
    of it; the record as it then is, and the configure run (None where the cluster never had one)."""
    from fsdpctl.configure import print_summary, run_configure
    from fsdpctl.deploy import DeployError, deploy

    # The blacklist entry was about the old node; the new one must be in the inventory to be
    # configured and deployed.
    record = state.change(lambda now: {"excluded": [e for e in now.excluded if e.rank != node.rank]})
    write_inventory(state)
    # The new node is brought to where the others are: a cluster never configured stays so (the
    # roles on one node of it would wait for services, such as slurmctld, the others never got).
    configured = run_configure(state, limit=node.name) if record.last_configure else None
    if configured is None:
        say(f"cluster {state.name} was never configured: {node.name} is left as booted (`fsdpctl "
            "configure` configures every node)")
    elif configured.canceled:  # Ctrl-C or SIGTERM: ends `heal --watch` too, instead of a failed pass
        print_summary(configured)
        raise Interrupted(f"the configure of the new {node.name} was canceled (logs in "
                          f"{configured.run_dir}). Run `fsdpctl configure --limit {node.name}`"
                          + (" and `fsdpctl deploy`." if record.deploy else "."))
    elif not configured.ok:
        print_summary(configured)
        raise CommandError(f"the new {node.name} failed configuration ({configured.status}, logs in "
                           f"{configured.run_dir}). Fix it, then run `fsdpctl configure --limit "
                           f"{node.name}`" + (" and `fsdpctl deploy`." if record.deploy else "."))
    if record.deploy is not None:
        try:
            deploy(state, record, ranks=[node.rank])
        except DeployError as e:
            raise CommandError(f"deploying the trainer to the new {node.name} failed: {e}. Fix it, then "
                               "run `fsdpctl deploy`.") from None
    _introduce_to_the_others(state, node, configured=configured is not None)
    return record, configured


ADDRESS_ROLES = ("common", "slurm", "monitoring")
"""The roles that write every node's address or instance id on each node: /etc/hosts, slurm.conf's
NodeAddr (where slurmctld reaches slurmd), the instance ids power saving starts and stops, and
Prometheus's scrape targets."""


def _introduce_to_the_others(state: ClusterState, old: Node, *, configured: bool) -> None:
    """What the other nodes knew of the replaced one, brought up to date:

    - its host key: they learnt the old one at their first node-to-node SSH (accept-new, role
      cluster_ssh) and would refuse the new one (mpirun, nccl-tests), so it is forgotten and the
      next SSH learns the new one;
    - its address and instance id, where the new instance has others (an AWS replacement gets a new
      private IP and id; a local node keeps its address and has no id): the roles that write them
      are run on the other nodes.
    """
    from fsdpctl import remote
    from fsdpctl.configure import print_summary, run_configure

    record = state.read()
    new = next(n for n in record.nodes if n.rank == old.rank)
    others = [n for n in remote.cluster_nodes(record) if n.rank != old.rank]
    if not others:
        return
    hosts = " ".join(dict.fromkeys([old.name, old.address, new.address]))
    # `; true`: a known_hosts without the host is no failure; only a node that does not answer is.
    forget = f"for host in {hosts}; do ssh-keygen -R $host >/dev/null 2>&1; done; true"
    answers = remote.run_all(record, forget, ranks=[n.rank for n in others], timeout=60, check=False)
    answered = [n for n in others if answers[n.rank].returncode == 0]
    moved = (new.address, new.instance_id) != (old.address, old.instance_id)
    if len(answered) < len(others):
        # A node that does not answer (another one EC2 took back, say) must not keep this one out of
        # service: it learns the new key and address when it is replaced or configured.
        warn(f"{', '.join(n.name for n in others if n not in answered)} did not answer: it still knows "
             f"{old.name}'s old host key{' and address' if moved else ''} until "
             f"`fsdpctl configure` reaches it")
    if not moved or not configured or not answered:
        return
    say(f"{new.name} is a new instance (address {old.address} -> {new.address}, instance "
        f"{old.instance_id or '-'} -> {new.instance_id or '-'}): running the roles that list every node's "
        f"address and instance id ({', '.join(ADDRESS_ROLES)}) on the other nodes")
    result = run_configure(state, tags=list(ADDRESS_ROLES), limit=",".join(n.name for n in answered))
    if not result.ok:
        print_summary(result)
        raise CommandError(f"the other nodes still list {new.name} at its old address {old.address} "
                           f"({result.status}, logs in {result.run_dir}): Slurm cannot reach it there. "
                           f"Fix it, then run `fsdpctl configure --tags {','.join(ADDRESS_ROLES)}`.")


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
