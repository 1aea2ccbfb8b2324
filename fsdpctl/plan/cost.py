"""What a plan costs per hour: the dated price table (infra/data/prices.yaml, or a `--prices` file
merged over it) applied to the recorded resource graph."""

from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from fsdpctl.errors import UsageError
from infra.catalog import CATALOG, offerings
from infra.catalog import regions as catalog_regions
from infra.offline import OfflinePlan, RecordingMocks, Registration
from infra.spec import RANK_TAG, parse_yaml, yaml_error_text
from infra.spec.load import deep_merge
from infra.spec.problems import problems_from_validation

Price = Annotated[float, Field(ge=0)]
"""A price in the table's currency: 0 or more (a negative one would make a total of nothing)."""


class _Prices(BaseModel):
    # Every key of a price table is one the estimate reads: a misspelt one would be ignored silently.
    model_config = ConfigDict(extra="forbid", frozen=True)


def _instance_type(name: str) -> str:
    """An instance type a price is given for: a near miss of a catalog type is a typo (its price would
    be ignored); other names are the bastion's and the like."""
    near = difflib.get_close_matches(name, list(CATALOG), n=1, cutoff=0.85)
    if name not in CATALOG and near:
        raise ValueError(f"is not an instance type of the catalog; did you mean {near[0]}?")
    return name


class RegionPrices(_Prices):
    """One region's prices (infra/data/prices.yaml, `regions.<region>`)."""

    instance_hour: dict[Annotated[str, AfterValidator(_instance_type)], Price] = {}
    nat_gateway_hour: Price | None = None
    public_ipv4_hour: Price | None = None
    ebs_gp3_gib_month: Price | None = None
    fsx_lustre_gib_month: dict[str, dict[int | Literal["default"], Price]] = {}
    """Per deployment type, per throughput tier (MB/s per TiB; `default` for a type with one tier)."""


def _region(name: str) -> str:
    known = catalog_regions()
    if not known.zones(name):
        near = known.nearest(name)
        raise ValueError("is not an AWS region (infra/data/regions.yaml); "
                         + (f"did you mean {' or '.join(near)}?" if near else "use e.g. us-east-1"))
    return name


class PriceTable(_Prices):
    """The price table (infra/data/prices.yaml), with a --prices file merged over it."""

    as_of: str = "unknown"
    source: str = "unknown"
    currency: str = "USD"
    hours_per_month: float = Field(default=730, gt=0)
    fallback_region: str | None = None
    """Where NAT gateway, public IPv4, EBS and FSx prices come from for a region the table lacks."""
    regions: dict[Annotated[str, AfterValidator(_region)], RegionPrices] = {}
    _override_file: str | None = PrivateAttr(default=None)
    """The --prices file merged into the built-in table (the built-in table's age is then moot)."""

    @property
    def override_file(self) -> str | None:
        return self._override_file


def load_prices(override: Path | None = None) -> PriceTable:
    """The built-in dated price table (infra/data/prices.yaml), with an optional override file
    merged over it key by key. A key the table does not have, or a negative price, is refused."""
    table = yaml.safe_load(resources.files("infra").joinpath("data/prices.yaml").read_text())
    if override is None:
        return PriceTable.model_validate(table)
    try:
        extra = parse_yaml(Path(override).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read the price table {override} ({e}); fix the path or drop --prices") \
            from None
    except yaml.YAMLError as e:
        raise UsageError(f"price table {override} is not valid YAML ({yaml_error_text(e)}); fix it or drop "
                         "--prices") from None
    if not isinstance(extra, dict):
        raise UsageError(f"price table {override} must be a YAML mapping shaped like infra/data/prices.yaml")
    merged = deep_merge(table, extra)
    if "source" not in extra:
        merged["source"] = f"{table.get('source', 'built-in table')}, with {override} merged over it"
    try:
        prices = PriceTable.model_validate(merged)
    except ValidationError as e:
        problems = problems_from_validation(e, PriceTable, docs="infra/data/prices.yaml")
        lines = "\n".join(f"  - {p}" for p in problems)
        raise UsageError(f"price table {override} has {len(problems)} problem(s):\n{lines}") from None
    prices._override_file = str(override)
    return prices


@dataclass
class CostLine:
    item: str
    quantity: float
    unit: str
    unit_price: float | None  # None: no fixed price (spot, Capacity Block) or not in the table
    note: str = ""
    max_unit_price: float | None = None
    """Without a unit price: the most a unit can cost (a spot node: its max price), or None."""

    @property
    def per_hour(self) -> float | None:
        return None if self.unit_price is None else self.quantity * self.unit_price

    @property
    def max_per_hour(self) -> float | None:
        """The most this line can cost per hour: its cost when priced, else at its unit bound."""
        bound = self.unit_price if self.unit_price is not None else self.max_unit_price
        return None if bound is None else self.quantity * bound


@dataclass(frozen=True)
class ElasticCost:
    """A cluster that stops idle nodes (spec `scaling`): its cost per hour with only the always-on
    nodes running and with every node running."""

    min_nodes: int
    max_nodes: int
    suspend_after_s: int
    at_min_per_hour: float | None  # None: not every line has a price
    at_max_per_hour: float | None
    note: str = ""
    """Why stopped nodes save less than their instance price, or ""."""

    def to_dict(self) -> dict[str, Any]:
        def rounded(value: float | None) -> float | None:
            return None if value is None else round(value, 4)

        return {"min_nodes": self.min_nodes, "max_nodes": self.max_nodes,
                "suspend_after_s": self.suspend_after_s, "at_min_per_hour": rounded(self.at_min_per_hour),
                "at_max_per_hour": rounded(self.at_max_per_hour), "note": self.note}


@dataclass
class CostEstimate:
    lines: list[CostLine]
    as_of: str
    source: str
    currency: str
    overridden: bool = False
    """Prices came (partly) from a --prices file."""
    elastic: ElasticCost | None = None
    """The range a cluster that stops idle nodes costs in; None for a fixed cluster."""

    @property
    def known_per_hour(self) -> float:
        """What the priced lines cost per hour (all of it only when `complete`)."""
        return sum(line.per_hour or 0.0 for line in self.lines)

    @property
    def per_hour(self) -> float | None:
        """The hourly total, or None when a line has no price (see max_per_hour and unpriced)."""
        return self.known_per_hour if self.complete else None

    @property
    def per_day(self) -> float | None:
        return None if self.per_hour is None else self.per_hour * 24

    @property
    def max_per_hour(self) -> float | None:
        """The most it can cost per hour: the total, or with every unpriced line at its bound;
        None when one has no bound."""
        bounds = [line.max_per_hour for line in self.lines]
        return None if None in bounds else sum(bounds)

    @property
    def complete(self) -> bool:
        return all(line.unit_price is not None for line in self.lines)

    @property
    def unpriced(self) -> list[CostLine]:
        return [line for line in self.lines if line.unit_price is None]

    def headline(self) -> str:
        """The hourly cost in one phrase, for `up`'s question: "about X per hour", "at most X per
        hour (why)", or "an unknown amount per hour (why)"."""
        amount = f"{amount_text(self.per_hour, self.max_per_hour, currency=self.currency)} per hour"
        if self.per_hour is not None:
            return amount
        why = "; ".join(f"{quantity_text(line)} {line.item}, {line.note}" for line in self.unpriced)
        if self.max_per_hour is None:
            why += f"; the priced items alone are {self.known_per_hour:,.2f} {self.currency} per hour"
        return f"{amount} ({why})"

    def to_dict(self) -> dict[str, Any]:
        def rounded(value: float | None, digits: int) -> float | None:
            return None if value is None else round(value, digits)

        return {
            "currency": self.currency,
            "prices_as_of": self.as_of,
            "prices_source": self.source,
            "per_hour": rounded(self.per_hour, 4),
            "per_day": rounded(self.per_day, 2),
            "max_per_hour": rounded(self.max_per_hour, 4),
            "known_per_hour": round(self.known_per_hour, 4),
            "complete": self.complete,
            "headline": self.headline(),
            "lines": [
                {
                    "item": c.item,
                    "quantity": c.quantity,
                    "unit": c.unit,
                    "unit_price": c.unit_price,
                    "max_unit_price": c.max_unit_price,
                    "per_hour": rounded(c.per_hour, 4),
                    "note": c.note,
                }
                for c in self.lines
            ],
            **({} if self.elastic is None else {"elastic": self.elastic.to_dict()}),
        }


def amount_text(per_hour: float | None, max_per_hour: float | None, hours: float = 1,
                currency: str = "USD") -> str:
    """What `hours` of a cluster cost, from the estimate `up` recorded (CostEstimate.per_hour and
    max_per_hour): "about X USD", "at most X USD" (spot), or "an unknown amount"."""
    if per_hour is not None:
        return f"about {per_hour * hours:,.2f} {currency}"
    if max_per_hour is not None:
        return f"at most {max_per_hour * hours:,.2f} {currency}"
    return "an unknown amount"


def quantity_text(line: CostLine) -> str:
    """How much a line bills: "4 x" instances, "810 GiB" of storage."""
    quantity = int(line.quantity) if float(line.quantity).is_integer() else line.quantity
    return f"{quantity} GiB" if line.unit.startswith("GiB") else f"{quantity} x"


def _market_of(template: Registration, own_reservations: set[str] = frozenset()) -> str:
    market = (template.inputs.get("instanceMarketOptions") or {}).get("marketType")
    if market:
        return market
    target = (template.inputs.get("capacityReservationSpecification") or {}).get("capacityReservationTarget")
    if target and target.get("capacityReservationId") not in own_reservations:
        return "capacity-reservation"
    return "on-demand"


@dataclass(frozen=True)
class _Rates:
    """The prices that apply in the plan's region, and what to note on a line priced from them."""

    table: RegionPrices
    instance_hour: dict[str, float]
    borrowed: str  # the note on a rate taken from the fallback region ("" for the region's own)
    borrowed_types: frozenset[str]  # instance types priced at the fallback region's rate
    missing: str  # the note on a line without a price
    hours_per_month: float
    currency: str

    def instance_note(self, itype: str) -> str:
        if itype not in self.instance_hour:
            return self.missing
        return self.borrowed if itype in self.borrowed_types else ""

    def service_note(self, price: float | None) -> str:
        return self.missing if price is None else self.borrowed


def _rates(region: str, prices: PriceTable) -> _Rates:
    own = prices.regions.get(region)
    table, borrowed = own, ""
    if own is None and prices.fallback_region in prices.regions:
        # Regions the offerings table covers but the service price list does not: the GPU price is
        # the region's own (offerings), NAT/IPv4/EBS/FSx are the fallback region's rates.
        table = prices.regions[prices.fallback_region]
        borrowed = f"{prices.fallback_region} rate; {region} may differ"
    table = table or RegionPrices()
    region_offerings = {itype: hourly for itype, by_region in offerings().prices.items()
                        for r, hourly in by_region.items() if r == region and hourly is not None}
    small = {}  # the bastion's type at the fallback region's rate
    if borrowed:
        small = {itype: hourly for itype, hourly in table.instance_hour.items() if itype not in CATALOG}
    return _Rates(table, {**small, **region_offerings, **(own.instance_hour if own else {})}, borrowed,
                  frozenset(small), f"not in the price table for {region}; pass --prices FILE",
                  prices.hours_per_month, prices.currency)


def _node_line(template: Registration, count: int, market: str, rates: _Rates) -> CostLine:
    """The `count` nodes launched from one launch template, priced by how they are bought."""
    itype = template.inputs.get("instanceType")
    if market == "spot":
        # EC2 never bills a spot instance above its max price, which defaults to the on-demand
        # price; the launch template carries the spec's spot_max_price as its max price.
        max_price = ((template.inputs.get("instanceMarketOptions") or {}).get("spotOptions") or {}).get(
            "maxPrice")
        if max_price is not None:
            cap, cap_source = float(max_price), "capacity.spot_max_price"
        else:
            cap = rates.instance_hour.get(itype)
            cap_source = "its on-demand price, EC2's default max price"
        bound = (f"; at most {cap:,.2f} {rates.currency} per instance-hour, {cap_source}" if cap is not None
                 else f"; no bound: set capacity.spot_max_price, or pass --prices FILE with the "
                      f"on-demand price of {itype}")
        return CostLine(f"{itype} spot", count, "instance-hour", None,
                        f"varies: the spot price of the hour{bound}", max_unit_price=cap)
    if market == "capacity-block":
        return CostLine(f"{itype} capacity block", count, "instance-hour", None,
                        "prepaid when the Capacity Block was bought (its offering has the price); not "
                        "priced per hour here")
    note = "" if itype in rates.instance_hour else rates.missing
    if market == "capacity-reservation":
        note = note or "reservations bill at the on-demand rate while active, used or not"
    return CostLine(f"{itype} {market}", count, "instance-hour", rates.instance_hour.get(itype), note)


def _instance_lines(mocks: RecordingMocks, rates: _Rates) -> tuple[list[CostLine], list[CostLine], float]:
    """The instances: one line per stand-alone instance (the bastion), one per launch template's
    nodes; and the GiB of EBS volumes they boot from."""
    lines: list[CostLine] = []
    node_lines: list[CostLine] = []
    ebs_gib = 0.0
    nodes_by_template: Counter[str] = Counter()
    for instance in mocks.of_type("aws:ec2/instance:Instance"):
        template_ref = (instance.inputs.get("launchTemplate") or {}).get("id")
        if template_ref:
            nodes_by_template[template_ref] += 1
            continue
        itype = instance.inputs.get("instanceType")
        lines.append(CostLine(f"{itype} ({instance.name})", 1, "instance-hour",
                              rates.instance_hour.get(itype), rates.instance_note(itype)))
        ebs_gib += float((instance.inputs.get("rootBlockDevice") or {}).get("volumeSize") or 0)
    own_reservations = {r.id for r in mocks.of_type(RESERVATION_TYPE)}
    for template_id, count in nodes_by_template.items():
        template = mocks.by_id[template_id]
        for mapping in template.inputs.get("blockDeviceMappings") or []:
            ebs_gib += count * float((mapping.get("ebs") or {}).get("volumeSize") or 0)
        node_lines.append(_node_line(template, count, _market_of(template, own_reservations), rates))
    return lines, node_lines, ebs_gib


def _network_lines(mocks: RecordingMocks, rates: _Rates) -> list[CostLine]:
    """NAT gateways and public IPv4 addresses, which bill by the hour."""
    lines = []
    nat_count = len(mocks.of_type("aws:ec2/natGateway:NatGateway"))
    if nat_count:
        borrowed = f" ({rates.borrowed})" if rates.borrowed else ""
        lines.append(CostLine("NAT gateway", nat_count, "gateway-hour", rates.table.nat_gateway_hour,
                              f"plus per-GB data processing{borrowed}"))
    public_ips = len(mocks.of_type("aws:ec2/eip:Eip")) + sum(
        1 for i in mocks.of_type("aws:ec2/instance:Instance") if i.inputs.get("associatePublicIpAddress"))
    if public_ips:
        lines.append(CostLine("public IPv4 address", public_ips, "address-hour", rates.table.public_ipv4_hour,
                              rates.borrowed))
    return lines


def _storage_lines(mocks: RecordingMocks, ebs_gib: float, rates: _Rates) -> list[CostLine]:
    """EBS root volumes and FSx for Lustre, priced per GiB-month and shown per hour."""
    lines = []
    if ebs_gib:
        gp3 = rates.table.ebs_gp3_gib_month
        lines.append(CostLine("EBS gp3 root volumes", ebs_gib, "GiB-hour",
                              None if gp3 is None else gp3 / rates.hours_per_month, rates.service_note(gp3)))
    for lustre in mocks.of_type("aws:fsx/lustreFileSystem:LustreFileSystem"):
        dtype = lustre.inputs.get("deploymentType")
        tiers = rates.table.fsx_lustre_gib_month.get(dtype) or {}
        tput = lustre.inputs.get("perUnitStorageThroughput")
        tier = tiers.get(int(tput)) if tput is not None else tiers.get("default")
        per_hour = None if tier is None else tier / rates.hours_per_month
        lines.append(CostLine(f"FSx for Lustre {dtype}" + (f" {int(tput)} MB/s/TiB" if tput else ""),
                              float(lustre.inputs.get("storageCapacity") or 0), "GiB-hour", per_hour,
                              rates.service_note(tier)))
    return lines


def estimate_cost(plan: OfflinePlan, prices: PriceTable) -> CostEstimate:
    """Hourly cost of what the plan would create, read off the resource graph (not the spec), so
    the estimate prices exactly what `pulumi up` would build."""
    rates = _rates(plan.spec.region, prices)
    instance_lines, node_lines, ebs_gib = _instance_lines(plan.mocks, rates)
    lines = [*instance_lines, *node_lines, *_network_lines(plan.mocks, rates),
             *_storage_lines(plan.mocks, ebs_gib, rates)]
    cost = CostEstimate(lines=lines, as_of=prices.as_of, source=prices.source, currency=prices.currency,
                        overridden=prices.override_file is not None)
    if plan.spec.power_saving:
        cost.elastic = _elastic_cost(plan, node_lines, cost.per_hour)
    return cost


def _elastic_cost(plan: OfflinePlan, node_lines: list[CostLine], per_hour: float | None) -> ElasticCost:
    """`per_hour` (every node running) less the instance-hours of the nodes power saving stops. A
    stopped node's root volume keeps billing, and so does the program's all-or-nothing reservation,
    whose capacity is held for every node whether it runs or not."""
    spec = plan.spec
    (nodes,) = node_lines  # one launch template: the spec has one instance type
    stopped = spec.node_count - spec.static_node_count
    note = ""
    saved = None if nodes.unit_price is None else stopped * nodes.unit_price
    if plan.mocks.of_type(RESERVATION_TYPE):
        note = (f"the all-or-nothing capacity reservation bills for all {spec.node_count} nodes whether "
                "they run or not")
        saved = 0.0
    at_min = None if per_hour is None or saved is None else per_hour - saved
    return ElasticCost(min_nodes=spec.static_node_count, max_nodes=spec.node_count,
                       suspend_after_s=spec.scaling.suspend_after_s, at_min_per_hour=at_min,
                       at_max_per_hour=per_hour, note=note)


# What bills by the hour (or by the GiB-month) while it exists.
BILLED_TYPES = {
    "aws:ec2/instance:Instance": "instance",
    "aws:ec2/natGateway:NatGateway": "NAT gateway",
    "aws:ec2/capacityReservation:CapacityReservation": "capacity reservation",
    "aws:ec2/eip:Eip": "Elastic IP (public IPv4)",
    "aws:fsx/lustreFileSystem:LustreFileSystem": "FSx for Lustre file system",
    "aws:s3/bucket:Bucket": "S3 bucket (storage)",
}
SCHEDULE_TYPE = "aws:scheduler/schedule:Schedule"
RESERVATION_TYPE = "aws:ec2/capacityReservation:CapacityReservation"
# What bills from the moment `up` creates it (a new bucket holds nothing yet).
HOURLY_TYPES = {t: kind for t, kind in BILLED_TYPES.items() if t != "aws:s3/bucket:Bucket"}


@dataclass
class AfterExpiry:
    """What the expiry schedules stop, and what keeps billing after them (read off the graph:
    a billed resource is stopped when a schedule's target input names its id)."""

    stopped: list[str]
    still_billed: list[str]


def _label(record: Registration) -> str:
    return f"{BILLED_TYPES[record.type]} {record.name}"


def _stopped_by(record: Registration, schedules: list[Registration]) -> list[Registration]:
    """The schedules whose call names the resource (by id, or an Elastic IP by allocation id)."""
    ids = [i for i in (record.id, *_computed_ids(record)) if i]
    calls = {s.urn: str((s.inputs.get("target") or {}).get("input", "")) for s in schedules}
    return [s for s in schedules if any(i in calls[s.urn] for i in ids)]


def split_by_expiry(records: list[Registration], billed_types: dict[str, str]) -> AfterExpiry:
    """The billed resources among `records` (a plan's, or a stack's as Pulumi recorded it), split
    by whether one of the schedules among them stops them."""
    schedules = [r for r in records if r.type == SCHEDULE_TYPE]
    stopped, still = [], []
    for record in records:
        if record.type in billed_types:
            (stopped if _stopped_by(record, schedules) else still).append(_label(record))
    return AfterExpiry(stopped=stopped, still_billed=still)


def after_expiry(plan: OfflinePlan) -> AfterExpiry | None:
    """None when the cluster has no expiry (everything keeps billing)."""
    if not plan.mocks.of_type(SCHEDULE_TYPE):
        return None
    return split_by_expiry(plan.mocks.resources, BILLED_TYPES)


def _computed_ids(record: Registration) -> list[str]:
    """Other identifiers a schedule may name a resource by in the plan (an Elastic IP's allocation
    id; on AWS that is its id)."""
    if record.type == "aws:ec2/eip:Eip":
        return [f"<{record.name}.allocation_id>"]
    return []


@dataclass
class FailedUp:
    """What keeps billing when `up` fails while buying GPU capacity, and until when."""

    until_expiry: list[str]
    """Stopped at the expiry: their schedules exist before the capacity is bought."""
    until_down: list[str]
    """Nothing stops them before `fsdpctl down` (no schedule yet, or no expiry at all)."""


def _is_capacity(record: Registration) -> bool:
    """GPU capacity: the reservation and the nodes, what fails (InsufficientInstanceCapacity)."""
    return record.type == RESERVATION_TYPE or (record.type == "aws:ec2/instance:Instance"
                                               and RANK_TAG in record.tags)


def if_up_fails(plan: OfflinePlan) -> FailedUp:
    """Pulumi starts no new step after a failed one, and runs the rest in parallel: when buying a
    piece of capacity fails, whatever does not wait for it may exist and bill. Its expiry stops it
    only if one of its schedules is among what that step waited for (the program's creation order,
    read off the dependencies); otherwise it bills until `fsdpctl down`."""
    resources = plan.mocks.resources
    by_urn = {r.urn: r for r in resources if r.urn}
    waits: dict[str, set[str]] = {}

    def waits_for(record: Registration) -> set[str]:
        if record.urn not in waits:
            found: set[str] = set()
            todo = list(record.dependencies)
            while todo:
                urn = todo.pop()
                if urn not in found and urn in by_urn:
                    found.add(urn)
                    todo += by_urn[urn].dependencies
            waits[record.urn] = found
        return waits[record.urn]

    schedules = [r for r in resources if r.type == SCHEDULE_TYPE]
    capacity = [r for r in resources if _is_capacity(r)]
    order = list(BILLED_TYPES)

    def listed(record: Registration) -> tuple:
        """Everything else first, then the reservation, then the nodes by rank."""
        last = (_is_capacity(record), record.type != RESERVATION_TYPE, int(record.tags.get(RANK_TAG, -1)))
        return (*last, order.index(record.type), record.name)

    failed = FailedUp(until_expiry=[], until_down=[])
    for record in sorted((r for r in resources if r.type in HOURLY_TYPES), key=listed):
        failing = [c for c in capacity if c is not record and c.urn not in waits_for(record)]
        if not failing:
            continue  # created only after all the capacity it could fail on
        stoppers = {s.urn for s in _stopped_by(record, schedules)}
        covered = all(stoppers & waits_for(step) for step in failing)
        (failed.until_expiry if covered else failed.until_down).append(_label(record))
    return failed
