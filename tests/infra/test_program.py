"""The Pulumi program, resource by resource, run under the offline planner's recording mocks.

Inputs are asserted as the AWS provider would receive them (engine camelCase names; numbers arrive
as floats)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from datetime import time as dt_time

import pytest

from infra.components.network import subnet_cidrs
from infra.spec import BASTION_SSM_PARAMETERS, CLUSTER_TAG, DEFAULT_DLAMI_PARAMETER, EXPIRES_TAG, RANK_TAG
from tests.infra.conftest import EXPIRES_AT, plan_of

VPC, SUBNET = "aws:ec2/vpc:Vpc", "aws:ec2/subnet:Subnet"
SG, LT, INSTANCE = "aws:ec2/securityGroup:SecurityGroup", "aws:ec2/launchTemplate:LaunchTemplate", \
    "aws:ec2/instance:Instance"
PG = "aws:ec2/placementGroup:PlacementGroup"
ROLE, POLICY = "aws:iam/role:Role", "aws:iam/rolePolicy:RolePolicy"
RESERVATION = "cr-0123456789abcdef0"


def nodes(plan):
    """Node instances by rank (registration order is asynchronous, so not a rank order)."""
    return sorted((r for r in plan.mocks.of_type(INSTANCE) if RANK_TAG in r.tags),
                  key=lambda r: int(r.tags[RANK_TAG]))


def bastions(plan):
    return [r for r in plan.mocks.of_type(INSTANCE) if RANK_TAG not in r.tags]


# ---- network ----------------------------------------------------------------------------------
def test_network_creates_vpc_subnets_gateways_routes_and_s3_endpoint(demo_plan):
    m = demo_plan.mocks
    vpc = m.one(VPC)
    assert vpc.inputs["cidrBlock"] == "10.42.0.0/16"
    assert vpc.inputs["enableDnsSupport"] and vpc.inputs["enableDnsHostnames"]
    private, public = m.named("demo-private", SUBNET), m.named("demo-public", SUBNET)
    assert (private.inputs["cidrBlock"], public.inputs["cidrBlock"]) == subnet_cidrs("10.42.0.0/16")
    for subnet in (private, public):
        assert subnet.inputs["vpcId"] == vpc.id
        assert subnet.inputs["availabilityZone"] == "us-east-1b"
        assert not subnet.inputs["mapPublicIpOnLaunch"]
    igw = m.one("aws:ec2/internetGateway:InternetGateway")
    nat = m.one("aws:ec2/natGateway:NatGateway")
    eip = m.one("aws:ec2/eip:Eip")
    assert nat.inputs["subnetId"] == public.id and nat.inputs["allocationId"] == f"<{eip.name}.allocation_id>"
    public_rt, private_rt = m.named("demo-public-routes", "aws:ec2/routeTable:RouteTable"), \
        m.named("demo-private-routes", "aws:ec2/routeTable:RouteTable")
    assert public_rt.inputs["routes"] == [{"cidrBlock": "0.0.0.0/0", "gatewayId": igw.id}]
    assert private_rt.inputs["routes"] == [{"cidrBlock": "0.0.0.0/0", "natGatewayId": nat.id}]
    associations = {(a.inputs["subnetId"], a.inputs["routeTableId"])
                    for a in m.of_type("aws:ec2/routeTableAssociation:RouteTableAssociation")}
    assert associations == {(public.id, public_rt.id), (private.id, private_rt.id)}
    endpoint = m.one("aws:ec2/vpcEndpoint:VpcEndpoint")
    assert endpoint.inputs["serviceName"] == "com.amazonaws.us-east-1.s3"
    assert endpoint.inputs["vpcEndpointType"] == "Gateway"
    assert set(endpoint.inputs["routeTableIds"]) == {public_rt.id, private_rt.id}


@pytest.mark.parametrize("vpc_cidr", ["10.42.0.0/16", "172.20.8.0/24"])
def test_subnets_fit_in_the_vpc_without_overlap(vpc_cidr):
    import ipaddress

    vpc = ipaddress.ip_network(vpc_cidr)
    private, public = map(ipaddress.ip_network, subnet_cidrs(vpc_cidr))
    assert private.subnet_of(vpc) and public.subnet_of(vpc) and not private.overlaps(public)


def test_existing_vpc_creates_no_network_and_uses_the_given_ids():
    plan = plan_of(network={"vpc_id": "vpc-0abc", "private_subnet_id": "subnet-0priv",
                            "public_subnet_id": "subnet-0pub"})
    counts = plan.mocks.counts()
    for typ in (VPC, SUBNET, "aws:ec2/natGateway:NatGateway", "aws:ec2/internetGateway:InternetGateway",
                "aws:ec2/eip:Eip", "aws:ec2/vpcEndpoint:VpcEndpoint", "aws:ec2/routeTable:RouteTable"):
        assert typ not in counts
    assert {sg.inputs["vpcId"] for sg in plan.mocks.of_type(SG)} == {"vpc-0abc"}
    template = plan.mocks.one(LT)
    assert {nic["subnetId"] for nic in template.inputs["networkInterfaces"]} == {"subnet-0priv"}
    assert bastions(plan)[0].inputs["subnetId"] == "subnet-0pub"
    assert plan.outputs["vpc_id"] == "vpc-0abc" and plan.outputs["private_subnet_id"] == "subnet-0priv"


# ---- security ---------------------------------------------------------------------------------
def _rules(sg, direction):
    return sg.inputs.get(direction) or []


def test_efa_group_allows_all_traffic_to_itself_and_ssh_only_through_the_bastion(demo_plan):
    m = demo_plan.mocks
    efa, bastion = m.named("demo-efa", SG), m.named("demo-bastion", SG)
    self_all = {"protocol": "-1", "fromPort": 0.0, "toPort": 0.0, "self": True}
    assert any(self_all.items() <= rule.items() for rule in _rules(efa, "ingress"))
    assert any(self_all.items() <= rule.items() for rule in _rules(efa, "egress"))
    others = [rule for rule in _rules(efa, "ingress") if not rule.get("self")]
    assert len(others) == 1
    assert others[0]["protocol"] == "tcp" and others[0]["fromPort"] == others[0]["toPort"] == 22.0
    assert others[0]["securityGroups"] == [bastion.id] and not others[0].get("cidrBlocks")
    assert _rules(bastion, "ingress") == [
        {"protocol": "tcp", "fromPort": 22.0, "toPort": 22.0, "cidrBlocks": ["203.0.113.0/24"],
         "description": "SSH from the operator network"}]
    assert demo_plan.outputs["security_group_id"] == efa.id


def test_without_a_bastion_nodes_take_ssh_from_ssh_cidr_only():
    plan = plan_of(access={"bastion": False})
    assert len(plan.mocks.of_type(SG)) == 1 and bastions(plan) == []
    ssh = [r for r in _rules(plan.mocks.one(SG), "ingress") if not r.get("self")]
    assert [(r["fromPort"], r["cidrBlocks"]) for r in ssh] == [(22.0, ["203.0.113.0/24"])]
    assert plan.outputs["bastion_public_ip"] is None


# ---- placement group --------------------------------------------------------------------------
def test_every_node_is_in_the_cluster_placement_group(demo_plan):
    group = demo_plan.mocks.one(PG)
    assert group.inputs["strategy"] == "cluster"
    assert demo_plan.mocks.one(LT).inputs["placement"] == {"groupName": f"<{group.name}.name>"}
    assert demo_plan.outputs["placement_group"] == f"<{group.name}.name>"


@pytest.mark.parametrize("capacity_type", ["capacity-reservation", "capacity-block"])
def test_reservations_skip_the_placement_group_and_target_the_reservation(capacity_type):
    plan = plan_of(capacity={"type": capacity_type, "reservation_id": RESERVATION})
    assert PG not in plan.mocks.counts()
    inputs = plan.mocks.one(LT).inputs
    assert "placement" not in inputs
    assert inputs["capacityReservationSpecification"] == {
        "capacityReservationTarget": {"capacityReservationId": RESERVATION}}
    market = inputs.get("instanceMarketOptions")
    assert market == ({"marketType": "capacity-block"} if capacity_type == "capacity-block" else None)
    assert plan.outputs["placement_group"] is None
    assert any("placement group" in w for w in plan.spec.warnings())


def test_an_existing_placement_group_is_used_by_name_not_created():
    plan = plan_of(capacity={"type": "capacity-block", "reservation_id": RESERVATION},
                   placement_group={"existing_name": "reserved-pg"})
    assert PG not in plan.mocks.counts()
    assert plan.mocks.one(LT).inputs["placement"] == {"groupName": "reserved-pg"}
    assert plan.outputs["placement_group"] == "reserved-pg"


def test_placement_group_can_be_turned_off():
    plan = plan_of(placement_group={"enabled": False})
    assert PG not in plan.mocks.counts() and "placement" not in plan.mocks.one(LT).inputs


# ---- launch template --------------------------------------------------------------------------
P5_LAYOUT_32 = [(0, 0, "efa")] + [(card, 1, "efa-only") for card in range(1, 32)]
LAYOUTS = {
    # The guide's basic layout: ENA primary + efa-only on card 0, efa-only at device 0 elsewhere.
    "p4d.24xlarge": [(0, 0, "interface"), (0, 1, "efa-only"), (1, 0, "efa-only"), (2, 0, "efa-only"),
                     (3, 0, "efa-only")],
    "p4de.24xlarge": [(0, 0, "interface"), (0, 1, "efa-only"), (1, 0, "efa-only"), (2, 0, "efa-only"),
                      (3, 0, "efa-only")],
    # "EFA configuration for P5, P5e and P5en instances", use case 1: EFA with ENA at card 0 device
    # 0 (the one IP), efa-only at device 1 of every other card.
    "p5.48xlarge": P5_LAYOUT_32,
    "p5e.48xlarge": P5_LAYOUT_32,
    "p5en.48xlarge": [(0, 0, "efa")] + [(card, 1, "efa-only") for card in range(1, 16)],
}


@pytest.mark.parametrize("instance_type", list(LAYOUTS))
def test_launch_template_efa_layout_per_instance_type(instance_type):
    plan = plan_of(instance_type=instance_type, node_count=2)
    nics = plan.mocks.one(LT).inputs["networkInterfaces"]
    layout = [(int(n["networkCardIndex"]), int(n["deviceIndex"]), n["interfaceType"]) for n in nics]
    assert layout == LAYOUTS[instance_type]
    cards = {card for card, _, _ in layout}
    assert cards == set(range(plan.spec.instance.network_cards))
    efas = sum(n["interfaceType"] in ("efa", "efa-only") for n in nics)
    assert efas == len(cards) == plan.spec.instance.efa_interfaces  # one EFA per network card
    assert sum(n["interfaceType"] in ("efa", "interface") for n in nics) == 1  # one IP per node
    assert len({(n["networkCardIndex"], n["deviceIndex"]) for n in nics}) == len(nics)
    assert [node["efa_count"] for node in plan.outputs["nodes"]] == [efas, efas]


def test_launch_template_settings(demo_plan):
    m = demo_plan.mocks
    inputs = m.one(LT).inputs
    assert inputs["instanceType"] == "p4d.24xlarge"
    efa, private = m.named("demo-efa", SG), m.named("demo-private", SUBNET)
    for nic in inputs["networkInterfaces"]:
        assert nic["subnetId"] == private.id and nic["securityGroups"] == [efa.id]
        assert nic["deleteOnTermination"] == "true"
        assert "associatePublicIpAddress" not in nic  # refused by EC2 with several interfaces
    assert inputs["metadataOptions"]["httpTokens"] == "required"
    assert inputs["metadataOptions"]["httpPutResponseHopLimit"] in (1.0, 2.0)
    assert inputs["metadataOptions"]["httpEndpoint"] == "enabled"
    [root] = inputs["blockDeviceMappings"]
    assert root["deviceName"] == "<root device of the AMI>"  # from the image's own description
    assert root["ebs"] == {"volumeSize": 200.0, "volumeType": "gp3", "encrypted": "true",
                           "deleteOnTermination": "true"}
    profile = m.one("aws:iam/instanceProfile:InstanceProfile")
    assert inputs["iamInstanceProfile"] == {"arn": f"<{profile.name}.arn>"}
    assert "userData" not in inputs
    assert "instanceMarketOptions" not in inputs
    # On-demand: the program's own all-or-nothing reservation (see test_all_or_nothing_...).
    reservation = m.one("aws:ec2/capacityReservation:CapacityReservation")
    assert inputs["capacityReservationSpecification"] == {
        "capacityReservationTarget": {"capacityReservationId": reservation.id}}
    tagged = {spec["resourceType"]: spec["tags"] for spec in inputs["tagSpecifications"]}
    assert set(tagged) == {"volume", "network-interface"}
    assert all(tags[CLUSTER_TAG] == "demo" and tags[EXPIRES_TAG] == EXPIRES_AT for tags in tagged.values())
    ami_lookup = [lk for lk in m.lookups if lk.token == "aws:ec2/getAmi:getAmi"]
    assert ami_lookup[0].args["filters"] == [{"name": "image-id", "values": [inputs["imageId"]]}]
    assert ami_lookup[0].args["includeDeprecated"] is True  # a pinned image may be deprecated later
    assert inputs["updateDefaultVersion"] is True


def test_spot_capacity_through_the_launch_template():
    plan = plan_of(capacity={"type": "spot", "spot_max_price": 30.5})
    inputs = plan.mocks.one(LT).inputs
    assert inputs["instanceMarketOptions"] == {"marketType": "spot", "spotOptions": {
        "maxPrice": "30.5", "spotInstanceType": "one-time", "instanceInterruptionBehavior": "terminate"}}
    assert "capacityReservationSpecification" not in inputs
    assert plan.mocks.one(PG)  # spot keeps the placement group


# ---- instances --------------------------------------------------------------------------------
def test_one_instance_per_node_with_a_stable_rank(demo_plan):
    template = demo_plan.mocks.one(LT)
    instances = nodes(demo_plan)
    assert [i.name for i in instances] == ["demo-node0", "demo-node1", "demo-node2", "demo-node3"]
    for rank, instance in enumerate(instances):
        assert instance.tags[RANK_TAG] == str(rank)
        assert instance.tags["Name"] == demo_plan.spec.node_name(rank)
        assert instance.tags[CLUSTER_TAG] == "demo" and instance.tags[EXPIRES_TAG] == EXPIRES_AT
        assert instance.inputs["launchTemplate"] == {"id": template.id, "version": "1"}
        # Everything else comes from the launch template: no second place to configure a node.
        assert not {"subnetId", "vpcSecurityGroupIds", "ami", "instanceType"} & instance.inputs.keys()


def test_node_urn_names_exactly_one_node(demo_plan):
    from infra.program import node_urn

    for rank, instance in enumerate(nodes(demo_plan)):
        assert instance.urn == node_urn("demo", demo_plan.spec, rank)


# ---- identity ---------------------------------------------------------------------------------
def test_node_role_has_ssm_and_only_the_checkpoint_bucket(demo_plan):
    m = demo_plan.mocks
    role = m.named("demo-node", ROLE)
    trust = json.loads(role.inputs["assumeRolePolicy"])
    assert trust["Statement"] == [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"},
                                   "Action": "sts:AssumeRole"}]
    attachment = m.one("aws:iam/rolePolicyAttachment:RolePolicyAttachment")
    assert attachment.inputs["policyArn"] == "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"
    assert attachment.inputs["role"] == f"<{role.name}.name>"
    policy = json.loads(m.named("demo-node-checkpoints", POLICY).inputs["policy"])
    bucket_arn = f"<{m.one('aws:s3/bucket:Bucket').name}.arn>"
    resources = {s["Resource"] for s in policy["Statement"]}
    assert resources == {bucket_arn, f"{bucket_arn}/*"}
    actions = [a for s in policy["Statement"] for a in s["Action"]]
    assert "s3:PutObject" in actions and "s3:GetObject" in actions and "s3:ListBucket" in actions
    assert not [a for a in actions if a.endswith("*")]
    profile = m.one("aws:iam/instanceProfile:InstanceProfile")
    assert profile.inputs["role"] == f"<{role.name}.name>"


def test_public_key_is_imported_as_a_key_pair_used_by_nodes_and_bastion():
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDemoKey operator@laptop"
    plan = plan_of(access={"public_key": key})
    pair = plan.mocks.one("aws:ec2/keyPair:KeyPair")
    assert pair.inputs["publicKey"] == key and pair.inputs["keyName"] == "demo-key"
    assert plan.mocks.one(LT).inputs["keyName"] == "demo-key"
    assert bastions(plan)[0].inputs["keyName"] == "demo-key"
    assert plan.outputs["key_name"] == "demo-key"


def test_existing_key_name_is_used_without_importing(demo_plan):
    plan = plan_of(access={"key_name": "team-key"})
    assert "aws:ec2/keyPair:KeyPair" not in plan.mocks.counts()
    assert plan.mocks.one(LT).inputs["keyName"] == "team-key" and plan.outputs["key_name"] == "team-key"
    assert "keyName" not in demo_plan.mocks.one(LT).inputs and demo_plan.outputs["key_name"] is None


# ---- storage ----------------------------------------------------------------------------------
def test_checkpoint_bucket_is_private_versioned_encrypted_and_expires_after_retention():
    plan = plan_of(checkpoint_bucket={"retention_days": 14})
    m = plan.mocks
    bucket = m.one("aws:s3/bucket:Bucket")
    assert bucket.inputs["bucketPrefix"] == "demo-checkpoints-"
    block = m.one("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock").inputs
    assert block["bucket"] == bucket.id
    assert all(block[k] for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls",
                                  "restrictPublicBuckets"))
    versioning = m.one("aws:s3/bucketVersioning:BucketVersioning").inputs
    assert versioning["versioningConfiguration"] == {"status": "Enabled"}
    sse = m.one("aws:s3/bucketServerSideEncryptionConfiguration:"
                "BucketServerSideEncryptionConfiguration").inputs
    assert sse["rules"][0]["applyServerSideEncryptionByDefault"]["sseAlgorithm"] in ("AES256", "aws:kms")
    rule, markers = m.one("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration").inputs["rules"]
    assert rule["status"] == markers["status"] == "Enabled"
    # How long that keeps a byte: test_no_byte_outlives_the_retention_promise_under_s3_rounding.
    assert rule["abortIncompleteMultipartUpload"]["daysAfterInitiation"] == 1.0
    assert rule["filter"] == markers["filter"] == {"prefix": ""}
    assert markers["expiration"] == {"expiredObjectDeleteMarker": True}
    assert plan.outputs["checkpoint_bucket"].startswith("demo-checkpoints-")


def test_checkpoint_bucket_goes_with_the_cluster_unless_kept(demo_plan):
    # Versioned checkpoints would block `pulumi destroy`: the bucket is emptied on destroy by default.
    assert demo_plan.mocks.one("aws:s3/bucket:Bucket").inputs["forceDestroy"] is True
    kept = plan_of(checkpoint_bucket={"keep_on_down": True})
    assert kept.mocks.one("aws:s3/bucket:Bucket").inputs["forceDestroy"] is False


@pytest.mark.parametrize("keep", [False, True])
def test_a_kept_bucket_keeps_its_lifecycle_encryption_versioning_and_public_access_block(keep):
    """`pulumi destroy` deletes whatever is not retained: a kept bucket keeps every setting of it, or
    it would be left without its public access block, with versioning suspended, with S3's default
    encryption instead of ours and without the lifecycle that deletes its bytes."""
    plan = plan_of(checkpoint_bucket={"keep_on_down": keep})
    bucket = plan.mocks.one("aws:s3/bucket:Bucket")
    of_bucket = [r for r in plan.mocks.resources if r.inputs.get("bucket") == bucket.id]
    assert {r.type.rsplit(":", 1)[-1] for r in of_bucket} == {
        "BucketPublicAccessBlock", "BucketVersioning", "BucketServerSideEncryptionConfiguration",
        "BucketLifecycleConfiguration"}
    assert {(r.name, r.retain_on_delete) for r in [bucket, *of_bucket]} == {
        (r.name, keep) for r in [bucket, *of_bucket]}


def test_named_checkpoint_bucket():
    plan = plan_of(checkpoint_bucket={"name": "acme-fsdp-checkpoints"})
    assert plan.mocks.one("aws:s3/bucket:Bucket").inputs["bucket"] == "acme-fsdp-checkpoints"
    assert plan.outputs["checkpoint_bucket"] == "acme-fsdp-checkpoints"


def test_fsx_persistent_2_with_its_s3_data_repository_association(demo_plan):
    plan = plan_of(storage={"fsx": {"enabled": True, "capacity_gib": 4800, "throughput_per_tib": 500,
                                    "s3_import_path": "s3://acme-data/tokens",
                                    "s3_export_path": "s3://acme-data/tokens"}})
    m = plan.mocks
    lustre = m.one("aws:fsx/lustreFileSystem:LustreFileSystem")
    assert lustre.inputs["deploymentType"] == "PERSISTENT_2"
    assert lustre.inputs["storageCapacity"] == 4800.0 and lustre.inputs["perUnitStorageThroughput"] == 500.0
    assert lustre.inputs["subnetIds"] == m.named("demo-private", SUBNET).id  # one str in pulumi-aws v7
    assert lustre.inputs["securityGroupIds"] == [m.named("demo-efa", SG).id]
    association = m.one("aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation").inputs
    assert association["fileSystemId"] == lustre.id
    assert association["dataRepositoryPath"] == "s3://acme-data/tokens"
    assert set(association["s3"]) == {"autoImportPolicy", "autoExportPolicy"}
    assert plan.outputs["fsx_dns_name"] == f"<{lustre.name}.dns_name>"
    assert plan.outputs["fsx_mount_name"] == f"<{lustre.name}.mount_name>"
    assert "aws:fsx/lustreFileSystem:LustreFileSystem" not in demo_plan.mocks.counts()
    assert demo_plan.outputs["fsx_dns_name"] is None and demo_plan.outputs["fsx_mount_name"] is None


def test_fsx_scratch_takes_s3_paths_on_the_file_system():
    plan = plan_of(storage={"fsx": {"enabled": True, "deployment_type": "SCRATCH_2",
                                    "s3_import_path": "s3://acme-data/tokens"}})
    lustre = plan.mocks.one("aws:fsx/lustreFileSystem:LustreFileSystem").inputs
    assert lustre["importPath"] == "s3://acme-data/tokens" and "perUnitStorageThroughput" not in lustre
    assert "exportPath" not in lustre  # export only when asked for
    assert "aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation" not in plan.mocks.counts()


def test_root_volume_size_from_the_spec():
    plan = plan_of(storage={"root_volume_gib": 500})
    assert plan.mocks.one(LT).inputs["blockDeviceMappings"][0]["ebs"]["volumeSize"] == 500.0


# ---- expiry -----------------------------------------------------------------------------------
SCHEDULE = "aws:scheduler/schedule:Schedule"


def _schedules(plan):
    return {r.name: r.inputs for r in plan.mocks.of_type(SCHEDULE)}


NODE_SCHEDULES = {f"demo-expiry-node{rank}" for rank in range(4)}
QUEUE = "aws:sqs/queue:Queue"


def _statements(plan):
    return json.loads(plan.mocks.named("demo-expiry-stop", POLICY).inputs["policy"])["Statement"]


def test_expiry_schedules_stop_every_billed_resource(demo_plan):
    m = demo_plan.mocks
    group = m.one("aws:scheduler/scheduleGroup:ScheduleGroup")
    assert group.inputs["name"] == "fsdp-cluster-demo" and group.tags[CLUSTER_TAG] == "demo"
    schedules = _schedules(demo_plan)
    assert set(schedules) == NODE_SCHEDULES | {"demo-expiry-bastion", "demo-expiry-capacity",
                                               "demo-expiry-nat", "demo-expiry-nat-ip"}
    role = m.named("demo-expiry", ROLE)
    queue = m.one(QUEUE)
    for schedule in schedules.values():
        assert schedule["groupName"] == "fsdp-cluster-demo"
        assert schedule["scheduleExpressionTimezone"] == "UTC"
        assert schedule["flexibleTimeWindow"] == {"mode": "OFF"}
        assert schedule["target"]["roleArn"] == f"<{role.name}.arn>"
        # A call that still fails after the retries lands in the queue, where `status` reports it.
        assert schedule["target"]["deadLetterConfig"] == {"arn": f"<{queue.name}.arn>"}
    nat, nat_ip = (schedules[n]["target"] for n in ("demo-expiry-nat", "demo-expiry-nat-ip"))
    assert schedules["demo-expiry-node0"]["scheduleExpression"] == "at(2026-12-03T13:00:00)"
    assert schedules["demo-expiry-nat"]["scheduleExpression"] == "at(2026-12-03T13:00:00)"
    # The Elastic IP only once the NAT gateway that holds it is gone.
    assert schedules["demo-expiry-nat-ip"]["scheduleExpression"] == "at(2026-12-03T14:00:00)"
    assert nat["arn"] == "arn:aws:scheduler:::aws-sdk:ec2:deleteNatGateway"
    assert json.loads(nat["input"]) == {"NatGatewayId": m.one("aws:ec2/natGateway:NatGateway").id}
    assert nat_ip["arn"] == "arn:aws:scheduler:::aws-sdk:ec2:releaseAddress"
    assert json.loads(nat_ip["input"]) == {"AllocationId": "<demo-nat-ip.allocation_id>"}
    trust = json.loads(role.inputs["assumeRolePolicy"])["Statement"][0]
    assert trust["Principal"] == {"Service": "scheduler.amazonaws.com"}
    capacity = schedules["demo-expiry-capacity"]["target"]
    assert capacity["arn"] == "arn:aws:scheduler:::aws-sdk:ec2:cancelCapacityReservation"
    assert json.loads(capacity["input"]) == {
        "CapacityReservationId": m.one("aws:ec2/capacityReservation:CapacityReservation").id}
    statements = _statements(demo_plan)
    assert {(s["Action"], s["Resource"]) for s in statements} == {
        ("ec2:TerminateInstances", "arn:aws:ec2:us-east-1:*:instance/*"),
        ("ec2:CancelCapacityReservation", "arn:aws:ec2:us-east-1:*:capacity-reservation/*"),
        ("ec2:DeleteNatGateway", "arn:aws:ec2:us-east-1:*:natgateway/*"),
        ("ec2:ReleaseAddress", "arn:aws:ec2:us-east-1:*:elastic-ip/*"),
        # Scheduler delivers a dead letter with the schedule's own role (no queue policy needed).
        ("sqs:SendMessage", f"<{queue.name}.arn>")}
    own = {"StringEquals": {"aws:ResourceTag/fsdp-cluster:cluster": "demo"}}
    for statement in statements:
        if statement["Action"] != "sqs:SendMessage":
            assert statement["Condition"] == own


def test_each_instance_is_terminated_by_its_own_schedule(demo_plan):
    """One TerminateInstances call per instance: AWS refuses a whole call when one of its ids is gone
    (a spot interruption, a reclaimed Capacity Block node, a half-done replace), which would leave
    every other node billing."""
    schedules = _schedules(demo_plan)
    [bastion] = bastions(demo_plan)
    expected = {f"demo-expiry-node{node.tags[RANK_TAG]}": node.id for node in nodes(demo_plan)}
    expected["demo-expiry-bastion"] = bastion.id
    for name, instance_id in expected.items():
        target = schedules[name]["target"]
        assert target["arn"] == "arn:aws:scheduler:::aws-sdk:ec2:terminateInstances"
        assert json.loads(target["input"]) == {"InstanceIds": [instance_id]}, name


def test_expiry_failures_wait_in_an_encrypted_dead_letter_queue(demo_plan):
    queue = demo_plan.mocks.one(QUEUE)
    assert queue.component == "fsdp-cluster:index:Expiry"
    assert queue.inputs["sqsManagedSseEnabled"] is True
    assert queue.inputs["messageRetentionSeconds"] == 14 * 24 * 3600.0  # SQS's longest
    assert "fifoQueue" not in queue.inputs  # Scheduler refuses a FIFO dead-letter queue
    assert queue.tags[CLUSTER_TAG] == "demo"  # the sweep finds it by this tag
    assert demo_plan.outputs["expiry_queue_url"] == f"<{queue.name}.url>"
    assert plan_of(expiry_hours=None).outputs["expiry_queue_url"] is None


def test_the_file_system_is_deleted_at_expiry_without_backup_by_default():
    plan = plan_of(storage={"fsx": {"enabled": True}})
    fsx = plan.mocks.one("aws:fsx/lustreFileSystem:LustreFileSystem")
    target = _schedules(plan)["demo-expiry-fsx"]["target"]
    assert target["arn"] == "arn:aws:scheduler:::aws-sdk:fsx:deleteFileSystem"
    assert json.loads(target["input"]) == {"FileSystemId": fsx.id,
                                           "LustreConfiguration": {"SkipFinalBackup": True}}
    [statement] = [s for s in _statements(plan) if s["Resource"].startswith("arn:aws:fsx:")]
    assert statement["Action"] == ["fsx:DeleteFileSystem", "fsx:DeleteDataRepositoryAssociation"]
    assert statement["Resource"] == "arn:aws:fsx:us-east-1:*:*"


def test_the_file_system_can_get_a_final_backup_at_expiry():
    plan = plan_of(storage={"fsx": {"enabled": True, "at_expiry": "backup"}})
    fsx = plan.mocks.one("aws:fsx/lustreFileSystem:LustreFileSystem")
    target = _schedules(plan)["demo-expiry-fsx"]["target"]
    assert json.loads(target["input"]) == {"FileSystemId": fsx.id, "LustreConfiguration": {
        "SkipFinalBackup": False,
        # Not the cluster tag: the backup is kept on purpose, and `down`'s sweep must not count it.
        "FinalBackupTags": [{"Key": "fsdp-cluster:final-backup-of", "Value": "demo"},
                            {"Key": "Name", "Value": "demo-fsx-final"}]}}
    statements = {s["Sid"]: s for s in _statements(plan)}
    assert "fsx:CreateBackup" in statements["DeleteThisClustersFileSystem"]["Action"]
    # The backup does not exist yet, so it has no tag a condition could check.
    backup = statements["CreateTheFinalBackup"]
    assert backup["Action"] == ["fsx:CreateBackup", "fsx:TagResource"]
    assert backup["Resource"] == "arn:aws:fsx:us-east-1:*:backup/*" and "Condition" not in backup


def test_a_kept_file_system_has_no_expiry():
    plan = plan_of(storage={"fsx": {"enabled": True, "at_expiry": "keep"}})
    assert "demo-expiry-fsx" not in _schedules(plan)
    assert not [s for s in _statements(plan) if s["Resource"].startswith("arn:aws:fsx:")]


def test_existing_vpc_has_no_nat_schedule():
    plan = plan_of(network={"vpc_id": "vpc-0abc", "private_subnet_id": "subnet-0priv",
                            "public_subnet_id": "subnet-0pub"})
    assert set(_schedules(plan)) == NODE_SCHEDULES | {"demo-expiry-bastion", "demo-expiry-capacity"}
    assert not [s for s in _statements(plan) if "natgateway" in s["Resource"]]


def test_plain_pulumi_up_without_expires_at_uses_the_expiry_clock():
    """`pulumi up` with only fsdp-cluster:cluster set: a pulumiverse-time Rotating records the
    creation time and the schedules fire expiry_hours later; being a rotating clock, it is created
    again by the first refreshed update after that time (a new expiry, where an Offset would keep
    sending the past one)."""
    from datetime import datetime, timedelta

    plan = plan_of(expires_at=None)
    clock = plan.mocks.one("time:index/rotating:Rotating")
    assert clock.inputs["rotationHours"] == float(plan.spec.expiry_hours)
    assert not [t for t in plan.mocks.counts() if t == "time:index/offset:Offset"]
    base = datetime.fromisoformat(plan.outputs["expires_at"].replace("Z", "+00:00")) \
        - timedelta(hours=plan.spec.expiry_hours)
    assert plan.outputs["expires_at"].endswith("Z")
    expected = f"at({plan.outputs['expires_at'][:-1]})"
    assert {s["scheduleExpression"] for s in _schedules(plan).values()} >= {expected}
    assert _schedules(plan)["demo-expiry-node0"]["scheduleExpression"] == expected
    assert {n.tags[EXPIRES_TAG] for n in nodes(plan)} == {plan.outputs["expires_at"]}
    assert base.tzinfo is not None


def test_no_expiry_schedule_when_expiry_is_disabled():
    plan = plan_of(expiry_hours=None)
    assert not [t for t in plan.mocks.counts() if t.startswith(("aws:scheduler", "aws:sqs"))]
    assert {r.tags.get(EXPIRES_TAG) for r in plan.mocks.resources if r.tags} == {"never"}


# ---- bastion and image ------------------------------------------------------------------------
def test_bastion_in_the_public_subnet_with_imdsv2_and_encrypted_root(demo_plan):
    m = demo_plan.mocks
    [bastion] = bastions(demo_plan)
    inputs = bastion.inputs
    assert inputs["instanceType"] == "t3.micro"
    assert inputs["subnetId"] == m.named("demo-public", SUBNET).id
    assert inputs["vpcSecurityGroupIds"] == [m.named("demo-bastion", SG).id]
    assert inputs["associatePublicIpAddress"] is True
    assert inputs["metadataOptions"]["httpTokens"] == "required"
    assert inputs["rootBlockDevice"]["encrypted"] is True and inputs["rootBlockDevice"]["volumeType"] == "gp3"
    assert inputs["ami"] == f"<AMI from SSM {BASTION_SSM_PARAMETERS['ubuntu']}>"
    assert demo_plan.outputs["bastion_public_ip"] == f"<{bastion.name}.public_ip>"


def test_node_image_from_the_dlami_ssm_parameter_or_an_explicit_id(demo_plan):
    parameters = [lk.args["name"] for lk in demo_plan.mocks.lookups
                  if lk.token == "aws:ssm/getParameter:getParameter"]
    assert DEFAULT_DLAMI_PARAMETER in parameters
    assert demo_plan.mocks.one(LT).inputs["imageId"] == f"<AMI from SSM {DEFAULT_DLAMI_PARAMETER}>"
    assert demo_plan.outputs["ami_id"] == f"<AMI from SSM {DEFAULT_DLAMI_PARAMETER}>"
    plan = plan_of(image={"ami_id": "ami-0123456789abcdef0"})
    assert plan.mocks.one(LT).inputs["imageId"] == "ami-0123456789abcdef0"
    assert plan.outputs["ami_id"] == "ami-0123456789abcdef0"
    assert DEFAULT_DLAMI_PARAMETER not in [lk.args.get("name") for lk in plan.mocks.lookups]


def test_amazon_linux_user_gets_an_amazon_linux_bastion():
    plan = plan_of(access={"ssh_user": "ec2-user"})
    assert bastions(plan)[0].inputs["ami"] == f"<AMI from SSM {BASTION_SSM_PARAMETERS['ec2-user']}>"
    assert plan.outputs["ssh_user"] == "ec2-user"


def test_provider_is_pinned_to_the_spec_region():
    plan = plan_of(region="us-west-2", availability_zone="us-west-2a")
    assert plan.mocks.one("pulumi:providers:aws").inputs["region"] == "us-west-2"
    assert {s.inputs["availabilityZone"] for s in plan.mocks.of_type(SUBNET)} == {"us-west-2a"}


# ---- S3 lifecycle, as the S3 User Guide describes it ------------------------------------------
# "Amazon S3 calculates the time by adding the number of days specified in the rule to the object
# creation time and rounding the resulting time to the next day midnight UTC"; for noncurrent
# versions the days count from when the version became noncurrent (when its successor, a newer
# version or the delete marker an expiration adds, was created), rounded the same way.
DAY = timedelta(days=1)


def s3_due(start: datetime, days: float) -> datetime:
    """When a lifecycle step with `days` falls due for something that started at `start`: rounded up
    to the next midnight UTC (an exact midnight counted as the next one, the worst reading)."""
    end = start + days * DAY
    return datetime.combine(end.date(), dt_time(), UTC) + DAY


def worst_case_age(rule: dict, write_times: list[datetime], acted_after: list[timedelta]) -> timedelta:
    """The longest a byte written at any of `write_times` survives the rule: never overwritten (the
    expiration adds a delete marker some time on the day it falls due, the version turns
    noncurrent then), overwritten at any time before that, or left in an unfinished multipart
    upload."""
    current = rule["expiration"]["days"]
    noncurrent = rule["noncurrentVersionExpiration"]["noncurrentDays"]
    aborted = rule["abortIncompleteMultipartUpload"]["daysAfterInitiation"]
    ages = []
    for written in write_times:
        expired = s3_due(written, current)
        became_noncurrent = [expired + delay for delay in acted_after]
        became_noncurrent += [written + (expired - written) * share for share in (0.01, 0.5, 0.999)]
        ages += [s3_due(when, noncurrent) - written for when in became_noncurrent]
        ages.append(s3_due(written, aborted) - written)
    return max(ages)


@pytest.mark.parametrize("retention", [4, 5, 7, 14, 30])
def test_no_byte_outlives_the_retention_promise_under_s3_rounding(retention):
    """A checkpoint written at any time of day is gone within retention_days, and the rule uses the
    whole promise (a byte written at midnight lives exactly retention_days)."""
    plan = plan_of(checkpoint_bucket={"retention_days": retention})
    lifecycle = plan.mocks.one("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration")
    rule = lifecycle.inputs["rules"][0]
    day0 = datetime(2026, 12, 3, tzinfo=UTC)
    write_times = [day0 + timedelta(minutes=m) for m in range(0, 24 * 60, 10)]
    write_times += [day0 + DAY - timedelta(seconds=1), day0 + timedelta(seconds=1)]
    acted_after = [timedelta(0), timedelta(seconds=1), timedelta(hours=12), DAY - timedelta(seconds=1)]
    assert worst_case_age(rule, write_times, acted_after) == retention * DAY


def test_nodes_pin_their_template_version_and_ignore_later_template_changes(demo_plan):
    template = demo_plan.mocks.one(LT)
    for node in nodes(demo_plan):
        # The number the template had when the node was created, not "$Default"/"$Latest".
        assert node.inputs["launchTemplate"] == {"id": template.id, "version": "1"}
        assert node.ignore_changes == ["launchTemplate"]
    assert template.inputs["updateDefaultVersion"] is True


def test_replace_takes_the_current_template_for_its_rank_only():
    from infra.offline import run_offline
    from infra.spec import parse_spec
    from tests.infra.conftest import demo_data

    plan = run_offline(parse_spec(demo_data()), EXPIRES_AT, retemplate=frozenset({2}))
    assert {int(n.tags[RANK_TAG]): n.ignore_changes for n in nodes(plan)} == {
        0: ["launchTemplate"], 1: ["launchTemplate"], 2: [], 3: ["launchTemplate"]}


@pytest.mark.parametrize("bad", [[7], ["0"], "1", [-1]])
def test_retemplate_config_must_name_ranks(bad):
    from infra.program import RETEMPLATE_KEY, build_from_config
    from infra.spec import SpecError
    from tests.infra.conftest import demo_data

    with pytest.raises(SpecError, match=rf"{RETEMPLATE_KEY}.*use ranks 0..3"):
        build_from_config(demo_data(), EXPIRES_AT, bad)


# ---- capacity: all nodes or none ----------------------------------------------------------------
def test_all_or_nothing_reservation_for_on_demand_nodes(demo_plan):
    """One On-Demand Capacity Reservation for all node_count instances, in the placement group,
    targeted by the launch template: EC2 grants it whole or fails it before any node launches."""
    m = demo_plan.mocks
    reservation = m.one("aws:ec2/capacityReservation:CapacityReservation")
    group = m.one(PG)
    assert reservation.inputs["instanceCount"] == 4.0
    assert reservation.inputs["instanceType"] == "p4d.24xlarge"
    assert reservation.inputs["availabilityZone"] == "us-east-1b"
    assert reservation.inputs["instanceMatchCriteria"] == "targeted"
    assert reservation.inputs["placementGroupArn"] == f"<{group.name}.arn>"
    assert reservation.inputs["instancePlatform"] == "Linux/UNIX"
    assert reservation.tags[CLUSTER_TAG] == "demo"
    # Still one instance per rank (replace RANK), all from the template that targets it.
    assert [int(n.tags[RANK_TAG]) for n in nodes(demo_plan)] == [0, 1, 2, 3]


def test_existing_placement_group_reservation_gets_its_arn_from_the_account():
    plan = plan_of(placement_group={"existing_name": "team-pg"})
    reservation = plan.mocks.one("aws:ec2/capacityReservation:CapacityReservation")
    assert reservation.inputs["placementGroupArn"] == \
        "arn:aws:ec2:us-east-1:<account id>:placement-group/team-pg"


@pytest.mark.parametrize("capacity", [{"type": "spot"}, {"all_or_nothing": False},
                                      {"type": "capacity-reservation", "reservation_id": RESERVATION}])
def test_no_program_reservation_for_spot_opt_out_or_a_given_reservation(capacity):
    plan = plan_of(capacity=capacity)
    assert "aws:ec2/capacityReservation:CapacityReservation" not in plan.mocks.counts()
    assert "demo-expiry-capacity" not in _schedules(plan)
