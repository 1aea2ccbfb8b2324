"""The Pulumi program run offline: no pulumi CLI, no AWS credentials, no network.

`run_offline(spec, expires_at)` runs the real program (`infra.program.build_cluster`) under Pulumi's own
mock engine (`pulumi.runtime.set_mocks`). The `RecordingMocks` below stand in for the engine and the
AWS provider: they record every resource registration and lookup, and answer values only AWS knows
(ids, ARNs, IPs, the AMI an SSM parameter points to) with readable placeholders such as
`<demo-vpc.id>`. `fsdpctl plan` prices and prints the recorded graph; the tests assert on it.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from infra.spec import ClusterSpec, parse_spec


@dataclass
class Registration:
    """One resource the program registered: its Pulumi type, logical name and inputs (engine
    camelCase names, as the provider would receive them)."""

    type: str
    name: str
    inputs: dict[str, Any]
    custom: bool
    id: str | None
    urn: str | None = None
    component: str | None = None  # the enclosing ComponentResource type, from the URN
    # Resource options the engine would apply (from the registration request).
    ignore_changes: list[str] = field(default_factory=list)
    retain_on_delete: bool = False
    # URNs of the resources it waits for (inputs it takes from them, and depends_on): the engine
    # starts creating it only once they exist.
    dependencies: list[str] = field(default_factory=list)

    @property
    def tags(self) -> dict[str, str]:
        return self.inputs.get("tags") or {}


@dataclass
class Lookup:
    token: str
    args: dict[str, Any]


def placeholder(resource_name: str, attribute: str) -> str:
    return f"<{resource_name}.{attribute}>"


def region_partition(region: str) -> tuple[str, str]:
    """What aws.get_partition answers for a region: (partition, reverse DNS prefix)."""
    if region.startswith("cn-"):
        return "aws-cn", "cn.com.amazonaws"
    if region.startswith("us-gov-"):
        return "aws-us-gov", "com.amazonaws"
    if region.startswith("us-isob-"):
        return "aws-iso-b", "gov.sgov.sc2s"
    if region.startswith("us-iso-"):
        return "aws-iso", "gov.ic.c2s"
    return "aws", "com.amazonaws"


def _computed_state(typ: str, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """Attributes AWS assigns at creation, as placeholders."""
    state: dict[str, Any] = {
        "arn": placeholder(name, "arn"),
        "name": inputs.get("name") or placeholder(name, "name"),
    }
    if typ == "aws:ec2/launchTemplate:LaunchTemplate":
        state["latestVersion"] = 1
        state["defaultVersion"] = 1
    elif typ == "aws:ec2/instance:Instance":
        state["privateIp"] = placeholder(name, "private_ip")
        state["publicIp"] = placeholder(name, "public_ip") if inputs.get("associatePublicIpAddress") else None
    elif typ == "aws:ec2/eip:Eip":
        state["allocationId"] = placeholder(name, "allocation_id")
        state["publicIp"] = placeholder(name, "public_ip")
    elif typ == "aws:fsx/lustreFileSystem:LustreFileSystem":
        state["dnsName"] = placeholder(name, "dns_name")
        state["mountName"] = placeholder(name, "mount_name")
    elif typ == "time:index/rotating:Rotating":
        # pulumiverse-time: the creation time (now, when not given) and the rotation time after it.
        from datetime import UTC, datetime, timedelta

        base = inputs.get("rfc3339") or datetime.now(UTC).replace(microsecond=0).isoformat()
        when = datetime.fromisoformat(base.replace("Z", "+00:00")) + timedelta(
            hours=float(inputs.get("rotationHours") or 0), minutes=float(inputs.get("rotationMinutes") or 0))
        state["rfc3339"] = base.replace("+00:00", "Z")
        state["rotationRfc3339"] = when.astimezone(UTC).replace(tzinfo=None).isoformat() + "Z"
    elif typ == "aws:s3/bucket:Bucket":
        state["bucket"] = inputs.get("bucket") or f"{inputs.get('bucketPrefix', '')}<unique suffix>"
    elif typ == "aws:sqs/queue:Queue":
        state["url"] = placeholder(name, "url")
    return state


class RecordingMocks:
    """Pulumi mocks that record the resource graph; the offline planner's engine."""

    def __init__(self) -> None:
        self.registrations: list[Registration] = []
        self.lookups: list[Lookup] = []
        self.by_id: dict[str, Registration] = {}
        self.region = "us-east-1"  # the explicit provider's, once registered

    # The pulumi.runtime.Mocks interface, duck-typed so this module imports pulumi only when planning.
    def new_resource(self, args: Any) -> tuple[str | None, dict[str, Any]]:
        custom = bool(args.custom)
        if args.typ == "pulumi:providers:aws" and args.inputs.get("region"):
            self.region = args.inputs["region"]
        resource_id = placeholder(args.name, "id") if custom else None
        record = Registration(
            type=args.typ, name=args.name, inputs=dict(args.inputs), custom=custom, id=resource_id
        )
        self.registrations.append(record)
        if resource_id:
            self.by_id[resource_id] = record
        if not custom:
            return resource_id, {}
        return resource_id, {**args.inputs, **_computed_state(args.typ, args.name, args.inputs)}

    def call(self, args: Any) -> dict[str, Any]:
        self.lookups.append(Lookup(token=args.token, args=dict(args.args)))
        if args.token == "aws:ssm/getParameter:getParameter":
            return {
                "name": args.args["name"],
                "type": "String",
                "value": f"<AMI from SSM {args.args['name']}>",
            }
        if args.token == "aws:index/getPartition:getPartition":
            partition, prefix = region_partition(self.region)
            return {"id": partition, "partition": partition, "reverseDnsPrefix": prefix,
                    "dnsSuffix": "amazonaws.com.cn" if partition == "aws-cn" else "amazonaws.com"}
        if args.token == "aws:index/getCallerIdentity:getCallerIdentity":
            return {"accountId": "<account id>", "arn": "<caller arn>", "id": "<account id>",
                    "userId": "<user id>"}
        if args.token == "aws:ec2/getAmi:getAmi":
            return {"rootDeviceName": "<root device of the AMI>"}
        return {}

    def register_transform(self, transform: Any) -> None:
        """Transforms are not used by the program."""

    def register_invoke_transform(self, transform: Any) -> None:
        """Invoke transforms are not used by the program."""

    # ---- queries over the recorded graph ----------------------------------------------------
    @property
    def resources(self) -> list[Registration]:
        """Custom resources (what AWS would hold), without the component wrappers."""
        return [r for r in self.registrations if r.custom]

    def of_type(self, typ: str) -> list[Registration]:
        return [r for r in self.resources if r.type == typ]

    def one(self, typ: str) -> Registration:
        found = self.of_type(typ)
        if len(found) != 1:
            raise LookupError(f"expected exactly one {typ}, found {len(found)}")
        return found[0]

    def named(self, name: str, typ: str | None = None) -> Registration:
        found = [r for r in self.resources if r.name == name and (typ is None or r.type == typ)]
        if len(found) != 1:
            raise LookupError(f"expected exactly one resource named {name!r}, found {len(found)}")
        return found[0]

    def counts(self) -> dict[str, int]:
        return dict(Counter(r.type for r in self.resources))


@dataclass
class OfflinePlan:
    spec: ClusterSpec
    expires_at: str | None
    mocks: RecordingMocks
    outputs: dict[str, Any] = field(default_factory=dict)


def _component_of(urn: str) -> str | None:
    """The enclosing component's type from a URN (urn:pulumi:stack::project::Parent$Type::name)."""
    chain = [t for t in urn.split("::")[2].split("$") if t != "pulumi:pulumi:Stack"]
    return chain[-2] if len(chain) > 1 else None


def run_offline(
    spec: ClusterSpec | Mapping[str, Any],
    expires_at: str | None,
    *,
    mocks: RecordingMocks | None = None,
    project: str = "fsdp-cluster",
    retemplate: frozenset[int] = frozenset(),
) -> OfflinePlan:
    """Run the Pulumi program under the recording mocks; return the graph and the resolved stack
    outputs. Given a raw mapping instead of a ClusterSpec, the program validates it itself, exactly
    as `pulumi up` does with the stack config (SpecError before anything is registered). Each call
    gets a fresh event loop and fresh mock settings."""
    import pulumi
    from pulumi.runtime.mocks import MockMonitor

    # pulumi_aws is slow to import: only when planning.
    from infra.program import build_cluster, build_from_config

    class RecordingMonitor(MockMonitor):
        """Pulumi's mock monitor, also keeping the options of each registration (ignoreChanges,
        retainOnDelete) and its dependencies, which the Mocks interface does not see."""

        options: dict[tuple[str, str], tuple[list[str], bool, list[str]]] = {}

        def RegisterResource(self, request):  # the gRPC method name
            self.options[(request.type, request.name)] = (list(request.ignoreChanges),
                                                          bool(request.retainOnDelete),
                                                          sorted(request.dependencies))
            return super().RegisterResource(request)

    mocks = mocks or RecordingMocks()
    monitor = RecordingMonitor(mocks)
    monitor.options = {}
    outputs: dict[str, Any] = {}
    if isinstance(spec, ClusterSpec):
        stack, build = spec.name, lambda: build_cluster(spec, expires_at, retemplate=retemplate)
    else:
        stack, build = str(spec.get("name") or "stack"), lambda: build_from_config(spec, expires_at)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        # preview=False: in preview every value the mock did not return is unknown and `apply`
        # callbacks (policies, schedule input, outputs) would silently not run.
        pulumi.runtime.set_mocks(mocks, project=project, stack=stack, preview=False, monitor=monitor)
        pulumi.runtime.test(lambda: pulumi.Output.from_input(build()).apply(outputs.update))()
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    urns = {(urn.split("::")[2].split("$")[-1], urn.rsplit("::", 1)[1]): urn
            for urn in monitor.get_registered_resources()}
    for record in mocks.registrations:
        record.urn = urns.get((record.type, record.name))
        record.component = _component_of(record.urn) if record.urn else None
        record.ignore_changes, record.retain_on_delete, record.dependencies = monitor.options.get(
            (record.type, record.name), ([], False, []))
    parsed = spec if isinstance(spec, ClusterSpec) else parse_spec(spec)
    return OfflinePlan(spec=parsed, expires_at=expires_at, mocks=mocks, outputs=outputs)

