"""`fsdpctl plan SPEC.yaml`: what `pulumi up` would create, and what it would cost, offline.

The offline planner runs the real Pulumi program (`infra.program.build_cluster`) under Pulumi's own
mock engine (`pulumi.runtime.set_mocks`): no pulumi CLI, no AWS credentials, no network. The
`RecordingMocks` below stand in for the engine and the AWS provider: they record every resource
registration and lookup, and answer values only AWS knows (ids, ARNs, IPs, the AMI an SSM parameter
points to) with readable placeholders such as `<demo-vpc.id>`. The tests use the same planner to
assert on the resource graph.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from infra.spec import RANK_TAG, ClusterSpec, load_spec, parse_spec

STALE_PRICES_DAYS = 180


# ---- recording mocks --------------------------------------------------------------------------
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

    @property
    def tags(self) -> dict[str, str]:
        return self.inputs.get("tags") or {}


@dataclass
class Lookup:
    token: str
    args: dict[str, Any]


def placeholder(resource_name: str, attribute: str) -> str:
    return f"<{resource_name}.{attribute}>"


def _computed_state(typ: str, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """Attributes AWS assigns at creation, as placeholders."""
    state: dict[str, Any] = {
        "arn": placeholder(name, "arn"),
        "name": inputs.get("name") or placeholder(name, "name"),
    }
    if typ == "aws:ec2/instance:Instance":
        state["privateIp"] = placeholder(name, "private_ip")
        state["publicIp"] = placeholder(name, "public_ip") if inputs.get("associatePublicIpAddress") else None
    elif typ == "aws:ec2/eip:Eip":
        state["allocationId"] = placeholder(name, "allocation_id")
        state["publicIp"] = placeholder(name, "public_ip")
    elif typ == "aws:fsx/lustreFileSystem:LustreFileSystem":
        state["dnsName"] = placeholder(name, "dns_name")
        state["mountName"] = placeholder(name, "mount_name")
    elif typ == "aws:s3/bucket:Bucket":
        state["bucket"] = inputs.get("bucket") or f"{inputs.get('bucketPrefix', '')}<unique suffix>"
    return state


class RecordingMocks:
    """Pulumi mocks that record the resource graph; the offline planner's engine."""

    def __init__(self) -> None:
        self.registrations: list[Registration] = []
        self.lookups: list[Lookup] = []
        self.by_id: dict[str, Registration] = {}

    # The pulumi.runtime.Mocks interface, duck-typed so this module imports pulumi only when planning.
    def new_resource(self, args: Any) -> tuple[str | None, dict[str, Any]]:
        custom = bool(args.custom)
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
) -> OfflinePlan:
    """Run the Pulumi program under the recording mocks; return the graph and the resolved stack
    outputs. Given a raw mapping instead of a ClusterSpec, the program validates it itself, exactly
    as `pulumi up` does with the stack config (SpecError before anything is registered). Each call
    gets a fresh event loop and fresh mock settings."""
    import pulumi
    from pulumi.runtime.mocks import MockMonitor

    # pulumi_aws is slow to import: only when planning.
    from infra.program import build_cluster, build_from_config

    mocks = mocks or RecordingMocks()
    monitor = MockMonitor(mocks)
    outputs: dict[str, Any] = {}
    if isinstance(spec, ClusterSpec):
        stack, build = spec.name, lambda: build_cluster(spec, expires_at)
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
    parsed = spec if isinstance(spec, ClusterSpec) else parse_spec(spec)
    return OfflinePlan(spec=parsed, expires_at=expires_at, mocks=mocks, outputs=outputs)


# ---- prices and cost --------------------------------------------------------------------------
def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_prices(override: Path | None = None) -> dict[str, Any]:
    """The built-in dated price table (infra/data/prices.yaml), with an optional override file
    merged over it key by key."""
    from infra.cli import CommandError

    table = yaml.safe_load(resources.files("infra").joinpath("data/prices.yaml").read_text())
    if override is None:
        return table
    try:
        extra = yaml.safe_load(Path(override).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise CommandError(
            f"cannot read the price table {override}: {e}. Fix the file or drop --prices."
        ) from None
    if not isinstance(extra, dict):
        raise CommandError(
            f"price table {override} must be a YAML mapping shaped like infra/data/prices.yaml"
        )
    return _deep_merge(table, extra)


@dataclass
class CostLine:
    item: str
    quantity: float
    unit: str
    unit_price: float | None  # None: no fixed price (spot, Capacity Block) or not in the table
    note: str = ""

    @property
    def per_hour(self) -> float | None:
        return None if self.unit_price is None else self.quantity * self.unit_price


@dataclass
class CostEstimate:
    lines: list[CostLine]
    as_of: str
    source: str
    currency: str

    @property
    def per_hour(self) -> float:
        return sum(line.per_hour or 0.0 for line in self.lines)

    @property
    def per_day(self) -> float:
        return self.per_hour * 24

    @property
    def complete(self) -> bool:
        return all(line.unit_price is not None for line in self.lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "currency": self.currency,
            "prices_as_of": self.as_of,
            "prices_source": self.source,
            "per_hour": round(self.per_hour, 4),
            "per_day": round(self.per_day, 2),
            "complete": self.complete,
            "lines": [
                {
                    "item": c.item,
                    "quantity": c.quantity,
                    "unit": c.unit,
                    "unit_price": c.unit_price,
                    "per_hour": None if c.per_hour is None else round(c.per_hour, 4),
                    "note": c.note,
                }
                for c in self.lines
            ],
        }


def _market_of(template: Registration) -> str:
    market = (template.inputs.get("instanceMarketOptions") or {}).get("marketType")
    if market:
        return market
    reservation = template.inputs.get("capacityReservationSpecification") or {}
    return "capacity-reservation" if reservation.get("capacityReservationTarget") else "on-demand"


def estimate_cost(plan: OfflinePlan, prices: dict[str, Any]) -> CostEstimate:
    """Hourly cost of what the plan would create, read off the resource graph (not the spec), so
    the estimate prices exactly what `pulumi up` would build."""
    mocks, region = plan.mocks, plan.spec.region
    table = (prices.get("regions") or {}).get(region) or {}
    hours_per_month = float(prices.get("hours_per_month", 730))
    instance_hour = table.get("instance_hour") or {}
    missing = f"not in the price table for {region}; pass --prices FILE"
    lines: list[CostLine] = []

    def price(value: Any) -> float | None:
        if value is None:
            return None
        try:
            return float(value)
        except (TypeError, ValueError):
            from infra.cli import CommandError

            raise CommandError(f"price table: {value!r} is not a number; fix the --prices file") from None

    ebs_gib = 0.0
    nodes_by_template = Counter()
    for instance in mocks.of_type("aws:ec2/instance:Instance"):
        template_ref = (instance.inputs.get("launchTemplate") or {}).get("id")
        if template_ref:
            nodes_by_template[template_ref] += 1
            continue
        itype = instance.inputs.get("instanceType")
        lines.append(
            CostLine(
                f"{itype} ({instance.name})",
                1,
                "instance-hour",
                price(instance_hour.get(itype)),
                "" if itype in instance_hour else missing,
            )
        )
        ebs_gib += float((instance.inputs.get("rootBlockDevice") or {}).get("volumeSize") or 0)
    for template_id, count in nodes_by_template.items():
        template = mocks.by_id[template_id]
        itype, market = template.inputs.get("instanceType"), _market_of(template)
        for mapping in template.inputs.get("blockDeviceMappings") or []:
            ebs_gib += count * float((mapping.get("ebs") or {}).get("volumeSize") or 0)
        if market == "spot":
            lines.append(
                CostLine(
                    f"{itype} spot",
                    count,
                    "instance-hour",
                    None,
                    "varies: the spot price of the hour (see the EC2 spot price history)",
                )
            )
        elif market == "capacity-block":
            lines.append(
                CostLine(
                    f"{itype} capacity block",
                    count,
                    "instance-hour",
                    None,
                    "prepaid with the Capacity Block offering; not billed per hour here",
                )
            )
        else:
            note = "" if itype in instance_hour else missing
            if market == "capacity-reservation":
                note = note or "reservations bill at the on-demand rate while active, used or not"
            lines.append(
                CostLine(f"{itype} {market}", count, "instance-hour", price(instance_hour.get(itype)), note)
            )
    nat_count = len(mocks.of_type("aws:ec2/natGateway:NatGateway"))
    if nat_count:
        lines.append(
            CostLine(
                "NAT gateway",
                nat_count,
                "gateway-hour",
                price(table.get("nat_gateway_hour")),
                "plus per-GB data processing",
            )
        )
    public_ips = len(mocks.of_type("aws:ec2/eip:Eip")) + sum(
        1 for i in mocks.of_type("aws:ec2/instance:Instance") if i.inputs.get("associatePublicIpAddress")
    )
    if public_ips:
        lines.append(
            CostLine("public IPv4 address", public_ips, "address-hour", price(table.get("public_ipv4_hour")))
        )
    if ebs_gib:
        gp3 = table.get("ebs_gp3_gib_month")
        lines.append(
            CostLine(
                "EBS gp3 root volumes",
                ebs_gib,
                "GiB-hour",
                None if gp3 is None else price(gp3) / hours_per_month,
                "" if gp3 is not None else missing,
            )
        )
    for lustre in mocks.of_type("aws:fsx/lustreFileSystem:LustreFileSystem"):
        dtype = lustre.inputs.get("deploymentType")
        tiers = (table.get("fsx_lustre_gib_month") or {}).get(dtype) or {}
        tput = lustre.inputs.get("perUnitStorageThroughput")
        tier = tiers.get(int(tput)) if tput is not None else tiers.get("default")
        gib = float(lustre.inputs.get("storageCapacity") or 0)
        lines.append(
            CostLine(
                f"FSx for Lustre {dtype}" + (f" {int(tput)} MB/s/TiB" if tput else ""),
                gib,
                "GiB-hour",
                None if tier is None else price(tier) / hours_per_month,
                "" if tier is not None else missing,
            )
        )
    return CostEstimate(
        lines=lines,
        as_of=str(prices.get("as_of", "unknown")),
        source=str(prices.get("source", "unknown")),
        currency=str(prices.get("currency", "USD")),
    )


# ---- rendering --------------------------------------------------------------------------------
def _natural(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _rule(rule: dict[str, Any]) -> str:
    proto = (
        "all" if rule.get("protocol") == "-1" else f"{rule.get('protocol')}/{int(rule.get('fromPort', 0))}"
    )
    peers = list(rule.get("cidrBlocks") or []) + list(rule.get("securityGroups") or [])
    if rule.get("self"):
        peers.append("itself")
    return f"{proto} {'+'.join(peers)}"


def _launch_template_summary(inputs: dict[str, Any]) -> str:
    nics = inputs.get("networkInterfaces") or []
    efa = sum(1 for n in nics if n.get("interfaceType") in ("efa", "efa-only"))
    meta = inputs.get("metadataOptions") or {}
    disks = [
        f"{int(m['ebs']['volumeSize'])} GiB {m['ebs']['volumeType']}"
        + (" encrypted" if m["ebs"].get("encrypted") == "true" else " UNENCRYPTED")
        for m in inputs.get("blockDeviceMappings") or []
        if m.get("ebs")
    ]
    parts = [
        inputs.get("instanceType", "?"),
        f"{efa} EFA on {len({n.get('networkCardIndex') for n in nics})} network cards",
        f"IMDSv2 {meta.get('httpTokens')} (hop limit {int(meta.get('httpPutResponseHopLimit', 0))})",
        "root " + ", ".join(disks),
    ]
    if (inputs.get("placement") or {}).get("groupName"):
        parts.append(f"placement group {inputs['placement']['groupName']}")
    market = (inputs.get("instanceMarketOptions") or {}).get("marketType")
    if market:
        parts.append(f"market {market}")
    target = (inputs.get("capacityReservationSpecification") or {}).get("capacityReservationTarget")
    if target:
        parts.append(f"reservation {target.get('capacityReservationId')}")
    return "; ".join(parts)


SUMMARY_KEYS = {
    "pulumi:providers:aws": ["region"],
    "aws:ec2/vpc:Vpc": ["cidrBlock"],
    "aws:ec2/subnet:Subnet": ["cidrBlock", "availabilityZone"],
    "aws:ec2/vpcEndpoint:VpcEndpoint": ["serviceName", "vpcEndpointType"],
    "aws:ec2/placementGroup:PlacementGroup": ["strategy"],
    "aws:ec2/keyPair:KeyPair": ["keyName"],
    "aws:s3/bucket:Bucket": ["bucket", "bucketPrefix"],
    "aws:fsx/lustreFileSystem:LustreFileSystem": [
        "deploymentType",
        "storageCapacity",
        "perUnitStorageThroughput",
    ],
    "aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation": ["dataRepositoryPath", "fileSystemPath"],
    "aws:iam/rolePolicyAttachment:RolePolicyAttachment": ["policyArn"],
    "aws:scheduler/scheduleGroup:ScheduleGroup": ["name"],
    "aws:scheduler/schedule:Schedule": ["scheduleExpression", "scheduleExpressionTimezone"],
}


def describe(record: Registration) -> str:
    """One line of key properties for a resource."""
    inputs = record.inputs
    if record.type == "aws:ec2/launchTemplate:LaunchTemplate":
        return _launch_template_summary(inputs)
    if record.type == "aws:ec2/securityGroup:SecurityGroup":
        ingress = ", ".join(_rule(r) for r in inputs.get("ingress") or [])
        egress = ", ".join(_rule(r) for r in inputs.get("egress") or [])
        return f"in: {ingress or 'nothing'} | out: {egress or 'nothing'}"
    if record.type == "aws:ec2/instance:Instance":
        rank = record.tags.get(RANK_TAG)
        if rank is not None:
            return f"rank {rank}, from the launch template"
        tokens = (inputs.get("metadataOptions") or {}).get("httpTokens")
        return f"{inputs.get('instanceType')} with a public IP, IMDSv2 {tokens}"
    if record.type == "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration":
        rule = (inputs.get("rules") or [{}])[0]
        days = int(rule.get("expiration", {}).get("days", 0))
        return f"objects and noncurrent versions expire after {days} days"
    if record.type == "aws:scheduler/schedule:Schedule":
        target = inputs.get("target") or {}
        return (
            f"{inputs.get('scheduleExpression')} {inputs.get('scheduleExpressionTimezone')} -> "
            f"{target.get('arn')} {target.get('input')}"
        )
    shown = [
        f"{_snake(k)}={_format_value(inputs[k])}" for k in SUMMARY_KEYS.get(record.type, []) if k in inputs
    ]
    return ", ".join(shown)


def _format_value(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _money(value: float | None, currency: str) -> str:
    if value is None:
        return "varies"
    return f"{value:,.2f} {currency}" if value >= 1 else f"{value:.4g} {currency}"


def render_text(plan: OfflinePlan, cost: CostEstimate, today: date | None = None) -> str:
    spec, mocks = plan.spec, plan.mocks
    out = [
        f"Plan for cluster {spec.name}: {spec.node_count} x {spec.instance_type} "
        f"({spec.capacity.type.value}) in {spec.availability_zone}",
        f"Resources `pulumi up` would create: {len(mocks.resources)} (<name.attr> = known after creation)",
    ]
    # Components in the order the program builds them; the explicit provider first.
    groups: dict[str | None, list[Registration]] = {None: []}
    groups.update({r.type: [] for r in mocks.registrations if not r.custom})
    for record in mocks.resources:
        groups[record.component].append(record)
    for component, records in groups.items():
        # Registration is asynchronous: keep each type where it first appeared, and order
        # resources of one type by name (demo-node2 before demo-node10), so the output is stable.
        first_seen = {r.type: i for i, r in reversed(list(enumerate(records)))}
        records.sort(key=lambda r: (first_seen[r.type], _natural(r.name)))
        if not records:
            continue
        out.append(f"\n  {component.rsplit(':', 1)[-1] if component else 'Provider'}")
        for record in records:
            out.append(
                f"    {record.type.rsplit(':', 1)[-1]:<40} {record.name:<28} {describe(record)}".rstrip()
            )
    counts = sorted(mocks.counts().items())
    out.append("\n  Resource counts: " + ", ".join(f"{t.rsplit(':', 1)[-1]} {n}" for t, n in counts))
    lookups = sorted(
        {f"{lk.args.get('name')}" for lk in mocks.lookups if lk.token == "aws:ssm/getParameter:getParameter"}
    )
    if lookups:
        out.append("  Looked up at `pulumi up`: SSM parameters " + ", ".join(lookups))
    warnings = spec.warnings()
    out.append("\nWarnings:" if warnings else "\nWarnings: none")
    out += [f"  - {w}" for w in warnings]
    out.append(f"\nEstimated cost (prices as of {cost.as_of}; {cost.source}):")
    for line in cost.lines:
        unit = "" if line.unit_price is None else f" at {_money(line.unit_price, cost.currency)}/{line.unit}"
        qty = _format_value(float(line.quantity))
        out.append(
            f"  {line.item:<44} x{qty:<6} {_money(line.per_hour, cost.currency) + '/h':>18}{unit}"
            + (f"  ({line.note})" if line.note else "")
        )
    partial = "" if cost.complete else " plus the items marked varies"
    out.append(
        f"  Total: {_money(cost.per_hour, cost.currency)} per hour, {_money(cost.per_day, cost.currency)} "
        f"per day{partial} (excludes data transfer and S3 storage/requests)"
    )
    age = (
        ((today or datetime.now(UTC).date()) - date.fromisoformat(cost.as_of)).days
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", cost.as_of)
        else None
    )
    if age is not None and age > STALE_PRICES_DAYS:
        out.append(f"  Note: the price table is {age} days old; check current prices or pass --prices FILE.")
    if plan.expires_at:
        out.append(
            f"\nThe nodes terminate themselves at {plan.expires_at} (expiry_hours {spec.expiry_hours}, "
            "counted from `fsdpctl up`)."
        )
    return "\n".join(out)


def render_json(plan: OfflinePlan, cost: CostEstimate) -> str:
    return json.dumps(
        {
            "cluster": plan.spec.name,
            "expires_at": plan.expires_at,
            "resources": [
                {"type": r.type, "name": r.name, "component": r.component, "inputs": r.inputs}
                for r in plan.mocks.resources
            ],
            "counts": plan.mocks.counts(),
            "lookups": [{"token": lk.token, "args": lk.args} for lk in plan.mocks.lookups],
            "outputs": plan.outputs,
            "warnings": plan.spec.warnings(),
            "cost": cost.to_dict(),
        },
        indent=2,
        default=str,
    )


def _require_pulumi() -> None:
    from infra.cli import CommandError

    try:
        import pulumi  # noqa: F401
        import pulumi_aws  # noqa: F401
    except ImportError as e:
        raise CommandError(
            f"fsdpctl plan runs the Pulumi program offline and needs the Python packages pulumi and "
            f"pulumi-aws ({e}). Install them with: pip install -e '.[aws]' (or `make plan`)."
        ) from None


def cmd_plan(args: Any) -> int:
    from infra.program import expiry_time

    # Validation first: a bad spec raises SpecError (exit 2, every problem listed) before the
    # program registers anything.
    spec = load_spec(args.spec)
    prices = load_prices(args.prices)
    _require_pulumi()
    if not args.json:
        print(
            f"Running the Pulumi program for {args.spec} offline (Pulumi mocks; no AWS calls)...",
            file=sys.stderr,
            flush=True,
        )
    plan = run_offline(spec, expiry_time(spec))
    cost = estimate_cost(plan, prices)
    print(render_json(plan, cost) if args.json else render_text(plan, cost))
    return 0
