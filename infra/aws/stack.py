"""`fsdpctl up/down/replace` on AWS: the Pulumi Automation API over the repository's Pulumi program.

`up` checks for the pulumi CLI, runs the pre-flight checks (nothing is created when one fails),
provides an SSH key, sets the stack config (`aws:region`, `fsdp-cluster:cluster` = the spec,
`fsdp-cluster:expiresAt` pinned at first creation), runs `pulumi up` with its progress on stdout and
writes the nodes, SSH settings, shared dir and stack outputs into the cluster state. `down` runs
`pulumi destroy` and then the leftover sweep (infra/aws/sweep.py); the state is removed only when
nothing is left. `replace` terminates one node and lets Pulumi recreate it under the same rank.

Stack state lives in `$PULUMI_BACKEND_URL` when set (Pulumi Cloud, s3://...), else in a local file
backend under the fsdpctl home; the stack name is the cluster name.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from infra import state as state_mod
from infra.aws import preflight, sweep
from infra.aws.clients import AwsClients
from infra.cli import CommandError
from infra.spec import ClusterSpec
from infra.state import ClusterState

REPO_ROOT = Path(__file__).resolve().parents[2]
PULUMI_INSTALL = "curl -fsSL https://get.pulumi.com | sh"
PULUMI_DOCS = "https://www.pulumi.com/docs/iac/download-install/"
GENERATED_KEY_NAME = "id_ed25519"
# Where a user's own private key is looked for (access.key_name / access.public_key), in order.
SSH_KEY_ENV = "FSDPCTL_SSH_KEY"

Out = Callable[[str], None]


# ---- the pulumi CLI and the stack ----------------------------------------------------------------
def pulumi_command():
    """The pulumi CLI for the Automation API, or a CommandError that says how to install it."""
    found = shutil.which("pulumi")
    installer_default = Path.home() / ".pulumi" / "bin" / "pulumi"
    if not found and installer_default.exists():
        found = str(installer_default)
    if not found:
        raise CommandError(
            "the pulumi CLI is not installed (not on PATH, not in ~/.pulumi/bin): fsdpctl drives "
            f"`pulumi up/destroy` through it. Install it with `{PULUMI_INSTALL}` (see {PULUMI_DOCS}), "
            "open a new shell so ~/.pulumi/bin is on PATH, then run the same fsdpctl command again. "
            "Nothing was created.")
    from pulumi.automation import PulumiCommand

    return PulumiCommand(root=str(Path(found).resolve().parent.parent))


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


def _workspace_options(command):
    from pulumi import automation as auto

    if not (REPO_ROOT / "Pulumi.yaml").exists():
        raise CommandError(f"no Pulumi.yaml in {REPO_ROOT}: run fsdpctl from a checkout of the "
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


def configure_stack(stack, spec: ClusterSpec) -> str | None:
    """Set the stack config; returns the pinned expiry time (None when expiry is off)."""
    from pulumi import automation as auto

    from infra.program import EXPIRES_AT_KEY, expiry_time
    from infra.spec import PULUMI_CONFIG_KEY

    stack.set_config("aws:region", auto.ConfigValue(spec.region))
    # A JSON string: the program's Config.require_object parses it into the same object.
    stack.set_config(PULUMI_CONFIG_KEY, auto.ConfigValue(json.dumps(spec.model_dump(mode="json"))))
    try:
        pinned = stack.get_config(EXPIRES_AT_KEY).value
    except auto.errors.CommandError:
        pinned = None
    if spec.expiry_hours is None:
        return None
    if not pinned:
        # Pinned once: re-running `up` must not push the dead-man's switch further out each time.
        pinned = expiry_time(spec)
        stack.set_config(EXPIRES_AT_KEY, auto.ConfigValue(pinned))
    return pinned


def _progress(out: Out) -> Callable[[str], None]:
    return lambda line: out(line.rstrip("\n"))


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(str(text).strip().splitlines()[-lines:])


# ---- SSH key -------------------------------------------------------------------------------------
def ssh_key(state: ClusterState, spec: ClusterSpec) -> tuple[Path, ClusterSpec]:
    """The private key fsdpctl connects with, and the spec to deploy (with the public key to import
    when fsdpctl generated the pair). A user's own key (key_name / public_key) must be findable
    before anything is created."""
    access = spec.access
    if access.key_name or access.public_key:
        return _users_private_key(spec), spec
    key = state.keys_dir / GENERATED_KEY_NAME
    if not key.exists():
        if not shutil.which("ssh-keygen"):
            raise CommandError("ssh-keygen is missing (package openssh-client): it generates the cluster's "
                               "SSH key. Install it, or set access.key_name / access.public_key in the spec.")
        state.keys_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"fsdp-cluster-{spec.name}",
                        "-f", str(key)], check=True)
    public = key.with_suffix(".pub").read_text().strip()
    return key, spec.model_copy(update={"access": access.model_copy(update={"public_key": public})})


def _users_private_key(spec: ClusterSpec) -> Path:
    ssh_dir = Path.home() / ".ssh"
    if os.environ.get(SSH_KEY_ENV):
        candidates = [Path(os.environ[SSH_KEY_ENV]).expanduser()]
    elif spec.access.key_name:
        candidates = [ssh_dir / f"{spec.access.key_name}.pem", ssh_dir / spec.access.key_name]
    else:
        # The private key next to the .pub file whose content is the spec's public key.
        wanted = spec.access.public_key.split()[:2]
        candidates = [pub.with_suffix("") for pub in sorted(ssh_dir.glob("*.pub"))
                      if pub.read_text().split()[:2] == wanted]
    for path in candidates:
        if path.is_file():
            return path
    what = (f"key pair {spec.access.key_name!r}" if spec.access.key_name else "access.public_key")
    looked = ", ".join(map(str, candidates)) or f"{ssh_dir}/*.pub"
    raise CommandError(f"cannot find the private key for {what} (looked at {looked}); set {SSH_KEY_ENV}="
                       "/path/to/private-key and run the command again. Nothing was created.")


# ---- outputs -> state ----------------------------------------------------------------------------
def state_from_outputs(spec: ClusterSpec, outputs: Mapping[str, Any], *, key_file: Path,
                       known_hosts: Path) -> dict[str, Any]:
    """The state fields a cluster gets from its stack outputs (plain values)."""
    nodes = sorted(outputs.get("nodes") or [], key=lambda n: n["rank"])
    if [n["rank"] for n in nodes] != list(range(spec.node_count)):
        raise CommandError(
            f"the stack reports nodes with ranks {[n['rank'] for n in nodes]}, the spec wants "
            f"{spec.node_count} (0..{spec.node_count - 1}): the Pulumi program and this fsdpctl disagree. "
            f"Run `fsdpctl up` again, or `fsdpctl down --cluster {spec.name}` to clean up.")
    user = outputs.get("ssh_user") or spec.access.ssh_user
    bastion = outputs.get("bastion_public_ip")
    fsx = spec.storage.fsx
    return {
        "nodes": [{"rank": n["rank"], "name": n["name"], "address": n["private_ip"],
                   "instance_id": n["instance_id"]} for n in nodes],
        "ssh": {"user": user, "key_file": str(key_file), "known_hosts": str(known_hosts),
                "proxy_jump": f"{user}@{bastion}" if bastion else None},
        "shared_dir": fsx.mount_point if fsx.enabled else None,
        "stack_outputs": dict(outputs),
    }


def _plain_outputs(up_result) -> dict[str, Any]:
    return {name: output.value for name, output in up_result.outputs.items()}


def _record_outputs(state: ClusterState, spec: ClusterSpec, up_result, key_file: Path) -> dict[str, Any]:
    return state.update(**state_from_outputs(spec, _plain_outputs(up_result), key_file=key_file,
                                             known_hosts=state.root / "known_hosts"))


def _up_failed(spec: ClusterSpec, error: Exception) -> CommandError:
    return CommandError(
        f"pulumi up failed for cluster {spec.name}:\n{_tail(error)}\n"
        f"What exists stays recorded in the stack. Fix the cause, then resume with `fsdpctl up SPEC.yaml` "
        f"(idempotent: Pulumi continues from what exists), or clean up with "
        f"`fsdpctl down --cluster {spec.name}`.")


# ---- up ------------------------------------------------------------------------------------------
def up(state: ClusterState, spec: ClusterSpec, out: Out = print) -> dict[str, Any]:
    command = pulumi_command()
    aws = AwsClients.for_spec(spec)
    out(f"pre-flight checks for {spec.name} in {spec.region} ...")
    report = preflight.run_preflight(spec, aws, out=out)
    if not report.ok:
        raise CommandError(f"pre-flight failed, nothing was created:\n{report.failure_text()}\n"
                           "Fix the spec or the account, then run `fsdpctl up SPEC.yaml` again.")
    key_file, deployed_spec = ssh_key(state, spec)

    from pulumi import automation as auto

    stack = open_stack(deployed_spec, command, create=True)
    # From here on `down` must run `pulumi destroy` (before, there is nothing to destroy).
    state.update(pulumi_stack=spec.name)
    expires_at = configure_stack(stack, deployed_spec)
    out(f"pulumi up: stack {spec.name}" + (f", nodes expire at {expires_at}" if expires_at else ""))
    try:
        result = stack.up(on_output=_progress(out), color="never")
    except auto.errors.ConcurrentUpdateError as e:
        raise CommandError(f"another pulumi operation holds stack {spec.name} ({_tail(e, 3)}). Wait for it, "
                           f"or if it crashed run `pulumi cancel --stack {spec.name}`, then `fsdpctl up` "
                           "again.") from None
    except auto.errors.CommandError as e:
        raise _up_failed(spec, e) from None
    data = _record_outputs(state, deployed_spec, result, key_file)
    out(f"pulumi up: {dict(result.summary.resource_changes or {})}")
    return data


# ---- down ----------------------------------------------------------------------------------------
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
    except auto.errors.CommandError as e:
        return _tail(e, 15)
    return None


def down(state: ClusterState, spec: ClusterSpec, force: bool = False, out: Out = print) -> sweep.SweepReport:
    """Destroy the stack, then sweep for tagged leftovers (deleting them with force). Removes the
    state only when nothing is left; otherwise raises CommandError saying what is left and what to
    run. Safe to run again at any point."""
    try:
        command, destroy_error = pulumi_command(), None
    except CommandError as e:
        has_stack = bool(state.read().get("pulumi_stack"))
        command, destroy_error = None, str(e) if has_stack else None
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
        state.remove()
        kept = "".join(f"; kept {item} (checkpoint_bucket.keep_on_down)" for item in report.kept)
        out(f"cluster {spec.name}: nothing left in {spec.region}{kept}")
        return report
    problems = sweep.describe_report(report, spec.name)
    if destroy_error:
        problems = f"  - pulumi destroy did not finish:\n{destroy_error}\n{problems}"
    raise CommandError(f"cluster {spec.name} is not fully gone:\n{problems.rstrip()}\n"
                       f"The state in {state.root} is kept. Fix the above and run "
                       f"`fsdpctl down --cluster {spec.name}" + ("" if force else " --force") + "` again.")


# ---- replace -------------------------------------------------------------------------------------
def _forget_host(known_hosts: Path, address: str) -> None:
    if known_hosts.exists():
        subprocess.run(["ssh-keygen", "-R", address, "-f", str(known_hosts)], capture_output=True,
                       check=False)


def cmd_replace(args: argparse.Namespace) -> int:
    state = state_mod.resolve(args.cluster)
    data = state.read()
    if data.get("target") != "aws":
        raise CommandError(f"fsdpctl replace works on aws clusters; {state.name} is on the "
                           f"{data.get('target')} target (use `fsdpctl down` and `fsdpctl up` there)")
    nodes = {n["rank"]: n for n in data.get("nodes", [])}
    if args.rank not in nodes:
        raise CommandError(f"cluster {state.name} has no node with rank {args.rank} "
                           f"(ranks: {', '.join(map(str, sorted(nodes))) or 'none'}); see `fsdpctl status`")
    spec, node = state.spec(), nodes[args.rank]
    command = pulumi_command()
    aws = AwsClients.for_spec(spec)
    from pulumi import automation as auto

    from infra.program import node_urn

    stack = open_stack(spec, command, create=False)
    if stack is None:
        backend = os.environ.get("PULUMI_BACKEND_URL") or pulumi_env()["PULUMI_BACKEND_URL"]
        raise CommandError(f"no Pulumi stack {spec.name} in {backend}; run `fsdpctl up` first "
                           "(or set PULUMI_BACKEND_URL to the backend it was created in)")
    # Terminate first: with a reservation sized to the cluster, the replacement needs the slot the
    # old instance holds (Pulumi would otherwise create the new one before deleting the old).
    print(f"terminating {node['name']} ({node['instance_id']}) ...")
    leftover = sweep.Leftover("instance", node["instance_id"], node["name"])
    failures = sweep.terminate_and_wait(aws, [leftover], print)
    if failures:
        raise CommandError(f"could not terminate {node['instance_id']}: {failures[0][1]}; "
                           f"run `fsdpctl replace {args.rank}` again")
    print(f"pulumi up --replace {node['name']} ...")
    started = time.monotonic()
    try:
        result = stack.up(replace=[node_urn(spec.name, spec, args.rank)], on_output=_progress(print),
                          color="never")
    except auto.errors.CommandError as e:
        raise _up_failed(spec, e) from None
    key_file = Path(data["ssh"]["key_file"])
    new = _record_outputs(state, spec, result, key_file)
    _forget_host(state.root / "known_hosts", node["address"])
    new_node = next(n for n in new["nodes"] if n["rank"] == args.rank)
    print(f"{node['name']}: {node['instance_id']} -> {new_node['instance_id']} ({new_node['address']}) "
          f"in {time.monotonic() - started:.0f} s")

    from infra.configure import run_configure
    from infra.deploy import DeployError, deploy
    from infra.inventory import write_inventory

    # The blacklist entry was about the old instance; the new one must be in the inventory to be
    # configured and deployed.
    state.update(excluded=[e for e in new.get("excluded", []) if e["rank"] != args.rank])
    write_inventory(state)
    configured = run_configure(state, limit=node["name"])
    if not configured.ok:
        failures = "\n".join(f"  - {f.host}: {f.task}: {f.message}" for f in configured.failures)
        raise CommandError(f"the new {node['name']} failed configuration ({configured.status}, logs in "
                           f"{configured.run_dir}):\n{failures}\nFix it, then run `fsdpctl configure --limit "
                           f"{node['name']}` and `fsdpctl deploy`.")
    try:
        deploy(state, ranks=[args.rank])
    except DeployError as e:
        raise CommandError(f"deploying the trainer to the new {node['name']} failed: {e}. Fix it, then run "
                           "`fsdpctl deploy`.") from None
    print(f"{node['name']} replaced, configured and deployed; rank {args.rank} is back in the cluster")
    return 0
