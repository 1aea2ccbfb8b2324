"""Spec input a newcomer gets wrong, each refused with its field, value and fix: a key given twice,
an alias bomb, an ssh_cidr without a prefix or in IPv6, a region or zone that does not exist, and
pydantic's own wording ("Input should be a valid dictionary or instance of Capacity")."""

from __future__ import annotations

import pytest
import yaml

from infra.catalog import regions
from infra.spec import MAX_YAML_VALUES, SpecError, load_spec, parse_spec, parse_yaml
from tests.infra.conftest import demo_data


def problems_of(data: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as raised:
        parse_spec(data)
    return {p.field: str(p) for p in raised.value.problems}


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    spec = tmp_path / "twice.yaml"
    spec.write_text(yaml.safe_dump(demo_data()) + "node_count: 8\n")
    with pytest.raises(SpecError) as raised:
        load_spec(spec)
    (problem,) = raised.value.problems
    lines = spec.read_text().splitlines()
    first = next(i for i, text in enumerate(lines, 1) if text.startswith("node_count"))
    assert problem.field == "(file)"
    assert (f"line {len(lines)}, column 1: key 'node_count' is given twice (also on line {first}); keep one"
            in str(problem))


def test_a_nested_key_given_twice_and_a_merge_key(tmp_path):
    with pytest.raises(yaml.YAMLError, match="key 'type' is given twice"):
        parse_yaml("capacity:\n  type: spot\n  type: on-demand\n")
    with pytest.raises(yaml.YAMLError, match="key 'a' is given twice"):
        parse_yaml("{a: 1, a: 2}")
    # `<<: *base` with a key overriding the merged one is one key each, not a repetition.
    assert parse_yaml("base: &b {x: 1, y: 2}\nover:\n  <<: *b\n  y: 3\n")["over"] == {"x": 1, "y": 3}


BOMB = "\n".join([
    'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
    *(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]"
      for prev, name in zip("abcdef", "bcdefg", strict=True)),
    "name: *g",
]) + "\n"


def test_an_alias_bomb_is_refused_in_a_line(tmp_path):
    spec = tmp_path / "bomb.yaml"
    spec.write_text(BOMB)
    assert len(BOMB) < 400
    with pytest.raises(SpecError) as raised:
        load_spec(spec)
    assert f"expand to more than {MAX_YAML_VALUES:,} values" in str(raised.value)
    assert len(str(raised.value)) < 500


def test_every_echoed_value_is_bounded():
    """Below the alias limit a value can still be large: a 90,000-item list, a megabyte of text."""
    huge = demo_data(name=["x" * 100] * 90_000, region="y" * 1_000_000)
    with pytest.raises(SpecError) as raised:
        parse_spec(huge)
    assert len(str(raised.value)) < 1_000
    assert {p.field for p in raised.value.problems} >= {"name", "region"}


@pytest.mark.parametrize(("cidr", "said"), [
    ("203.0.113.7", "has no prefix length (got '203.0.113.7'). Fix: write the network with its length, e.g. "
                    "203.0.113.7/32 for this one address"),
    ("2001:db8::/32", "is an IPv6 network, and the security groups take SSH over IPv4 (got '2001:db8::/32'). "
                      "Fix: give your office/VPN range's IPv4 CIDR"),
])
def test_ssh_cidr_needs_an_ipv4_network_with_its_prefix(cidr, said):
    assert said in problems_of(demo_data(ssh_cidr=cidr))["ssh_cidr"]
    assert str(parse_spec(demo_data(ssh_cidr="203.0.113.7/32")).ssh_cidr) == "203.0.113.7/32"


def test_a_region_that_does_not_exist_is_refused_with_the_nearest():
    said = problems_of(demo_data(region="us-est-1", availability_zone="us-est-1a"))["region"]
    assert "is not an AWS region (infra/data/regions.yaml" in said and "us-east-1" in said.split("Fix:")[1]
    said = problems_of(demo_data(region="zz-nowhere-9", availability_zone="zz-nowhere-9a"))["region"]
    assert said.endswith("Fix: use e.g. us-east-1")


def test_a_zone_the_region_does_not_have_is_refused_with_its_zones():
    said = problems_of(demo_data(availability_zone="us-east-1z"))["availability_zone"]
    assert said == ("availability_zone: is not a zone of us-east-1, whose zones run from us-east-1a to "
                    "us-east-1f (infra/data/regions.yaml) (got 'us-east-1z'). Fix: use one of us-east-1a, "
                    "us-east-1b, us-east-1c, us-east-1d, us-east-1e, us-east-1f")
    assert "availability_zone" in problems_of(demo_data(region="eu-west-1", availability_zone="eu-west-1d"))


def test_every_region_the_offerings_table_prices_is_a_known_region():
    from infra.catalog import offerings

    known = regions()
    assert all(known.zones(r) for by_region in offerings().prices.values() for r in by_region)
    canada = parse_spec(demo_data(region="ca-central-1", availability_zone="ca-central-1d"))
    assert canada.availability_zone == "ca-central-1d"


@pytest.mark.parametrize(("change", "field", "said"), [
    ({"capacity": 5}, "capacity",
     "capacity: is not a mapping of keys (got 5). Fix: write it as `key: value` lines indented under it (its "
     "keys: type, reservation_id, spot_max_price, all_or_nothing)"),
    ({"node_count": "four"}, "node_count",
     "node_count: is not a whole number (got 'four'). Fix: write a whole number, without quotes"),
    ({"capacity": {"type": "cheap"}}, "capacity.type",
     "capacity.type: is not one of the allowed values (got 'cheap'). Fix: use 'on-demand', 'spot', "
     "'capacity-reservation' or 'capacity-block'"),
    ({"expiry_hours": 0}, "expiry_hours",
     "expiry_hours: is below the minimum, 1 (got 0). Fix: use 1 or more"),
    ({"allow_ssh_from_anywhere": "maybe"}, "allow_ssh_from_anywhere",
     "allow_ssh_from_anywhere: is not true or false (got 'maybe'). Fix: write true or false"),
    ({"capacity": {"tpye": "spot"}}, "capacity.tpye",
     "capacity.tpye: is not a known field (got 'spot'). Fix: did you mean `type`?"),
])
def test_pydantic_errors_are_in_the_specs_own_words(change, field, said):
    problems = problems_of(demo_data(**change))
    assert problems[field] == said
    assert not any("Input should" in p or "instance of" in p for p in problems.values())


def test_a_combination_with_a_default_is_refused_next_to_a_bad_field():
    # node_count 0 fails validation, so the combinations are checked on the raw input: the bastion
    # (on by default, model.py) in an existing VPC without a public subnet is found all the same,
    # and so is the FSx size for the default deployment type.
    data = {k: v for k, v in demo_data(node_count=0).items() if k not in ("access", "network", "storage")}
    problems = problems_of({**data, "network": {"vpc_id": "vpc-0abc", "private_subnet_id": "subnet-0abc"},
                            "storage": {"fsx": {"enabled": True, "capacity_gib": 1300}}})
    assert {"node_count", "network.public_subnet_id", "storage.fsx.capacity_gib"} <= set(problems)
    assert "PERSISTENT_2" in problems["storage.fsx.capacity_gib"]
