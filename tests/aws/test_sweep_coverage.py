"""The tie between the Pulumi program and the teardown sweep: every resource type the program
registers (run under Pulumi's mocks with every optional part on) is one the sweep removes when
`pulumi destroy` leaves it, or one the table says needs no sweeping. A new resource type cannot ship
without its sweep step, and the table cannot keep types the program no longer makes."""

from __future__ import annotations

import pytest

from fsdpctl.targets.aws import sweep
from tests.infra.conftest import plan_of

# Every optional part on: a created VPC with NAT gateway and bastion, the all-or-nothing
# reservation, a created placement group, FSx with its S3 association, an imported key pair and
# the expiry schedules; and once without a pinned expiry (the program's clock resource).
FULL = {"storage": {"fsx": {"enabled": True, "s3_import_path": "s3://acme-data/tokens"}},
        "access": {"bastion": True, "public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDemoKey op@laptop"},
        "capacity": {"type": "on-demand", "all_or_nothing": True}}
PLANS = {"full": (FULL, "2026-12-03T13:00:00Z"), "unpinned expiry": (FULL, None)}


@pytest.fixture(scope="module")
def plans():
    return {name: plan_of(expires_at, **overrides) for name, (overrides, expires_at) in PLANS.items()}


def test_every_type_the_program_registers_is_swept_or_needs_no_sweep(plans):
    registered = {r.type for plan in plans.values() for r in plan.mocks.resources}
    assert registered - set(sweep.PROGRAM_TYPES) == set(), "add them to sweep.PROGRAM_TYPES (and the sweep)"
    assert set(sweep.PROGRAM_TYPES) - registered == set(), "the program no longer registers these"


def test_the_table_names_sweep_kinds_that_delete():
    deleting = {kind.name for kind in sweep.KINDS if kind.delete is not None}
    for resource_type, coverage in sweep.PROGRAM_TYPES.items():
        assert coverage.kind is None or coverage.kind in deleting, resource_type
        assert coverage.own or coverage.note, f"{resource_type}: say how it goes, or why it needs no sweep"
    # What is not swept is not in AWS at all: Pulumi's own bookkeeping.
    assert {t for t, c in sweep.PROGRAM_TYPES.items() if c.kind is None} == {
        "pulumi:providers:aws", "time:index/rotating:Rotating"}


def test_the_sweep_can_find_what_it_covers(plans):
    """Kinds found by the cluster tag need the tag on the resource; IAM, being global, is found by
    the cluster's name prefix first (Pulumi adds a random suffix to the logical name)."""
    for plan in plans.values():
        for record in plan.mocks.resources:
            coverage = sweep.PROGRAM_TYPES[record.type]
            if coverage.kind in ("iam-role", "instance-profile") and coverage.own:
                aws_name = record.inputs.get("name") or record.name  # else Pulumi's name plus a suffix
                assert aws_name.startswith(f"{plan.spec.name}-"), record.name
            elif coverage.own and coverage.kind != "schedule-group":
                assert record.tags.get("fsdp-cluster:cluster") == plan.spec.name, record.name
