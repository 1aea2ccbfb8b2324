"""A plan as text (grouped by component, with its cost) or as JSON."""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
from datetime import UTC, date, datetime
from typing import Any

from fsdpctl.plan.cost import CostEstimate, CostLine, after_expiry, if_up_fails, quantity_text
from infra.offline import OfflinePlan, Registration
from infra.spec import RANK_TAG

STALE_PRICES_DAYS = 180
WIDTH = 100
"""Every line of the text plan fits this many columns."""


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
            profile = inputs.get("iamInstanceProfile")
            own_profile = f", instance profile {profile}" if profile else ""
            return f"rank {rank}, from the launch template{own_profile}"
        tokens = (inputs.get("metadataOptions") or {}).get("httpTokens")
        return f"{inputs.get('instanceType')} with a public IP, IMDSv2 {tokens}"
    if record.type == "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration":
        from infra.components.storage import longest_kept_days

        rule = (inputs.get("rules") or [{}])[0]
        current = int(rule.get("expiration", {}).get("days", 0))
        noncurrent = int(rule.get("noncurrentVersionExpiration", {}).get("noncurrentDays", 0))
        return (f"every byte deleted within {longest_kept_days(current, noncurrent)} days ({current} "
                f"current + {noncurrent} noncurrent, each rounded up to midnight UTC by S3), expired "
                "delete markers removed")
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


def _wrapped(text: str, indent: int) -> list[str]:
    """`text` as lines of at most WIDTH columns, continuation lines indented by `indent`."""
    return textwrap.wrap(text, WIDTH, subsequent_indent=" " * indent, break_on_hyphens=False,
                         break_long_words=False) or [""]


def _line_per_hour(line: CostLine, currency: str) -> str:
    if line.per_hour is None and line.max_per_hour is not None:
        return f"<= {_money(line.max_per_hour, currency)}/h"
    return _money(line.per_hour, currency) + "/h"


def _total(cost: CostEstimate) -> str:
    """The total line: exact, a cap (spot), or unknown, never the priced items passed off as all."""
    excluded = "excludes data transfer and S3 storage/requests"
    if cost.per_hour is not None:
        return (f"Total: {_money(cost.per_hour, cost.currency)} per hour, "
                f"{_money(cost.per_day, cost.currency)} per day ({excluded})")
    unpriced = ", ".join(f"{quantity_text(line)} {line.item}" for line in cost.unpriced)
    known = f"the priced items alone are {_money(cost.known_per_hour, cost.currency)} per hour"
    if cost.max_per_hour is not None:
        return (f"Total: at most {_money(cost.max_per_hour, cost.currency)} per hour, "
                f"{_money(cost.max_per_hour * 24, cost.currency)} per day ({unpriced} at the bound "
                f"above; {known}; {excluded})")
    return f"Total: unknown ({unpriced}: no price, see above; {known}; {excluded})"


def _cost_lines(cost: CostEstimate) -> list[str]:
    out = []
    for line in cost.lines:
        unit = "" if line.unit_price is None else f" at {_money(line.unit_price, cost.currency)}/{line.unit}"
        out.append(f"  {line.item:<34} {quantity_text(line):>9} {_line_per_hour(line, cost.currency):>16}"
                   f"{unit}")
        if line.note:
            out += _wrapped(f"      ({line.note})", 7)
    out += _wrapped(f"  {_total(cost)}", 4)
    out += _elastic_lines(cost)
    return out


def _elastic_lines(cost: CostEstimate) -> list[str]:
    """The range a cluster that stops idle nodes costs in: "1-4 nodes: 22.11-87.99 USD/h (...)"."""
    elastic = cost.elastic
    if elastic is None:
        return []
    low, high = elastic.at_min_per_hour, elastic.at_max_per_hour
    amount = ("unknown (a line above has no price)" if low is None or high is None
              else f"{low:,.2f}-{high:,.2f} {cost.currency}/h")
    why = f"nodes from rank {elastic.min_nodes} stop after {elastic.suspend_after_s} s idle"
    if elastic.note:
        why += f"; {elastic.note}"
    return _wrapped(f"  {elastic.min_nodes}-{elastic.max_nodes} nodes: {amount} ({why})", 4)


def render_text(plan: OfflinePlan, cost: CostEstimate, today: date | None = None) -> str:
    """The whole plan, every line at most WIDTH columns."""
    spec, mocks = plan.spec, plan.mocks
    out = [
        f"Plan for cluster {spec.name}: {spec.node_count} x {spec.instance_type} "
        f"({spec.capacity.type.value}) in {spec.availability_zone}",
        f"Resources `pulumi up` would create: {len(mocks.resources)} (<name.attr>: known after creation)",
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
            out.append(f"    {record.type.rsplit(':', 1)[-1]:<36} {record.name}")
            summary = describe(record)
            if summary:
                out += _wrapped(f"        {summary}", 10)
    counts = sorted(mocks.counts().items())
    out += ["", *_wrapped("  Resource counts: " + ", ".join(f"{t.rsplit(':', 1)[-1]} {n}" for t, n in counts),
                          4)]
    lookups = sorted(
        {f"{lk.args.get('name')}" for lk in mocks.lookups if lk.token == "aws:ssm/getParameter:getParameter"}
    )
    if lookups:
        out += _wrapped("  Looked up at `pulumi up`: SSM parameters " + ", ".join(lookups), 4)
    warnings = spec.warnings()
    out.append("\nWarnings:" if warnings else "\nWarnings: none")
    for warning in warnings:
        out += _wrapped(f"  - {warning}", 4)
    out.append("")
    out += _wrapped(f"Estimated cost (prices as of {cost.as_of}; {cost.source}):", 2)
    out += _cost_lines(cost)
    age = (
        ((today or datetime.now(UTC).date()) - date.fromisoformat(cost.as_of)).days
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", cost.as_of)
        else None
    )
    if not cost.overridden and age is not None and age > STALE_PRICES_DAYS:
        out += _wrapped(f"  Note: the price table is {age} days old; check current prices or pass "
                        "--prices FILE.", 4)
    out.append("")
    out += _after_expiry_lines(plan)
    out += _if_up_fails_lines(plan)
    return "\n".join(out)


def _after_expiry_lines(plan: OfflinePlan) -> list[str]:
    spec, after = plan.spec, after_expiry(plan)
    if after is None:
        return _wrapped("No expiry (expiry_hours: null): everything above keeps billing until "
                        "`fsdpctl down`.", 0)
    out = _wrapped(f"At {plan.expires_at or 'creation + expiry_hours'} (expiry_hours {spec.expiry_hours}, "
                   "counted from `fsdpctl up`; `fsdpctl extend --hours N` moves it) the expiry "
                   "schedules stop on AWS's side:", 0)
    out += _wrapped("  " + ", ".join(after.stopped), 4)
    days = spec.checkpoint_bucket.retention_days
    still = ", ".join(after.still_billed) or "nothing"
    out += _wrapped(f"What keeps billing after expiry: {still} (the checkpoint bucket's lifecycle "
                    f"deletes every byte within {days} days). Everything else left is free (VPC, "
                    "subnets, security groups, roles, launch template, schedules, dead-letter queue); "
                    "`fsdpctl up` brings the cluster back, `fsdpctl down` removes the rest.", 0)
    return out


def _if_up_fails_lines(plan: OfflinePlan) -> list[str]:
    failed = if_up_fails(plan)
    if not failed.until_expiry and not failed.until_down:
        return []
    out = ["", *_wrapped("If `up` fails half-way (InsufficientInstanceCapacity when it buys the GPU "
                         "capacity is the usual failure), what it created keeps billing; `fsdpctl down` "
                         "removes it all:", 0)]
    if failed.until_expiry:
        out += _wrapped(f"  bill until the expiry at {plan.expires_at or 'creation + expiry_hours'} stops "
                        f"them: {', '.join(failed.until_expiry)} (their schedules exist before the capacity "
                        "is bought)", 4)
    out += _wrapped(f"  bill until `fsdpctl down`: {', '.join(failed.until_down) or 'nothing'}", 4)
    return out


def render_summary(plan: OfflinePlan, cost: CostEstimate) -> str:
    """A few lines for `fsdpctl up`'s question: what a new stack holds and what it costs."""
    counts = sorted(plan.mocks.counts().items())
    out = _wrapped(f"{len(plan.mocks.resources)} resources to create: "
                   + ", ".join(f"{t.rsplit(':', 1)[-1]} {n}" for t, n in counts), 2)
    out.append(f"Estimated cost (prices as of {cost.as_of}):")
    return "\n".join(out + _cost_lines(cost))


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
            "after_expiry": None if (after := after_expiry(plan)) is None else {
                "stopped": after.stopped, "still_billed": after.still_billed},
            "if_up_fails": dataclasses.asdict(if_up_fails(plan)),
        },
        indent=2,
        default=str,
    )

