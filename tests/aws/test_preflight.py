"""Pre-flight against moto (offerings, instance types, AMIs, key pairs, VPCs, S3), botocore Stubber
(EC2 service quotas) and the before-call fake (capacity reservations)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber
from moto.core import DEFAULT_ACCOUNT_ID, enable_iam_authentication

from fsdpctl import cli
from fsdpctl.errors import CommandError
from fsdpctl.targets.aws import permissions, preflight
from fsdpctl.targets.aws.clients import AwsClients

from .conftest import REGION, Ec2Extras, make_spec, seed_image

DLAMI_PARAMETER = "/fsdp-test/dlami/ami-id"


def stub_quota(aws: AwsClients, value: float, code: str = "L-417A185B", applied: bool = True) -> Stubber:
    client = boto3.client("service-quotas", region_name=REGION)
    stubber = Stubber(client)
    params = {"ServiceCode": "ec2", "QuotaCode": code}
    quota = {"Quota": {"ServiceCode": "ec2", "QuotaCode": code, "Value": value}}
    if applied:
        stubber.add_response("get_service_quota", quota, params)
    else:
        stubber.add_client_error("get_service_quota", "NoSuchResourceException", expected_params=params)
        stubber.add_response("get_aws_default_service_quota", quota, params)
    stubber.activate()
    aws.service_quotas = client
    return stubber


@pytest.fixture
def dlami(aws) -> str:
    ami = seed_image("x86_64", "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)")
    aws.ssm.put_parameter(Name=DLAMI_PARAMETER, Value=ami, Type="String")
    return ami


def spec_with_image(**overrides):
    return make_spec(image={"ssm_parameter": DLAMI_PARAMETER}, **overrides)


def findings_of(report: preflight.PreflightReport, check_name: str) -> list[preflight.Finding]:
    return [f for name, f in report.findings if name == check_name]


def test_passing_preflight_reports_every_check(aws, dlami):
    stubber = stub_quota(aws, 384)
    lines = []
    report = preflight.run_preflight(spec_with_image(node_count=4), aws, out=lines.append)
    stubber.assert_no_pending_responses()
    assert report.ok, report.failure_text()
    status = {r.name: r.status for r in report.results}
    assert status == {
        "instance type offered in AZ": "pass", "instance type GPUs/EFA match catalog": "pass",
        "service quota (vCPUs)": "pass", "AMI resolves (x86_64)": "pass", "key pair exists": "skip",
        "existing VPC and subnets": "skip", "capacity reservation": "skip",
        "existing placement group": "skip", "FSx S3 bucket": "skip", "IAM permissions (simulated)": "pass",
    }
    assert f"[1/{len(preflight.CHECKS)}] instance type offered in AZ ..." in lines
    assert any(dlami in line for line in lines)
    assert "quota 384 vCPUs, 0 in use, cluster needs 384" in report.table()


def test_every_failure_is_reported_at_once_with_its_fix(aws):
    stub_quota(aws, 96)
    spec = make_spec(instance_type="p4de.24xlarge", availability_zone="us-east-1a", node_count=4,
                     image={"ami_id": "ami-0123456789abcdef0"}, access={"key_name": "missing-key"})
    report = preflight.run_preflight(spec, aws, out=lambda _: None)
    assert not report.ok
    failed = {r.name for r in report.results if r.status == "fail"}
    assert failed == {"instance type offered in AZ", "service quota (vCPUs)", "AMI resolves (x86_64)",
                      "key pair exists"}

    [offer] = findings_of(report, "instance type offered in AZ")
    assert "p4de.24xlarge is not offered there" in offer.message
    assert offer.fix.startswith("set availability_zone to one of us-east-1b")

    [quota] = findings_of(report, "service quota (vCPUs)")
    assert "need 384 vCPUs" in quota.message and "L-417A185B" in quota.message
    assert "--desired-value 384" in quota.fix and "lower node_count to 1" in quota.fix

    [ami] = findings_of(report, "AMI resolves (x86_64)")
    assert "ami-0123456789abcdef0 does not exist" in ami.message and "image.ami_id" in ami.message

    [key] = findings_of(report, "key pair exists")
    assert "access.key_name missing-key" in key.message and "import-key-pair" in key.fix


def test_quota_counts_instances_already_running(aws, dlami):
    stub_quota(aws, 150)
    aws.ec2.run_instances(ImageId=dlami, InstanceType="p4d.24xlarge", MinCount=1, MaxCount=1)
    report = preflight.run_preflight(spec_with_image(node_count=1), aws, out=lambda _: None)
    [quota] = findings_of(report, "service quota (vCPUs)")
    assert "with 96 already in use" in quota.message
    assert "at least 192 vCPUs" in quota.fix


def test_spot_uses_the_spot_quota_and_its_default_value(aws, dlami):
    stubber = stub_quota(aws, 768, code="L-7212CCBC", applied=False)
    report = preflight.run_preflight(spec_with_image(capacity={"type": "spot"}), aws, out=lambda _: None)
    stubber.assert_no_pending_responses()
    assert report.ok, report.failure_text()


def test_arm_image_is_refused(aws):
    stub_quota(aws, 384)
    arm = seed_image("arm64", "some arm64 image")
    report = preflight.run_preflight(make_spec(image={"ami_id": arm}), aws, out=lambda _: None)
    [finding] = findings_of(report, "AMI resolves (x86_64)")
    assert "is arm64" in finding.message and "x86_64 image" in finding.fix


def test_missing_ssm_parameter(aws):
    stub_quota(aws, 384)
    report = preflight.run_preflight(make_spec(image={"ssm_parameter": "/no/such/param"}), aws,
                                     out=lambda _: None)
    [finding] = findings_of(report, "AMI resolves (x86_64)")
    assert "image.ssm_parameter /no/such/param" in finding.message
    assert "get-parameters-by-path" in finding.fix


def test_subnet_in_another_az_and_foreign_public_subnet(aws, dlami):
    stub_quota(aws, 384)
    vpc = aws.ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    other_vpc = aws.ec2.create_vpc(CidrBlock="10.1.0.0/16")["Vpc"]["VpcId"]
    private = aws.ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.1.0/24", AvailabilityZone="us-east-1a")
    public = aws.ec2.create_subnet(VpcId=other_vpc, CidrBlock="10.1.0.0/24", AvailabilityZone="us-east-1b")
    spec = spec_with_image(network={"vpc_id": vpc, "private_subnet_id": private["Subnet"]["SubnetId"],
                                    "public_subnet_id": public["Subnet"]["SubnetId"]})
    report = preflight.run_preflight(spec, aws, out=lambda _: None)
    az, foreign = findings_of(report, "existing VPC and subnets")
    assert "is in us-east-1a, but the nodes go to us-east-1b" in az.message
    assert az.fix == "give a subnet in us-east-1b, or set availability_zone: us-east-1a"
    assert "network.public_subnet_id" in foreign.message and f"not {vpc}" in foreign.message


def test_missing_vpc(aws, dlami):
    stub_quota(aws, 384)
    spec = spec_with_image(network={"vpc_id": "vpc-0abc1234", "private_subnet_id": "subnet-0abc1234"},
                           access={"bastion": False})
    report = preflight.run_preflight(spec, aws, out=lambda _: None)
    [finding] = findings_of(report, "existing VPC and subnets")
    assert "network.vpc_id vpc-0abc1234: no such VPC" in finding.message


RID = "cr-0123456789abcdef0"


def reservation(**overrides) -> dict:
    res = {"CapacityReservationId": RID, "InstanceType": "p4d.24xlarge", "AvailabilityZone": "us-east-1b",
           "State": "active", "ReservationType": "default", "TotalInstanceCount": 4,
           "AvailableInstanceCount": 4}
    res.update(overrides)
    return res


@pytest.mark.parametrize(("stored", "capacity_type", "message", "fix"), [
    (reservation(InstanceType="p5.48xlarge"), "capacity-reservation",
     f"instance_type p4d.24xlarge: reservation {RID} is for p5.48xlarge", "set instance_type: p5.48xlarge"),
    (reservation(AvailabilityZone="us-east-1c"), "capacity-reservation",
     f"availability_zone us-east-1b: reservation {RID} is in us-east-1c",
     "set availability_zone: us-east-1c"),
    (reservation(AvailableInstanceCount=1), "capacity-reservation",
     f"node_count 2: reservation {RID} has 1 of 4 instances available", "lower node_count to 1"),
    (reservation(ReservationType="capacity-block"), "capacity-reservation",
     f"capacity.type capacity-reservation: {RID} is a Capacity Block", "set capacity.type: capacity-block"),
    (reservation(), "capacity-block",
     f"capacity.type capacity-block: {RID} is a capacity reservation",
     "set capacity.type: capacity-reservation"),
    (reservation(State="scheduled", ReservationType="capacity-block", StartDate="2027-01-04T11:30:00Z"),
     "capacity-block", f"capacity.reservation_id {RID}: is scheduled (starts 2027-01-04", "wait until"),
    (None, "capacity-reservation", f"capacity.reservation_id {RID}: no such reservation",
     "describe-capacity-reservations"),
])
def test_reservation_problems(aws, dlami, stored, capacity_type, message, fix):
    stub_quota(aws, 384)
    extras = Ec2Extras(aws.ec2)
    if stored:
        extras.reservations[RID] = stored
    spec = spec_with_image(capacity={"type": capacity_type, "reservation_id": RID})
    report = preflight.run_preflight(spec, aws, out=lambda _: None)
    found = findings_of(report, "capacity reservation")
    assert len(found) == 1, found
    assert found[0].message.startswith(message) and fix in found[0].fix


def test_matching_capacity_block_passes(aws, dlami):
    Ec2Extras(aws.ec2).reservations[RID] = reservation(ReservationType="capacity-block")
    spec = spec_with_image(capacity={"type": "capacity-block", "reservation_id": RID})
    report = preflight.run_preflight(spec, aws, out=lambda _: None)
    assert report.ok, report.failure_text()
    assert {r.name: r.status for r in report.results}["service quota (vCPUs)"] == "skip"


PG_ARN = "arn:aws:ec2:us-east-1:123456789012:placement-group/"


PG_FIELD = "placement_group.existing_name train-pg"


@pytest.mark.parametrize(("group", "reservation_group", "message", "fix"), [
    (None, None, f"{PG_FIELD}: no such placement group", "remove existing_name"),
    ("spread", "train-pg", f"{PG_FIELD}: is a spread group", "strategy cluster"),
    ("cluster", "other-pg", f"{PG_FIELD}: reservation {RID} was created in other-pg",
     "set placement_group.existing_name to other-pg"),
    ("cluster", "", f"{PG_FIELD}: reservation {RID} was not created in a placement group",
     "remove placement_group.existing_name"),
    ("cluster", "train-pg", None, None),
])
def test_existing_placement_group_must_match_the_reservation(aws, dlami, group, reservation_group, message,
                                                             fix):
    stub_quota(aws, 384)
    extras = Ec2Extras(aws.ec2)
    if group:
        aws.ec2.create_placement_group(GroupName="train-pg", Strategy=group)
    extras.reservations[RID] = reservation(PlacementGroupArn=PG_ARN + reservation_group) \
        if reservation_group else reservation()
    spec = spec_with_image(capacity={"type": "capacity-reservation", "reservation_id": RID},
                           placement_group={"existing_name": "train-pg"})
    report = preflight.run_preflight(spec, aws, out=lambda _: None)
    found = findings_of(report, "existing placement group")
    if message is None:
        assert report.ok, report.failure_text()
    else:
        assert len(found) == 1 and found[0].message.startswith(message) and fix in found[0].fix, found


def test_fsx_import_bucket_must_exist_in_the_region(aws, dlami):
    stub_quota(aws, 384)
    boto3.client("s3", region_name="eu-west-1").create_bucket(
        Bucket="far-away-data", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    fsx = {"enabled": True, "s3_import_path": "s3://no-such-bucket-here/data",
           "s3_export_path": "s3://no-such-bucket-here/data"}
    report = preflight.run_preflight(spec_with_image(storage={"fsx": fsx}), aws, out=lambda _: None)
    [missing] = findings_of(report, "FSx S3 bucket")
    assert "bucket no-such-bucket-here does not exist" in missing.message and "aws s3 mb" in missing.fix

    fsx["s3_import_path"] = fsx["s3_export_path"] = "s3://far-away-data/x"
    report = preflight.run_preflight(spec_with_image(storage={"fsx": fsx}), aws, out=lambda _: None)
    [far] = findings_of(report, "FSx S3 bucket")
    assert "is in eu-west-1" in far.message and far.fix == "use a bucket in us-east-1"


def test_access_denied_fails_only_its_check(aws, dlami):
    client = boto3.client("service-quotas", region_name=REGION)
    stubber = Stubber(client)
    stubber.add_client_error("get_service_quota", "AccessDeniedException", "not allowed")
    stubber.activate()
    aws.service_quotas = client
    report = preflight.run_preflight(spec_with_image(), aws, out=lambda _: None)
    assert [r.name for r in report.results if r.status == "fail"] == ["service quota (vCPUs)"]
    [finding] = findings_of(report, "service quota (vCPUs)")
    assert "GetServiceQuota failed (AccessDeniedException" in finding.message
    assert "allow the GetServiceQuota action" in finding.fix


def test_missing_credentials_is_one_clear_error(no_credentials):
    with pytest.raises(CommandError, match="no AWS credentials found for region us-east-1; configure"):
        AwsClients.for_spec(make_spec())


def test_cmd_preflight_prints_table_and_exits_non_zero(aws_env, stub_quotas, tmp_path, capsys):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("name: pf\nregion: us-east-1\navailability_zone: us-east-1a\n"
                         "instance_type: p4de.24xlarge\nnode_count: 2\nssh_cidr: 203.0.113.0/24\n")
    assert cli.main(["preflight", str(spec_file)]) == 1
    out, err = capsys.readouterr()
    assert re.search(r"^instance type offered in AZ +FAIL +not offered in us-east-1a$", out, re.M)
    assert "pre-flight failed" in err and "nothing was created" in err
    assert "set availability_zone to one of us-east-1b, us-east-1c" in err


def test_cmd_preflight_json_is_the_report(aws_env, stub_quotas, tmp_path, capsys):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("name: pf\nregion: us-east-1\navailability_zone: us-east-1a\n"
                         "instance_type: p4de.24xlarge\nnode_count: 2\nssh_cidr: 203.0.113.0/24\n")
    assert cli.main(["preflight", str(spec_file), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["cluster"] == "pf" and report["passed"] is False
    offering = next(c for c in report["checks"] if c["name"] == "instance type offered in AZ")
    assert offering["status"] == "fail" and offering["detail"] == "not offered in us-east-1a"
    assert "us-east-1b, us-east-1c" in offering["findings"][0]["fix"]
    assert len(report["checks"]) == len(preflight.CHECKS)


def test_denied_actions_are_listed_with_the_simulated_principal(aws, dlami, iam_simulation):
    stub_quota(aws, 384)
    iam_simulation.denied = {"iam:PassRole", "ec2:CreateCapacityReservation"}
    report = preflight.run_preflight(spec_with_image(), aws, out=lambda _: None)
    [finding] = findings_of(report, "IAM permissions (simulated)")
    assert "is not allowed ec2:CreateCapacityReservation, iam:PassRole (" in finding.message
    assert "--print-policy" in finding.fix and "docs/aws.md" in finding.fix
    # One simulation per scope of the policy, all of the caller.
    assert set(iam_simulation.principals) == {aws.sts.get_caller_identity()["Arn"]}
    assert len(iam_simulation.principals) == len(permissions.simulation_requests("pf", "aws", "1"))


def test_a_caller_that_may_not_simulate_skips_the_permission_check(aws, dlami, iam_simulation):
    stub_quota(aws, 384)
    iam_simulation.refuse = "AccessDenied"
    report = preflight.run_preflight(spec_with_image(), aws, out=lambda _: None)
    result = next(r for r in report.results if r.name == "IAM permissions (simulated)")
    assert result.status == "skip" and "docs/aws.md" in result.outcome.detail and report.ok


@pytest.mark.parametrize(("caller", "principal"), [
    ("arn:aws:sts::123456789012:assumed-role/Admin/alice", "arn:aws:iam::123456789012:role/Admin"),
    ("arn:aws-us-gov:sts::123456789012:assumed-role/Ops/bob", "arn:aws-us-gov:iam::123456789012:role/Ops"),
    ("arn:aws:iam::123456789012:user/ci", "arn:aws:iam::123456789012:user/ci"),
    ("arn:aws:iam::123456789012:root", None),
])
def test_principal_to_simulate(caller, principal):
    assert preflight.principal_arn(caller) == principal


def docs_action_rows() -> list[str]:
    """docs/aws.md's "IAM policy" table rows: per service, every action the policy grants."""
    by_service: dict[str, list[str]] = {}
    for action in permissions.required_actions():
        by_service.setdefault(action.split(":")[0], []).append(f"`{action}`")
    return [f"| {service} | {', '.join(actions)} |" for service, actions in sorted(by_service.items())]


def test_required_actions_are_listed_in_the_docs():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "aws.md").read_text()
    section = docs[docs.index("### IAM policy"):]
    section = section[:section.index("\n## ")]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    assert rows == docs_action_rows(), "list permissions.required_actions() by service in docs/aws.md"
    for scope in permissions.SCOPES:
        assert f"`{scope.sid}`" in section


def test_root_volume_smaller_than_the_ami_snapshot_is_refused(aws, dlami, monkeypatch):
    from moto.ec2.models.amis import Ami

    # moto's images all have a 15 GiB root snapshot; a DLAMI's is larger than the spec's minimum.
    size = 120
    monkeypatch.setattr(Ami, "block_device_mappings", property(lambda image: [{
        "DeviceName": image.root_device_name, "Ebs": {"SnapshotId": "snap-1", "VolumeSize": size,
                                                      "DeleteOnTermination": True, "VolumeType": "gp3"}}]))
    stub_quota(aws, 384)
    spec = spec_with_image(storage={"root_volume_gib": size - 1})
    [finding] = findings_of(preflight.run_preflight(spec, aws, out=lambda _: None), "AMI resolves (x86_64)")
    assert finding.message.startswith(f"storage.root_volume_gib {size - 1}: smaller than the root snapshot")
    assert finding.fix == f"set storage.root_volume_gib to at least {size}"
    stub_quota(aws, 384)
    fits = spec_with_image(storage={"root_volume_gib": size})
    assert not findings_of(preflight.run_preflight(fits, aws, out=lambda _: None), "AMI resolves (x86_64)")


def test_capacity_block_that_ends_before_the_expiry_is_refused(aws, dlami):
    import datetime as dt

    end = dt.datetime.now(dt.UTC) + dt.timedelta(hours=5, minutes=30)
    Ec2Extras(aws.ec2).reservations[RID] = reservation(ReservationType="capacity-block", EndDate=end)
    spec = spec_with_image(capacity={"type": "capacity-block", "reservation_id": RID}, expiry_hours=12)
    [finding] = findings_of(preflight.run_preflight(spec, aws, out=lambda _: None), "capacity reservation")
    assert finding.message.startswith(f"expiry_hours 12: Capacity Block {RID} ends at ")
    assert finding.fix == "set expiry_hours to at most 5, or extend the Capacity Block"
    ok = spec_with_image(capacity={"type": "capacity-block", "reservation_id": RID}, expiry_hours=4)
    assert not findings_of(preflight.run_preflight(ok, aws, out=lambda _: None), "capacity reservation")


def test_open_spot_requests_count_against_the_spot_quota(aws, dlami):
    stub_quota(aws, 384, code="L-7212CCBC")
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models import ec2_backends

    aws.ec2.request_spot_instances(InstanceCount=1, LaunchSpecification={
        "ImageId": dlami, "InstanceType": "p4d.24xlarge"})
    # moto fulfils requests at once; a real one for p4d often waits, open, holding its quota share.
    for request in ec2_backends[DEFAULT_ACCOUNT_ID][REGION].spot_instance_requests.values():
        request.state = "open"
    running = [i["InstanceId"] for r in aws.ec2.describe_instances()["Reservations"] for i in r["Instances"]]
    aws.ec2.terminate_instances(InstanceIds=running)
    report = preflight.run_preflight(spec_with_image(node_count=4, capacity={"type": "spot"}), aws,
                                     out=lambda _: None)
    [finding] = findings_of(report, "service quota (vCPUs)")
    assert "with 96 already in use" in finding.message
    result = next(r for r in report.results if r.name == "service quota (vCPUs)")
    assert "96 in use (96 by open spot requests)" in result.outcome.detail


class MotoPolicySimulation:
    """iam:SimulatePrincipalPolicy (which moto lacks) answered by moto's own policy engine, the one
    behind its IAM enforcement, over the simulated user's attached and inline policies: Action and
    Resource are matched, a StringEquals condition is tested against the request's context entries.
    Where moto stops: it evaluates no other condition operator, takes a condition key the request
    lacks as met, and knows no service control policy or permissions boundary. A caller whose own
    policies do not allow iam:SimulatePrincipalPolicy is refused, as AWS refuses it."""

    def __init__(self, client, access_key_id: str):
        self.access_key_id = access_key_id
        events = client.meta.events
        events.register("before-parameter-build.iam.SimulatePrincipalPolicy", Ec2Extras._keep_params)
        events.register("before-call.iam.SimulatePrincipalPolicy",
                        lambda context, **_: self._answer(context["fake_params"]))

    def _decision(self, action: str, resource: str, context: dict[str, str]) -> str:
        from moto.iam.access_control import IAMPolicy, IAMUserAccessKey, PermissionResult

        policies = IAMUserAccessKey(DEFAULT_ACCOUNT_ID, "aws", self.access_key_id, {}).collect_policies()
        results = {IAMPolicy(p).is_action_permitted(action, resource, incoming_condition_values=context)
                   for p in policies}
        if PermissionResult.DENIED in results:
            return "explicitDeny"
        return "allowed" if PermissionResult.PERMITTED in results else "implicitDeny"

    def _answer(self, params):
        source = params["PolicySourceArn"]
        if self._decision("iam:SimulatePrincipalPolicy", source, {}) != "allowed":
            return Ec2Extras._error("AccessDenied", f"{source} is not authorized to perform "
                                    "iam:SimulatePrincipalPolicy")
        context = {e["ContextKeyName"]: e["ContextKeyValues"][0] for e in params.get("ContextEntries", [])}
        return Ec2Extras._ok({"IsTruncated": False, "EvaluationResults": [
            {"EvalActionName": action, "EvalResourceName": resource,
             "EvalDecision": self._decision(action, resource, context)}
            for action in params["ActionNames"] for resource in params.get("ResourceArns") or ["*"]]})


def newcomer(document: dict, monkeypatch) -> AwsClients:
    """A user with only `document` attached, as a customer managed policy (moto validates it as IAM
    does), and AwsClients on that user's own access key."""
    iam = boto3.client("iam", region_name=REGION)
    iam.create_user(UserName="newcomer")
    arn = iam.create_policy(PolicyName="fsdpctl", PolicyDocument=json.dumps(document))["Policy"]["Arn"]
    iam.attach_user_policy(UserName="newcomer", PolicyArn=arn)
    key = iam.create_access_key(UserName="newcomer")["AccessKey"]
    session = boto3.Session(aws_access_key_id=key["AccessKeyId"],
                            aws_secret_access_key=key["SecretAccessKey"], region_name=REGION)
    simulated_iam = session.client("iam", region_name=REGION)
    MotoPolicySimulation(simulated_iam, key["AccessKeyId"])
    monkeypatch.setattr(AwsClients, "iam", property(lambda _: simulated_iam))
    return AwsClients(session)


def without(document: dict, action: str) -> dict:
    """The policy with one action taken out (and a statement left empty by it)."""
    statements = [{**s, "Action": [a for a in s["Action"] if a != action]} for s in document["Statement"]]
    return {**document, "Statement": [s for s in statements if s["Action"]]}


def test_a_newcomer_with_the_generated_policy_passes_preflight(aws, dlami, monkeypatch):
    clients = newcomer(permissions.policy_document(), monkeypatch)
    stub_quota(clients, 384)
    # From here on moto refuses every call the user's policy does not allow.
    with enable_iam_authentication():
        report = preflight.run_preflight(spec_with_image(), clients, out=lambda _: None)
    assert report.ok, report.failure_text()
    check = next(r for r in report.results if r.name == "IAM permissions (simulated)")
    assert check.status == "pass"
    # Every action once; PassRole once per role of the cluster, CreateServiceLinkedRole once per service.
    requests = len(permissions.required_actions()) - 2 + 2 + len(permissions.SERVICE_LINKED_ROLE_SERVICES)
    assert check.outcome.detail == (f"arn:aws:iam::{DEFAULT_ACCOUNT_ID}:user/newcomer: {requests}/{requests} "
                                    "simulated requests allowed")


@pytest.mark.parametrize(("action", "reported", "failing_check"), [
    ("ssm:GetParameter", "ssm:GetParameter", "AMI resolves (x86_64)"),
    ("iam:PassRole", f"iam:PassRole on arn:aws:iam::{DEFAULT_ACCOUNT_ID}:role/pf-node-*", None),
    ("iam:CreateServiceLinkedRole", "iam:CreateServiceLinkedRole (iam:AWSServiceName spot.amazonaws.com)",
     None),
    ("ec2:ModifyCapacityReservation", "ec2:ModifyCapacityReservation", None),
])
def test_a_policy_missing_one_action_is_reported(aws, dlami, monkeypatch, action, reported, failing_check):
    clients = newcomer(without(permissions.policy_document(), action), monkeypatch)
    stub_quota(clients, 384)
    with enable_iam_authentication():
        report = preflight.run_preflight(spec_with_image(), clients, out=lambda _: None)
    [finding] = findings_of(report, "IAM permissions (simulated)")
    assert f" {reported}" in finding.message and "--print-policy" in finding.fix
    # Moto's enforcement agrees: the check that calls the action fails on it.
    failed = {r.name for r in report.results if r.status == "fail"}
    assert failed == {"IAM permissions (simulated)"} | ({failing_check} if failing_check else set())


def test_a_newcomer_who_may_not_simulate_skips_only_that_check(aws, dlami, monkeypatch):
    clients = newcomer(without(permissions.policy_document(), "iam:SimulatePrincipalPolicy"), monkeypatch)
    stub_quota(clients, 384)
    with enable_iam_authentication():
        report = preflight.run_preflight(spec_with_image(), clients, out=lambda _: None)
    check = next(r for r in report.results if r.name == "IAM permissions (simulated)")
    assert check.status == "skip" and "--print-policy" in check.outcome.detail and report.ok
