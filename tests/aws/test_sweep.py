"""The teardown sweep against moto (plus the placement-group fake): planted leftovers of every kind
are found, deleted in dependency order, and a second sweep finds nothing."""

from __future__ import annotations

import json

import pytest

from fsdpctl.targets.aws import sweep
from infra.components.expiry import schedule_group_name
from infra.spec import CLUSTER_TAG

from .conftest import Ec2Extras, seed_image

CLUSTER = "sweepme"


def tags(cluster: str = CLUSTER, **extra: str) -> list[dict]:
    return [{"Key": CLUSTER_TAG, "Value": cluster}, *({"Key": k, "Value": v} for k, v in extra.items())]


def tag_spec(resource_type: str, cluster: str = CLUSTER) -> list[dict]:
    return [{"ResourceType": resource_type, "Tags": tags(cluster)}]


def record_calls(*clients) -> list[str]:
    calls: list[str] = []
    for client in clients:
        client.meta.events.register("before-call", lambda model, **_: calls.append(model.name))
    return calls


def plant_cluster(aws, extras: Ec2Extras) -> dict[str, str]:
    """What a half-destroyed cluster leaves: the whole network, two nodes, mutually referencing
    security groups, an FSx file system, the expiry schedule group and loose ENIs/volumes."""
    ec2 = aws.ec2
    vpc = ec2.create_vpc(CidrBlock="10.42.0.0/16", TagSpecifications=tag_spec("vpc"))["Vpc"]["VpcId"]
    private = ec2.create_subnet(VpcId=vpc, CidrBlock="10.42.1.0/24", AvailabilityZone="us-east-1b",
                                TagSpecifications=tag_spec("subnet"))["Subnet"]["SubnetId"]
    public = ec2.create_subnet(VpcId=vpc, CidrBlock="10.42.0.0/24", AvailabilityZone="us-east-1b",
                               TagSpecifications=tag_spec("subnet"))["Subnet"]["SubnetId"]
    igw = ec2.create_internet_gateway(TagSpecifications=tag_spec("internet-gateway"))
    igw_id = igw["InternetGateway"]["InternetGatewayId"]
    ec2.attach_internet_gateway(InternetGatewayId=igw_id, VpcId=vpc)
    eip = ec2.allocate_address(Domain="vpc", TagSpecifications=tag_spec("elastic-ip"))["AllocationId"]
    nat = ec2.create_nat_gateway(SubnetId=public, AllocationId=eip,
                                 TagSpecifications=tag_spec("natgateway"))["NatGateway"]["NatGatewayId"]
    routes = ec2.create_route_table(VpcId=vpc, TagSpecifications=tag_spec("route-table"))
    routes_id = routes["RouteTable"]["RouteTableId"]
    ec2.associate_route_table(RouteTableId=routes_id, SubnetId=private)
    ec2.create_vpc_endpoint(VpcId=vpc, ServiceName="com.amazonaws.us-east-1.s3", VpcEndpointType="Gateway",
                            RouteTableIds=[routes_id], TagSpecifications=tag_spec("vpc-endpoint"))

    bastion_sg = ec2.create_security_group(GroupName=f"{CLUSTER}-bastion", Description="bastion", VpcId=vpc,
                                           TagSpecifications=tag_spec("security-group"))["GroupId"]
    nodes_sg = ec2.create_security_group(GroupName=f"{CLUSTER}-nodes", Description="nodes", VpcId=vpc,
                                         TagSpecifications=tag_spec("security-group"))["GroupId"]
    # EFA needs all traffic to and from the group itself; the bastion may reach the nodes and the
    # nodes answer it: each group references the other.
    ec2.authorize_security_group_ingress(GroupId=nodes_sg, IpPermissions=[
        {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": nodes_sg}, {"GroupId": bastion_sg}]}])
    ec2.authorize_security_group_egress(GroupId=nodes_sg, IpPermissions=[
        {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": nodes_sg}]}])
    ec2.authorize_security_group_ingress(GroupId=bastion_sg, IpPermissions=[
        {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "UserIdGroupPairs": [{"GroupId": nodes_sg}]}])

    ami = seed_image("x86_64", "dlami")
    template = ec2.create_launch_template(LaunchTemplateName=f"{CLUSTER}-nodes", LaunchTemplateData={
        "ImageId": ami, "InstanceType": "p4d.24xlarge"}, TagSpecifications=tag_spec("launch-template"))
    ec2.create_placement_group(GroupName=f"{CLUSTER}-pg", Strategy="cluster", TagSpecifications=tag_spec(
        "placement-group"))
    ec2.run_instances(ImageId=ami, InstanceType="p4d.24xlarge", MinCount=2, MaxCount=2, SubnetId=private,
                      SecurityGroupIds=[nodes_sg], TagSpecifications=tag_spec("instance"))
    eni = ec2.create_network_interface(SubnetId=private, Groups=[nodes_sg],
                                       TagSpecifications=tag_spec("network-interface"))
    volume = ec2.create_volume(AvailabilityZone="us-east-1b", Size=100, TagSpecifications=tag_spec("volume"))
    ec2.create_key_pair(KeyName=f"{CLUSTER}-key", TagSpecifications=tag_spec("key-pair"))
    fs = aws.fsx.create_file_system(
        FileSystemType="LUSTRE", StorageCapacity=1200, SubnetIds=[private], SecurityGroupIds=[nodes_sg],
        LustreConfiguration={"DeploymentType": "PERSISTENT_2", "PerUnitStorageThroughput": 250},
        Tags=tags())["FileSystem"]["FileSystemId"]
    role = aws.iam.create_role(RoleName=f"{CLUSTER}-node-1a2b3c", AssumeRolePolicyDocument="{}",
                               Tags=tags())["Role"]["RoleName"]
    document = json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::bucket/*"}]})
    aws.iam.put_role_policy(RoleName=role, PolicyName="checkpoints", PolicyDocument=document)
    policy = aws.iam.create_policy(PolicyName=f"{CLUSTER}-ssm", PolicyDocument=document)
    aws.iam.attach_role_policy(RoleName=role, PolicyArn=policy["Policy"]["Arn"])
    aws.iam.create_instance_profile(InstanceProfileName=f"{CLUSTER}-node-4d5e6f", Tags=tags())
    aws.iam.add_role_to_instance_profile(InstanceProfileName=f"{CLUSTER}-node-4d5e6f", RoleName=role)
    aws.scheduler.create_schedule_group(Name=schedule_group_name(CLUSTER), Tags=[
        {"Key": CLUSTER_TAG, "Value": CLUSTER}])
    # The schedules' dead-letter queue (auto-named by Pulumi: logical name plus a suffix).
    aws.sqs.create_queue(QueueName=f"{CLUSTER}-expiry-failures-1a2b3c4", tags={CLUSTER_TAG: CLUSTER})
    # The all-or-nothing reservation (moto has none: the fake holds it).
    extras.reservations["cr-0aaaabbbbccccdddd"] = {
        "CapacityReservationId": "cr-0aaaabbbbccccdddd", "InstanceType": "p4d.24xlarge", "State": "active",
        "AvailabilityZone": "us-east-1b", "TotalInstanceCount": 2, "AvailableInstanceCount": 0,
        "Tags": tags()}
    return {"vpc": vpc, "nat": nat, "eip": eip, "nodes_sg": nodes_sg, "bastion_sg": bastion_sg,
            "eni": eni["NetworkInterface"]["NetworkInterfaceId"], "volume": volume["VolumeId"], "fsx": fs,
            "template": template["LaunchTemplate"]["LaunchTemplateId"], "ami": ami}


@pytest.fixture
def planted(aws):
    extras = Ec2Extras(aws.ec2)
    return extras, plant_cluster(aws, extras)


def test_sweep_reports_without_force_and_deletes_nothing(aws, planted):
    lines = []
    report = sweep.sweep(aws, CLUSTER, out=lines.append)
    kinds = sorted({item.kind for item in report.found})
    assert kinds == sorted(["vpc", "subnet", "internet-gateway", "elastic-ip", "nat-gateway", "route-table",
                            "vpc-endpoint", "security-group", "launch-template", "placement-group",
                            "instance", "network-interface", "volume", "key-pair", "fsx-file-system",
                            "schedule-group", "iam-role", "instance-profile", "capacity-reservation",
                            "sqs-queue"])
    assert sum(item.kind == "instance" for item in report.found) == 2
    assert sum(item.kind == "security-group" for item in report.found) == 2
    assert not report.deleted and not report.clean
    assert any(line.startswith("  found instance i-") for line in lines)
    assert "--force` deletes it" in sweep.describe_report(report, CLUSTER)
    # Nothing was touched.
    assert len(sweep.find_leftovers(aws, CLUSTER, out=lambda _: None).found) == len(report.found)


def test_forced_sweep_deletes_in_dependency_order_and_is_idempotent(aws, planted):
    extras, ids = planted
    # Another cluster's node and an untagged volume must survive.
    other = aws.ec2.run_instances(ImageId=ids["ami"], InstanceType="t3.micro", MinCount=1, MaxCount=1,
                                  TagSpecifications=tag_spec("instance", cluster="other"))
    other_id = other["Instances"][0]["InstanceId"]
    untagged = aws.ec2.create_volume(AvailabilityZone="us-east-1b", Size=8)["VolumeId"]
    aws.iam.create_role(RoleName=f"{CLUSTER}-hand-made", AssumeRolePolicyDocument="{}")

    calls = record_calls(aws.ec2, aws.fsx, aws.scheduler, aws.iam, aws.sqs)
    report = sweep.sweep(aws, CLUSTER, force=True, out=lambda _: None)
    assert report.failed == []
    assert report.clean, sweep.describe_report(report, CLUSTER)
    assert len(report.deleted) == 23

    calls += extras.calls  # the fake answers DeletePlacementGroup before the recorder's turn is visible
    def first(op: str) -> int:
        return calls.index(op)

    def last(op: str) -> int:
        return len(calls) - 1 - calls[::-1].index(op)

    assert first("DeleteScheduleGroup") < first("TerminateInstances")
    # The dead-letter queue goes once no schedule can write to it.
    assert first("DeleteScheduleGroup") < first("DeleteQueue")
    # Instances are terminated and waited for before anything they hold.
    waited = calls.index("DescribeInstances", last("TerminateInstances"))
    for op in ("DeleteNetworkInterface", "DeleteVolume", "DeleteSecurityGroup", "DeleteSubnet"):
        assert waited < first(op), op
    # FSx goes (and is waited for) before its security group and subnet.
    fsx_gone = calls.index("DescribeFileSystems", first("DeleteFileSystem"))
    assert fsx_gone < first("DeleteSecurityGroup") and fsx_gone < first("DeleteSubnet")
    assert last("DeleteNatGateway") < first("ReleaseAddress")
    # The reservation is cancelled once its instances are gone (it would bill on, empty).
    assert waited < first("CancelCapacityReservation")
    assert extras.reservations["cr-0aaaabbbbccccdddd"]["State"] == "cancelled"
    # VPC endpoints are deleted and waited for before route tables, subnets and the VPC.
    endpoints_gone = calls.index("DescribeVpcEndpoints", last("DeleteVpcEndpoints"))
    for op in ("DeleteRouteTable", "DeleteSubnet", "DeleteVpc"):
        assert endpoints_gone < first(op), op
    # Every group reference is revoked before the first group is deleted.
    assert calls.count("RevokeSecurityGroupIngress") == 2 and calls.count("RevokeSecurityGroupEgress") == 1
    assert last("RevokeSecurityGroupIngress") < first("DeleteSecurityGroup")
    assert last("DeleteSecurityGroup") < first("DeleteSubnet")
    assert last("DetachInternetGateway") < first("DeleteVpc")
    assert last("DeleteSubnet") < first("DeleteVpc")
    assert extras.placement_groups == {}
    # A role leaves its instance profile and sheds its policies before it is deleted.
    assert waited < first("DeleteInstanceProfile")
    assert first("RemoveRoleFromInstanceProfile") < first("DeleteInstanceProfile") < first("DeleteRole")
    assert first("DeleteRolePolicy") < first("DeleteRole") and first("DetachRolePolicy") < first("DeleteRole")

    again = sweep.sweep(aws, CLUSTER, force=True, out=lambda _: None)
    assert again.found == [] and again.deleted == [] and again.failed == []

    state = aws.ec2.describe_instances(InstanceIds=[other_id])["Reservations"][0]["Instances"][0]["State"]
    assert state["Name"] == "running"
    assert aws.ec2.describe_volumes(VolumeIds=[untagged])["Volumes"][0]["State"] == "available"
    assert [r["RoleName"] for r in aws.iam.list_roles()["Roles"]] == [f"{CLUSTER}-hand-made"]


def test_one_failed_deletion_is_reported_and_the_rest_continue(aws, planted):
    _, ids = planted
    # A subnet someone added by hand (untagged, so never swept) keeps the VPC from being deleted.
    aws.ec2.create_subnet(VpcId=ids["vpc"], CidrBlock="10.42.9.0/24", AvailabilityZone="us-east-1b")
    report = sweep.sweep(aws, CLUSTER, force=True, out=lambda _: None)
    assert [(item.id, reason.split(":")[0]) for item, reason in report.failed] == [
        (ids["vpc"], "DependencyViolation")]
    deleted = {item.id for item in report.deleted}
    assert {ids[k] for k in ("fsx", "eni", "volume", "nodes_sg", "bastion_sg", "template")} <= deleted
    assert [item.id for item in report.found] == [ids["vpc"]]
    text = sweep.describe_report(report, CLUSTER)
    assert f"could not delete vpc {ids['vpc']} (10.42.0.0/16): DependencyViolation" in text


def test_expiry_dead_letter_queue_is_swept_by_its_tag_and_others_are_left_alone(aws):
    Ec2Extras(aws.ec2)
    ours = aws.sqs.create_queue(QueueName=f"{CLUSTER}-expiry-failures-9f8e7d6",
                                tags={CLUSTER_TAG: CLUSTER})["QueueUrl"]
    others = [aws.sqs.create_queue(QueueName=f"{CLUSTER}-hand-made")["QueueUrl"],
              aws.sqs.create_queue(QueueName="other-expiry-failures-1",
                                   tags={CLUSTER_TAG: "other"})["QueueUrl"]]
    report = sweep.sweep(aws, CLUSTER, out=lambda _: None)
    # Its own kind, not an "other tagged resource" the sweep would refuse to delete.
    assert [(i.kind, i.id) for i in report.found] == [("sqs-queue", ours)]
    assert "--force` deletes it" in sweep.describe_report(report, CLUSTER)
    report = sweep.sweep(aws, CLUSTER, force=True, out=lambda _: None)
    assert [(i.kind, i.id) for i in report.deleted] == [("sqs-queue", ours)] and report.clean
    assert sorted(aws.sqs.list_queues()["QueueUrls"]) == sorted(others)


def _planted_bucket(aws, name: str) -> None:
    aws.s3.create_bucket(Bucket=name)
    aws.s3.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    aws.s3.put_bucket_tagging(Bucket=name, Tagging={"TagSet": tags()})
    for _ in range(2):  # two versions of one object, then a delete marker
        aws.s3.put_object(Bucket=name, Key="step-00010/__0_0.distcp", Body=b"shard")
    aws.s3.delete_object(Bucket=name, Key="step-00010/__0_0.distcp")


def test_tagged_bucket_is_found_and_with_force_emptied_and_deleted(aws):
    Ec2Extras(aws.ec2)
    _planted_bucket(aws, "sweepme-checkpoints-1")
    report = sweep.sweep(aws, CLUSTER, force=False, out=lambda _: None)
    assert [(i.kind, i.id) for i in report.found] == [("s3-bucket", "sweepme-checkpoints-1")]
    assert "--force` deletes it" in sweep.describe_report(report, CLUSTER)
    report = sweep.sweep(aws, CLUSTER, force=True, out=lambda _: None)
    assert [(i.kind, i.id) for i in report.deleted] == [("s3-bucket", "sweepme-checkpoints-1")]
    assert report.clean
    assert "sweepme-checkpoints-1" not in [b["Name"] for b in aws.s3.list_buckets()["Buckets"]]


def test_bucket_kept_on_purpose_is_reported_as_kept_not_left_over(aws):
    Ec2Extras(aws.ec2)
    _planted_bucket(aws, "sweepme-checkpoints-2")
    report = sweep.sweep(aws, CLUSTER, force=True, out=lambda _: None, keep_kinds=frozenset({"s3-bucket"}))
    assert report.clean and report.deleted == []
    assert [(i.kind, i.id) for i in report.kept] == [("s3-bucket", "sweepme-checkpoints-2")]
    aws.s3.head_bucket(Bucket="sweepme-checkpoints-2")


def test_sweep_waits_while_a_vpc_endpoint_is_still_deleting(aws, planted, monkeypatch):
    """DeleteVpcEndpoints returns while the endpoint is `deleting`: nothing that it holds (route
    tables, subnets, the VPC) may be deleted until a describe says it is gone."""
    monkeypatch.setattr(sweep, "WAIT_POLL_SECONDS", 0)
    calls = record_calls(aws.ec2)
    polls = []

    def still_deleting(params, **_):
        if params.get("VpcEndpointIds") and not polls:
            polls.append("deleting")
            calls.append("DescribeVpcEndpoints:deleting")
            return (Ec2Extras._ok({"VpcEndpoints": [
                {"VpcEndpointId": params["VpcEndpointIds"][0], "State": "deleting"}]}))
        return None

    aws.ec2.meta.events.register("before-parameter-build.ec2.DescribeVpcEndpoints",
                                 lambda params, context, **_: context.update(p=dict(params)))
    aws.ec2.meta.events.register("before-call.ec2.DescribeVpcEndpoints",
                                 lambda context, **_: still_deleting(context["p"]))
    lines = []
    report = sweep.sweep(aws, CLUSTER, force=True, out=lines.append)
    assert report.clean, sweep.describe_report(report, CLUSTER)
    assert "  waiting for VPC endpoints to delete ..." in lines
    deleting = calls.index("DescribeVpcEndpoints:deleting")
    assert calls.index("DeleteVpcEndpoints") < deleting
    gone = calls.index("DescribeVpcEndpoints", deleting + 1)  # the poll that saw it gone
    for op in ("DeleteRouteTable", "DeleteSubnet", "DeleteVpc"):
        assert gone < calls.index(op), op
