"""`fsdpctl plan`: the offline plan's text and JSON output, the cost estimate and its price table,
and bad input (exit 2, every problem listed, nothing run)."""

from __future__ import annotations

import json
import re
import sys
from datetime import date

import pytest
import yaml

from fsdpctl.cli import main
from fsdpctl.plan import PriceTable, estimate_cost, load_prices, render_json, render_text
from infra import offline
from infra.spec import RANK_TAG
from tests.infra.conftest import EXPIRES_AT, REPO, demo_data, plan_of

DEMO = str(REPO / "examples" / "demo.yaml")


def write_spec(tmp_path, **overrides):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(demo_data(**overrides)))
    return str(path)


def demo_cost_per_hour(prices: PriceTable) -> float:
    """4 p4d nodes, NAT gateway, 2 public IPv4 (NAT, bastion), t3.micro bastion, 4x200+10 GiB gp3."""
    region = prices.regions["us-east-1"]
    return (4 * region.instance_hour["p4d.24xlarge"] + region.nat_gateway_hour
            + 2 * region.public_ipv4_hour + region.instance_hour["t3.micro"]
            + 810 * region.ebs_gp3_gib_month / prices.hours_per_month)


def test_plan_text_shows_resources_by_component_warnings_and_cost(capsys):
    assert main(["plan", DEMO]) == 0
    out = capsys.readouterr().out
    for heading in ("Network", "Security", "Storage", "Identity", "Compute", "Expiry"):
        assert f"\n  {heading}\n" in out
    assert "Resources `pulumi up` would create: 43" in out
    assert "4 EFA on 4 network cards" in out and "IMDSv2 required" in out
    assert "in: all itself, tcp/22 <demo-bastion.id>" in out
    assert "demo-node3" in out and "rank 3" in out
    assert ("every byte deleted within 7 days (4 current + 1 noncurrent, each rounded up to midnight "
            "UTC by S3)") in " ".join(out.split())
    assert "Warnings: none" in out
    expected = demo_cost_per_hour(load_prices())
    assert f"Total: {expected:,.2f} USD per hour, {expected * 24:,.2f} USD per day" in out
    assert "prices as of 2025-06-10" in out
    # The spec's trainer config runs only in the smoke test, with the batch that sets for 32 ranks.
    assert re.search(r"Memory fit \(fsdp-train --estimate\): trainer config smoke, with the smoke test's "
                     r"batch, on 32 x a100-40gb needs [\d.]+ GiB per GPU of 36\.0 usable: fits",
                     " ".join(out.split()))


def test_plan_json_is_the_graph_outputs_and_cost(capsys):
    assert main(["plan", DEMO, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cluster"] == "demo"
    assert len(report["resources"]) == 43 and sum(report["counts"].values()) == 43
    assert report["counts"]["aws:ec2/instance:Instance"] == 5
    assert [n["efa_count"] for n in report["outputs"]["nodes"]] == [4, 4, 4, 4]
    assert report["warnings"] == []
    cost = report["cost"]
    assert cost["complete"] is True
    assert cost["per_hour"] == pytest.approx(demo_cost_per_hour(load_prices()), abs=1e-3)
    assert cost["per_day"] == pytest.approx(cost["per_hour"] * 24, abs=0.01)
    nodes = next(line for line in cost["lines"] if line["item"] == "p4d.24xlarge on-demand")
    assert nodes["quantity"] == 4 and nodes["unit_price"] == 21.96
    fit = report["memory_fit"]
    assert (fit["config"], fit["smoke_test_batch"], fit["world_size"], fit["runs_on_spec"], fit["fits"]) == (
        "smoke", True, 32, True, True)


def test_price_override_file_is_merged_over_the_built_in_table(tmp_path, capsys):
    prices = tmp_path / "prices.yaml"
    prices.write_text(yaml.safe_dump({"as_of": "2026-11-30",
                                      "regions": {"us-east-1": {"instance_hour": {"p4d.24xlarge": 10.0}}}}))
    assert main(["plan", DEMO, "--json", "--prices", str(prices)]) == 0
    cost = json.loads(capsys.readouterr().out)["cost"]
    assert cost["prices_as_of"] == "2026-11-30"
    nodes = next(line for line in cost["lines"] if line["item"] == "p4d.24xlarge on-demand")
    assert nodes["per_hour"] == 40.0
    nat = next(line for line in cost["lines"] if line["item"] == "NAT gateway")
    assert nat["unit_price"] == load_prices().regions["us-east-1"].nat_gateway_hour


def test_spot_capacity_blocks_and_missing_regions_are_not_priced_as_on_demand():
    prices = load_prices()
    spot = estimate_cost(plan_of(capacity={"type": "spot"}), prices)
    line = next(c for c in spot.lines if "spot" in c.item)
    assert line.unit_price is None and "varies" in line.note and not spot.complete
    block_plan = plan_of(capacity={"type": "capacity-block", "reservation_id": "cr-0123456789abcdef0"})
    block = estimate_cost(block_plan, prices)
    assert next(c for c in block.lines if "capacity block" in c.item).unit_price is None
    # A region the offerings table lacks for this type: no made-up price.
    nowhere = estimate_cost(plan_of(region="af-south-1", availability_zone="af-south-1a"), prices)
    node_line = next(c for c in nowhere.lines if "p4d" in c.item)
    assert node_line.unit_price is None and "--prices" in node_line.note


def test_a_spot_total_is_a_cap_from_spot_max_price_or_the_on_demand_price_not_the_priced_rest():
    """4 x p5 spot once planned at "0.1542 USD per hour" (the NAT gateway and disks only). The spot
    price is not known in advance; what the nodes can cost is: at most the spot_max_price the launch
    template passes, else at most the on-demand price (EC2's default max price)."""
    prices = load_prices()
    on_demand = prices.regions["us-east-1"].instance_hour["p5.48xlarge"]
    for capacity, cap in (({"type": "spot"}, on_demand), ({"type": "spot", "spot_max_price": 30.0}, 30.0)):
        plan = plan_of(instance_type="p5.48xlarge", capacity=capacity)
        cost = estimate_cost(plan, prices)
        assert cost.per_hour is None and cost.per_day is None and not cost.complete
        assert 0 < cost.known_per_hour < 1
        assert cost.max_per_hour == pytest.approx(cost.known_per_hour + 4 * cap)
        assert cost.headline().startswith(f"at most {cost.max_per_hour:,.2f} USD per hour (")
        assert "spot" in cost.headline()
        text = " ".join(render_text(plan, cost, today=date(2025, 7, 1)).split())
        assert f"Total: at most {cost.max_per_hour:,.2f} USD per hour" in text
        assert f"Total: {cost.known_per_hour:.4g} USD" not in text
        data = cost.to_dict()
        assert data["per_hour"] is None and data["max_per_hour"] == pytest.approx(cost.max_per_hour, abs=1e-3)
        assert data["known_per_hour"] == pytest.approx(cost.known_per_hour, abs=1e-3)


@pytest.mark.parametrize("overrides", [
    {"capacity": {"type": "capacity-block", "reservation_id": "cr-0123456789abcdef0"}},
    {"region": "af-south-1", "availability_zone": "af-south-1a"},
])
def test_a_total_without_a_gpu_price_or_bound_is_unknown_and_says_why(overrides):
    plan = plan_of(**overrides)
    cost = estimate_cost(plan, load_prices())
    assert cost.per_hour is None and cost.max_per_hour is None
    headline = cost.headline()
    assert headline.startswith("an unknown amount per hour (")
    assert f"the priced items alone are {cost.known_per_hour:,.2f} USD per hour" in headline
    (gpu,) = [line for line in cost.lines if line.item.startswith("p4d")]
    assert gpu.item in headline and gpu.note in headline
    text = " ".join(render_text(plan, cost, today=date(2025, 7, 1)).split())
    assert "Total: unknown" in text and "Total: 0." not in text


@pytest.mark.slow
def test_every_region_of_the_offerings_table_is_priced():
    """The GPU price is the region's own (offerings table); NAT, IPv4, EBS and the bastion borrow
    the fallback region's rates and say so."""
    from infra.catalog import offerings

    prices, table = load_prices(), offerings()
    far = estimate_cost(plan_of(region="ap-southeast-2", availability_zone="ap-southeast-2a"), prices)
    node_line = next(c for c in far.lines if "p4d" in c.item)
    assert node_line.unit_price == table.prices["p4d.24xlarge"]["ap-southeast-2"] == 28.54493
    nat = next(c for c in far.lines if c.item == "NAT gateway")
    assert nat.unit_price == prices.regions["us-east-1"].nat_gateway_hour
    assert "us-east-1 rate; ap-southeast-2 may differ" in nat.note
    for itype, regions in table.prices.items():
        for region, hourly in regions.items():
            cost = estimate_cost(plan_of(instance_type=itype, node_count=1, region=region,
                                         availability_zone=f"{region}a"), prices)
            assert cost.complete is (hourly is not None), (itype, region)
            assert cost.known_per_hour > (hourly or 0)
            assert (cost.per_hour is None) is (hourly is None), (itype, region)


def test_plan_warns_about_a_type_the_region_does_not_offer():
    plan = plan_of(instance_type="p5.48xlarge", node_count=2, region="af-south-1",
                   availability_zone="af-south-1a")
    (warning,) = [w for w in plan.spec.warnings() if w.startswith("region:")]
    assert "p5.48xlarge is not offered in af-south-1 according to the offerings table of 20" in warning
    assert "us-east-1" in warning and "fsdpctl preflight" in warning
    assert not [w for w in plan_of(instance_type="p5.48xlarge", node_count=2).spec.warnings()
                if w.startswith("region:")]


def test_fsx_is_priced_per_gib_month_of_its_tier():
    prices = load_prices()
    plan = plan_of(storage={"fsx": {"enabled": True, "capacity_gib": 2400, "throughput_per_tib": 125}})
    line = next(c for c in estimate_cost(plan, prices).lines if c.item.startswith("FSx"))
    per_gib_month = prices.regions["us-east-1"].fsx_lustre_gib_month["PERSISTENT_2"][125]
    assert line.per_hour == pytest.approx(2400 * per_gib_month / prices.hours_per_month)


def test_plan_text_warns_about_reservations_and_old_prices(demo_plan):
    plan = plan_of(capacity={"type": "capacity-reservation", "reservation_id": "cr-0123456789abcdef0"})
    text = render_text(plan, estimate_cost(plan, load_prices()), today=date(2026, 12, 1))
    assert "no placement group is created" in text
    assert "reservations bill at the on-demand rate" in text
    assert "the price table is 539 days old" in text
    fresh = render_text(demo_plan, estimate_cost(demo_plan, load_prices()), today=date(2025, 7, 1))
    assert "days old" not in fresh


def test_bad_spec_exits_2_with_every_problem_and_runs_nothing(tmp_path, capsys, monkeypatch):
    def must_not_run(*_args, **_kwargs):
        raise AssertionError("the program ran for an invalid spec")

    monkeypatch.setattr(offline, "run_offline", must_not_run)
    spec = write_spec(tmp_path, node_count=0, ssh_cidr="0.0.0.0/0", instance_type="p5.48xlarg")
    assert main(["plan", spec]) == 2
    err = capsys.readouterr().err
    assert "3 problem(s)" in err
    assert "node_count" in err and "ssh_cidr" in err and "did you mean p5.48xlarge" in err


def test_missing_spec_file_and_bad_price_file_are_clear_errors(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad_prices = tmp_path / "prices.yaml"
    bad_prices.write_text("- just\n- a list\n")
    assert main(["plan", DEMO, "--prices", str(bad_prices)]) == 2
    assert "must be a YAML mapping" in capsys.readouterr().err


def test_missing_pulumi_packages_are_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pulumi_aws", None)  # makes `import pulumi_aws` fail
    assert main(["plan", DEMO]) == 2
    err = capsys.readouterr().err
    assert "needs the Python packages pulumi and pulumi-aws" in err and "pip install -e '.[aws]'" in err


@pytest.mark.parametrize("overrides", [
    {},
    {"storage": {"fsx": {"enabled": True, "s3_import_path": "s3://team-data/corpus"}},
     "capacity": {"type": "capacity-reservation", "reservation_id": "cr-0123456789abcdef0"},
     "tags": {"team": "foundation-models", "cost-center": "ml-research-0042"}},
    {"instance_type": "p5.48xlarge", "capacity": {"type": "spot"}, "network": {"mtu": 1500}},
    # Elastic, with the all-or-nothing reservation: the range line carries its longest note.
    {"scaling": {"min_nodes": 2, "suspend_after_s": 86400}},
])
def test_plan_lines_fit_100_columns_and_quantities_read_as_amounts(overrides):
    plan = plan_of(**overrides)
    text = render_text(plan, estimate_cost(plan, load_prices()), today=date(2026, 12, 1))
    too_long = [line for line in text.splitlines() if len(line) > 100]
    assert too_long == []
    assert re.search(r"EBS gp3 root volumes +\d+ GiB ", text) and " x810" not in text
    assert re.search(r"p[45][a-z]*\.48xlarge .* +[24] x ", text) or re.search(r"p4d.24xlarge .* 4 x ", text)


def test_no_stale_price_note_when_a_prices_file_replaced_the_table(tmp_path, capsys):
    prices = tmp_path / "prices.yaml"
    prices.write_text(yaml.safe_dump({"regions": {"us-east-1": {"instance_hour": {"p4d.24xlarge": 20.0}}}}))
    assert main(["plan", DEMO]) == 0
    assert "days old" in capsys.readouterr().out  # the built-in table is from 2025
    assert main(["plan", DEMO, "--prices", str(prices)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # long paths wrap
    assert "days old" not in out and f"with {prices} merged over it" in out


@pytest.mark.parametrize("overrides", [{}, {"storage": {"fsx": {"enabled": True}}},
                                       {"instance_type": "p5.48xlarge", "node_count": 2}])
def test_after_expiry_only_the_bucket_keeps_billing(overrides):
    from fsdpctl.plan.cost import after_expiry

    plan = plan_of(**overrides)
    after = after_expiry(plan)
    assert all(not s.startswith("capacity reservation") for s in after.still_billed)
    assert after.still_billed == [next(f"S3 bucket (storage) {r.name}" for r in plan.mocks.resources
                                       if r.type == "aws:s3/bucket:Bucket")]
    assert sum(s.startswith("instance ") for s in after.stopped) == plan.spec.node_count + 1  # + bastion
    assert any(s.startswith("NAT gateway") for s in after.stopped)
    assert any(s.startswith("Elastic IP") for s in after.stopped)
    assert any(s.startswith("FSx") for s in after.stopped) == bool(overrides.get("storage"))


def test_plan_text_says_what_keeps_billing_after_expiry():
    from fsdpctl.plan import estimate_cost, load_prices, render_text

    plan = plan_of()
    text = " ".join(render_text(plan, estimate_cost(plan, load_prices())).split())
    assert "What keeps billing after expiry: S3 bucket (storage) demo-checkpoints" in text
    assert "NAT gateway demo-nat" in text and "Elastic IP (public IPv4) demo-nat-ip" in text
    no_expiry = plan_of(expiry_hours=None)
    text = " ".join(render_text(no_expiry, estimate_cost(no_expiry, load_prices())).split())
    assert "No expiry (expiry_hours: null): everything above keeps billing" in text


def test_plan_shows_the_trainer_configs_memory_fit_on_the_planned_gpus(capsys):
    assert main(["plan", DEMO, "--trainer-config", "gpt-7b"]) == 0
    out = capsys.readouterr().out
    fit = " ".join(line.strip() for line in out[out.index("Memory fit"):].splitlines())
    assert re.fullmatch(r"Memory fit \(fsdp-train --estimate\): trainer config gpt-7b on 32 x a100-40gb "
                        r"needs [\d.]+ GiB per GPU of 36\.0 usable: fits", fit), fit
    # A config that does not fit fails the plan (exit 1) after printing all of it, with one line why.
    assert main(["plan", DEMO, "--json", "--trainer-config", "gpt-120b"]) == 1
    out, err = capsys.readouterr()
    fit = json.loads(out)["memory_fit"]
    assert fit["config"] == "gpt-120b" and fit["world_size"] == 32 and fit["fits"] is False
    assert fit["per_rank_gib"] > fit["usable_gib"]
    assert err.strip() == (f"fsdpctl plan: trainer config gpt-120b does not fit: it needs "
                           f"{fit['per_rank_gib']:.1f} GiB per GPU of 36.0 usable on 32 x a100-40gb; no "
                           "cluster size fits as configured. Plan more or larger GPUs, or change the config "
                           "(docs/trainer.md, \"Will it fit?\")")


def test_plan_warns_when_the_trainer_would_refuse_the_config_on_the_cluster(capsys):
    """`fsdpctl train smoke` on 4 x 8 GPUs: its 16 sequences in 2 micro-batches do not split over 32
    ranks. The plan still succeeds: the trainer's own problem and fix are the warning."""
    problem = ("training.global_batch_size: does not split evenly: 16 / 2 accumulation steps / 32 ranks "
               "(got 16). Fix: make it a multiple of 64")
    assert main(["plan", DEMO, "--trainer-config", "smoke"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (f"Warning: trainer config smoke cannot run on this cluster's 32 ranks (4 nodes x 8; the trainer "
            f"refuses it at launch): {problem}. Memory fit: not computed.") in out
    assert main(["plan", DEMO, "--json", "--trainer-config", "smoke"]) == 0
    fit = json.loads(capsys.readouterr().out)["memory_fit"]
    assert (fit["smoke_test_batch"], fit["runs_on_spec"], fit["layout_problems"]) == (False, False, [problem])
    assert "fits" not in fit


def test_plan_refuses_an_unknown_trainer_config(capsys):
    assert main(["plan", DEMO, "--trainer-config", "gpt-9000"]) == 2
    assert "--trainer-config gpt-9000" in capsys.readouterr().err


def test_plan_fits_the_hugging_face_presets_with_their_variants(tmp_path, capsys):
    """Presets whose architecture is a bundled config.json need no weights to be planned: Llama 3.1 8B
    fits one p5 node, 70B only with LoRA there."""
    spec = write_spec(tmp_path, instance_type="p5.48xlarge", node_count=1)
    for config, fits in (("llama3-8b", True), ("llama3-70b", False), ("llama3-70b-lora", True)):
        assert main(["plan", spec, "--json", "--trainer-config", config]) == (0 if fits else 1)
        fit = json.loads(capsys.readouterr().out)["memory_fit"]
        assert (fit["config"], fit["world_size"], fit["gpu"], fit["fits"]) == (config, 8, "h100", fits)


# ---- what bills when `up` fails half-way ------------------------------------------------------
def _graph(ordered: bool) -> offline.OfflinePlan:
    """A NAT gateway, its address, a bastion, a reservation and two nodes, with their expiry
    schedules: `ordered` as the program creates them (every other schedule before the reservation,
    the reservation's before the nodes), else with nothing ordering them before the capacity."""
    def urn(name: str) -> str:
        return f"urn:pulumi:demo::fsdp-cluster::x${name}"

    def resource(typ: str, name: str, depends: tuple[str, ...] = (), **inputs) -> offline.Registration:
        return offline.Registration(typ, name, inputs, custom=True, id=f"<{name}.id>", urn=urn(name),
                                    dependencies=[urn(d) for d in depends])

    def schedule(name: str, stops: str) -> offline.Registration:
        payload = json.dumps({"Id": f"<{stops}.allocation_id>" if stops == "nat-ip" else f"<{stops}.id>"})
        return resource("aws:scheduler/schedule:Schedule", name, (stops,), target={"input": payload})

    before_capacity = ("expiry-nat", "expiry-nat-ip", "expiry-bastion") if ordered else ()
    before_nodes = ("capacity", *before_capacity, *(("expiry-capacity",) if ordered else ()))
    mocks = offline.RecordingMocks()
    mocks.registrations = [
        resource("aws:ec2/eip:Eip", "nat-ip"), resource("aws:ec2/natGateway:NatGateway", "nat", ("nat-ip",)),
        resource("aws:ec2/instance:Instance", "bastion", tags={"Name": "bastion"}),
        resource("aws:s3/bucket:Bucket", "checkpoints"),
        schedule("expiry-nat", "nat"), schedule("expiry-nat-ip", "nat-ip"),
        schedule("expiry-bastion", "bastion"),
        resource("aws:ec2/capacityReservation:CapacityReservation", "capacity", before_capacity),
        schedule("expiry-capacity", "capacity"),
        *[resource("aws:ec2/instance:Instance", f"node{r}", before_nodes, tags={RANK_TAG: str(r)})
          for r in (0, 1)],
        schedule("expiry-node0", "node0"), schedule("expiry-node1", "node1"),
    ]
    return offline.OfflinePlan(spec=plan_of().spec, expires_at=EXPIRES_AT, mocks=mocks)


def test_what_bills_after_a_failed_capacity_purchase_is_read_off_the_creation_order():
    """Pulumi starts no new step after a failed one; buying GPU capacity (the reservation, a node)
    is the step that fails. What was created before keeps billing: until the expiry when its
    schedule was sure to exist before that step, else until `fsdpctl down`. A node launched
    before another failed has no schedule yet; an empty bucket bills nothing."""
    from fsdpctl.plan.cost import if_up_fails

    ordered = if_up_fails(_graph(ordered=True))
    assert ordered.until_expiry == ["instance bastion", "NAT gateway nat", "Elastic IP (public IPv4) nat-ip",
                                    "capacity reservation capacity"]
    assert ordered.until_down == ["instance node0", "instance node1"]
    unordered = if_up_fails(_graph(ordered=False))
    assert unordered.until_expiry == []
    assert unordered.until_down == ["instance bastion", "NAT gateway nat", "Elastic IP (public IPv4) nat-ip",
                                    "capacity reservation capacity", "instance node0", "instance node1"]


@pytest.mark.parametrize("overrides", [{}, {"storage": {"fsx": {"enabled": True}}, "node_count": 1},
                                       {"capacity": {"type": "spot"}}, {"expiry_hours": None}])
def test_plan_says_what_bills_if_up_fails_half_way_and_until_when(overrides):
    from fsdpctl.plan.cost import BILLED_TYPES, if_up_fails

    plan = plan_of(**overrides)
    failed = if_up_fails(plan)
    listed = failed.until_expiry + failed.until_down
    nodes = {f"instance {r.name}" for r in plan.mocks.of_type("aws:ec2/instance:Instance")
             if RANK_TAG in r.tags}
    others = {f"{BILLED_TYPES[r.type]} {r.name}" for r in plan.mocks.resources
              if r.type in BILLED_TYPES and r.type != "aws:s3/bucket:Bucket"} - nodes
    # Everything billed that is not GPU capacity, and the nodes launched before another one failed.
    assert set(listed) == others | (nodes if len(nodes) > 1 else set())
    assert len(listed) == len(set(listed))
    assert not nodes & set(failed.until_expiry)
    if plan.spec.expiry_hours is None:
        assert failed.until_expiry == []
    text = " ".join(render_text(plan, estimate_cost(plan, load_prices())).split())
    assert "If `up` fails half-way (InsufficientInstanceCapacity" in text
    if failed.until_expiry:
        until_expiry = ", ".join(failed.until_expiry)
        assert f"bill until the expiry at {EXPIRES_AT} stops them: {until_expiry}" in text
    assert ("bill until `fsdpctl down`: " + ", ".join(failed.until_down)) in text
    report = json.loads(render_json(plan, estimate_cost(plan, load_prices())))
    assert report["if_up_fails"] == {"until_expiry": failed.until_expiry, "until_down": failed.until_down}
