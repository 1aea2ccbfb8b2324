"""`fsdpctl plan` of an elastic cluster (spec `scaling`): the cost per hour with only the always-on
nodes running and with all of them, against figures computed by hand from the price table."""

from __future__ import annotations

import json
from datetime import date

import pytest
import yaml

from fsdpctl.cli import main
from fsdpctl.plan import estimate_cost, load_prices, render_summary, render_text
from tests.infra.conftest import demo_data, plan_of

RESERVATION = "cr-0123456789abcdef0"
ELASTIC = {"scaling": {"min_nodes": 1}, "capacity": {"all_or_nothing": False}}

# us-east-1, infra/data/prices.yaml of 2025-06-10: 4 x p4d.24xlarge at 21.96, the NAT gateway at
# 0.045, 2 public IPv4 addresses at 0.005, the t3.micro bastion at 0.0104, and 4 x 200 + 10 GiB of
# gp3 at 0.08 per GiB-month of 730 hours.
FIXED_PART = 0.045 + 2 * 0.005 + 0.0104 + 810 * 0.08 / 730  # 0.15417 USD/h
ALL_FOUR = 4 * 21.96 + FIXED_PART  # 87.99417 USD/h
ONE_RUNNING = 1 * 21.96 + FIXED_PART  # 22.11417 USD/h: stopped nodes still bill their root volumes


def text_of(plan) -> str:
    return render_text(plan, estimate_cost(plan, load_prices()), today=date(2025, 7, 1))


def test_the_cost_at_min_and_at_max_nodes_is_read_off_the_price_table():
    cost = estimate_cost(plan_of(**ELASTIC), load_prices())
    assert cost.per_hour == pytest.approx(ALL_FOUR)
    elastic = cost.elastic
    assert (elastic.min_nodes, elastic.max_nodes, elastic.suspend_after_s) == (1, 4, 600)
    assert elastic.at_min_per_hour == pytest.approx(ONE_RUNNING)
    assert elastic.at_max_per_hour == pytest.approx(ALL_FOUR)
    assert elastic.note == ""


def test_plan_text_shows_the_range_under_the_total():
    lines = text_of(plan_of(**ELASTIC)).splitlines()
    total = next(i for i, line in enumerate(lines) if line.startswith("  Total: 87.99 USD per hour"))
    assert lines[total + 1] == "  1-4 nodes: 22.11-87.99 USD/h (nodes from rank 1 stop after 600 s idle)"


def test_the_range_follows_min_nodes_and_suspend_after_s():
    plan = plan_of(instance_type="p5.48xlarge", node_count=8, capacity={"all_or_nothing": False},
                   scaling={"min_nodes": 3, "max_nodes": 8, "suspend_after_s": 1800})
    per_hour = 8 * 55.04 + 0.045 + 2 * 0.005 + 0.0104 + 1610 * 0.08 / 730
    at_min = per_hour - 5 * 55.04
    line = f"  3-8 nodes: {at_min:,.2f}-{per_hour:,.2f} USD/h (nodes from rank 3 stop after 1800 s idle)"
    assert line == "  3-8 nodes: 165.36-440.56 USD/h (nodes from rank 3 stop after 1800 s idle)"
    assert line in text_of(plan).splitlines()


def test_the_all_or_nothing_reservation_keeps_billing_for_stopped_nodes():
    plan = plan_of(scaling={"min_nodes": 1})
    elastic = estimate_cost(plan, load_prices()).elastic
    assert elastic.at_min_per_hour == pytest.approx(ALL_FOUR) == elastic.at_max_per_hour
    held = "the all-or-nothing capacity reservation bills for all 4 nodes whether they run or not"
    assert elastic.note == held
    text = " ".join(text_of(plan).split())
    assert f"1-4 nodes: 87.99-87.99 USD/h (nodes from rank 1 stop after 600 s idle; {held})" in text
    assert "set capacity.all_or_nothing: false to save" in text  # the warning


def test_an_unpriced_region_has_no_made_up_range():
    plan = plan_of(region="af-south-1", availability_zone="af-south-1a", **ELASTIC)
    cost = estimate_cost(plan, load_prices())
    assert cost.elastic.at_min_per_hour is None and cost.elastic.at_max_per_hour is None
    text = " ".join(text_of(plan).split())
    assert "1-4 nodes: unknown (a line above has no price) (nodes from rank 1" in text


@pytest.mark.parametrize("overrides", [
    {},
    {"scaling": {"min_nodes": 4}},
    {"scaling": {"min_nodes": 1}, "capacity": {"type": "capacity-block", "reservation_id": RESERVATION}},
    {"scaling": {"min_nodes": 1}, "capacity": {"type": "spot"}},
])
def test_a_fixed_cluster_shows_no_range(overrides):
    plan = plan_of(**overrides)
    cost = estimate_cost(plan, load_prices())
    assert cost.elastic is None and "elastic" not in cost.to_dict()
    assert " nodes: " not in text_of(plan)


def test_plan_says_why_min_nodes_is_ignored_for_a_capacity_block():
    plan = plan_of(scaling={"min_nodes": 1},
                   capacity={"type": "capacity-block", "reservation_id": RESERVATION})
    assert ("scaling.min_nodes: 1 ignored: capacity-block nodes bill whether running or stopped, so none is "
            "powered down.") in " ".join(text_of(plan).split())


def test_ups_summary_shows_the_range_too():
    plan = plan_of(**ELASTIC)
    summary = render_summary(plan, estimate_cost(plan, load_prices()))
    assert "  1-4 nodes: 22.11-87.99 USD/h (nodes from rank 1 stop after 600 s idle)" in summary.splitlines()


def test_plan_json_has_the_range(tmp_path, capsys):
    spec = tmp_path / "elastic.yaml"
    spec.write_text(yaml.safe_dump(demo_data(**ELASTIC)))
    assert main(["plan", str(spec), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cost"]["elastic"] == {
        "min_nodes": 1, "max_nodes": 4, "suspend_after_s": 600,
        "at_min_per_hour": pytest.approx(ONE_RUNNING, abs=1e-4),
        "at_max_per_hour": pytest.approx(ALL_FOUR, abs=1e-4), "note": ""}
    assert [w for w in report["warnings"] if w.startswith("scaling")] == [
        "scaling: nodes from rank 1 come back from a stop with /scratch empty (EC2 wipes instance-store NVMe "
        "on stop); keep what must last in the checkpoint bucket or on FSx."]
