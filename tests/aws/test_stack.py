"""The Automation API wrapper without the pulumi CLI (it cannot be installed here): the missing-CLI
error, that `up` touches nothing when pre-flight fails, the stack config, the SSH key, and the
outputs -> state mapping."""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
from pulumi import automation as auto

from fsdpctl import lifecycle
from fsdpctl import state as state_mod
from fsdpctl.errors import CommandError, UsageError
from fsdpctl.targets.aws import stack
from infra.program import EXPIRES_AT_KEY, OUTPUT_NAMES
from infra.spec import CLUSTER_TAG, PULUMI_CONFIG_KEY

from .conftest import Ec2Extras, make_spec, seed_image


@pytest.fixture
def fsdpctl_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "fsdpctl-home"
    monkeypatch.setenv("FSDPCTL_HOME", str(home))
    monkeypatch.setenv("HOME", str(tmp_path / "user-home"))
    (tmp_path / "user-home").mkdir()
    return home


@pytest.fixture
def no_pulumi(monkeypatch, fsdpctl_home):
    monkeypatch.setenv("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    assert stack.shutil.which("pulumi") is None


@pytest.fixture
def fake_pulumi(tmp_path, monkeypatch, fsdpctl_home) -> Path:
    """A `pulumi` that answers `version` (the Automation API asks first) and logs and refuses
    everything else: any stack operation shows up in the log."""
    log = tmp_path / "pulumi-calls.log"
    binary = tmp_path / "pulumi-root" / "bin" / "pulumi"
    binary.parent.mkdir(parents=True)
    binary.write_text('#!/bin/sh\necho "$@" >> "$FAKE_PULUMI_LOG"\n'
                      'if [ "$1" = version ]; then echo v3.272.0; exit 0; fi\n'
                      'echo "fake pulumi refuses: $*" >&2; exit 1\n')
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_PULUMI_LOG", str(log))
    monkeypatch.setenv("PATH", f"{binary.parent}:/usr/bin:/bin")
    return log


def refuse(question: str) -> None:
    raise AssertionError(f"asked {question!r} before pre-flight passed")


def new_state(tmp_path, spec) -> state_mod.ClusterState:
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(json.dumps(spec.model_dump(mode="json")))
    return state_mod.create(spec_file, spec, "aws")


def test_up_without_pulumi_cli_says_how_to_install_it(no_pulumi, tmp_path):
    spec = make_spec()
    with pytest.raises(CommandError) as err:
        stack.up(new_state(tmp_path, spec), spec, node_count=spec.node_count, approve=refuse, out=print)
    message = str(err.value)
    assert "the pulumi CLI is not installed" in message
    assert "curl -fsSL https://get.pulumi.com | sh" in message and stack.PULUMI_DOCS in message
    assert "Nothing was created" in message


def test_installer_location_is_found_without_path(no_pulumi, fake_pulumi, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    installed = Path(os.environ["HOME"]) / ".pulumi"
    (fake_pulumi.parent / "pulumi-root").rename(installed)
    command = stack.pulumi_command()
    assert command.command == str(installed / "bin" / "pulumi")


def test_up_creates_nothing_when_preflight_fails(fake_pulumi, aws, stub_quotas, tmp_path, monkeypatch):
    monkeypatch.setattr(stack.AwsClients, "for_spec", classmethod(lambda cls, spec: aws))
    spec = make_spec(instance_type="p4de.24xlarge", availability_zone="us-east-1a")
    state = new_state(tmp_path, spec)
    lines = []
    with pytest.raises(CommandError) as err:
        stack.up(state, spec, node_count=spec.node_count, approve=refuse, out=lines.append)
    message = str(err.value)
    assert message.startswith("pre-flight failed, nothing was created:")
    assert "set availability_zone to one of us-east-1b, us-east-1c" in message
    assert f"[1/{len(stack.preflight.CHECKS)}] instance type offered in AZ ..." in lines
    stub_quotas.assert_no_pending_responses()
    # The CLI was only asked for its version; no key was generated; AWS holds nothing new.
    assert fake_pulumi.read_text().split("\n")[:-1] == ["version"]
    assert not state.keys_dir.exists()
    assert aws.ec2.describe_key_pairs()["KeyPairs"] == []
    assert aws.ec2.describe_instances()["Reservations"] == []
    tagged = [{"Name": f"tag:{CLUSTER_TAG}", "Values": [spec.name]}]
    assert aws.ec2.describe_vpcs(Filters=tagged)["Vpcs"] == []


def test_down_without_cli_sweeps_but_keeps_the_state(no_pulumi, aws, tmp_path, monkeypatch):
    monkeypatch.setattr(stack.AwsClients, "for_spec", classmethod(lambda cls, spec: aws))
    Ec2Extras(aws.ec2)
    spec = make_spec()
    state = new_state(tmp_path, spec)
    state.update(pulumi_stack=spec.name)
    volume = aws.ec2.create_volume(AvailabilityZone="us-east-1b", Size=10, TagSpecifications=[
        {"ResourceType": "volume", "Tags": [{"Key": CLUSTER_TAG, "Value": spec.name}]}])["VolumeId"]
    with pytest.raises(CommandError) as err:
        stack.down(state, spec, force=True, out=lambda _: None)
    assert "pulumi destroy did not finish" in str(err.value) and "get.pulumi.com" in str(err.value)
    assert state.exists()
    assert aws.ec2.describe_volumes(Filters=[{"Name": "volume-id", "Values": [volume]}])["Volumes"] == []


def test_down_without_cli_and_without_a_stack_is_clean(no_pulumi, aws, tmp_path, monkeypatch):
    # `up` stopped before the stack existed (no CLI, failed pre-flight): nothing to destroy, so the
    # target reports clean and lifecycle removes the state.
    monkeypatch.setattr(stack.AwsClients, "for_spec", classmethod(lambda cls, spec: aws))
    Ec2Extras(aws.ec2)
    spec = make_spec()
    state = new_state(tmp_path, spec)
    said: list[str] = []
    stack.down(state, spec, out=said.append)
    stack.down(state, spec, out=said.append)  # and again: still fine
    assert said.count(f"cluster {spec.name}: nothing left in {spec.region}") == 2


class FakeStack:
    """The config part of an Automation API Stack, with the CLI's behaviour for a missing key, and
    its workspace's view of the stack settings file."""

    name = "pf"

    def __init__(self):
        self.config: dict[str, str] = {}

    def set_config(self, key, value):
        self.config[key] = value.value

    def get_config(self, key):
        if key not in self.config:
            raise auto.errors.CommandError(auto.CommandResult(stdout="", stderr=f"{key} not found", code=1))
        return auto.ConfigValue(self.config[key])

    def remove_config(self, key):
        self.config.pop(key)

    @property
    def workspace(self):
        return SimpleNamespace(stack_settings=lambda name: auto.StackSettings(
            secrets_provider="passphrase", encryption_salt="v1:salt", config=dict(self.config)))


def test_stack_config_carries_the_spec_and_pins_the_expiry():
    spec = make_spec(expiry_hours=6, tags={"team": "ml"})
    fake = FakeStack()
    config = stack.stack_config(fake, spec)
    assert fake.config == {}  # worked out, not written: `up` writes it after the yes
    stack.write_stack_config(fake, config)
    first = config.expires_at
    assert fake.config["aws:region"] == "us-east-1"
    assert json.loads(fake.config[PULUMI_CONFIG_KEY]) == spec.model_dump(mode="json")
    assert fake.config[EXPIRES_AT_KEY] == first and first.endswith("Z")
    # A later `up` (even with another expiry_hours) keeps the pinned time.
    assert stack.stack_config(fake, make_spec(expiry_hours=48)).expires_at == first
    assert stack.stack_config(None, make_spec(expiry_hours=6)).expires_at is not None  # a new stack
    assert stack.stack_config(FakeStack(), make_spec(expiry_hours=None)).expires_at is None


def test_generated_key_is_reused_and_its_public_half_goes_into_the_spec(fsdpctl_home, tmp_path):
    spec = make_spec()
    state = new_state(tmp_path, spec)
    key, deployed = stack.ssh_key(state, spec)
    assert key == state.keys_dir / "id_ed25519" and key.exists()
    assert deployed.access.public_key == key.with_suffix(".pub").read_text().strip()
    assert deployed.access.public_key.startswith("ssh-ed25519 ")
    assert spec.access.public_key is None
    again, redeployed = stack.ssh_key(state, spec)
    assert again == key and redeployed.access.public_key == deployed.access.public_key


def test_users_own_key_is_located_or_refused_before_anything_is_created(fsdpctl_home, tmp_path, monkeypatch):
    ssh_dir = Path(os.environ["HOME"]) / ".ssh"
    ssh_dir.mkdir()
    spec = make_spec(access={"key_name": "team-key"})
    state = new_state(tmp_path, spec)
    with pytest.raises(CommandError, match=r"cannot find the private key for key pair 'team-key' .*"
                                           r"set FSDPCTL_SSH_KEY=/path/to/private-key"):
        stack.ssh_key(state, spec)
    (ssh_dir / "team-key.pem").write_text("PRIVATE")
    assert stack.ssh_key(state, spec) == (ssh_dir / "team-key.pem", spec)

    (ssh_dir / "laptop").write_text("PRIVATE")
    (ssh_dir / "laptop.pub").write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample me@laptop\n")
    by_public = make_spec(access={"public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample"})
    assert stack.ssh_key(state, by_public)[0] == ssh_dir / "laptop"
    monkeypatch.setenv("FSDPCTL_SSH_KEY", str(ssh_dir / "team-key.pem"))
    assert stack.ssh_key(state, by_public)[0] == ssh_dir / "team-key.pem"


OUTPUTS = {
    "nodes": [
        {"rank": 1, "name": "pf-node1", "instance_id": "i-0bbb", "private_ip": "10.42.1.11", "efa_count": 4},
        {"rank": 0, "name": "pf-node0", "instance_id": "i-0aaa", "private_ip": "10.42.1.10", "efa_count": 4},
    ],
    "bastion_public_ip": "198.51.100.7", "ssh_user": "ubuntu", "checkpoint_bucket": "pf-checkpoints-x",
    "fsx_dns_name": "fs-1.fsx.us-east-1.amazonaws.com", "fsx_mount_name": "abcdef",
    "placement_group": "pf-pg",
    "security_group_id": "sg-1", "vpc_id": "vpc-1", "private_subnet_id": "subnet-1", "ami_id": "ami-1",
    "key_name": "pf-key",
}


def test_state_from_outputs_with_bastion_and_fsx(tmp_path):
    spec = make_spec(storage={"fsx": {"enabled": True, "mount_point": "/fsx"}})
    state = new_state(tmp_path, spec)
    files = {"key_file": tmp_path / "k", "known_hosts": tmp_path / "kh"}
    stack.state_from_outputs(spec, OUTPUTS, **files).record(state)
    record = state.read()
    assert record.nodes == [
        state_mod.Node(rank=0, name="pf-node0", address="10.42.1.10", instance_id="i-0aaa"),
        state_mod.Node(rank=1, name="pf-node1", address="10.42.1.11", instance_id="i-0bbb"),
    ]
    assert record.ssh == state_mod.SshSettings(user="ubuntu", key_file=str(tmp_path / "k"),
                                               known_hosts=str(tmp_path / "kh"),
                                               proxy_jump="ubuntu@198.51.100.7")
    assert record.shared_dir == "/fsx"
    # Every output, those this stack has not (no expiry here) as null: what `fsdpctl inventory` reads.
    assert record.stack_outputs == {**OUTPUTS, "expires_at": None, "expiry_queue_url": None}


def test_stack_outputs_are_the_programs():
    assert set(stack.StackOutputs.model_fields) == set(OUTPUT_NAMES)


def test_state_from_outputs_without_bastion_or_fsx(tmp_path):
    spec = make_spec(access={"bastion": False, "ssh_user": "ec2-user"})
    outputs = {**OUTPUTS, "bastion_public_ip": None, "ssh_user": None}
    data = stack.state_from_outputs(spec, outputs, key_file=tmp_path / "k", known_hosts=tmp_path / "kh")
    assert data.ssh.proxy_jump is None and data.ssh.user == "ec2-user"
    assert data.shared_dir is None


@pytest.mark.parametrize(("outputs", "message"), [
    ({k: v for k, v in OUTPUTS.items() if k != "nodes"}, r"stack output nodes of cluster pf: Field required"),
    ({**OUTPUTS, "nodes": [{**OUTPUTS["nodes"][0], "private_ip": None}]},
     r"stack output nodes\.0\.private_ip of cluster pf: value None: Input should be a valid string"),
    ({**OUTPUTS, "bastion_public_ip": ["198.51.100.7"]},
     r"stack output bastion_public_ip of cluster pf: value \['198\.51\.100\.7'\]: Input should be a valid "
     r"string"),
])
def test_a_missing_or_garbled_output_is_named(tmp_path, outputs, message):
    with pytest.raises(CommandError, match=message + r".*another version of the Pulumi program.*fsdpctl up"):
        stack.state_from_outputs(make_spec(), outputs, key_file=tmp_path / "k", known_hosts=tmp_path / "kh")


def test_state_records_the_expiry_dead_letter_queue(tmp_path):
    url = "https://sqs.us-east-1.amazonaws.com/123456789012/pf-expiry-failures-1a2b3c4"
    files = {"key_file": tmp_path / "k", "known_hosts": tmp_path / "kh"}
    state = new_state(tmp_path, make_spec())
    stack.state_from_outputs(make_spec(), {**OUTPUTS, "expiry_queue_url": url}, **files).record(state)
    assert state.read().expiry_queue_url == url
    stack.state_from_outputs(make_spec(expiry_hours=None), {**OUTPUTS, "expiry_queue_url": None},
                             **files).record(state)
    assert state.read().expiry_queue_url is None


def _dead_letter(aws, url: str, schedule: str, code: str, message: str) -> None:
    """What EventBridge Scheduler puts in a schedule's dead-letter queue once a call still fails after
    its retry policy: the target's input as the body, the failure as message attributes."""
    def attribute(value: str) -> dict:
        return {"DataType": "String", "StringValue": value}

    schedule_arn = f"arn:aws:scheduler:us-east-1:123456789012:schedule/fsdp-cluster-pf/{schedule}"
    attributes = {"ERROR_CODE": attribute(code), "ERROR_MESSAGE": attribute(message),
                  "SCHEDULE_ARN": attribute(schedule_arn)}
    aws.sqs.send_message(QueueUrl=url, MessageBody=json.dumps({"InstanceIds": ["i-0bbb"]}),
                         MessageAttributes=attributes)


def test_status_reports_the_expiry_calls_that_failed(aws, fsdpctl_home, tmp_path):
    spec = make_spec()
    state = new_state(tmp_path, spec)
    ami = seed_image("x86_64", "dlami")
    running = [i["InstanceId"] for i in aws.ec2.run_instances(
        ImageId=ami, InstanceType="t3.micro", MinCount=2, MaxCount=2)["Instances"]]
    aws.ec2.terminate_instances(InstanceIds=running[1:])
    url = aws.sqs.create_queue(QueueName="pf-expiry-failures-1a2b3c4")["QueueUrl"]
    outputs = {**OUTPUTS, "expiry_queue_url": url, "nodes": [
        {**node, "instance_id": running[node["rank"]]} for node in OUTPUTS["nodes"]]}
    stack.state_from_outputs(spec, outputs, key_file=tmp_path / "k",
                             known_hosts=tmp_path / "kh").record(state)
    assert stack.health(state) == [f"pf-node1: instance {running[1]} is terminated"]

    _dead_letter(aws, url, "pf-expiry-node1", "InvalidInstanceID.NotFound",
                 "The instance ID 'i-0bbb' does not exist")
    problems = stack.health(state)
    assert problems[0] == (
        f"expiry: 1 call failed (dead-letter queue {url}): pf-expiry-node1: InvalidInstanceID.NotFound: "
        "The instance ID 'i-0bbb' does not exist. What it was to stop may still bill: check it in the "
        "EC2/FSx console, or run `fsdpctl down --cluster pf`")
    assert problems[1:] == [f"pf-node1: instance {running[1]} is terminated"]
    _dead_letter(aws, url, "pf-expiry-nat", "AccessDeniedException", "not authorized")
    # Reading leaves the messages in the queue: the next `status` reports them again.
    assert stack.health(state)[0].startswith(f"expiry: 2 calls failed (dead-letter queue {url}): pf-expiry-")


def test_state_from_outputs_refuses_a_node_count_mismatch(tmp_path):
    with pytest.raises(CommandError, match=r"ranks \[0, 1\], the spec wants 3 .*fsdpctl down --cluster pf"):
        stack.state_from_outputs(make_spec(node_count=3), OUTPUTS, key_file=tmp_path, known_hosts=tmp_path)


def test_default_backend_is_local_unless_chosen(fsdpctl_home, monkeypatch):
    monkeypatch.delenv("PULUMI_BACKEND_URL", raising=False)
    monkeypatch.delenv("PULUMI_CONFIG_PASSPHRASE", raising=False)
    monkeypatch.delenv("PULUMI_CONFIG_PASSPHRASE_FILE", raising=False)
    env = stack.pulumi_env()
    assert env == {"PULUMI_BACKEND_URL": (fsdpctl_home / "pulumi").as_uri(), "PULUMI_CONFIG_PASSPHRASE": ""}
    monkeypatch.setenv("PULUMI_BACKEND_URL", "s3://team-pulumi-state")
    monkeypatch.setenv("PULUMI_CONFIG_PASSPHRASE", "secret")
    assert stack.pulumi_env() == {}


def test_replace_refuses_unknown_ranks_before_asking(fsdpctl_home, tmp_path):
    spec = make_spec()
    state = new_state(tmp_path, spec)
    state.update(nodes=[{"rank": 0, "name": "pf-node0", "address": "10.0.0.1", "instance_id": "i-1"}])
    with pytest.raises(UsageError, match=r"no node with rank 5 \(ranks: 0\)"):
        lifecycle.cmd_replace(argparse.Namespace(cluster="pf", rank=5, yes=True))


class RecordingStack(FakeStack):
    """An Automation API Stack that records what `up` asks of it; `info()` says whether it has been
    updated before (an existing stack gets a preview diff, a new one the offline plan)."""

    def __init__(self, existing: bool):
        super().__init__()
        self.existing, self.calls = existing, []

    def info(self):
        return object() if self.existing else None

    def refresh(self, **kwargs):
        """What the engine reports for a cluster whose expiry schedule ran: the nodes are gone."""
        from pulumi.automation import events

        self.calls.append(("refresh", kwargs))
        urn = "urn:pulumi:pf::fsdp-cluster::fsdp-cluster:index:Compute$aws:ec2/instance:Instance::pf-node0"
        kwargs["on_event"](events.EngineEvent(1, 0, res_outputs_event=events.ResOutputsEvent(
            events.StepEventMetadata(events.OpType.REFRESH, urn, "aws:ec2/instance:Instance", "p"))))
        return auto.RefreshResult("", "", auto.UpdateSummary(
            kind="refresh", start_time=None, message="", environment={}, config={}, result="succeeded",
            end_time=None, version=1, deployment=None, resource_changes={"same": 30, "delete": 1}))

    def preview(self, **kwargs):
        self.calls.append(("preview", kwargs))
        kwargs["on_output"]("~ aws:ec2/instance:Instance pf-node0 update [diff: ~tags]\n")

    def up(self, **kwargs):
        self.calls.append(("up", kwargs))
        raise AssertionError("pulumi up ran without a yes")


@pytest.fixture
def passing_preflight(monkeypatch, fake_pulumi):
    monkeypatch.setattr(stack.AwsClients, "for_spec", classmethod(lambda cls, spec: None))
    monkeypatch.setattr(stack.preflight, "run_preflight",
                        lambda spec, aws, out: stack.preflight.PreflightReport(spec, []))


@pytest.mark.parametrize("existing", [False, True])
def test_up_shows_the_plan_or_the_diff_with_its_cost_and_creates_nothing_without_a_yes(
        passing_preflight, tmp_path, monkeypatch, existing):
    fake = RecordingStack(existing)
    monkeypatch.setattr(stack, "open_stack", lambda spec, command, create: fake)
    spec = make_spec()
    state = new_state(tmp_path, spec)
    lines, questions = [], []

    def no(question):
        questions.append(question)
        raise CommandError("not confirmed; nothing was done")

    with pytest.raises(CommandError, match="not confirmed"):
        stack.up(state, spec, node_count=spec.node_count, approve=no, out=lines.append)
    text = "\n".join(lines)
    assert "Estimated cost" in text and "p4d.24xlarge on-demand" in text
    (question,) = questions
    assert re.search(r"about [\d,]+\.\d\d USD per hour; its billed resources expire at 20\d\d-", question)
    if existing:
        assert question.startswith("Apply these changes to cluster pf")
        # Refresh first (the expiry schedule deletes resources behind Pulumi's back), then the diff.
        assert [name for name, _ in fake.calls] == ["refresh", "preview"]
        assert fake.calls[1][1]["diff"] is True
        assert "pulumi refresh: 1 resource(s) gone from AWS, 0 changed outside Pulumi" in text
        assert "  gone:    aws:ec2/instance:Instance pf-node0" in text
        assert "pf-node0 update [diff: ~tags]" in text
    else:
        assert question.startswith("Create cluster pf on AWS") and not fake.calls
    # Not confirmed: `pulumi up` never ran, and `down` has no stack to destroy.
    assert all(name != "up" for name, _ in fake.calls)
    assert state.read().pulumi_stack is None


def test_lock_advice_names_the_projects_backend(fsdpctl_home, monkeypatch):
    monkeypatch.delenv("PULUMI_BACKEND_URL", raising=False)
    advice = stack.cancel_advice("pf")
    backend = (fsdpctl_home / "pulumi").as_uri()
    assert advice.startswith(f"PULUMI_BACKEND_URL={backend} pulumi cancel --stack pf")


def test_refresh_findings_without_drift_and_with_changes():
    assert stack.refresh_findings({"same": 12}, {}) == [
        "pulumi refresh: the stack matches AWS (nothing changed outside Pulumi)"]
    urn = "urn:pulumi:pf::fsdp-cluster::fsdp-cluster:index:Network$aws:ec2/natGateway:NatGateway::pf-nat"
    lines = stack.refresh_findings({"update": 1}, {urn: "update"})
    assert lines == ["pulumi refresh: 0 resource(s) gone from AWS, 1 changed outside Pulumi",
                     "  changed: aws:ec2/natGateway:NatGateway pf-nat"]


class LockedStack:
    """A stack another pulumi process holds: every operation fails as the CLI does (exit 255,
    'the stack is currently locked')."""

    def _locked(self, **kwargs):
        raise auto.errors.ConcurrentUpdateError(auto.CommandResult(
            stdout="", code=255, stderr="error: the stack is currently locked by 1 lock(s)"))

    destroy = up = refresh = preview = _locked

    def __init__(self):
        self.config = {}

    def set_config(self, key, value):
        self.config[key] = value.value

    def remove_config(self, key):
        self.config.pop(key)


@pytest.mark.parametrize("verb", ["down", "replace 0"])
def test_destroy_and_replace_catch_a_concurrent_update_with_the_full_cancel_command(
        fake_pulumi, fsdpctl_home, tmp_path, monkeypatch, verb):
    monkeypatch.delenv("PULUMI_BACKEND_URL", raising=False)
    locked = LockedStack()
    monkeypatch.setattr(stack, "open_stack", lambda spec, command, create: locked)
    monkeypatch.setattr(stack.AwsClients, "for_spec", classmethod(lambda cls, spec: None))
    terminated = []
    monkeypatch.setattr(stack.sweep, "terminate_and_wait",
                        lambda aws, leftovers, out: terminated.extend(leftovers) or [])
    spec = make_spec()
    state = new_state(tmp_path, spec)
    state.update(pulumi_stack=spec.name, nodes=[
        {"rank": 0, "name": "pf-node0", "address": "10.0.0.1", "instance_id": "i-1"}])
    with pytest.raises(UsageError) as err:
        if verb == "down":
            stack._destroy(spec, stack.pulumi_command(), out=lambda _: None)
        else:
            stack.replace_node(state, spec, 0, out=lambda _: None)
    message = str(err.value)
    backend = (fsdpctl_home / "pulumi").as_uri()
    assert "another pulumi operation holds stack pf" in message
    assert f"PULUMI_BACKEND_URL={backend} pulumi cancel --stack pf --yes --cwd " in message
    assert f"then run `fsdpctl {verb}` again" in message
    assert locked.config == {}  # replace's one-run retemplate key is removed again
    assert terminated == []  # a locked stack is found before the node is terminated


class ReplacingStack(LockedStack):
    """A stack whose refresh succeeds and whose state holds `held` (URNs) afterwards; `up` records
    the retemplate config and its arguments, then fails as the CLI does."""

    def __init__(self, held: list[str]):
        super().__init__()
        self.held, self.seen = held, None

    def refresh(self, **kwargs):
        return auto.RefreshResult("", "", auto.UpdateSummary(
            kind="refresh", start_time=None, message="", environment={}, config={}, result="succeeded",
            end_time=None, version=1, deployment=None, resource_changes={"same": 9}))

    def export_stack(self):
        return auto.Deployment(version=3, deployment={"resources": [
            {"urn": urn, "type": "aws:ec2/instance:Instance", "custom": True, "id": "i-1"}
            for urn in self.held]})

    def up(self, **kwargs):
        self.seen = (dict(self.config), kwargs)
        raise auto.errors.CommandError(auto.CommandResult(stdout="", stderr="boom", code=1))


def _replace_rank_1(tmp_path, monkeypatch, held_ranks: list[int]) -> tuple[ReplacingStack, list, list[str]]:
    """`replace_node(rank 1)` of a 2-node cluster whose stack state holds the instances of
    `held_ranks` after the refresh: (the stack, the instances terminated, what was printed)."""
    from infra.program import node_urn

    spec = make_spec(node_count=2)
    fake = ReplacingStack([node_urn(spec.name, spec, r) for r in held_ranks])
    monkeypatch.setattr(stack, "open_stack", lambda spec, command, create: fake)
    monkeypatch.setattr(stack.AwsClients, "for_spec", classmethod(lambda cls, spec: None))
    terminated: list = []
    monkeypatch.setattr(stack.sweep, "terminate_and_wait",
                        lambda aws, leftovers, out: terminated.extend(leftovers) or [])
    state = new_state(tmp_path, spec)
    state.update(pulumi_stack=spec.name, nodes=[
        {"rank": r, "name": f"pf-node{r}", "address": f"10.0.0.{r}", "instance_id": f"i-{r}"}
        for r in (0, 1)])
    said: list[str] = []
    with pytest.raises(CommandError, match="pulumi up failed"):
        stack.replace_node(state, spec, 1, out=said.append)
    return fake, terminated, said


def test_replace_lets_only_the_replaced_rank_take_the_current_template(fake_pulumi, fsdpctl_home, tmp_path,
                                                                        monkeypatch):
    from infra.program import RETEMPLATE_KEY, node_urn

    fake, terminated, _ = _replace_rank_1(tmp_path, monkeypatch, held_ranks=[0, 1])
    urn = node_urn("pf", make_spec(node_count=2), 1)
    config, kwargs = fake.seen
    assert config == {RETEMPLATE_KEY: "[1]"}
    assert (kwargs["target"], kwargs["replace"], kwargs["target_dependents"]) == ([urn], [urn], True)
    assert [leftover.id for leftover in terminated] == ["i-1"]  # first, so a reservation has the slot
    assert fake.config == {}


def test_replace_of_an_instance_ec2_took_back_creates_it_without_a_replace(fake_pulumi, fsdpctl_home,
                                                                            tmp_path, monkeypatch):
    """A spot node EC2 reclaimed is terminated: the refresh drops it from the stack (the AWS provider
    reads a terminated instance as gone), and Pulumi refuses `--replace` of a URN its stack does not
    hold, so the targeted up creates it instead, and nothing is terminated."""
    from infra.program import node_urn

    fake, terminated, said = _replace_rank_1(tmp_path, monkeypatch, held_ranks=[0])
    _, kwargs = fake.seen
    assert (kwargs["target"], kwargs["replace"]) == ([node_urn("pf", make_spec(node_count=2), 1)], None)
    assert terminated == []
    assert "pf-node1 (i-1) is already gone from AWS; pulumi up creates it again" in "\n".join(said)


# ---- expiry: a second day ---------------------------------------------------------------------
import datetime as dt  # noqa: E402

NOW = dt.datetime(2026, 12, 3, 12, 0, tzinfo=dt.UTC)


def test_up_of_an_expired_cluster_sets_a_new_expiry():
    spec = make_spec(expiry_hours=6)
    fake = FakeStack()
    fake.config[EXPIRES_AT_KEY] = "2026-12-03T11:00:00Z"  # an hour ago: the schedules have run
    lines = []
    config = stack.stack_config(fake, spec, now=NOW, out=lines.append)
    assert config.expires_at == "2026-12-03T18:00:00Z"
    assert "expired at 2026-12-03T11:00:00Z" in lines[0] and "new expiry" in lines[0]
    stack.write_stack_config(fake, config)
    assert fake.config[EXPIRES_AT_KEY] == "2026-12-03T18:00:00Z"
    # Not yet expired: kept, whatever expiry_hours says now.
    assert stack.stack_config(fake, make_spec(expiry_hours=48), now=NOW).expires_at == "2026-12-03T18:00:00Z"


def test_extended_expiry_adds_hours_to_the_later_of_now_and_the_current_one():
    assert stack.extended_expiry("2026-12-03T18:00:00Z", 4, NOW) == "2026-12-03T22:00:00Z"
    assert stack.extended_expiry(None, 4, NOW) == "2026-12-03T16:00:00Z"


class ExtendStack(RecordingStack):
    def up(self, **kwargs):
        self.calls.append(("up", dict(self.config)))
        return auto.UpResult("", "", auto.UpdateSummary(
            kind="update", start_time=None, message="", environment={}, config={}, result="succeeded",
            end_time=None, version=2, deployment=None, resource_changes={"update": 33}), outputs={})


def test_extend_moves_the_expiry_refreshing_first_and_records_it(fake_pulumi, tmp_path, monkeypatch):
    fake = ExtendStack(existing=True)
    fake.config[EXPIRES_AT_KEY] = "2026-12-03T18:00:00Z"
    monkeypatch.setattr(stack, "open_stack", lambda spec, command, create: fake)
    spec = make_spec(expiry_hours=6)
    state = new_state(tmp_path, spec)
    state.update(pulumi_stack=spec.name, expires_at="2026-12-03T18:00:00Z", cost_per_hour=100.0)
    questions, lines = [], []
    assert stack.extend(state, spec, hours=4, approve=questions.append, out=lines.append,
                        now=NOW) == "2026-12-03T22:00:00Z"
    assert questions == ["Move the expiry of cluster pf from 2026-12-03T18:00:00Z to 2026-12-03T22:00:00Z "
                         "(about 400.00 USD more)?"]
    assert [name for name, _ in fake.calls] == ["refresh", "up"]
    assert fake.calls[1][1][EXPIRES_AT_KEY] == "2026-12-03T22:00:00Z"  # the config `pulumi up` saw
    assert state.read().expires_at == "2026-12-03T22:00:00Z"


def test_extend_refuses_an_expired_cluster_and_one_without_expiry(fake_pulumi, tmp_path):
    spec = make_spec(expiry_hours=6)
    state = new_state(tmp_path, spec)
    state.update(pulumi_stack=spec.name, expires_at="2026-12-03T11:00:00Z")
    with pytest.raises(UsageError, match=r"expired at 2026-12-03T11:00:00Z.*Run `fsdpctl up .*spec.yaml`"):
        stack.extend(state, spec, hours=4, approve=refuse, out=print, now=NOW)
    with pytest.raises(UsageError, match="expiry_hours: null"):
        stack.extend(state, make_spec(expiry_hours=None), hours=4, approve=refuse, out=print, now=NOW)
    assert not fake_pulumi.exists()  # the CLI was never asked anything


def test_state_records_the_programs_expiry_output(tmp_path):
    state = new_state(tmp_path, make_spec())
    state.update(expires_at="2026-12-03T20:00:00Z")
    outputs = {**OUTPUTS, "expires_at": "2026-12-03T22:00:00Z"}
    files = {"key_file": tmp_path / "k", "known_hosts": tmp_path}
    stack.state_from_outputs(make_spec(), outputs, **files).record(state)
    assert state.read().expires_at == "2026-12-03T22:00:00Z"
    # A stack that exports no expiry leaves the recorded one as it was.
    stack.state_from_outputs(make_spec(), OUTPUTS, **files).record(state)
    assert state.read().expires_at == "2026-12-03T22:00:00Z"


def test_status_and_list_show_the_expiry_and_whether_it_passed(fsdpctl_home, tmp_path, capsys):
    spec = make_spec()
    state = new_state(tmp_path, spec)
    assert lifecycle.expiry_text("2026-12-03T11:00:00Z", NOW) == "2026-12-03T11:00:00Z (EXPIRED)"
    assert lifecycle.expiry_text("2026-12-03T18:30:00Z", NOW, left=True) == "2026-12-03T18:30:00Z (in 6h30m)"
    assert lifecycle.expiry_text("2026-12-03T18:30:00Z", NOW) == "2026-12-03T18:30:00Z"
    state.update(expires_at="2020-01-01T00:00:00Z")
    lifecycle.cmd_list(argparse.Namespace(json=False))
    assert "2020-01-01T00:00:00Z (EXPIRED)" in capsys.readouterr().out
    lifecycle.cmd_list(argparse.Namespace(json=True))
    [row] = json.loads(capsys.readouterr().out)
    assert row["expires_at"] == "2020-01-01T00:00:00Z" and row["expired"] is True


def test_status_counts_a_node_stopped_by_power_saving_as_healthy(aws, fsdpctl_home, tmp_path):
    spec = make_spec(scaling={"min_nodes": 1})
    state = new_state(tmp_path, spec)
    ami = seed_image("x86_64", "dlami")
    ids = [i["InstanceId"] for i in aws.ec2.run_instances(
        ImageId=ami, InstanceType="t3.micro", MinCount=2, MaxCount=2)["Instances"]]
    aws.ec2.stop_instances(InstanceIds=ids)
    outputs = {**OUTPUTS, "nodes": [{**node, "instance_id": ids[node["rank"]]} for node in OUTPUTS["nodes"]]}
    stack.state_from_outputs(spec, outputs, key_file=tmp_path / "k",
                             known_hosts=tmp_path / "kh").record(state)
    # node1 is Slurm's to stop and start; node0 runs the controller and must run.
    assert stack.health(state) == [f"pf-node0: instance {ids[0]} is stopped"]


# ---- a new node's boot ---------------------------------------------------------------------------
def _booting(tmp_path, monkeypatch, answers_after: int):
    """A replaced node whose sshd answers from its `answers_after`-th try on (ssh exits 255 before),
    with a clock that moves one poll per try: (the state, its node, the tries, what was printed)."""
    from fsdpctl import remote

    spec = make_spec(node_count=2)
    state = new_state(tmp_path, spec)
    state.update(nodes=[{"rank": 1, "name": "pf-node1", "address": "10.0.7.19", "instance_id": "i-0b1"}])
    node = state.read().nodes[0]
    tries: list[int] = []

    def run(cluster, rank, command, *, timeout, check):
        tries.append(rank)
        refused = "channel 0: open failed: connect failed: Connection refused"
        return (SimpleNamespace(returncode=0, stderr="") if len(tries) >= answers_after
                else SimpleNamespace(returncode=255, stderr=f"{refused}\n"))

    monkeypatch.setattr(remote, "run", run)
    now = [0.0]

    def clock() -> float:
        return now[0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    return state, node, tries, [], clock, sleep


def test_a_replaced_node_is_waited_for_until_its_sshd_answers(tmp_path, monkeypatch):
    state, node, tries, said, clock, sleep = _booting(tmp_path, monkeypatch, answers_after=4)
    stack.wait_for_ssh(state, node, said.append, clock=clock, sleep=sleep)
    assert tries == [1, 1, 1, 1]
    assert said[:3] == [f"waiting for pf-node1 to answer SSH ({s} s) ..." for s in (0, 15, 30)]
    assert said[-1] == "pf-node1 answers SSH (45 s after EC2 started it)"


def test_a_node_that_never_answers_ends_the_wait_with_its_boot_log_command(tmp_path, monkeypatch):
    state, node, tries, said, clock, sleep = _booting(tmp_path, monkeypatch, answers_after=10**6)
    with pytest.raises(CommandError) as failed:
        stack.wait_for_ssh(state, node, said.append, timeout_s=60, clock=clock, sleep=sleep)
    message = str(failed.value)
    assert len(tries) == 5  # at 0, 15, 30, 45 and 60 s
    assert message.startswith("pf-node1 (i-0b1, 10.0.7.19) did not answer SSH within 60 s of EC2 starting it "
                              "(channel 0: open failed: connect failed: Connection refused)")
    assert "aws ec2 get-console-output --instance-id i-0b1 --latest --output text" in message
    assert message.endswith("run `fsdpctl configure --limit pf-node1` and `fsdpctl deploy`; if it never "
                            "does, `fsdpctl replace 1` again.")
