"""The Pulumi program: one cluster spec in, the cluster's AWS resources and stack outputs out.

`build_cluster(spec, expires_at)` assembles the components (infra/components/) in dependency order
and returns the stack outputs (the contract the operator tool reads after `pulumi up`). `run_stack()`
is what `pulumi up` runs (infra/__main__.py): it reads the stack config `fsdp-cluster:cluster` (the
spec as an object) and `fsdp-cluster:expiresAt` (ISO 8601 UTC, pinned by `fsdpctl up`
and moved by `fsdpctl extend`; when absent, a pulumiverse-time Rotating resource records the creation
time and rotates expiry_hours later, so plain `pulumi up` with only the cluster set works too). The same
`build_cluster` runs under Pulumi's mocks for `fsdpctl plan` (infra/offline.py) and the tests.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pulumi
import pulumi_aws as aws

from infra.components.compute import Compute
from infra.components.context import ClusterContext
from infra.components.expiry import BilledResources, Expiry
from infra.components.identity import Identity
from infra.components.network import Network
from infra.components.security import Security
from infra.components.storage import Storage
from infra.spec import PULUMI_CONFIG_KEY, ClusterSpec, Problem, SpecError, parse_spec

PROJECT = "fsdp-cluster"
EXPIRES_AT_KEY = f"{PROJECT}:expiresAt"
# Ranks whose node takes the launch template's current version in this run (set by
# `fsdpctl replace RANK` for its one `pulumi up --replace`; absent otherwise).
RETEMPLATE_KEY = f"{PROJECT}:retemplate"
OUTPUT_NAMES = (
    "nodes", "bastion_public_ip", "ssh_user", "checkpoint_bucket", "fsx_dns_name", "fsx_mount_name",
    "placement_group", "security_group_id", "vpc_id", "private_subnet_id", "ami_id", "key_name",
    "expires_at", "expiry_queue_url",
)


def parse_expires_at(value: str | None, spec: ClusterSpec) -> str | None:
    """The expiry time the stack config pins (ISO 8601 UTC, '...Z'), or None: expiry disabled, or
    not pinned (the program's clock resource decides then). A bad value raises SpecError before
    anything is registered."""
    if spec.expiry_hours is None or not value:
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        when = None
    if when is None or when.tzinfo is None or when.utcoffset().total_seconds() != 0:
        raise SpecError([Problem(
            EXPIRES_AT_KEY, value, "is not an ISO 8601 UTC time",
            "use the form 2026-12-03T13:00:00Z, or remove the key to expire expiry_hours after "
            "creation")], "stack config")
    return when.astimezone(UTC).replace(tzinfo=None).isoformat() + "Z"


def expiry_clock(spec: ClusterSpec) -> pulumi.Output[str]:
    """The expiry time of a stack whose config pins none (plain `pulumi up` with only
    fsdp-cluster:cluster set): a pulumiverse-time Rotating (terraform's time_rotating), which records
    its creation time in the stack state and rotates expiry_hours later. Updates before then keep the
    same time; once it has passed, the next refresh (`pulumi up --refresh`) drops the clock from the
    state, so that update creates it again and the schedules get a new time (now + expiry_hours), as
    `fsdpctl up` does for an expired cluster. `pulumi config set fsdp-cluster:expiresAt ...`
    overrides it."""
    import pulumiverse_time

    clock = pulumiverse_time.Rotating(f"{spec.name}-expiry-clock", rotation_hours=spec.expiry_hours)
    return clock.rotation_rfc3339


def expiry_time(spec: ClusterSpec, now: datetime | None = None) -> str | None:
    """The expiry time a new cluster gets: now + expiry_hours, as ISO 8601 UTC ('...Z')."""
    if spec.expiry_hours is None:
        return None
    start = (now or datetime.now(UTC)).astimezone(UTC).replace(microsecond=0)
    return (start + timedelta(hours=spec.expiry_hours)).isoformat().replace("+00:00", "Z")


def build_cluster(spec: ClusterSpec, expires_at: str | None, *,
                  retemplate: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Register every resource of the cluster and return the stack outputs (Outputs and plain
    values), keyed as OUTPUT_NAMES."""
    pinned = parse_expires_at(expires_at, spec)
    provider = aws.Provider(f"{spec.name}-aws", region=spec.region)
    expires: pulumi.Input[str] | None = None
    if spec.expiry_hours is not None:
        expires = pinned or expiry_clock(spec)
    partition = aws.get_partition(opts=pulumi.InvokeOptions(provider=provider))
    ctx = ClusterContext(spec=spec, expires_at=expires, provider=provider,
                         partition=partition.partition, reverse_dns_prefix=partition.reverse_dns_prefix)
    opts = pulumi.ResourceOptions(providers=[provider])

    network = Network(ctx, opts=opts)
    security = Security(ctx, network.vpc_id, opts=opts)
    storage = Storage(ctx, network.private_subnet_id, security.node_security_group_id, opts=opts)
    identity = Identity(ctx, storage.bucket_arn, opts=opts)
    # Before Compute: the expiry of the NAT gateway and the file system must exist before any GPU
    # capacity is bought (Compute adds the bastion's, the reservation's and each node's).
    expiry = None if expires is None else Expiry(ctx, expires, BilledResources(
        nat_gateway_id=network.nat_gateway_id, nat_allocation_id=network.nat_allocation_id,
        file_system_id=storage.fsx_id), opts=opts)
    compute = Compute(
        ctx, private_subnet_id=network.private_subnet_id, public_subnet_id=network.public_subnet_id,
        node_security_group_id=security.node_security_group_id,
        bastion_security_group_id=security.bastion_security_group_id,
        instance_profile_arn=identity.instance_profile_arn, key_name=identity.key_name,
        controller_instance_profile=identity.controller_instance_profile_name,
        expiry=expiry, retemplate=retemplate, opts=opts)

    nodes = pulumi.Output.all(*[pulumi.Output.all(n.id, n.private_ip) for n in compute.nodes]).apply(
        lambda pairs: [
            {"rank": rank, "name": spec.node_name(rank), "instance_id": instance_id,
             "private_ip": private_ip, "efa_count": compute.efa_count}
            for rank, (instance_id, private_ip) in enumerate(pairs)
        ])
    return {
        "nodes": nodes,
        "bastion_public_ip": compute.bastion_public_ip,
        "ssh_user": spec.access.ssh_user,
        "checkpoint_bucket": storage.bucket_name,
        "fsx_dns_name": storage.fsx_dns_name,
        "fsx_mount_name": storage.fsx_mount_name,
        "placement_group": compute.placement_group_name,
        "security_group_id": security.node_security_group_id,
        "vpc_id": network.vpc_id,
        "private_subnet_id": network.private_subnet_id,
        "ami_id": compute.ami_id,
        "key_name": identity.key_name,
        "expires_at": expires,
        "expiry_queue_url": None if expiry is None else expiry.queue_url,
    }


def node_urn(stack: str, spec: ClusterSpec, rank: int) -> str:
    """The URN of a node's instance, for `pulumi up --replace` (fsdpctl replace RANK)."""
    return (f"urn:pulumi:{stack}::{PROJECT}::fsdp-cluster:index:Compute$aws:ec2/instance:Instance::"
            f"{spec.node_name(rank)}")


def build_from_config(cluster: Any, expires_at: str | None, retemplate: Any = None) -> dict[str, Any]:
    """Validate the stack config object into a spec, then build the cluster. Every problem is
    raised as one SpecError before the first resource is registered."""
    spec = parse_spec(cluster, source=f"stack config {PULUMI_CONFIG_KEY}")
    ranks = retemplate or []
    if not isinstance(ranks, list) or not all(isinstance(r, int) and 0 <= r < spec.node_count
                                              for r in ranks):
        raise SpecError([Problem(RETEMPLATE_KEY, retemplate, "is not a list of node ranks",
                                 f"use ranks 0..{spec.node_count - 1}, e.g. [0], or remove the key")],
                        "stack config")
    return build_cluster(spec, expires_at, retemplate=frozenset(ranks))


def run_stack() -> None:
    """The body of infra/__main__.py: config -> spec -> resources -> stack outputs."""
    config = pulumi.Config(PROJECT)
    try:
        outputs = build_from_config(config.require_object("cluster"), config.get("expiresAt"),
                                    config.get_object("retemplate"))
    except SpecError as e:
        # A clean error listing every problem, instead of a Python traceback.
        raise pulumi.RunError(str(e)) from None
    for name in OUTPUT_NAMES:
        pulumi.export(name, outputs[name])
