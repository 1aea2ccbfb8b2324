"""An elastic cluster (spec `scaling`): which nodes may be powered down, the refusals and warnings, and
what the program gives the controller (rank 0) to start and stop them, run under the offline
planner's recording mocks (Pulumi's own mock engine)."""

from __future__ import annotations

import fnmatch
import json

import pytest

from fsdpctl.targets.aws import permissions
from infra.spec import CLUSTER_TAG, RANK_TAG, SpecError, parse_spec
from tests.infra.conftest import demo_data, plan_of

ROLE, POLICY = "aws:iam/role:Role", "aws:iam/rolePolicy:RolePolicy"
PROFILE, INSTANCE = "aws:iam/instanceProfile:InstanceProfile", "aws:ec2/instance:Instance"
RESERVATION = "cr-0123456789abcdef0"
# 4 nodes, 1 always on, without the all-or-nothing reservation (which would bill for all 4 anyway).
ELASTIC = {"scaling": {"min_nodes": 1}, "capacity": {"all_or_nothing": False}}


def problems_of(data: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as raised:
        parse_spec(data)
    return {p.field: str(p) for p in raised.value.problems}


# ---- the spec ---------------------------------------------------------------------------------
def test_the_default_is_a_fixed_cluster():
    spec = parse_spec(demo_data())
    assert (spec.scaling.min_nodes, spec.scaling.max_nodes, spec.scaling.suspend_after_s) == (None, None, 600)
    assert spec.static_node_count == 4 and not spec.power_saving
    assert not [w for w in spec.warnings() if w.startswith("scaling")]


@pytest.mark.parametrize(("scaling", "static"), [
    ({"min_nodes": 1}, 1), ({"min_nodes": 3, "max_nodes": 4}, 3), ({"min_nodes": 4}, 4),
    ({"max_nodes": 4}, 4),
])
def test_nodes_below_min_nodes_are_static(scaling, static):
    spec = parse_spec(demo_data(scaling=scaling))
    assert spec.static_node_count == static
    assert spec.power_saving is (static < 4)


@pytest.mark.parametrize(("capacity", "why"), [
    ({"type": "capacity-block", "reservation_id": RESERVATION},
     "capacity-block nodes bill whether running or stopped"),
    ({"type": "capacity-reservation", "reservation_id": RESERVATION},
     "capacity-reservation nodes bill whether running or stopped"),
    ({"type": "spot"}, "spot nodes are one-time spot instances, which EC2 cannot stop"),
])
def test_capacity_that_cannot_stop_keeps_the_cluster_fixed_and_says_so(capacity, why):
    spec = parse_spec(demo_data(scaling={"min_nodes": 1}, capacity=capacity))
    assert spec.static_node_count == 4 and not spec.power_saving
    scaling = [w for w in spec.warnings() if w.startswith("scaling")]
    assert scaling == [f"scaling.min_nodes: 1 ignored: {why}, so none is powered down."]


def test_a_power_saving_cluster_is_warned_about_its_scratch_and_the_all_or_nothing_reservation():
    spec = parse_spec(demo_data(scaling={"min_nodes": 2}))
    on_demand = [w for w in spec.warnings() if w.startswith("scaling")]
    assert on_demand[0].startswith("scaling: nodes from rank 2 come back from a stop with /scratch empty")
    assert on_demand[1].startswith("scaling: the all-or-nothing capacity reservation "
                                   "(capacity.all_or_nothing) bills for all 4 nodes whether they run or are "
                                   "stopped")
    assert "set capacity.all_or_nothing: false" in on_demand[1]
    without = [w for w in parse_spec(demo_data(**ELASTIC)).warnings() if w.startswith("scaling")]
    assert len(without) == 1 and "/scratch empty" in without[0]


@pytest.mark.parametrize(("scaling", "field", "said"), [
    ({"min_nodes": 0}, "scaling.min_nodes",
     "scaling.min_nodes: rank 0 runs the Slurm controller and is always on (got 0). Fix: use 1 or more, or "
     "leave it out for a fixed cluster"),
    ({"min_nodes": 5}, "scaling.min_nodes",
     "scaling.min_nodes: is more than node_count 4 (got 5). Fix: use 1 to 4, or leave it out to keep every "
     "node on"),
    ({"max_nodes": 8}, "scaling.max_nodes",
     "scaling.max_nodes: differs from node_count 4: `up` creates every node and idle ones are stopped, not "
     "terminated, so node_count nodes is the most that run (got 8). Fix: set it to 4 or leave it out; for up "
     "to 8 nodes set node_count: 8"),
    ({"min_nodes": 1, "max_nodes": 2}, "scaling.max_nodes",
     "scaling.max_nodes: differs from node_count 4: `up` creates every node and idle ones are stopped, not "
     "terminated, so node_count nodes is the most that run (got 2). Fix: set it to 4 or leave it out"),
    ({"suspend_after_s": 30}, "scaling.suspend_after_s",
     "scaling.suspend_after_s: is outside 60 to 86400 seconds (a day): a stopped node takes minutes to "
     "start again, so a shorter wait would stop nodes between two jobs (got 30). Fix: use e.g. 600"),
    ({"suspend_after_s": 86401}, "scaling.suspend_after_s", "is outside 60 to 86400 seconds"),
    ({"min_nodes": "one"}, "scaling.min_nodes",
     "scaling.min_nodes: is not a whole number (got 'one'). Fix: write a whole number, without quotes"),
    ({"min_node": 1}, "scaling.min_node", "Fix: did you mean `min_nodes`?"),
])
def test_bad_scaling_is_refused_in_one_line_with_the_fix(scaling, field, said):
    problems = problems_of(demo_data(scaling=scaling))
    assert said in problems[field]
    if said.startswith(field):  # the whole line
        assert problems[field] == said
    assert "\n" not in problems[field]
    assert not any("Input should" in p or "Value error" in p for p in problems.values())


def test_scaling_is_checked_next_to_another_bad_field():
    problems = problems_of(demo_data(ssh_cidr="203.0.113.7", scaling={"min_nodes": 9, "max_nodes": 3}))
    assert {"ssh_cidr", "scaling.min_nodes", "scaling.max_nodes"} <= set(problems)


# ---- the program ------------------------------------------------------------------------------
def _nodes(plan):
    return sorted((r for r in plan.mocks.of_type(INSTANCE) if RANK_TAG in r.tags),
                  key=lambda r: int(r.tags[RANK_TAG]))


def test_a_fixed_cluster_has_no_controller_role_and_no_node_carries_its_own_profile(demo_plan):
    for plan in (demo_plan, plan_of(scaling={"min_nodes": 4}),
                 plan_of(scaling={"min_nodes": 1}, capacity={"type": "spot"})):
        assert {r.name for r in plan.mocks.of_type(ROLE)} == {"demo-node", "demo-expiry"}
        assert [p.name for p in plan.mocks.of_type(PROFILE)] == ["demo-node"]
        assert not [r for r in plan.mocks.of_type(POLICY) if r.name.endswith("-power")]
        assert not [n for n in _nodes(plan) if "iamInstanceProfile" in n.inputs]


def test_the_controller_runs_with_its_own_profile_and_the_others_with_the_templates():
    plan = plan_of(**ELASTIC)
    m = plan.mocks
    controller = m.named("demo-node-controller", PROFILE)
    role = m.named("demo-node-controller", ROLE)
    assert controller.inputs["role"] == f"<{role.name}.name>"
    assert controller.tags[CLUSTER_TAG] == "demo" and role.tags[CLUSTER_TAG] == "demo"
    node0, *others = _nodes(plan)
    assert node0.inputs["iamInstanceProfile"] == f"<{controller.name}.name>"
    assert [n.inputs.get("iamInstanceProfile") for n in others] == [None, None, None]
    node_profile = m.named("demo-node", PROFILE)
    assert m.one("aws:ec2/launchTemplate:LaunchTemplate").inputs["iamInstanceProfile"] == {
        "arn": f"<{node_profile.name}.arn>"}


def test_the_controller_role_has_the_node_roles_policies_plus_start_and_stop_of_the_powered_nodes():
    plan = plan_of(**ELASTIC)
    m = plan.mocks
    node, controller = m.named("demo-node", ROLE), m.named("demo-node-controller", ROLE)
    assert controller.inputs["assumeRolePolicy"] == node.inputs["assumeRolePolicy"]
    attached = {a.inputs["role"]: a.inputs["policyArn"]
                for a in m.of_type("aws:iam/rolePolicyAttachment:RolePolicyAttachment")}
    assert attached == {f"<{r.name}.name>": "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"
                        for r in (node, controller)}
    inline = {p.name: p for p in m.of_type(POLICY)}
    assert inline["demo-node-controller-checkpoints"].inputs["policy"] == \
        inline["demo-node-checkpoints"].inputs["policy"]
    assert inline["demo-node-controller-power"].inputs["role"] == f"<{controller.name}.name>"
    assert json.loads(inline["demo-node-controller-power"].inputs["policy"]) == {
        "Version": "2012-10-17",
        "Statement": [
            {"Sid": "StartAndStopThisClustersPoweredNodes", "Effect": "Allow",
             "Action": ["ec2:StartInstances", "ec2:StopInstances"],
             "Resource": "arn:aws:ec2:us-east-1:*:instance/*",
             "Condition": {"StringEquals": {"aws:ResourceTag/fsdp-cluster:cluster": "demo",
                                            "aws:ResourceTag/fsdp-cluster:node-rank": ["1", "2", "3"]}}},
            {"Sid": "ReadInstanceStates", "Effect": "Allow", "Action": "ec2:DescribeInstances",
             "Resource": "*"},
        ]}
    # The tags the conditions name are the ones the nodes really carry.
    assert [(n.tags[CLUSTER_TAG], n.tags[RANK_TAG]) for n in _nodes(plan)] == [
        ("demo", "0"), ("demo", "1"), ("demo", "2"), ("demo", "3")]


def test_only_the_nodes_that_may_be_powered_down_can_be_started_or_stopped():
    plan = plan_of(node_count=6, region="eu-west-1", availability_zone="eu-west-1a",
                   scaling={"min_nodes": 4}, capacity={"all_or_nothing": False})
    policy = json.loads(plan.mocks.named("demo-node-controller-power", POLICY).inputs["policy"])
    [start_stop] = [s for s in policy["Statement"] if s["Sid"] == "StartAndStopThisClustersPoweredNodes"]
    assert start_stop["Condition"]["StringEquals"]["aws:ResourceTag/fsdp-cluster:node-rank"] == ["4", "5"]
    assert start_stop["Resource"] == "arn:aws:ec2:eu-west-1:*:instance/*"


def test_the_operators_policy_may_pass_the_controller_role():
    """`up` passes the controller role to EC2 through its instance profile: its name must match the
    operator policy's PassRole scope (Pulumi names a role <logical name>-<7 random hex>)."""
    plan = plan_of(**ELASTIC)
    document = permissions.policy_document(cluster="demo", partition="aws")
    [scope] = [s for s in document["Statement"] if "iam:PassRole" in s["Action"]]
    role = plan.mocks.named("demo-node-controller", ROLE)
    assert "name" not in role.inputs
    arn = f"arn:aws:iam::123456789012:role/{role.name}-0a1b2c3"
    assert any(fnmatch.fnmatchcase(arn, pattern) for pattern in scope["Resource"])


def test_power_saving_adds_only_the_controllers_identity():
    fixed = plan_of(capacity={"all_or_nothing": False}).mocks.counts()
    elastic = plan_of(**ELASTIC).mocks.counts()
    added = {t: elastic[t] - fixed.get(t, 0) for t in elastic if elastic[t] != fixed.get(t, 0)}
    assert added == {ROLE: 1, POLICY: 2, PROFILE: 1,
                     "aws:iam/rolePolicyAttachment:RolePolicyAttachment": 1}
