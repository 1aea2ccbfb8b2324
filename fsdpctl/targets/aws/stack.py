"""The aws target's verbs over the Pulumi Automation API and the repository's Pulumi program.

`up` checks for the pulumi CLI, runs the pre-flight checks (nothing is created when one fails),
provides an SSH key, works out the stack config (`aws:region`, `fsdp-cluster:cluster` = the spec,
`fsdp-cluster:expiresAt` pinned at first creation), shows what it will create (the offline plan for a
new stack, Pulumi's preview diff of that config for an existing one) with its cost, asks, and only
then creates the stack, writes the config, runs `pulumi up` with its progress and records the nodes,
SSH settings, shared dir and stack outputs in the cluster state: a "no" leaves everything as it was.
`extend` and `replace_node` update only what they are for (a targeted `pulumi up`).
`down` runs `pulumi destroy` and then the leftover sweep (sweep.py); it raises when anything is left.
`replace_node` terminates one node and lets Pulumi recreate it under the same rank.

Stack state lives in `$PULUMI_BACKEND_URL` when set (Pulumi Cloud, s3://...), else in a local file
backend under the fsdpctl home; the stack name is the cluster name.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import botocore.exceptions
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from fsdpctl import state as state_mod
from fsdpctl.checkout import REPO_ROOT
from fsdpctl.console import Out
from fsdpctl.errors import CommandError, UsageError
from fsdpctl.state import ClusterState
from fsdpctl.targets.aws import preflight, sweep
from fsdpctl.targets.aws.clients import AwsClients, error_text
from fsdpctl.targets.aws.keys import ssh_key
from infra.offline import Registration
from infra.spec import ClusterSpec

UPDATES_IN_PLACE = True
"""`up` of an existing cluster with a changed spec updates it: Pulumi applies the difference."""

PULUMI_INSTALL = "curl -fsSL https://get.pulumi.com | sh"
PULUMI_DOCS = "https://www.pulumi.com/docs/iac/download-install/"


# ---- the pulumi CLI and the stack ----------------------------------------------------------------
def pulumi_command():
    """The pulumi CLI for the Automation API, or a UsageError that says how to install it."""
    found = shutil.which("pulumi")
    installer_default = Path.home() / ".pulumi" / "bin" / "pulumi"
    if not found and installer_default.exists():
        found = str(installer_default)
    if not found:
        raise UsageError(
            "the pulumi CLI is not installed (not on PATH, not in ~/.pulumi/bin): fsdpctl drives "
            f"`pulumi up/destroy` through it. Install it with `{PULUMI_INSTALL}` (see {PULUMI_DOCS}), "
            "open a new shell so ~/.pulumi/bin is on PATH, then run the same fsdpctl command again. "
            "Nothing was created.")
    from pulumi.automation import PulumiCommand

    return PulumiCommand(root=str(Path(found).resolve().parent.parent))


def check_prerequisites(action: str) -> None:
    """What `up` needs on this machine, before any state exists: the pulumi CLI."""
    del action
    pulumi_command()


def pulumi_env() -> dict[str, str]:
    """Backend and passphrase for non-interactive runs, unless the user chose their own."""
    env = {}
    if not os.environ.get("PULUMI_BACKEND_URL"):
        backend = state_mod.home() / "pulumi"
        backend.mkdir(parents=True, exist_ok=True)
        env["PULUMI_BACKEND_URL"] = backend.as_uri()
    if not os.environ.get("PULUMI_CONFIG_PASSPHRASE") and not os.environ.get("PULUMI_CONFIG_PASSPHRASE_FILE"):
        # The stack config holds no secrets (only a public key); the passphrase guards nothing.
        env["PULUMI_CONFIG_PASSPHRASE"] = ""
    return env


def backend_url() -> str:
    return os.environ.get("PULUMI_BACKEND_URL") or pulumi_env()["PULUMI_BACKEND_URL"]


def cancel_advice(cluster: str) -> str:
    """The exact command that clears a crashed operation's lock on this project's backend (a plain
    `pulumi cancel` would look in the user's default backend)."""
    return (f"PULUMI_BACKEND_URL={backend_url()} pulumi cancel --stack {cluster} --yes "
            f"--cwd {REPO_ROOT}")


def _workspace_options(command):
    from pulumi import automation as auto

    if not (REPO_ROOT / "Pulumi.yaml").exists():
        raise UsageError(f"no Pulumi.yaml in {REPO_ROOT}: run fsdpctl from a checkout of the "
                         "fsdp-cluster repository (pip install -e .)")
    return auto.LocalWorkspaceOptions(work_dir=str(REPO_ROOT), pulumi_command=command, env_vars=pulumi_env())


def open_stack(spec: ClusterSpec, command, *, create: bool):
    """The cluster's stack (named after the cluster); None when it does not exist and create is false."""
    from pulumi import automation as auto

    opts = _workspace_options(command)
    if create:
        return auto.create_or_select_stack(spec.name, work_dir=str(REPO_ROOT), opts=opts)
    try:
        return auto.select_stack(spec.name, work_dir=str(REPO_ROOT), opts=opts)
    except auto.errors.StackNotFoundError:
        return None


def _utc(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _iso(when: dt.datetime) -> str:
    return when.astimezone(dt.UTC).replace(microsecond=0, tzinfo=None).isoformat() + "Z"


@dataclass(frozen=True)
class StackConfig:
    """The stack config `up` applies: the region, the spec (as the JSON object the program's
    Config.require_object parses) and the pinned expiry (None: expiry off)."""

    region: str
    cluster: str
    expires_at: str | None

    def values(self) -> dict[str, str]:
        from infra.program import EXPIRES_AT_KEY
        from infra.spec import PULUMI_CONFIG_KEY

        values = {"aws:region": self.region, PULUMI_CONFIG_KEY: self.cluster}
        if self.expires_at:
            values[EXPIRES_AT_KEY] = self.expires_at
        return values


def stack_config(stack, spec: ClusterSpec, *, now: dt.datetime | None = None,
                 out: Out | None = None) -> StackConfig:
    """The config `up` would give the stack (None: a stack not created yet), read but not written:
    `up` writes it only once the user said yes. The expiry is pinned at first creation and kept by
    later `up`s (re-running `up` must not push the dead-man's switch out each time); once it has
    passed (the schedules stopped the billed resources), the next `up` brings the cluster back with
    a new expiry of now + expiry_hours."""
    from pulumi import automation as auto

    from infra.program import EXPIRES_AT_KEY, expiry_time

    now = now or dt.datetime.now(dt.UTC)
    cluster = json.dumps(spec.model_dump(mode="json"))
    if spec.expiry_hours is None:
        return StackConfig(spec.region, cluster, expires_at=None)
    try:
        pinned = stack.get_config(EXPIRES_AT_KEY).value if stack is not None else None
    except auto.errors.CommandError:
        pinned = None
    if pinned and _utc(pinned) <= now:
        if out:
            out(f"cluster {spec.name} expired at {pinned} ({spec.stopped_at_expiry()} were stopped); "
                "this `up` recreates them with a new expiry")
        pinned = None
    return StackConfig(spec.region, cluster, expires_at=pinned or expiry_time(spec, now))


def write_stack_config(stack, config: StackConfig) -> None:
    from pulumi import automation as auto

    for key, value in config.values().items():
        stack.set_config(key, auto.ConfigValue(value))


@contextmanager
def proposed_settings(stack, config: StackConfig) -> Iterator[str]:
    """A copy of the stack's settings file (its secrets provider and salt included) with `config`
    in it, for `pulumi preview --config-file`: the diff `up` shows is that of the new spec, while
    the stack's own config stays as it is until the yes."""
    from pulumi.automation import StackSettings

    try:
        settings = stack.workspace.stack_settings(stack.name)
    except FileNotFoundError:  # a stack created elsewhere, whose settings file is not here
        settings = StackSettings()
    settings.config = {**(settings.config or {}), **config.values()}
    with tempfile.TemporaryDirectory(prefix="fsdpctl-preview-") as folder:
        path = Path(folder) / f"Pulumi.{stack.name}.yaml"
        # The Automation API's own serialization of a stack settings file.
        path.write_text(yaml.safe_dump(settings._serialize()))
        yield str(path)


def extended_expiry(current: str | None, hours: int, now: dt.datetime) -> str:
    """`fsdpctl extend --hours N`: N hours after the current expiry (or after now, when the
    cluster has none)."""
    base = _utc(current) if current else now
    return _iso(max(base, now) + dt.timedelta(hours=hours))


def _progress(out: Out) -> Callable[[str], None]:
    return lambda line: out(line.rstrip("\n"))


def _tail(text: object, lines: int = 25) -> str:
    return "\n".join(str(text).strip().splitlines()[-lines:])


def _locked(spec: ClusterSpec, error: Exception, what: str) -> UsageError:
    return UsageError(f"another pulumi operation holds stack {spec.name} ({_tail(error, 3)}). Wait for it; "
                      f"if it crashed, clear its lock with `{cancel_advice(spec.name)}`, then run "
                      f"`fsdpctl {what}` again.")


# ---- outputs -> state ----------------------------------------------------------------------------
class StackNode(BaseModel):
    """One node as the program exports it (`nodes`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int
    name: str
    instance_id: str
    private_ip: str
    efa_count: int


class StackOutputs(BaseModel):
    """The stack outputs of the Pulumi program (infra/program.py, OUTPUT_NAMES): what `up` reads back.
    Outputs that a spec does not call for (no bastion, no FSx, no expiry) are null."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nodes: list[StackNode]
    bastion_public_ip: str | None = None
    ssh_user: str | None = None
    checkpoint_bucket: str | None = None
    fsx_dns_name: str | None = None
    fsx_mount_name: str | None = None
    placement_group: str | None = None
    security_group_id: str | None = None
    vpc_id: str | None = None
    private_subnet_id: str | None = None
    ami_id: str | None = None
    key_name: str | None = None
    expires_at: str | None = None
    """The program's own view of the expiry (a pinned config value, or its clock resource)."""
    expiry_queue_url: str | None = None


def _parse_outputs(outputs: Mapping[str, object], cluster: str) -> StackOutputs:
    """The outputs of cluster `cluster`'s stack; CommandError naming the first missing or garbled one."""
    try:
        return StackOutputs.model_validate(outputs)
    except ValidationError as e:
        error = e.errors()[0]
        name = ".".join(str(part) for part in error["loc"])
        shown = f"value {error['input']!r}: " if error["type"] != "missing" else ""
        raise CommandError(
            f"stack output {name} of cluster {cluster}: {shown}{error['msg']}; the stack was made by another "
            f"version of the Pulumi program than this checkout's. Run `fsdpctl up` again (it updates the "
            f"stack), or `fsdpctl down --cluster {cluster}` to clean up.") from None


@dataclass(frozen=True)
class StackState:
    """What a cluster's state gets from its stack outputs."""

    nodes: list[state_mod.Node]
    ssh: state_mod.SshSettings
    shared_dir: str | None
    outputs: StackOutputs

    def record(self, state: ClusterState) -> None:
        """Write these fields into the cluster's state (its expiry only where the program exports
        one: without it the state keeps what it had)."""
        expires_at = self.outputs.expires_at
        state.update(nodes=self.nodes, ssh=self.ssh, shared_dir=self.shared_dir,
                     stack_outputs=self.outputs.model_dump(mode="json"),
                     expiry_queue_url=self.outputs.expiry_queue_url,
                     **({"expires_at": expires_at} if expires_at else {}))


def state_from_outputs(spec: ClusterSpec, outputs: Mapping[str, object], *, key_file: Path,
                       known_hosts: Path) -> StackState:
    """The state a cluster gets from its stack outputs (plain values, as the Automation API gives
    them): CommandError naming an output that is missing or garbled, or nodes that are not the spec's."""
    parsed = _parse_outputs(outputs, spec.name)
    nodes = sorted(parsed.nodes, key=lambda n: n.rank)
    if [n.rank for n in nodes] != list(range(spec.node_count)):
        raise CommandError(
            f"the stack reports nodes with ranks {[n.rank for n in nodes]}, the spec wants "
            f"{spec.node_count} (0..{spec.node_count - 1}): the Pulumi program and this fsdpctl disagree. "
            f"Run `fsdpctl up` again, or `fsdpctl down --cluster {spec.name}` to clean up.")
    user = parsed.ssh_user or spec.access.ssh_user
    bastion = parsed.bastion_public_ip
    fsx = spec.storage.fsx
    return StackState(
        nodes=[state_mod.Node(rank=n.rank, name=n.name, address=n.private_ip, instance_id=n.instance_id)
               for n in nodes],
        ssh=state_mod.SshSettings(user=user, key_file=str(key_file), known_hosts=str(known_hosts),
                                  proxy_jump=f"{user}@{bastion}" if bastion else None),
        shared_dir=fsx.mount_point if fsx.enabled else None, outputs=parsed)


def _record_outputs(state: ClusterState, spec: ClusterSpec, up_result, key_file: Path) -> None:
    outputs = {name: output.value for name, output in up_result.outputs.items()}
    state_from_outputs(spec, outputs, key_file=key_file, known_hosts=state.known_hosts).record(state)


def _up_failed(spec: ClusterSpec, error: Exception, billing: str = "") -> CommandError:
    return CommandError(
        f"pulumi up failed for cluster {spec.name}:\n{_tail(error)}\n{billing}"
        f"What exists stays recorded in the stack. Fix the cause, then resume with `fsdpctl up SPEC.yaml` "
        f"(idempotent: Pulumi continues from what exists), or remove all of it with "
        f"`fsdpctl down --cluster {spec.name}`.")


def _stack_resources(stack) -> list[Registration]:
    """The custom resources the stack's state holds (what exists in AWS as far as Pulumi knows),
    as the offline plan's Registration records."""
    deployment = stack.export_stack().deployment or {}
    return [Registration(type=r["type"], name=r["urn"].rsplit("::", 1)[-1], inputs=r.get("inputs") or {},
                         custom=True, id=r.get("id"), urn=r["urn"])
            for r in deployment.get("resources") or [] if r.get("custom") and not r.get("delete")]


def billing_after_failure(stack, spec: ClusterSpec, expires_at: str | None) -> str:
    """What a failed `up` left billing (read from the stack's state) and whether an expiry schedule
    stops it, as lines for the error (which ends with `fsdpctl down`)."""
    from pulumi import automation as auto

    from fsdpctl.plan.cost import HOURLY_TYPES, split_by_expiry

    try:
        billed = split_by_expiry(_stack_resources(stack), HOURLY_TYPES)
    except auto.errors.CommandError as e:
        return (f"Could not read the stack to say what bills ({_tail(e, 2)}); whatever was created bills "
                "until its expiry schedule stops it or `fsdpctl down` removes it.\n")
    if not billed.stopped and not billed.still_billed:
        return "Nothing that bills by the hour was created.\n"
    lines = ["Billing now (created before the failure):"]
    if billed.stopped:
        stopped = ", ".join(billed.stopped)
        lines.append(f"  until the expiry at {expires_at} (their schedules exist): {stopped}")
    if billed.still_billed:
        why = "yet" if spec.expiry_hours is not None else "at all: expiry_hours is null"
        lines.append(f"  until `fsdpctl down` (no expiry schedule for them {why}): "
                     + ", ".join(billed.still_billed))
    return "\n".join([*lines, ""])


# ---- refresh -------------------------------------------------------------------------------------
def _short(urn: str) -> str:
    """`aws:ec2/instance:Instance demo-node0` from a URN."""
    parts = urn.split("::")
    return f"{parts[-2].split('$')[-1]} {parts[-1]}" if len(parts) >= 4 else urn


def refresh_findings(summary_changes: Mapping[str, int] | None, drifted: Mapping[str, str]) -> list[str]:
    """What `pulumi refresh` found, as lines: resources gone (terminated by the expiry schedule,
    deleted by hand) and resources changed outside Pulumi."""
    gone = sorted(urn for urn, op in drifted.items() if op == "delete")
    changed = sorted(urn for urn, op in drifted.items() if op != "delete")
    changes = dict(summary_changes or {})
    if not gone and not changed and not changes.get("delete") and not changes.get("update"):
        return ["pulumi refresh: the stack matches AWS (nothing changed outside Pulumi)"]
    lines = [f"pulumi refresh: {len(gone) or changes.get('delete', 0)} resource(s) gone from AWS, "
             f"{len(changed) or changes.get('update', 0)} changed outside Pulumi"]
    lines += [f"  gone:    {_short(urn)}" for urn in gone]
    lines += [f"  changed: {_short(urn)}" for urn in changed]
    if gone:
        lines.append("  `up` recreates what is gone (e.g. what the expiry schedule stopped)")
    return lines


def refresh(stack, spec: ClusterSpec, out: Out, *, what: str) -> list[str]:
    """`pulumi refresh` before an update: reads every resource back from AWS so the preview and the
    update start from what exists (the expiry schedule deletes billed resources behind Pulumi's
    back). Prints and returns what it found."""
    from pulumi import automation as auto
    from pulumi.automation import events

    drifted: dict[str, str] = {}

    def on_event(event) -> None:
        outputs = getattr(event, "res_outputs_event", None)
        if outputs is None:
            return
        meta = outputs.metadata
        op = str(getattr(meta.op, "value", meta.op))
        if meta.op == events.OpType.REFRESH and meta.new is None:
            op = "delete"
        elif meta.op == events.OpType.REFRESH and meta.diffs:
            op = "update"
        if op in ("update", "delete"):
            drifted[meta.urn] = op

    out(f"pulumi refresh: reading stack {spec.name} back from AWS ...")
    try:
        result = stack.refresh(on_output=_progress(out), on_event=on_event, color="never")
    except auto.errors.ConcurrentUpdateError as e:
        raise _locked(spec, e, what) from None
    except auto.errors.CommandError as e:
        raise CommandError(f"pulumi refresh failed for cluster {spec.name}:\n{_tail(e)}\n"
                           f"Nothing was changed. Fix the cause, then run `fsdpctl {what}` again.") from None
    lines = refresh_findings(result.summary.resource_changes, drifted)
    for line in lines:
        out(line)
    return lines


# ---- up ------------------------------------------------------------------------------------------
def _offline_cost(spec: ClusterSpec, expires_at: str | None, out: Out):
    """Print what a new stack will hold and cost (the offline plan); returns the CostEstimate."""
    from fsdpctl.plan import estimate_cost, load_prices, render_summary
    from infra.offline import run_offline

    plan = run_offline(spec, expires_at)
    cost = estimate_cost(plan, load_prices())
    out(render_summary(plan, cost))
    return cost


def up(state: ClusterState, spec: ClusterSpec, *, node_count: int, approve: Callable[[str], None],
       out: Out) -> None:
    """Create or update the stack; `approve(question)` is asked after the preview, before anything
    is created or changed."""
    del node_count  # the stack always has the spec's node_count (checked by lifecycle)
    command = pulumi_command()
    aws = AwsClients.for_spec(spec)
    out(f"pre-flight checks for {spec.name} in {spec.region} ...")
    report = preflight.run_preflight(spec, aws, out=out)
    if not report.ok:
        raise CommandError(f"pre-flight failed, nothing was created:\n{report.failure_text()}\n"
                           "Fix the spec or the account, then run `fsdpctl up SPEC.yaml` again.")
    key_file, deployed_spec = ssh_key(state, spec)

    from pulumi import automation as auto

    # Nothing is written before the yes: the stack is only read (and refreshed) until then, and the
    # preview reads the new config from a copy of the stack settings.
    stack = open_stack(deployed_spec, command, create=False)
    config = stack_config(stack, deployed_spec, out=out)
    cost = _offline_cost(deployed_spec, config.expires_at, out)
    expiry = f"; its billed resources expire at {config.expires_at}" if config.expires_at else ""
    if stack is None or stack.info() is None:
        question = f"Create cluster {spec.name} on AWS ({cost.headline()}{expiry})?"
    else:
        refresh(stack, spec, out, what="up")
        out(f"pulumi preview: what `up` changes in the existing stack {spec.name}")
        try:
            with proposed_settings(stack, config) as settings:
                stack.preview(diff=True, on_output=_progress(out), color="never", config_file=settings)
        except auto.errors.ConcurrentUpdateError as e:
            raise _locked(spec, e, "up") from None
        except auto.errors.CommandError as e:
            raise _up_failed(spec, e) from None
        question = f"Apply these changes to cluster {spec.name} ({cost.headline()}{expiry})?"
    approve(question)
    stack = stack or open_stack(deployed_spec, command, create=True)
    write_stack_config(stack, config)
    # From here on `down` must run `pulumi destroy` (before, there is nothing to destroy).
    state.update(pulumi_stack=spec.name, expires_at=config.expires_at, cost_per_hour=cost.per_hour,
                 cost_per_hour_max=cost.max_per_hour)
    out(f"pulumi up: stack {spec.name}" + (f", expiry at {config.expires_at}" if config.expires_at else ""))
    try:
        result = stack.up(on_output=_progress(out), color="never")
    except auto.errors.ConcurrentUpdateError as e:
        raise _locked(spec, e, "up") from None
    except auto.errors.CommandError as e:
        raise _up_failed(spec, e, billing_after_failure(stack, spec, config.expires_at)) from None
    _record_outputs(state, deployed_spec, result, key_file)
    out(f"pulumi up: {dict(result.summary.resource_changes or {})}")


# ---- extend --------------------------------------------------------------------------------------
def deployed_spec_of(stack, spec: ClusterSpec) -> ClusterSpec:
    """The spec in the stack config (what `pulumi up` runs the program with: the one last
    approved, with the generated public key); `spec` when the config has none."""
    from pulumi import automation as auto

    from infra.spec import PULUMI_CONFIG_KEY, parse_spec

    try:
        cluster = stack.get_config(PULUMI_CONFIG_KEY).value
    except auto.errors.CommandError:
        return spec
    return parse_spec(json.loads(cluster), source=f"stack config {PULUMI_CONFIG_KEY}")


def expiry_targets(spec: ClusterSpec, current: str | None, new: str) -> list[str]:
    """The URNs of what moving the expiry from `current` to `new` changes (the schedules, whatever
    carries the expires-at tag, the program's clock when no time was pinned): the program run
    offline for both times, compared resource by resource. `extend` updates these and nothing else."""
    from infra.offline import run_offline

    def inputs_by_urn(expires_at: str | None) -> dict[str, dict[str, Any]]:
        # As the engine writes URNs (resource.NewURN): without the root stack's type in front of
        # its direct children's, which Pulumi's mock monitor puts there.
        return {r.urn.replace("::pulumi:pulumi:Stack$", "::", 1): r.inputs
                for r in run_offline(spec, expires_at).mocks.resources}

    before, after = inputs_by_urn(current), inputs_by_urn(new)
    return sorted(urn for urn in before.keys() | after.keys() if before.get(urn) != after.get(urn))


def extend(state: ClusterState, spec: ClusterSpec, *, hours: int, approve: Callable[[str], None],
           out: Out, now: dt.datetime | None = None) -> str:
    """Move the expiry N hours later: the stack config's expiresAt, then a `pulumi up` targeted at
    what carries the expiry (the schedules and the expires-at tags; nothing is replaced, and
    nothing else in the stack config is applied). Refuses an expired cluster: its billed resources
    are gone, and `fsdpctl up` recreates them with a new expiry. Returns the new time."""
    from pulumi import automation as auto

    from fsdpctl.plan.cost import amount_text
    from infra.program import EXPIRES_AT_KEY

    if spec.expiry_hours is None:
        raise UsageError(f"cluster {spec.name} has expiry_hours: null, so nothing expires; set "
                         f"expiry_hours in {state.spec_path} and run `fsdpctl up` to give it an expiry")
    now = now or dt.datetime.now(dt.UTC)
    record = state.read()
    if record.expires_at and _utc(record.expires_at) <= now:
        raise UsageError(f"cluster {spec.name} expired at {record.expires_at}: {spec.stopped_at_expiry()} "
                         f"were stopped. Run `fsdpctl up {state.spec_path}` to "
                         "bring it back with a new expiry (then `fsdpctl extend` moves that one)")
    command = pulumi_command()
    stack = open_stack(spec, command, create=False)
    if stack is None:
        raise UsageError(f"no Pulumi stack {spec.name} in {backend_url()}; run `fsdpctl up` first "
                         "(or set PULUMI_BACKEND_URL to the backend it was created in)")
    try:
        current = stack.get_config(EXPIRES_AT_KEY).value
    except auto.errors.CommandError:
        current = record.expires_at
    new = extended_expiry(current, hours, now)
    approve(f"Move the expiry of cluster {spec.name} from {current or 'none'} to {new} "
            f"({amount_text(record.cost_per_hour, record.cost_per_hour_max, hours)} more)?")
    refresh(stack, spec, out, what=f"extend --hours {hours}")
    targets = expiry_targets(deployed_spec_of(stack, spec), current, new)
    stack.set_config(EXPIRES_AT_KEY, auto.ConfigValue(new))
    out(f"pulumi up: stack {spec.name}, expiry {current} -> {new} ({len(targets)} resources)")
    try:
        result = stack.up(target=targets, on_output=_progress(out), color="never")
    except auto.errors.ConcurrentUpdateError as e:
        if current:  # nothing moved: keep the config saying so
            stack.set_config(EXPIRES_AT_KEY, auto.ConfigValue(current))
        raise _locked(spec, e, f"extend --hours {hours}") from None
    except auto.errors.CommandError as e:
        raise _up_failed(spec, e) from None
    state.update(expires_at=new)
    if record.ssh is not None:
        _record_outputs(state, spec, result, Path(record.ssh.key_file))
    out(f"cluster {spec.name} now expires at {new}")
    return new


# ---- down ----------------------------------------------------------------------------------------
def destruction(state: ClusterState, spec: ClusterSpec) -> list[str]:
    """What `down` destroys, for its question."""
    record = state.read()
    nodes = ", ".join(f"{n.name} ({n.instance_id})" for n in record.nodes) or "none recorded"
    bucket = ("the checkpoint bucket is kept (checkpoint_bucket.keep_on_down)"
              if spec.checkpoint_bucket.keep_on_down else
              "the checkpoint bucket, emptied: its checkpoints are deleted")
    return [f"every resource of Pulumi stack {spec.name} in {spec.region}: the nodes {nodes}, the "
            "network, bastion, IAM roles and file systems",
            bucket,
            f"anything else tagged {sweep.CLUSTER_TAG}={spec.name} (with --force)"]


def _destroy(spec: ClusterSpec, command, out: Out, *, refresh: bool = False) -> str | None:
    """Run `pulumi destroy` and remove the stack; the error text, or None on success."""
    from pulumi import automation as auto

    stack = open_stack(spec, command, create=False)
    if stack is None:
        out(f"pulumi: no stack {spec.name}; nothing to destroy")
        return None
    out(f"pulumi destroy: stack {spec.name} ...")
    try:
        stack.destroy(on_output=_progress(out), color="never", refresh=refresh)
        stack.workspace.remove_stack(spec.name)
    except auto.errors.ConcurrentUpdateError as e:
        raise _locked(spec, e, "down") from None
    except auto.errors.CommandError as e:
        return _tail(e, 15)
    return None


def down(state: ClusterState, spec: ClusterSpec, *, force: bool = False, out: Out) -> None:
    """Destroy the stack, then sweep for tagged leftovers (deleting them with force). Raises
    CommandError saying what is left and what to run when anything is; safe to run again."""
    try:
        command, destroy_error = pulumi_command(), None
    except UsageError as e:
        command, destroy_error = None, str(e) if state.read().pulumi_stack else None
    aws = AwsClients.for_spec(spec)
    if command is not None:
        destroy_error = _destroy(spec, command, out)
    keep = frozenset({"s3-bucket"}) if spec.checkpoint_bucket.keep_on_down else frozenset()
    report = sweep.sweep(aws, spec.name, force=force, out=out, keep_kinds=keep)
    if destroy_error and command is not None and force and report.clean:
        # The sweep removed what blocked the destroy; refresh lets Pulumi drop what is gone.
        out("pulumi destroy failed before the sweep; trying again now that the leftovers are gone")
        destroy_error = _destroy(spec, command, out, refresh=True)
    if report.clean and not destroy_error:
        kept = "".join(f"; kept {item} (checkpoint_bucket.keep_on_down)" for item in report.kept)
        out(f"cluster {spec.name}: nothing left in {spec.region}{kept}")
        return
    problems = sweep.describe_report(report, spec.name)
    if destroy_error:
        problems = f"  - pulumi destroy did not finish:\n{destroy_error}\n{problems}"
    raise CommandError(f"cluster {spec.name} is not fully gone:\n{problems.rstrip()}\n"
                       f"The state in {state.root} is kept. Fix the above and run "
                       f"`fsdpctl down --cluster {spec.name}" + ("" if force else " --force") + "` again.")


# ---- health and replace --------------------------------------------------------------------------
@dataclass(frozen=True)
class DeadLetter:
    """One expiry call that failed after its retries, as EventBridge Scheduler puts it in the
    schedule's dead-letter queue: the failure in message attributes, the call's input as the body."""

    schedule: str
    error_code: str
    error_message: str

    @classmethod
    def from_message(cls, message: Mapping[str, Any]) -> DeadLetter:
        attributes = message.get("MessageAttributes") or {}

        def attribute(name: str) -> str:
            return (attributes.get(name) or {}).get("StringValue", "")

        # The schedule's name, or else the call's input (the body) says which call failed.
        schedule_arn = attribute("SCHEDULE_ARN")
        schedule = schedule_arn.rsplit("/", 1)[-1] if schedule_arn else message.get("Body", "")[:200]
        return cls(schedule=schedule, error_code=attribute("ERROR_CODE") or "unknown error",
                   error_message=attribute("ERROR_MESSAGE"))


def expiry_failures(aws: AwsClients, cluster: str, queue_url: str | None) -> list[str]:
    """The expiry calls that failed (the dead-letter queue's messages), as one line; [] when none.
    Reading leaves the messages in the queue, so every `status` reports them until someone acts."""
    if not queue_url:
        return []
    try:
        count = int(aws.sqs.get_queue_attributes(
            QueueUrl=queue_url, AttributeNames=["ApproximateNumberOfMessages"])["Attributes"][
            "ApproximateNumberOfMessages"])
        # VisibilityTimeout 0: the message stays visible, for the next `status` and the console.
        messages = aws.sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=1, VisibilityTimeout=0,
                                           MessageAttributeNames=["All"]).get("Messages", []) if count else []
    except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
        return [f"expiry: could not read the dead-letter queue {queue_url} ({error_text(e)}), so failed "
                "expiry calls would go unseen; allow sqs:GetQueueAttributes and sqs:ReceiveMessage on it"]
    if not messages:
        return []
    first = DeadLetter.from_message(messages[0])
    calls = "1 call" if count == 1 else f"{count} calls"
    return [f"expiry: {calls} failed (dead-letter queue {queue_url}): {first.schedule}: {first.error_code}: "
            f"{first.error_message}. What it was to stop may still bill: check it in the EC2/FSx console, "
            f"or run `fsdpctl down --cluster {cluster}`"]


POWER_SAVING_STATES = ("pending", "stopping", "stopped")
"""EC2 states of a node Slurm powers down or up."""


def health(state: ClusterState) -> list[str]:
    """Expiry calls that failed, nodes whose instance is not running, or that do not answer over
    SSH."""
    from fsdpctl.remote import run_all

    record = state.read()
    if not record.nodes or record.ssh is None:
        return ["the cluster never finished coming up"]
    spec = state.spec()
    aws = AwsClients.for_spec(spec)
    expiry = expiry_failures(aws, state.name, record.expiry_queue_url)
    nodes = record.active_nodes()
    # Slurm's power saving stops and starts these (docs/slurm.md): stopped is not a fault there.
    elastic = {n.rank for n in nodes if spec.power_saving and n.rank >= spec.static_node_count}
    ids = [n.instance_id for n in nodes if n.instance_id]
    states = {}
    try:
        reservations = aws.ec2.describe_instances(InstanceIds=ids).get("Reservations", [])
    except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
        raise CommandError(f"EC2 did not say how the nodes are ({error_text(e)})") from None
    for reservation in reservations:
        for instance in reservation["Instances"]:
            states[instance["InstanceId"]] = instance["State"]["Name"]
    problems = [f"{n.name}: instance {n.instance_id} is {states.get(n.instance_id, 'gone')}"
                for n in nodes if states.get(n.instance_id) != "running"
                and not (n.rank in elastic and states.get(n.instance_id) in POWER_SAVING_STATES)]
    if problems:
        return expiry + problems
    names = {n.rank: n.name for n in record.nodes}
    running = [n.rank for n in nodes if states.get(n.instance_id) == "running"]
    results = run_all(state, "true", ranks=running, timeout=30, check=False)
    return expiry + [f"{names[rank]}: ssh failed: {r.stderr.strip()[-200:]}" for rank, r in results.items()
                     if r.returncode]


def node_destruction(state: ClusterState, rank: int) -> str:
    node = next(n for n in state.read().nodes if n.rank == rank)
    return f"instance {node.instance_id} ({node.name}) and its local NVMe data are terminated"


def _forget_host(known_hosts: Path, address: str) -> None:
    if known_hosts.exists():
        subprocess.run(["ssh-keygen", "-R", address, "-f", str(known_hosts)], capture_output=True,
                       check=False)


def replace_node(state: ClusterState, spec: ClusterSpec, rank: int, *, out: Out) -> None:
    """Terminate the node of `rank` and let Pulumi create a new one with the same rank (a `pulumi up`
    targeted at that node and what names it); the new instance id and address are recorded."""
    from pulumi import automation as auto

    from infra.program import RETEMPLATE_KEY, node_urn

    record = state.read()
    node = next(n for n in record.nodes if n.rank == rank)
    command = pulumi_command()
    aws = AwsClients.for_spec(spec)
    stack = open_stack(spec, command, create=False)
    if stack is None:
        raise UsageError(f"no Pulumi stack {spec.name} in {backend_url()}; run `fsdpctl up` first "
                         "(or set PULUMI_BACKEND_URL to the backend it was created in)")
    # Refresh before anything is destroyed: a stack locked by another pulumi run stops here, with the
    # node still running, and the update below starts from what AWS holds.
    refresh(stack, spec, out, what=f"replace {rank}")
    urn = node_urn(spec.name, spec, rank)
    if urn in {resource.urn for resource in _stack_resources(stack)}:
        # Terminate first: with a reservation sized to the cluster, the replacement needs the slot the
        # old instance holds (Pulumi would otherwise create the new one before deleting the old).
        out(f"terminating {node.name} ({node.instance_id}) ...")
        leftover = sweep.Leftover("instance", node.instance_id or "", node.name)
        failures = sweep.terminate_and_wait(aws, [leftover], out)
        if failures:
            raise CommandError(f"could not terminate {node.instance_id}: {failures[0][1]}; "
                               f"run `fsdpctl replace {rank}` again")
        replace: list[str] | None = [urn]
        out(f"pulumi up --replace {node.name} (with the launch template's current version) ...")
    else:
        # EC2 took the instance back (a spot interruption) or it was terminated outside fsdpctl, and the
        # refresh dropped it from the stack. Pulumi refuses `--replace` of a resource its stack does not
        # hold ("one or more targets could not be found in the stack"); a targeted up creates it.
        replace = None
        out(f"{node.name} ({node.instance_id}) is already gone from AWS; pulumi up creates it again "
            "(with the launch template's current version) ...")
    started = time.monotonic()
    # The nodes ignore template changes (infra/components/compute.py); this one run lets the
    # replaced rank take the current template version, every other node keeps its own.
    stack.set_config(RETEMPLATE_KEY, auto.ConfigValue(json.dumps([rank])))
    try:
        # Only this node, and what takes its id (its expiry schedule): nothing else the stack
        # config may hold is applied by a replace.
        result = stack.up(target=[urn], target_dependents=True, replace=replace, on_output=_progress(out),
                          color="never")
    except auto.errors.ConcurrentUpdateError as e:
        raise _locked(spec, e, f"replace {rank}") from None
    except auto.errors.CommandError as e:
        raise _up_failed(spec, e) from None
    finally:
        stack.remove_config(RETEMPLATE_KEY)
    _record_outputs(state, spec, result, Path(record.ssh.key_file))
    _forget_host(state.known_hosts, node.address)
    new = next(n for n in state.read().nodes if n.rank == rank)
    out(f"{node.name}: {node.instance_id} -> {new.instance_id} ({new.address}) "
        f"in {time.monotonic() - started:.0f} s")
    wait_for_ssh(state, new, out)


NODE_BOOT_TIMEOUT_S = 900
"""How long a new instance may take from `running` to answering SSH: a p5 on the Deep Learning AMI
takes minutes (its EFA, NVMe and driver set-up run at boot)."""
NODE_BOOT_POLL_S = 15


def wait_for_ssh(state: ClusterState, node: state_mod.Node, out: Out, *,
                 timeout_s: float = NODE_BOOT_TIMEOUT_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait until a new node answers SSH. EC2 calls an instance running, and `pulumi up` returns, before
    its sshd listens; the configure that follows a replace would find it unreachable at once."""
    from fsdpctl import remote

    started = clock()
    while True:
        answer = remote.run(state, node.rank, "true", timeout=30, check=False)
        waited = clock() - started
        if answer.returncode == 0:
            out(f"{node.name} answers SSH ({waited:.0f} s after EC2 started it)")
            return
        if waited >= timeout_s:
            why = (answer.stderr.strip().splitlines() or ["no answer"])[-1]
            raise CommandError(
                f"{node.name} ({node.instance_id}, {node.address}) did not answer SSH within "
                f"{timeout_s:.0f} s of EC2 starting it ({why}). Its boot log: aws ec2 get-console-output "
                f"--instance-id {node.instance_id} --latest --output text. Once it answers, run `fsdpctl "
                f"configure --limit {node.name}` and `fsdpctl deploy`; if it never does, `fsdpctl replace "
                f"{node.rank}` again.")
        out(f"waiting for {node.name} to answer SSH ({waited:.0f} s) ...")
        sleep(NODE_BOOT_POLL_S)
