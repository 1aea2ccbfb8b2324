"""Whole-graph properties of the program, checked on several spec variants, and the stack outputs."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys

import pytest

from infra.program import OUTPUT_NAMES
from infra.spec import CLUSTER_TAG, EXPIRES_TAG, RANK_TAG
from tests.infra.conftest import EXPIRES_AT, REPO, demo_data, plan_of

VARIANTS = {
    "demo": {},
    "p5-fsx-spot-key": {
        "instance_type": "p5.48xlarge", "node_count": 2, "capacity": {"type": "spot"},
        "access": {"public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDemoKey operator@laptop"},
        "storage": {"fsx": {"enabled": True, "s3_import_path": "s3://acme-data/tokens"}},
        "tags": {"team": "llm"}},
    "existing-vpc-reservation": {
        "network": {"vpc_id": "vpc-0abc", "private_subnet_id": "subnet-0priv",
                    "public_subnet_id": "subnet-0pub"},
        "capacity": {"type": "capacity-reservation", "reservation_id": "cr-0123456789abcdef0"}},
    "ssm-only": {"access": {"bastion": False}, "node_count": 1},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    return request.param, plan_of(**VARIANTS[request.param])


def _is_taggable(resource_type: str) -> bool:
    """Whether the pulumi_aws resource class takes tags (e.g. aws:ec2/vpc:Vpc -> pulumi_aws.ec2.Vpc)."""
    if not resource_type.startswith("aws:"):
        return False
    module, cls = resource_type.split(":")[1].split("/")[0], resource_type.split(":")[2]
    resource_class = getattr(importlib.import_module(f"pulumi_aws.{module}"), cls)
    return "tags" in inspect.signature(resource_class._internal_init).parameters


EXPECTED_DEMO_COUNTS = {
    "pulumi:providers:aws": 1,
    "aws:ec2/vpc:Vpc": 1, "aws:ec2/subnet:Subnet": 2, "aws:ec2/internetGateway:InternetGateway": 1,
    "aws:ec2/eip:Eip": 1, "aws:ec2/natGateway:NatGateway": 1, "aws:ec2/routeTable:RouteTable": 2,
    "aws:ec2/routeTableAssociation:RouteTableAssociation": 2, "aws:ec2/vpcEndpoint:VpcEndpoint": 1,
    "aws:ec2/securityGroup:SecurityGroup": 2,
    "aws:s3/bucket:Bucket": 1, "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock": 1,
    "aws:s3/bucketVersioning:BucketVersioning": 1,
    "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration": 1,
    "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration": 1,
    "aws:iam/role:Role": 2, "aws:iam/rolePolicy:RolePolicy": 2,
    "aws:iam/rolePolicyAttachment:RolePolicyAttachment": 1, "aws:iam/instanceProfile:InstanceProfile": 1,
    "aws:ec2/placementGroup:PlacementGroup": 1, "aws:ec2/launchTemplate:LaunchTemplate": 1,
    "aws:ec2/instance:Instance": 5,  # 4 nodes + the bastion
    # All 4 nodes in one all-or-nothing On-Demand Capacity Reservation.
    "aws:ec2/capacityReservation:CapacityReservation": 1,
    # Expiry: terminate each node and the bastion on its own, cancel the reservation, delete the
    # NAT gateway, release its Elastic IP; the dead-letter queue of the failed calls.
    "aws:scheduler/scheduleGroup:ScheduleGroup": 1, "aws:scheduler/schedule:Schedule": 8,
    "aws:sqs/queue:Queue": 1,
}


def test_demo_resource_counts(demo_plan):
    assert demo_plan.mocks.counts() == EXPECTED_DEMO_COUNTS


SCHEDULE, INSTANCE = "aws:scheduler/schedule:Schedule", "aws:ec2/instance:Instance"
RESERVATION = "aws:ec2/capacityReservation:CapacityReservation"


def _waits_for(plan, record) -> set[str]:
    """Names of every resource the engine must have created before it starts `record` (its
    dependencies, theirs, and so on)."""
    by_urn = {r.urn: r for r in plan.mocks.registrations if r.urn}
    seen: set[str] = set()
    todo = list(record.dependencies)
    while todo:
        urn = todo.pop()
        if urn not in seen:
            seen.add(urn)
            todo += by_urn[urn].dependencies
    return {by_urn[urn].name for urn in seen}


def test_capacity_is_bought_only_once_everything_else_billed_has_its_expiry(variant):
    """Pulumi starts no new step after a failed one, and buying GPU capacity is the step that fails
    (InsufficientInstanceCapacity on the reservation or a node). So the NAT gateway, its address,
    the file system and the bastion get their expiry schedules before the reservation is asked for,
    the reservation gets its own before any node is launched, and each node gets its own right after
    it exists."""
    name, plan = variant
    schedules = {s.name: s for s in plan.mocks.of_type(SCHEDULE)}
    nodes = [i for i in plan.mocks.of_type(INSTANCE) if RANK_TAG in i.tags]
    node_schedules = {f"demo-expiry-node{n.tags[RANK_TAG]}" for n in nodes}
    assert node_schedules <= set(schedules), name
    before_capacity = set(schedules) - node_schedules - {"demo-expiry-capacity"}
    expected = {"demo-expiry-bastion"} if plan.spec.access.bastion else set()
    expected |= {"demo-expiry-nat", "demo-expiry-nat-ip"} if plan.spec.network.creates_vpc else set()
    expected |= {"demo-expiry-fsx"} if plan.spec.storage.fsx.enabled else set()
    assert before_capacity == expected, name
    for reservation in plan.mocks.of_type(RESERVATION):
        assert before_capacity <= _waits_for(plan, reservation), name
        assert reservation.name in _waits_for(plan, schedules["demo-expiry-capacity"]), name
    for node in nodes:
        assert set(schedules) - node_schedules <= _waits_for(plan, node), (name, node.name)
        assert node.name in _waits_for(plan, schedules[f"demo-expiry-node{node.tags[RANK_TAG]}"]), name


def _iam_action(target_arn: str) -> str:
    """arn:aws:scheduler:::aws-sdk:ec2:terminateInstances -> ec2:TerminateInstances"""
    service, action = target_arn.rsplit(":", 2)[1:]
    return f"{service}:{action[0].upper()}{action[1:]}"


def test_the_expiry_role_may_make_the_calls_of_its_schedules_and_little_else(variant):
    name, plan = variant
    called = {_iam_action(s.inputs["target"]["arn"]) for s in plan.mocks.of_type(SCHEDULE)}
    policy = plan.mocks.named("demo-expiry-stop", "aws:iam/rolePolicy:RolePolicy")
    allowed = {action for statement in json.loads(policy.inputs["policy"])["Statement"]
               for action in ([statement["Action"]] if isinstance(statement["Action"], str)
                              else statement["Action"])}
    assert called <= allowed, name
    # Delivering a dead letter; deleting a file system with its S3 association.
    assert allowed - called <= {"sqs:SendMessage", "fsx:DeleteDataRepositoryAssociation"}, name


def test_components_own_their_resources(demo_plan):
    components = {r.component for r in demo_plan.mocks.resources if r.type != "pulumi:providers:aws"}
    assert components == {f"fsdp-cluster:index:{c}" for c in
                          ("Network", "Security", "Storage", "Identity", "Compute", "Expiry")}
    by_name = {r.name: r.component for r in demo_plan.mocks.resources}
    assert by_name["demo-node0"] == "fsdp-cluster:index:Compute"
    assert by_name["demo-vpc"] == "fsdp-cluster:index:Network"


def test_no_ingress_from_anywhere(variant):
    _, plan = variant
    for sg in plan.mocks.of_type("aws:ec2/securityGroup:SecurityGroup"):
        for rule in sg.inputs.get("ingress") or []:
            assert "0.0.0.0/0" not in (rule.get("cidrBlocks") or []), sg.name
            assert "::/0" not in (rule.get("ipv6CidrBlocks") or []), sg.name


def test_every_ebs_volume_is_encrypted(variant):
    _, plan = variant
    volumes = 0
    for template in plan.mocks.of_type("aws:ec2/launchTemplate:LaunchTemplate"):
        for mapping in template.inputs["blockDeviceMappings"]:
            assert mapping["ebs"]["encrypted"] == "true"
            volumes += 1
    for instance in plan.mocks.of_type("aws:ec2/instance:Instance"):
        assert "ebsBlockDevices" not in instance.inputs
        if "rootBlockDevice" in instance.inputs:
            assert instance.inputs["rootBlockDevice"]["encrypted"] is True
            volumes += 1
        else:
            assert "launchTemplate" in instance.inputs
    assert volumes >= 1


def test_imdsv2_everywhere(variant):
    _, plan = variant
    for record in plan.mocks.of_type("aws:ec2/launchTemplate:LaunchTemplate"):
        assert record.inputs["metadataOptions"]["httpTokens"] == "required"
    for instance in plan.mocks.of_type("aws:ec2/instance:Instance"):
        if "launchTemplate" not in instance.inputs:
            assert instance.inputs["metadataOptions"]["httpTokens"] == "required"


def test_every_taggable_resource_is_tagged(variant):
    name, plan = variant
    extra = VARIANTS[name].get("tags", {})
    taggable = [r for r in plan.mocks.resources if _is_taggable(r.type)]
    assert len(taggable) >= 8
    for record in taggable:
        assert record.tags.get(CLUSTER_TAG) == "demo", record.name
        assert record.tags.get(EXPIRES_TAG) == EXPIRES_AT, record.name
        assert extra.items() <= record.tags.items(), record.name


def test_single_availability_zone(variant):
    _, plan = variant
    zones = {s.inputs["availabilityZone"] for s in plan.mocks.of_type("aws:ec2/subnet:Subnet")}
    assert zones <= {"us-east-1b"}
    subnets = {nic["subnetId"] for t in plan.mocks.of_type("aws:ec2/launchTemplate:LaunchTemplate")
               for nic in t.inputs["networkInterfaces"]}
    assert len(subnets) == 1  # every node interface in the one private subnet


def test_stack_outputs(variant):
    _, plan = variant
    outputs = plan.outputs
    assert set(outputs) == set(OUTPUT_NAMES)
    spec = plan.spec
    assert [n["rank"] for n in outputs["nodes"]] == list(range(spec.node_count))
    for node in outputs["nodes"]:
        assert set(node) == {"rank", "name", "instance_id", "private_ip", "efa_count"}
        assert node["name"] == spec.node_name(node["rank"])
        assert node["instance_id"] == f"<{node['name']}.id>"
        assert node["private_ip"] == f"<{node['name']}.private_ip>"
        assert node["efa_count"] == spec.instance.efa_interfaces
    assert outputs["ssh_user"] == "ubuntu"
    assert (outputs["bastion_public_ip"] is None) == (not spec.access.bastion)
    assert outputs["security_group_id"] == "<demo-efa.id>"
    assert outputs["checkpoint_bucket"]
    json.dumps(outputs)  # plain data, as the Automation API returns it


def test_pulumi_runs_infra_main_with_the_stack_config_and_refuses_a_bad_one(tmp_path):
    """Run infra/__main__.py the way the Pulumi language host does (the directory as a script, so
    infra/ - not the repository root - is first on sys.path) with the stack config set, under the
    recording mocks, in a fresh interpreter: once with the demo spec, once with a bad one."""
    script = tmp_path / "run_main.py"
    script.write_text(f"""
import asyncio, json, runpy, sys
# The repository root last, not first: this checkout's package (an editable install may point at
# another checkout) without the root shadowing infra/ as the language host's first entry.
sys.path = [p for p in sys.path if p not in ("", {str(REPO)!r})] + [{str(REPO)!r}]
import pulumi
from pulumi.runtime import settings
from infra.offline import RecordingMocks
for cluster in ({json.dumps(demo_data())}, {json.dumps(demo_data(node_count=0, network={"mtu": 12000}))}):
    asyncio.set_event_loop(asyncio.new_event_loop())
    pulumi.runtime.set_all_config({{"fsdp-cluster:cluster": json.dumps(cluster),
                                   "fsdp-cluster:expiresAt": {EXPIRES_AT!r}}})
    mocks = RecordingMocks()
    pulumi.runtime.set_mocks(mocks, project="fsdp-cluster", stack="demo", preview=False)
    try:
        pulumi.runtime.test(lambda: runpy.run_path({str(REPO / 'infra')!r}, run_name="__main__"))()
        print("OK", json.dumps(sorted(settings.get_root_resource().outputs), separators=(",", ":")),
              len(mocks.registrations))
    except Exception as e:
        print("ERROR", type(e).__name__, len(mocks.registrations), str(e).replace(chr(10), " | "))
""")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    good, bad = result.stdout.splitlines()[-2:]
    status, exports, registered = good.split(" ", 2)
    assert status == "OK", good
    assert json.loads(exports) == sorted(OUTPUT_NAMES)
    assert int(registered) == sum(EXPECTED_DEMO_COUNTS.values()) + 6  # + the six components
    # A bad config: a RunError (Pulumi prints its message without a traceback), nothing registered.
    status, error_type, registered, message = bad.split(" ", 3)
    assert (status, error_type, registered) == ("ERROR", "RunError", "0"), bad
    assert "node_count" in message and "network.mtu" in message
    assert "stack config fsdp-cluster:cluster" in message


def test_pulumi_project_file():
    import yaml

    project = yaml.safe_load((REPO / "Pulumi.yaml").read_text())
    assert project["name"] == "fsdp-cluster"
    assert project["runtime"] == {"name": "python", "options": {"toolchain": "pip", "virtualenv": ".venv"}}
    assert project["main"] == "infra/" and (REPO / "infra" / "__main__.py").is_file()


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


@pytest.mark.parametrize(("region", "partition", "s3_service"), [
    ("us-gov-west-1", "aws-us-gov", "com.amazonaws.us-gov-west-1.s3"),
    ("cn-north-1", "aws-cn", "cn.com.amazonaws.cn-north-1.s3"),
    ("us-east-1", "aws", "com.amazonaws.us-east-1.s3"),
])
def test_arns_and_service_names_come_from_the_regions_partition(region, partition, s3_service):
    plan = plan_of(region=region, availability_zone=f"{region}a")
    assert any(lk.token == "aws:index/getPartition:getPartition" for lk in plan.mocks.lookups)
    arns = [s for r in plan.mocks.resources for s in _strings(r.inputs) if s.startswith("arn:")]
    arns += [arn for r in plan.mocks.resources if r.type == "aws:iam/rolePolicy:RolePolicy"
             for statement in json.loads(r.inputs["policy"])["Statement"]
             for arn in ([statement["Resource"]] if isinstance(statement["Resource"], str)
                         else statement["Resource"]) if arn.startswith("arn:")]
    assert arns and all(arn.startswith(f"arn:{partition}:") for arn in arns), arns
    endpoint = plan.mocks.one("aws:ec2/vpcEndpoint:VpcEndpoint")
    assert endpoint.inputs["serviceName"] == s3_service


def test_no_hard_coded_partition_in_the_program():
    sources = [p.read_text() for p in (REPO / "infra").rglob("*.py")]
    assert not [s for s in sources if '"arn:aws:' in s or "'arn:aws:" in s or "f\"arn:aws:" in s]


# Ports of the services other roles run on the nodes: slurmctld 6817, slurmd 6818, slurmdbd 6819,
# Prometheus 9090, node exporter 9100, DCGM exporter 9400. MUNGE itself listens on a local Unix
# socket only (its credentials travel inside Slurm's RPCs on 6817-6819), so it has no port of its own.
CLUSTER_ONLY_PORTS = {"slurmctld": 6817, "slurmd": 6818, "slurmdbd": 6819, "prometheus": 9090,
                      "node-exporter": 9100, "dcgm-exporter": 9400}


def _covers(rule: dict, port: int) -> bool:
    if rule["protocol"] in ("-1", "all"):
        return True
    return rule["protocol"] in ("tcp", "6") and int(rule["fromPort"]) <= port <= int(rule["toPort"])


def test_cluster_service_ports_are_reachable_only_from_the_cluster_group(variant):
    name, plan = variant
    spec = plan.spec
    groups = plan.mocks.of_type("aws:ec2/securityGroup:SecurityGroup")
    node_group = plan.mocks.named(f"{spec.name}-efa", "aws:ec2/securityGroup:SecurityGroup")
    for service, port in CLUSTER_ONLY_PORTS.items():
        # Reachable inside the cluster: a self-referencing rule of the node group covers the port.
        assert any(rule.get("self") and _covers(rule, port) for rule in node_group.inputs["ingress"]), \
            (name, service)
        for group in groups:
            for rule in group.inputs.get("ingress") or []:
                if not _covers(rule, port):
                    continue
                # Nothing from an address range (0.0.0.0/0, ssh_cidr, IPv6), nor from another group.
                assert group is node_group and rule.get("self"), (name, service, group.name, rule)
                assert not rule.get("cidrBlocks") and not rule.get("ipv6CidrBlocks"), (name, service)
                assert not rule.get("securityGroups"), (name, service, rule)
    # And the only port open to ssh_cidr anywhere is 22.
    for group in groups:
        for rule in group.inputs.get("ingress") or []:
            if rule.get("cidrBlocks"):
                assert rule["cidrBlocks"] == [spec.ssh_cidr], (name, group.name, rule)
                assert (rule["protocol"], rule["fromPort"], rule["toPort"]) == ("tcp", 22.0, 22.0)
    assert not plan.mocks.of_type("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")
    assert not plan.mocks.of_type("aws:ec2/securityGroupRule:SecurityGroupRule")
