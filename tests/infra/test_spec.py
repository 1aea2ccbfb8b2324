"""The cluster spec: defaults of the minimal demo spec, and every rejected input refused with its
field, value and fix before the Pulumi program registers a single resource."""

from __future__ import annotations

import pytest

from infra.offline import RecordingMocks, run_offline
from infra.spec import (
    DEFAULT_DLAMI_PARAMETER,
    CapacityType,
    SpecError,
    load_spec,
    parse_spec,
)
from tests.infra.conftest import EXPIRES_AT, REPO, demo_data, plan_of


def test_demo_spec_defaults():
    spec = load_spec(REPO / "examples" / "demo.yaml")
    assert (spec.name, spec.instance_type, spec.node_count) == ("demo", "p4d.24xlarge", 4)
    assert spec.capacity.type is CapacityType.ON_DEMAND and spec.capacity.reservation_id is None
    assert spec.uses_placement_group
    assert spec.network.creates_vpc and spec.network.mtu == 9000 and spec.network.vpc_cidr == "10.42.0.0/16"
    assert spec.access.bastion and spec.access.ssm and spec.access.bastion_instance_type == "t3.micro"
    assert spec.access.ssh_user == "ubuntu"
    assert spec.storage.scratch_mount == "/scratch" and spec.storage.root_volume_gib == 200
    assert not spec.storage.fsx.enabled and spec.storage.fsx.capacity_gib == 1200
    assert spec.image.ami_id is None and spec.image.ssm_parameter == DEFAULT_DLAMI_PARAMETER
    assert spec.checkpoint_bucket.retention_days == 7
    assert spec.expiry_hours == 24
    assert spec.base_tags() == {"fsdp-cluster:cluster": "demo"}
    assert spec.warnings() == []


def test_reservation_turns_the_placement_group_off_with_a_warning():
    spec = parse_spec(demo_data(capacity={"type": "capacity-reservation",
                                          "reservation_id": "cr-0123456789abcdef0"}))
    assert not spec.uses_placement_group
    assert any("placement group" in w and "cr-0123456789abcdef0" in w for w in spec.warnings())
    spec = parse_spec(demo_data(capacity={"type": "capacity-block", "reservation_id": "cr-0123456789abcdef0"},
                                placement_group={"existing_name": "reserved-pg"}))
    assert spec.uses_placement_group and spec.warnings() == []


REJECTED = {
    "unknown instance type": (
        {"instance_type": "p4d.24xl"}, "instance_type", "p4d.24xl", "did you mean p4d.24xlarge"),
    "node_count below 1": ({"node_count": 0}, "node_count", 0, "at least 1 node"),
    "MTU below 576": ({"network": {"mtu": 500}}, "network.mtu", 500, "9000"),
    "MTU above 9001": ({"network": {"mtu": 9216}}, "network.mtu", 9216, "9000"),
    "AZ of another region": (
        {"availability_zone": "us-west-2a"}, "availability_zone", "us-west-2a", "us-east-1a"),
    "SSH open to the internet": (
        {"ssh_cidr": "0.0.0.0/0"}, "ssh_cidr", "0.0.0.0/0", "allow_ssh_from_anywhere"),
    "FSx capacity AWS rejects": (
        {"storage": {"fsx": {"enabled": True, "capacity_gib": 3000}}}, "storage.fsx.capacity_gib", 3000,
        "use 2400 or 4800"),
    "FSx capacity below the minimum": (
        {"storage": {"fsx": {"enabled": True, "capacity_gib": 1000}}}, "storage.fsx.capacity_gib", 1000,
        "use 1200"),
    "spot with a reservation": (
        {"capacity": {"type": "spot", "reservation_id": "cr-0123456789abcdef0"}}, "capacity.reservation_id",
        "cr-0123456789abcdef0", "remove reservation_id"),
    "zero retention days": (
        {"checkpoint_bucket": {"retention_days": 0}}, "checkpoint_bucket.retention_days", 0, "use 7"),
    "retention shorter than S3's rounding can keep": (
        {"checkpoint_bucket": {"retention_days": 3}}, "checkpoint_bucket.retention_days", 3,
        "at least 4"),
    "bastion user without an image": (
        {"access": {"ssh_user": "admin"}}, "access.ssh_user", "admin", "access.bastion: false"),
    "PERSISTENT_2 export path differs": (
        {"storage": {"fsx": {"enabled": True, "s3_import_path": "s3://data-bucket/in",
                             "s3_export_path": "s3://data-bucket/out"}}},
        "storage.fsx.s3_export_path", "s3://data-bucket/out", "s3://data-bucket/in"),
    "FSx final backup of a scratch file system": (
        {"storage": {"fsx": {"enabled": True, "deployment_type": "SCRATCH_2", "at_expiry": "backup"}}},
        "storage.fsx.at_expiry", "backup", "use delete"),
    "FSx final backup of a file system linked to S3": (
        {"storage": {"fsx": {"enabled": True, "s3_import_path": "s3://data-bucket/in",
                             "at_expiry": "backup"}}},
        "storage.fsx.at_expiry", "backup", "s3_export_path"),
    "unknown FSx expiry action": (
        {"storage": {"fsx": {"enabled": True, "at_expiry": "snapshot"}}}, "storage.fsx.at_expiry", "snapshot",
        "'delete', 'backup' or 'keep'"),
    "GPU utilisation threshold above 100 %": (
        {"recovery": {"gpu_idle_pct": 150}}, "recovery.gpu_idle_pct", 150,
        "use e.g. 5, or 0 to turn the rule off"),
    "negative GPU utilisation threshold": (
        {"recovery": {"gpu_idle_pct": -1}}, "recovery.gpu_idle_pct", -1, "is outside 0 to 100 percent"),
    "GPU idle window shorter than a large model's load": (
        {"recovery": {"gpu_idle_s": 60}}, "recovery.gpu_idle_s", 60, "use e.g. 1800"),
    "GPU idle window longer than a day": (
        {"recovery": {"gpu_idle_s": 90000}}, "recovery.gpu_idle_s", 90000, "is outside 300 to 86400 seconds"),
    "GPU idle window not a whole number": (
        {"recovery": {"gpu_idle_s": "30m"}}, "recovery.gpu_idle_s", "30m", "write a whole number"),
    "local login user that is no user name": (
        {"local": {"login_user": "Bad User"}}, "local.login_user", "Bad User", "e.g. root or ubuntu"),
}


@pytest.mark.parametrize("case", REJECTED, ids=list(REJECTED))
def test_rejected_input_names_field_value_fix_and_registers_nothing(case):
    overrides, field, value, fix_hint = REJECTED[case]
    data = demo_data(**overrides)
    with pytest.raises(SpecError) as caught:
        parse_spec(data)
    problems = [p for p in caught.value.problems if p.field == field]
    assert problems, f"no problem reported for {field}: {caught.value}"
    assert problems[0].value == value
    assert fix_hint in f"{problems[0].message} {problems[0].fix}"
    assert fix_hint in str(caught.value)

    # The same config given to the Pulumi program (as `pulumi up` does) registers nothing.
    recorder = RecordingMocks()
    with pytest.raises(SpecError):
        run_offline(data, EXPIRES_AT, mocks=recorder)
    assert recorder.registrations == []


def test_the_gpu_utilisation_rule_defaults_and_its_off_switch():
    recovery = parse_spec(demo_data()).recovery
    assert (recovery.gpu_idle_pct, recovery.gpu_idle_s) == (5, 1800)
    off = parse_spec(demo_data(recovery={"gpu_idle_pct": 0, "gpu_idle_s": 300})).recovery
    assert (off.gpu_idle_pct, off.gpu_idle_s) == (0, 300)
    with pytest.raises(SpecError) as caught:
        parse_spec(demo_data(recovery={"gpu_idle_s": 60}))
    assert [str(p) for p in caught.value.problems] == [
        "recovery.gpu_idle_s: is outside 300 to 86400 seconds (a day): a large model loads for minutes "
        "with its GPUs idle, so a shorter window would requeue a job that is starting (got 60). Fix: use "
        "e.g. 1800"]


def test_the_shortest_retention_accepted_is_the_shortest_the_lifecycle_rule_can_keep():
    from infra.components.storage import MIN_RETENTION_DAYS, lifecycle_days, longest_kept_days

    spec = parse_spec(demo_data(checkpoint_bucket={"retention_days": MIN_RETENTION_DAYS}))
    current, noncurrent = lifecycle_days(spec.checkpoint_bucket.retention_days)
    assert current >= 1 and noncurrent >= 1  # S3's minimum for both
    assert longest_kept_days(current, noncurrent) == MIN_RETENTION_DAYS
    with pytest.raises(SpecError):
        parse_spec(demo_data(checkpoint_bucket={"retention_days": MIN_RETENTION_DAYS - 1}))


def test_ssh_from_anywhere_needs_the_opt_in():
    spec = parse_spec(demo_data(ssh_cidr="0.0.0.0/0", allow_ssh_from_anywhere=True))
    assert spec.ssh_cidr == "0.0.0.0/0"


def test_every_problem_is_listed_at_once():
    data = demo_data(instance_type="p5.48xl", node_count=0, network={"mtu": 10000}, ssh_cidr="0.0.0.0/0",
                     availability_zone="eu-west-1a", checkpoint_bucket={"retention_days": 0},
                     capacity={"type": "spot", "reservation_id": "cr-0123456789abcdef0"},
                     storage={"fsx": {"enabled": True, "capacity_gib": 5000}}, colour="blue")
    with pytest.raises(SpecError) as caught:
        parse_spec(data)
    fields = {p.field for p in caught.value.problems}
    assert fields >= {"instance_type", "node_count", "network.mtu", "ssh_cidr", "availability_zone",
                      "checkpoint_bucket.retention_days", "capacity.reservation_id",
                      "storage.fsx.capacity_gib", "colour"}
    assert all(p.fix for p in caught.value.problems)


def test_a_bad_expiry_time_registers_nothing():
    recorder = RecordingMocks()
    with pytest.raises(SpecError, match="ISO 8601 UTC"):
        run_offline(demo_data(), "2026-12-03 13:00 +0200", mocks=recorder)
    assert recorder.registrations == []


def test_spec_round_trips_through_the_stack_config_object():
    """`fsdpctl up` stores the spec as a JSON object in `fsdp-cluster:cluster`; the program must read
    back exactly the same spec, every default included."""
    import json

    spec = parse_spec(demo_data(capacity={"type": "spot", "spot_max_price": 12.5}, tags={"team": "llm"},
                                storage={"fsx": {"enabled": True, "s3_import_path": "s3://acme-data/x"}}))
    config_object = json.loads(json.dumps(spec.model_dump(mode="json")))
    assert parse_spec(config_object) == spec


FSX_AT_EXPIRY_WARNINGS = {
    "delete": "is deleted without a final backup",
    "backup": "`fsdpctl down` does not delete it",
    "keep": "keeps billing after the expiry",
}


@pytest.mark.parametrize("at_expiry", FSX_AT_EXPIRY_WARNINGS)
def test_plan_and_up_warn_what_the_expiry_does_to_the_file_system(at_expiry):
    """Deleted without a backup, backed up into a backup that outlives the cluster, or kept billing:
    each is said in the warnings `plan` prints and `up` repeats before asking."""
    from fsdpctl.plan import estimate_cost, load_prices, render_text

    fsx = {"enabled": True, "deployment_type": "PERSISTENT_2", "at_expiry": at_expiry}
    plan = plan_of(storage={"fsx": fsx})
    [warning] = [w for w in plan.spec.warnings() if w.startswith("storage.fsx.at_expiry")]
    assert FSX_AT_EXPIRY_WARNINGS[at_expiry] in warning
    text = " ".join(render_text(plan, estimate_cost(plan, load_prices())).split())
    assert "Warnings: none" not in text and FSX_AT_EXPIRY_WARNINGS[at_expiry] in text
    # Nothing expires without expiry_hours, and there is nothing to say without FSx.
    assert not [w for w in parse_spec(demo_data(expiry_hours=None, storage={"fsx": fsx})).warnings()
                if w.startswith("storage.fsx")]
    assert parse_spec(demo_data(storage={"fsx": {**fsx, "enabled": False}})).warnings() == []


def test_the_file_system_kept_at_expiry_is_what_keeps_billing():
    from fsdpctl.plan.cost import after_expiry

    after = after_expiry(plan_of(storage={"fsx": {"enabled": True, "at_expiry": "keep"}}))
    assert "FSx for Lustre file system demo-fsx" in after.still_billed
    after = after_expiry(plan_of(storage={"fsx": {"enabled": True, "at_expiry": "backup"}}))
    assert "FSx for Lustre file system demo-fsx" in after.stopped


@pytest.mark.parametrize(("changes", "phrase"), [
    ({}, "the nodes, the bastion, the capacity reservation and the NAT gateway"),
    ({"storage": {"fsx": {"enabled": True}}, "access": {"bastion": False}},
     "the nodes, the capacity reservation, the NAT gateway and the file system"),
    ({"storage": {"fsx": {"enabled": True, "at_expiry": "keep"}}, "capacity": {"all_or_nothing": False}},
     "the nodes, the bastion and the NAT gateway"),
])
def test_what_the_expiry_stopped_is_said_per_spec(changes, phrase):
    """status, extend and up after an expiry name what the schedules stopped: what this spec has and
    the program gives a schedule, not a fixed list (a kept file system was not stopped)."""
    spec = parse_spec(demo_data(**changes))
    assert spec.stopped_at_expiry() == phrase
    schedules = {r.name for r in plan_of(**changes).mocks.of_type("aws:scheduler/schedule:Schedule")}
    assert any(n.endswith("expiry-fsx") for n in schedules) == ("file system" in phrase)
    assert any(n.endswith("expiry-bastion") for n in schedules) == ("bastion" in phrase)
