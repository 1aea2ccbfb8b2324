"""What a plan costs per hour: the dated price table (infra/data/prices.yaml, or a `--prices` file
merged over it) applied to the recorded resource graph."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from fsdpctl.errors import UsageError
from infra.catalog import CATALOG, offerings
from infra.offline import OfflinePlan, Registration
from infra.spec import yaml_error_text


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


OVERRIDE_KEY = "override_file"
"""Set in a price table that a --prices file was merged into (the built-in table's age is then moot)."""


def load_prices(override: Path | None = None) -> dict[str, Any]:
    """The built-in dated price table (infra/data/prices.yaml), with an optional override file
    merged over it key by key."""
    table = yaml.safe_load(resources.files("infra").joinpath("data/prices.yaml").read_text())
    if override is None:
        return table
    try:
        extra = yaml.safe_load(Path(override).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read the price table {override} ({e}); fix the path or drop --prices") \
            from None
    except yaml.YAMLError as e:
        raise UsageError(f"price table {override} is not valid YAML ({yaml_error_text(e)}); fix it or drop "
                         "--prices") from None
    if not isinstance(extra, dict):
        raise UsageError(f"price table {override} must be a YAML mapping shaped like infra/data/prices.yaml")
    merged = _deep_merge(table, extra)
    merged[OVERRIDE_KEY] = str(override)
    if "source" not in extra:
        merged["source"] = f"{table.get('source', 'built-in table')}, with {override} merged over it"
    return merged


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
    overridden: bool = False
    """Prices came (partly) from a --prices file."""

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


def _market_of(template: Registration, own_reservations: set[str] = frozenset()) -> str:
    market = (template.inputs.get("instanceMarketOptions") or {}).get("marketType")
    if market:
        return market
    target = (template.inputs.get("capacityReservationSpecification") or {}).get("capacityReservationTarget")
    if target and target.get("capacityReservationId") not in own_reservations:
        return "capacity-reservation"
    return "on-demand"


def estimate_cost(plan: OfflinePlan, prices: dict[str, Any]) -> CostEstimate:
    """Hourly cost of what the plan would create, read off the resource graph (not the spec), so
    the estimate prices exactly what `pulumi up` would build."""
    mocks, region = plan.mocks, plan.spec.region
    regions = prices.get("regions") or {}
    fallback = prices.get("fallback_region")
    table = regions.get(region)
    borrowed = ""
    if table is None and fallback in regions:
        # Regions the offerings table covers but the service price list does not: the GPU price is
        # the region's own (offerings), NAT/IPv4/EBS/FSx are the fallback region's rates.
        table, borrowed = regions[fallback], f"{fallback} rate; {region} may differ"
    table = table or {}
    hours_per_month = float(prices.get("hours_per_month", 730))
    region_offerings = {itype: hourly for itype, by_region in offerings().prices.items()
                        for r, hourly in by_region.items() if r == region and hourly is not None}
    small = {}  # the bastion's type at the fallback region's rate
    if borrowed:
        small = {itype: hourly for itype, hourly in (table.get("instance_hour") or {}).items()
                 if itype not in CATALOG}
    instance_hour = {**small, **region_offerings, **(regions.get(region) or {}).get("instance_hour", {})}
    missing = f"not in the price table for {region}; pass --prices FILE"
    lines: list[CostLine] = []

    def price(value: Any) -> float | None:
        if value is None:
            return None
        try:
            return float(value)
        except (TypeError, ValueError):
            raise UsageError(f"price table: {value!r} is not a number; fix the --prices file") from None

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
                (borrowed if itype in small else "") if itype in instance_hour else missing,
            )
        )
        ebs_gib += float((instance.inputs.get("rootBlockDevice") or {}).get("volumeSize") or 0)
    own = {r.id for r in mocks.of_type("aws:ec2/capacityReservation:CapacityReservation")}
    for template_id, count in nodes_by_template.items():
        template = mocks.by_id[template_id]
        itype, market = template.inputs.get("instanceType"), _market_of(template, own)
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
                "plus per-GB data processing" + (f" ({borrowed})" if borrowed else ""),
            )
        )
    public_ips = len(mocks.of_type("aws:ec2/eip:Eip")) + sum(
        1 for i in mocks.of_type("aws:ec2/instance:Instance") if i.inputs.get("associatePublicIpAddress")
    )
    if public_ips:
        lines.append(
            CostLine("public IPv4 address", public_ips, "address-hour", price(table.get("public_ipv4_hour")),
                     borrowed)
        )
    if ebs_gib:
        gp3 = table.get("ebs_gp3_gib_month")
        lines.append(
            CostLine(
                "EBS gp3 root volumes",
                ebs_gib,
                "GiB-hour",
                None if gp3 is None else price(gp3) / hours_per_month,
                borrowed if gp3 is not None else missing,
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
                borrowed if tier is not None else missing,
            )
        )
    return CostEstimate(
        lines=lines,
        as_of=str(prices.get("as_of", "unknown")),
        source=str(prices.get("source", "unknown")),
        currency=str(prices.get("currency", "USD")),
        overridden=OVERRIDE_KEY in prices,
    )



# What bills by the hour (or by the GiB-month) while it exists.
BILLED_TYPES = {
    "aws:ec2/instance:Instance": "instance",
    "aws:ec2/natGateway:NatGateway": "NAT gateway",
    "aws:ec2/capacityReservation:CapacityReservation": "capacity reservation",
    "aws:ec2/eip:Eip": "Elastic IP (public IPv4)",
    "aws:fsx/lustreFileSystem:LustreFileSystem": "FSx for Lustre file system",
    "aws:s3/bucket:Bucket": "S3 bucket (storage)",
}


@dataclass
class AfterExpiry:
    """What the expiry schedules stop, and what keeps billing after them (read off the graph:
    a billed resource is stopped when a schedule's target input names its id)."""

    stopped: list[str]
    still_billed: list[str]


def after_expiry(plan: OfflinePlan) -> AfterExpiry | None:
    """None when the cluster has no expiry (everything keeps billing)."""
    schedules = plan.mocks.of_type("aws:scheduler/schedule:Schedule")
    if not schedules:
        return None
    targeted = " ".join(str((s.inputs.get("target") or {}).get("input", "")) for s in schedules)
    stopped, still = [], []
    for record in plan.mocks.resources:
        kind = BILLED_TYPES.get(record.type)
        if kind is None:
            continue
        ids = [record.id, *(v for k, v in _computed_ids(record))]
        label = f"{kind} {record.name}"
        (stopped if any(i and i in targeted for i in ids) else still).append(label)
    return AfterExpiry(stopped=stopped, still_billed=still)


def _computed_ids(record: Registration) -> list[tuple[str, str]]:
    """Other identifiers a schedule may name a resource by (an Elastic IP's allocation id)."""
    if record.type == "aws:ec2/eip:Eip":
        return [("allocation_id", f"<{record.name}.allocation_id>")]
    return []
