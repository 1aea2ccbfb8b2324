"""A "no" changes nothing, and later verbs apply only their own change: `up` asks before it writes
the stack config (the preview reads the new spec from a copy of the stack settings), `extend` and
`replace` update only what they are for (a targeted `pulumi up`), a failed `up` says what bills, and
the cost `up` asks about is never the priced part passed off as the whole."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from pulumi import automation as auto

from fsdpctl import lifecycle
from fsdpctl.errors import CommandError, UsageError
from fsdpctl.targets.aws import stack
from infra.offline import run_offline
from infra.program import EXPIRES_AT_KEY, RETEMPLATE_KEY, node_urn
from infra.spec import PULUMI_CONFIG_KEY

from .conftest import make_spec
from .test_stack import NOW, RecordingStack, new_state

# The fixtures of test_stack (a fake pulumi CLI, pre-flight passing, the fsdpctl home).
from .test_stack import fake_pulumi, fsdpctl_home, passing_preflight  # noqa: F401  isort: skip

APPROVED = make_spec(node_count=2)
DECLINED = make_spec(node_count=3, instance_type="p4de.24xlarge", availability_zone="us-east-1c")
PINNED = "2099-01-01T00:00:00Z"


class SettingsFileStack(RecordingStack):
    """An existing stack whose config lives in its settings file, as the Automation API's local
    workspace keeps it (Pulumi.<stack>.yaml): every set or removed key rewrites the file. `up`
    records the config it ran with and what it targeted."""

    def __init__(self, path, spec):
        super().__init__(existing=True)
        self.path, self.previewed = path, []
        config = {"aws:region": spec.region, PULUMI_CONFIG_KEY: json.dumps(spec.model_dump(mode="json")),
                  EXPIRES_AT_KEY: PINNED}
        for key, value in config.items():
            self.set_config(key, auto.ConfigValue(value))

    def _save(self):
        self.path.write_text(yaml.safe_dump({"encryptionsalt": "v1:salt", "config": self.config}))

    def set_config(self, key, value):
        super().set_config(key, value)
        self._save()

    def remove_config(self, key):
        super().remove_config(key)
        self._save()

    def preview(self, **kwargs):
        super().preview(**kwargs)
        config_file = kwargs.get("config_file")
        self.previewed.append(yaml.safe_load(Path(config_file).read_text()) if config_file else None)

    def export_stack(self):
        """The state after the refresh: the approved spec's nodes but pf-node0, which it found gone."""
        return auto.Deployment(version=3, deployment={"resources": [
            {"urn": node_urn("pf", APPROVED, rank), "type": "aws:ec2/instance:Instance", "custom": True}
            for rank in range(1, APPROVED.node_count)]})

    def up(self, **kwargs):
        self.calls.append(("up", {"config": dict(self.config), **kwargs}))
        return auto.UpResult("", "", auto.UpdateSummary(
            kind="update", start_time=None, message="", environment={}, config={}, result="succeeded",
            end_time=None, version=3, deployment=None, resource_changes={"update": 1}), outputs={})


def no(question: str) -> None:
    raise CommandError("not confirmed; nothing was done")


@pytest.fixture
def declined(tmp_path, monkeypatch):
    """An existing stack of APPROVED, after `up` of DECLINED was answered no."""
    fake = SettingsFileStack(tmp_path / "Pulumi.pf.yaml", APPROVED)
    monkeypatch.setattr(stack, "open_stack", lambda spec, command, create: fake)
    state = new_state(tmp_path, APPROVED)
    state.update(pulumi_stack="pf", expires_at=PINNED, ssh={"user": "ubuntu", "key_file": str(tmp_path / "k"),
                                                            "known_hosts": str(tmp_path / "kh")},
                 nodes=[{"rank": r, "name": f"pf-node{r}", "address": f"10.0.0.{r}", "instance_id": f"i-{r}"}
                        for r in (0, 1)])
    before = fake.path.read_bytes()
    with pytest.raises(CommandError, match="not confirmed"):
        stack.up(state, DECLINED, node_count=3, approve=no, out=lambda _: None)
    assert fake.path.read_bytes() == before  # byte-identical: nothing was written before the yes
    return fake, state


@pytest.mark.usefixtures("passing_preflight")
def test_a_declined_up_previews_the_new_spec_and_writes_no_config(declined):
    fake, _ = declined
    assert [name for name, _ in fake.calls] == ["refresh", "preview"]
    # The preview ran on a copy of the settings with the new spec in it (and the pinned expiry).
    (settings,) = fake.previewed
    assert settings["encryptionsalt"] == "v1:salt"
    deployed = json.loads(settings["config"][PULUMI_CONFIG_KEY])
    assert (deployed["node_count"], deployed["instance_type"]) == (3, "p4de.24xlarge")
    assert settings["config"][EXPIRES_AT_KEY] == PINNED
    assert json.loads(fake.config[PULUMI_CONFIG_KEY])["node_count"] == 2


@pytest.mark.usefixtures("passing_preflight")
def test_extend_after_a_declined_up_updates_only_what_carries_the_expiry(declined, monkeypatch):
    fake, state = declined
    monkeypatch.setattr(stack, "_record_outputs", lambda *args: None)
    state.update(cost_per_hour=None, cost_per_hour_max=220.31)  # a spot cluster: only its cap is known
    questions = []
    stack.extend(state, APPROVED, hours=4, approve=questions.append, out=lambda _: None, now=NOW)
    assert questions[0].endswith("(at most 881.24 USD more)?")
    (call,) = [c for name, c in fake.calls if name == "up"]
    assert json.loads(call["config"][PULUMI_CONFIG_KEY])["node_count"] == 2
    assert call["config"][EXPIRES_AT_KEY] == "2099-01-01T04:00:00Z"
    # Only what the expiry time reaches: the schedules and every resource with the expires-at tag,
    # as the program registers them for the deployed spec; nothing of the declined one.
    plan = run_offline(APPROVED, PINNED).mocks
    urns = {r.name: r.urn for r in plan.resources}
    targets = set(call["target"])
    assert {urns["pf-node0"], urns["pf-node1"], urns["pf-vpc"]} <= targets
    assert {r.urn for r in plan.of_type("aws:scheduler/schedule:Schedule")} <= targets
    assert node_urn("pf", DECLINED, 2) not in targets
    untouched = {r.urn for r in plan.of_type("aws:ec2/routeTableAssociation:RouteTableAssociation")}
    assert untouched and not untouched & targets
    assert not call.get("target_dependents")


@pytest.mark.usefixtures("passing_preflight")
def test_replace_after_a_declined_up_updates_only_its_node_and_what_names_it(declined, monkeypatch):
    fake, state = declined
    monkeypatch.setattr(stack.AwsClients, "for_spec", classmethod(lambda cls, spec: None))
    monkeypatch.setattr(stack.sweep, "terminate_and_wait", lambda aws, leftovers, out: [])
    monkeypatch.setattr(stack, "_record_outputs", lambda *args: None)
    waited = []  # the new node's boot (tests/aws/test_stack.py): no SSH from here
    monkeypatch.setattr(stack, "wait_for_ssh", lambda state, node, out: waited.append(node.name))
    stack.replace_node(state, APPROVED, 1, out=lambda _: None)
    assert waited == ["pf-node1"]
    (call,) = [c for name, c in fake.calls if name == "up"]
    urn = node_urn("pf", APPROVED, 1)
    assert (call["target"], call["replace"], call["target_dependents"]) == ([urn], [urn], True)
    assert json.loads(call["config"][PULUMI_CONFIG_KEY])["node_count"] == 2
    assert call["config"][RETEMPLATE_KEY] == "[1]" and RETEMPLATE_KEY not in fake.config


@pytest.mark.usefixtures("passing_preflight")
def test_a_declined_up_creates_no_stack(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(stack, "open_stack", lambda spec, command, create: asked.append(create))
    with pytest.raises(CommandError, match="not confirmed"):
        stack.up(new_state(tmp_path, APPROVED), APPROVED, node_count=2, approve=no, out=lambda _: None)
    assert asked == [False]


@pytest.mark.usefixtures("passing_preflight")
def test_a_declined_up_keeps_the_clusters_spec_copy(declined, tmp_path, monkeypatch):
    """`fsdpctl up` of a changed spec, answered no: the state's spec copy (what `extend`, `replace`
    and `down` read) is the approved one still."""
    _, state = declined
    approved = state.spec_path.read_bytes()
    changed = tmp_path / "changed.yaml"
    changed.write_text(json.dumps(DECLINED.model_dump(mode="json")))
    with pytest.raises(UsageError, match="no terminal"):  # no terminal, no --yes: the answer is no
        lifecycle.up(changed, target="aws")
    assert state.spec_path.read_bytes() == approved
    assert state.read().node_count is None


@pytest.mark.parametrize(("capacity", "expected"), [
    ({"type": "spot"}, r"\(at most [\d,]+\.\d\d USD per hour \(4 x p5\.48xlarge spot, varies"),
    ({"type": "capacity-block", "reservation_id": "cr-0123456789abcdef0"},
     r"\(an unknown amount per hour \(4 x p5\.48xlarge capacity block, prepaid"),
])
@pytest.mark.usefixtures("passing_preflight")
def test_up_asks_with_the_bound_or_an_unknown_cost_never_the_priced_rest(tmp_path, monkeypatch, capacity,
                                                                         expected):
    monkeypatch.setattr(stack, "open_stack", lambda spec, command, create: None)
    spec = make_spec(instance_type="p5.48xlarge", node_count=4, capacity=capacity)
    questions = []

    def ask(question: str) -> None:
        questions.append(question)
        no(question)

    with pytest.raises(CommandError):
        stack.up(new_state(tmp_path, spec), spec, node_count=4, approve=ask, out=lambda _: None)
    (question,) = questions
    assert re.search(expected, question), question
    assert not re.search(r"about 0\.\d\d USD", question)


class FailingUpStack(SettingsFileStack):
    """`pulumi up` fails at the nodes (InsufficientInstanceCapacity) after the network, the bastion,
    the reservation and some schedules exist; the exported state is what Pulumi recorded."""

    def up(self, **kwargs):
        raise auto.errors.CommandError(auto.CommandResult(
            stdout="", code=255, stderr="error: creating EC2 Instance: InsufficientInstanceCapacity"))

    def export_stack(self):
        def resource(typ: str, name: str, rid: str, **inputs) -> dict:
            return {"urn": f"urn:pulumi:pf::fsdp-cluster::x${typ}::{name}", "custom": True, "type": typ,
                    "id": rid, "inputs": inputs}

        def schedule(name: str, payload: dict) -> dict:
            return resource("aws:scheduler/schedule:Schedule", name, name,
                            target={"input": json.dumps(payload)})

        return auto.Deployment(version=3, deployment={"resources": [
            {"urn": "urn:pulumi:pf::fsdp-cluster::pulumi:pulumi:Stack::fsdp-cluster-pf", "custom": False,
             "type": "pulumi:pulumi:Stack"},
            resource("aws:ec2/eip:Eip", "pf-nat-ip", "eipalloc-1"),
            resource("aws:ec2/natGateway:NatGateway", "pf-nat", "nat-1"),
            resource("aws:ec2/instance:Instance", "pf-bastion", "i-b"),
            resource("aws:ec2/capacityReservation:CapacityReservation", "pf-capacity", "cr-1"),
            resource("aws:s3/bucket:Bucket", "pf-checkpoints", "pf-checkpoints-x"),
            schedule("pf-expiry-nat", {"NatGatewayId": "nat-1"}),
            schedule("pf-expiry-nat-ip", {"AllocationId": "eipalloc-1"}),
        ]})


@pytest.mark.usefixtures("passing_preflight")
def test_a_failed_up_says_what_bills_until_when_and_that_down_removes_it(tmp_path, monkeypatch):
    fake = FailingUpStack(tmp_path / "Pulumi.pf.yaml", APPROVED)
    monkeypatch.setattr(stack, "open_stack", lambda spec, command, create: fake)
    state = new_state(tmp_path, APPROVED)
    with pytest.raises(CommandError) as err:
        stack.up(state, APPROVED, node_count=2, approve=lambda q: None, out=lambda _: None)
    message = str(err.value)
    assert "InsufficientInstanceCapacity" in message
    assert (f"until the expiry at {PINNED} (their schedules exist): Elastic IP (public IPv4) pf-nat-ip, "
            "NAT gateway pf-nat") in message
    assert ("until `fsdpctl down` (no expiry schedule for them yet): instance pf-bastion, "
            "capacity reservation pf-capacity") in message
    assert message.endswith("or remove all of it with `fsdpctl down --cluster pf`.")
    assert "pf-checkpoints" not in message  # a new bucket holds nothing yet
