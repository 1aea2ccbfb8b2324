"""The teardown sweep: after `pulumi destroy`, find whatever still carries the cluster's tag.

`pulumi destroy` can stop half-way (an ENI still attached, a security group another group points
at, a non-empty bucket, an interrupted run) and what it leaves keeps billing. The sweep lists every
resource tagged `fsdp-cluster:cluster=<name>` through the EC2, FSx and Scheduler describe APIs and
the Resource Groups Tagging API, reports it, and with `force` deletes it in dependency order:
the expiry's schedule group and dead-letter queue, instances (then their capacity reservation) and
file systems first (and waited for, since they hold ENIs and security groups), then NAT gateways
and their addresses, VPC endpoints (waited for: they hold routes and ENIs), ENIs, volumes,
templates, placement groups, key pairs, the node and expiry IAM roles and instance profile (global,
so matched by the cluster's name prefix and then its tag), security groups (cross-references
revoked first), gateways, route tables, subnets and finally the VPC.
Only tagged resources are touched; one failed deletion is reported with its id and reason and never
stops the rest. Running it twice is safe: the second run finds nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import botocore.exceptions

from fsdpctl.targets.aws.clients import AwsClients, error_code, error_text
from infra.spec import CLUSTER_TAG

WAIT_POLL_SECONDS = 15
INSTANCE_WAIT_SECONDS = 15 * 60
FSX_WAIT_SECONDS = 30 * 60
NAT_WAIT_SECONDS = 10 * 60
ENDPOINT_WAIT_SECONDS = 10 * 60


@dataclass(frozen=True)
class Leftover:
    kind: str
    id: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.id}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class SweepReport:
    found: list[Leftover] = field(default_factory=list)
    deleted: list[Leftover] = field(default_factory=list)
    failed: list[tuple[Leftover, str]] = field(default_factory=list)
    # Found, but kept on purpose (e.g. the checkpoint bucket with checkpoint_bucket.keep_on_down).
    kept: list[Leftover] = field(default_factory=list)
    # Kinds that could not be listed (no permission, API unavailable): the sweep cannot vouch for them.
    listing_errors: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.found and not self.listing_errors


Out = Callable[[str], None]


@dataclass(frozen=True)
class Kind:
    name: str
    find: Callable[[AwsClients, str], list[Leftover]]
    # Deletes the given leftovers, returning (leftover, error text) for each one that failed.
    delete: Callable[[AwsClients, list[Leftover], Out], list[tuple[Leftover, str]]] | None
    # Why a kind is never deleted automatically (shown as the fix).
    keep_reason: str = ""


def _tag_filter(cluster: str) -> list[dict]:
    return [{"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]}]


def _tags(items: Iterable[dict] | None) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in items or []}


def _paginate(client, operation: str, key: str, **kwargs) -> list[dict]:
    return [item for page in client.get_paginator(operation).paginate(**kwargs) for item in page.get(key, [])]


def _each(items: list[Leftover], action: Callable[[Leftover], None], out: Out) -> list[tuple[Leftover, str]]:
    failures = []
    for item in items:
        try:
            action(item)
            out(f"  deleted {item}")
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            failures.append((item, error_text(e)))
            out(f"  FAILED  {item}: {error_text(e)}")
    return failures


def _wait_until(done: Callable[[], bool], timeout_s: float, what: str, out: Out) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            out(f"  gave up waiting for {what} after {timeout_s / 60:.0f} min")
            return False
        out(f"  waiting for {what} ...")
        time.sleep(WAIT_POLL_SECONDS)
    return True


# ---- schedule group ------------------------------------------------------------------------------
def _find_schedule_group(aws: AwsClients, cluster: str) -> list[Leftover]:
    from infra.components.expiry import schedule_group_name

    name = schedule_group_name(cluster)
    try:
        group = aws.scheduler.get_schedule_group(Name=name)
    except botocore.exceptions.ClientError as e:
        if error_code(e) == "ResourceNotFoundException":
            return []
        raise
    if group.get("State") == "DELETING":
        return []
    return [Leftover("schedule-group", name, "expiry schedule")]


def _delete_schedule_groups(aws: AwsClients, items: list[Leftover], out: Out):
    # Deleting the group deletes its schedules.
    return _each(items, lambda g: aws.scheduler.delete_schedule_group(Name=g.id), out)


# ---- the expiry's dead-letter queue --------------------------------------------------------------
def _find_queues(aws: AwsClients, cluster: str) -> list[Leftover]:
    """Tagged SQS queues (the expiry schedules' dead-letter queue) that still exist: the Tagging API
    may list a deleted queue for a while."""
    mappings = _paginate(aws.tagging, "get_resources", "ResourceTagMappingList",
                         TagFilters=[{"Key": CLUSTER_TAG, "Values": [cluster]}], ResourceTypeFilters=["sqs"])
    found = []
    for m in mappings:
        _, account, name = m["ResourceARN"].rsplit(":", 2)
        try:
            url = aws.sqs.get_queue_url(QueueName=name, QueueOwnerAWSAccountId=account)["QueueUrl"]
        except botocore.exceptions.ClientError as e:
            if error_code(e) in ("AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"):
                continue
            raise
        found.append(Leftover("sqs-queue", url, "expiry failures"))
    return found


def _delete_queues(aws: AwsClients, items: list[Leftover], out: Out):
    return _each(items, lambda q: aws.sqs.delete_queue(QueueUrl=q.id), out)


# ---- instances -----------------------------------------------------------------------------------
def _find_instances(aws: AwsClients, cluster: str) -> list[Leftover]:
    reservations = _paginate(aws.ec2, "describe_instances", "Reservations", Filters=[
        *_tag_filter(cluster),
        {"Name": "instance-state-name",
         "Values": ["pending", "running", "stopping", "stopped", "shutting-down"]}])
    return [Leftover("instance", i["InstanceId"], _tags(i.get("Tags")).get("Name", i["InstanceType"]))
            for r in reservations for i in r["Instances"]]


def _terminated(aws: AwsClients, ids: list[str]) -> bool:
    if not ids:
        return True
    reservations = _paginate(aws.ec2, "describe_instances", "Reservations", InstanceIds=ids)
    return all(i["State"]["Name"] == "terminated" for r in reservations for i in r["Instances"])


def terminate_and_wait(aws: AwsClients, items: list[Leftover], out: Out) -> list[tuple[Leftover, str]]:
    """Terminate the instances and wait until they are gone: their ENIs and volumes, and the
    security groups and placement group they use, cannot be deleted before."""
    failures = _each(items, lambda i: aws.ec2.terminate_instances(InstanceIds=[i.id]), out)
    failed_ids = {f[0].id for f in failures}
    pending = [i.id for i in items if i.id not in failed_ids]
    if not _wait_until(lambda: _terminated(aws, pending), INSTANCE_WAIT_SECONDS,
                       f"{len(pending)} instance(s) to terminate", out):
        failures += [(i, "still not terminated") for i in items if i.id in pending]
    return failures


# ---- FSx -----------------------------------------------------------------------------------------
def _find_file_systems(aws: AwsClients, cluster: str) -> list[Leftover]:
    return [Leftover("fsx-file-system", fs["FileSystemId"],
                     f"{fs.get('FileSystemType')}, {fs.get('Lifecycle')}")
            for fs in _paginate(aws.fsx, "describe_file_systems", "FileSystems")
            if _tags(fs.get("Tags")).get(CLUSTER_TAG) == cluster]


def _file_system_gone(aws: AwsClients, fs_id: str) -> bool:
    try:
        found = aws.fsx.describe_file_systems(FileSystemIds=[fs_id])["FileSystems"]
    except botocore.exceptions.ClientError as e:
        if error_code(e) == "FileSystemNotFound":
            return True
        raise
    return not found or found[0].get("Lifecycle") == "DELETED"


def _delete_file_systems(aws: AwsClients, items: list[Leftover], out: Out):
    def delete(fs: Leftover) -> None:
        if "DELETING" not in fs.detail:
            aws.fsx.delete_file_system(FileSystemId=fs.id)

    failures = _each(items, delete, out)
    failed_ids = {f[0].id for f in failures}
    for fs in items:
        if fs.id not in failed_ids and not _wait_until(
                lambda fs=fs: _file_system_gone(aws, fs.id), FSX_WAIT_SECONDS, f"FSx {fs.id} to delete", out):
            failures.append((fs, "still deleting"))
    return failures


# ---- NAT gateways and addresses ------------------------------------------------------------------
def _find_nat_gateways(aws: AwsClients, cluster: str) -> list[Leftover]:
    return [Leftover("nat-gateway", n["NatGatewayId"], n["State"])
            for n in _paginate(aws.ec2, "describe_nat_gateways", "NatGateways", Filters=_tag_filter(cluster))
            if n["State"] not in ("deleted", "deleting")]


def _delete_nat_gateways(aws: AwsClients, items: list[Leftover], out: Out):
    failures = _each(items, lambda n: aws.ec2.delete_nat_gateway(NatGatewayId=n.id), out)
    failed_ids = {f[0].id for f in failures}
    pending = [n.id for n in items if n.id not in failed_ids]

    def gone() -> bool:
        gateways = aws.ec2.describe_nat_gateways(NatGatewayIds=pending)["NatGateways"]
        return all(n["State"] == "deleted" for n in gateways)

    # A NAT gateway holds its Elastic IP until it is deleted.
    if pending and not _wait_until(gone, NAT_WAIT_SECONDS, "NAT gateways to delete", out):
        failures += [(n, "still deleting") for n in items if n.id in pending]
    return failures


def _find_addresses(aws: AwsClients, cluster: str) -> list[Leftover]:
    return [Leftover("elastic-ip", a["AllocationId"], a.get("PublicIp", ""))
            for a in aws.ec2.describe_addresses(Filters=_tag_filter(cluster))["Addresses"]]


def _release_addresses(aws: AwsClients, items: list[Leftover], out: Out):
    return _each(items, lambda a: aws.ec2.release_address(AllocationId=a.id), out)


# ---- ENIs, volumes, templates, placement groups, key pairs ----------------------------------------
def _find_network_interfaces(aws: AwsClients, cluster: str) -> list[Leftover]:
    return [Leftover("network-interface", n["NetworkInterfaceId"], n.get("Status", ""))
            for n in _paginate(aws.ec2, "describe_network_interfaces", "NetworkInterfaces",
                               Filters=_tag_filter(cluster))]


def _delete_network_interfaces(aws: AwsClients, items: list[Leftover], out: Out):
    return _each(items, lambda n: aws.ec2.delete_network_interface(NetworkInterfaceId=n.id), out)


def _find_volumes(aws: AwsClients, cluster: str) -> list[Leftover]:
    return [Leftover("volume", v["VolumeId"], f"{v['Size']} GiB, {v['State']}")
            for v in _paginate(aws.ec2, "describe_volumes", "Volumes", Filters=_tag_filter(cluster))
            if v["State"] not in ("deleting", "deleted")]


def _delete_volumes(aws: AwsClients, items: list[Leftover], out: Out):
    return _each(items, lambda v: aws.ec2.delete_volume(VolumeId=v.id), out)


def _find_launch_templates(aws: AwsClients, cluster: str) -> list[Leftover]:
    return [Leftover("launch-template", t["LaunchTemplateId"], t["LaunchTemplateName"])
            for t in _paginate(aws.ec2, "describe_launch_templates", "LaunchTemplates",
                               Filters=_tag_filter(cluster))]


def _delete_launch_templates(aws: AwsClients, items: list[Leftover], out: Out):
    return _each(items, lambda t: aws.ec2.delete_launch_template(LaunchTemplateId=t.id), out)


def _find_placement_groups(aws: AwsClients, cluster: str) -> list[Leftover]:
    return [Leftover("placement-group", g["GroupName"], g.get("Strategy", ""))
            for g in aws.ec2.describe_placement_groups(Filters=_tag_filter(cluster))["PlacementGroups"]
            if g.get("State") not in ("deleting", "deleted")]


def _delete_placement_groups(aws: AwsClients, items: list[Leftover], out: Out):
    return _each(items, lambda g: aws.ec2.delete_placement_group(GroupName=g.id), out)


def _find_key_pairs(aws: AwsClients, cluster: str) -> list[Leftover]:
    return [Leftover("key-pair", k["KeyName"], k.get("KeyPairId", ""))
            for k in aws.ec2.describe_key_pairs(Filters=_tag_filter(cluster))["KeyPairs"]]


def _delete_key_pairs(aws: AwsClients, items: list[Leftover], out: Out):
    return _each(items, lambda k: aws.ec2.delete_key_pair(KeyName=k.id), out)


# ---- IAM (global; found by the cluster's name prefix, then confirmed by its tag) -----------------
def _tagged_iam(aws: AwsClients, cluster: str, listing: str, key: str, name_key: str,
                tags_of: Callable[[str], list[dict]]) -> list[dict]:
    candidates = [x for x in _paginate(aws.iam, listing, key) if x[name_key].startswith(f"{cluster}-")]
    return [x for x in candidates if _tags(tags_of(x[name_key])).get(CLUSTER_TAG) == cluster]


def _find_instance_profiles(aws: AwsClients, cluster: str) -> list[Leftover]:
    def tags_of(name: str) -> list[dict]:
        return aws.iam.get_instance_profile(InstanceProfileName=name)["InstanceProfile"].get("Tags", [])

    return [Leftover("instance-profile", p["InstanceProfileName"],
                     ",".join(r["RoleName"] for r in p["Roles"]))
            for p in _tagged_iam(aws, cluster, "list_instance_profiles", "InstanceProfiles",
                                 "InstanceProfileName", tags_of)]


def _delete_instance_profiles(aws: AwsClients, items: list[Leftover], out: Out):
    def delete(profile: Leftover) -> None:
        for role in filter(None, profile.detail.split(",")):
            aws.iam.remove_role_from_instance_profile(InstanceProfileName=profile.id, RoleName=role)
        aws.iam.delete_instance_profile(InstanceProfileName=profile.id)
    return _each(items, delete, out)


def _find_roles(aws: AwsClients, cluster: str) -> list[Leftover]:
    def tags_of(name: str) -> list[dict]:
        return aws.iam.get_role(RoleName=name)["Role"].get("Tags", [])

    return [Leftover("iam-role", r["RoleName"])
            for r in _tagged_iam(aws, cluster, "list_roles", "Roles", "RoleName", tags_of)]


def _delete_roles(aws: AwsClients, items: list[Leftover], out: Out):
    def delete(role: Leftover) -> None:
        for name in _paginate(aws.iam, "list_role_policies", "PolicyNames", RoleName=role.id):
            aws.iam.delete_role_policy(RoleName=role.id, PolicyName=name)
        attached = _paginate(aws.iam, "list_attached_role_policies", "AttachedPolicies", RoleName=role.id)
        for policy in attached:
            aws.iam.detach_role_policy(RoleName=role.id, PolicyArn=policy["PolicyArn"])
        aws.iam.delete_role(RoleName=role.id)
    return _each(items, delete, out)


# ---- security groups -----------------------------------------------------------------------------
def _find_security_groups(aws: AwsClients, cluster: str) -> list[Leftover]:
    return [Leftover("security-group", g["GroupId"], g["GroupName"])
            for g in _paginate(aws.ec2, "describe_security_groups", "SecurityGroups",
                               Filters=_tag_filter(cluster))
            if g["GroupName"] != "default"]


def _group_references(permissions: list[dict]) -> list[dict]:
    """The rules of a permission list that name another (or the same) security group."""
    return [{"IpProtocol": p["IpProtocol"],
             **{k: p[k] for k in ("FromPort", "ToPort") if k in p},
             "UserIdGroupPairs": [{"GroupId": pair["GroupId"]} for pair in p["UserIdGroupPairs"]]}
            for p in permissions if p.get("UserIdGroupPairs")]


def _delete_security_groups(aws: AwsClients, items: list[Leftover], out: Out):
    """Rules that reference groups (the nodes' self rule, bastion -> nodes) make each group a
    dependency of the other (DependencyViolation): revoke them all, then delete the groups."""
    failures = []
    ids = [g.id for g in items]
    groups = aws.ec2.describe_security_groups(GroupIds=ids)["SecurityGroups"] if ids else []
    by_id = {g.id: g for g in items}
    for group in groups:
        leftover = by_id[group["GroupId"]]
        try:
            if ingress := _group_references(group.get("IpPermissions", [])):
                aws.ec2.revoke_security_group_ingress(GroupId=group["GroupId"], IpPermissions=ingress)
            if egress := _group_references(group.get("IpPermissionsEgress", [])):
                aws.ec2.revoke_security_group_egress(GroupId=group["GroupId"], IpPermissions=egress)
        except botocore.exceptions.ClientError as e:
            failures.append((leftover, f"revoking its group references: {error_text(e)}"))
            out(f"  FAILED  {leftover}: revoking its group references: {error_text(e)}")
    return failures + _each(items, lambda g: aws.ec2.delete_security_group(GroupId=g.id), out)


# ---- network -------------------------------------------------------------------------------------
def _find_vpc_endpoints(aws: AwsClients, cluster: str) -> list[Leftover]:
    return [Leftover("vpc-endpoint", e["VpcEndpointId"], e.get("ServiceName", ""))
            for e in _paginate(aws.ec2, "describe_vpc_endpoints", "VpcEndpoints",
                               Filters=_tag_filter(cluster))
            if e.get("State", "").lower() not in ("deleting", "deleted")]


def _endpoints_gone(aws: AwsClients, ids: list[str]) -> bool:
    try:
        endpoints = aws.ec2.describe_vpc_endpoints(VpcEndpointIds=ids)["VpcEndpoints"]
    except botocore.exceptions.ClientError as e:
        if error_code(e) == "InvalidVpcEndpointId.NotFound":
            return True
        raise
    return all(e.get("State", "").lower() == "deleted" for e in endpoints)


def _delete_vpc_endpoints(aws: AwsClients, items: list[Leftover], out: Out):
    """Delete, then wait: DeleteVpcEndpoints only starts the deletion (state `deleting`), and a
    gateway endpoint still holds routes in its route tables and an interface endpoint its ENIs in
    the subnets, so route tables, subnets and the VPC fail with DependencyViolation until it is gone."""
    failures = _each(items, lambda e: aws.ec2.delete_vpc_endpoints(VpcEndpointIds=[e.id]), out)
    failed_ids = {f[0].id for f in failures}
    pending = [e.id for e in items if e.id not in failed_ids]
    if pending and not _wait_until(lambda: _endpoints_gone(aws, pending), ENDPOINT_WAIT_SECONDS,
                                   "VPC endpoints to delete", out):
        failures += [(e, "still deleting") for e in items if e.id in pending]
    return failures


def _find_capacity_reservations(aws: AwsClients, cluster: str) -> list[Leftover]:
    """The all-or-nothing reservation (it bills like running instances until cancelled)."""
    found = _paginate(aws.ec2, "describe_capacity_reservations", "CapacityReservations",
                      Filters=[*_tag_filter(cluster), {"Name": "state", "Values": ["active", "pending"]}])
    return [Leftover("capacity-reservation", r["CapacityReservationId"],
                     f"{r.get('TotalInstanceCount')} x {r.get('InstanceType')}") for r in found]


def _cancel_capacity_reservations(aws: AwsClients, items: list[Leftover], out: Out):
    return _each(items, lambda r: aws.ec2.cancel_capacity_reservation(CapacityReservationId=r.id), out)


def _find_internet_gateways(aws: AwsClients, cluster: str) -> list[Leftover]:
    return [Leftover("internet-gateway", g["InternetGatewayId"],
                     ",".join(a["VpcId"] for a in g.get("Attachments", [])))
            for g in aws.ec2.describe_internet_gateways(Filters=_tag_filter(cluster))["InternetGateways"]]


def _delete_internet_gateways(aws: AwsClients, items: list[Leftover], out: Out):
    def delete(gateway: Leftover) -> None:
        for vpc in filter(None, gateway.detail.split(",")):
            aws.ec2.detach_internet_gateway(InternetGatewayId=gateway.id, VpcId=vpc)
        aws.ec2.delete_internet_gateway(InternetGatewayId=gateway.id)
    return _each(items, delete, out)


def _find_route_tables(aws: AwsClients, cluster: str) -> list[Leftover]:
    return [Leftover("route-table", t["RouteTableId"], t.get("VpcId", ""))
            for t in aws.ec2.describe_route_tables(Filters=_tag_filter(cluster))["RouteTables"]
            if not any(a.get("Main") for a in t.get("Associations", []))]


def _delete_route_tables(aws: AwsClients, items: list[Leftover], out: Out):
    def delete(table: Leftover) -> None:
        found = aws.ec2.describe_route_tables(RouteTableIds=[table.id])["RouteTables"]
        for assoc in found[0].get("Associations", []) if found else []:
            aws.ec2.disassociate_route_table(AssociationId=assoc["RouteTableAssociationId"])
        aws.ec2.delete_route_table(RouteTableId=table.id)
    return _each(items, delete, out)


def _find_subnets(aws: AwsClients, cluster: str) -> list[Leftover]:
    return [Leftover("subnet", s["SubnetId"], f"{s['CidrBlock']} in {s['AvailabilityZone']}")
            for s in aws.ec2.describe_subnets(Filters=_tag_filter(cluster))["Subnets"]]


def _delete_subnets(aws: AwsClients, items: list[Leftover], out: Out):
    return _each(items, lambda s: aws.ec2.delete_subnet(SubnetId=s.id), out)


def _find_vpcs(aws: AwsClients, cluster: str) -> list[Leftover]:
    return [Leftover("vpc", v["VpcId"], v["CidrBlock"])
            for v in aws.ec2.describe_vpcs(Filters=_tag_filter(cluster))["Vpcs"]]


def _delete_vpcs(aws: AwsClients, items: list[Leftover], out: Out):
    return _each(items, lambda v: aws.ec2.delete_vpc(VpcId=v.id), out)


# ---- the checkpoint bucket -----------------------------------------------------------------------
def _find_buckets(aws: AwsClients, cluster: str) -> list[Leftover]:
    mappings = _paginate(aws.tagging, "get_resources", "ResourceTagMappingList",
                         TagFilters=[{"Key": CLUSTER_TAG, "Values": [cluster]}], ResourceTypeFilters=["s3"])
    return [Leftover("s3-bucket", m["ResourceARN"].rsplit(":", 1)[-1], "checkpoints") for m in mappings]


def _empty_and_delete_bucket(aws: AwsClients, bucket: Leftover) -> None:
    # A versioned bucket is empty only once every version and delete marker is gone.
    for page in aws.s3.get_paginator("list_object_versions").paginate(Bucket=bucket.id):
        doomed = [{"Key": v["Key"], "VersionId": v["VersionId"]}
                  for v in page.get("Versions", []) + page.get("DeleteMarkers", [])]
        if doomed:
            aws.s3.delete_objects(Bucket=bucket.id, Delete={"Objects": doomed, "Quiet": True})
    aws.s3.delete_bucket(Bucket=bucket.id)


def _delete_buckets(aws: AwsClients, items: list[Leftover], out: Out):
    return _each(items, lambda b: _empty_and_delete_bucket(aws, b), out)


# ---- anything else the Tagging API knows ---------------------------------------------------------
# ARN resource types covered by a kind above (or deleted together with one, like an FSx data
# repository association with its file system).
_COVERED_ARN_TYPES = {
    ("ec2", t) for t in ("instance", "network-interface", "volume", "security-group", "security-group-rule",
                         "launch-template", "placement-group", "capacity-reservation", "key-pair",
                         "natgateway", "elastic-ip", "vpc-endpoint",
                         "internet-gateway", "route-table", "subnet", "vpc")
} | {("fsx", "file-system"), ("fsx", "association"), ("scheduler", "schedule-group"), ("s3", "bucket"),
     ("sqs", "queue")}
# Services whose ARNs name the resource without its type (arn:aws:s3:::NAME, arn:aws:sqs:...:NAME).
_UNTYPED_ARN_KINDS = {"s3": "bucket", "sqs": "queue"}


def _arn_resource(arn: str) -> tuple[str, str, str]:
    """(service, resource type, resource id) of an ARN."""
    parts = arn.split(":", 5)
    service, resource = parts[2], parts[5]
    kind, _, rest = resource.partition("/")
    return (service, kind, rest) if rest else (service, _UNTYPED_ARN_KINDS.get(service, kind), resource)


def _find_tagged_others(aws: AwsClients, cluster: str) -> list[Leftover]:
    mappings = _paginate(aws.tagging, "get_resources", "ResourceTagMappingList",
                         TagFilters=[{"Key": CLUSTER_TAG, "Values": [cluster]}])
    out = []
    for m in mappings:
        service, kind, rid = _arn_resource(m["ResourceARN"])
        if (service, kind) in _COVERED_ARN_TYPES:
            continue
        out.append(Leftover(f"{service}-{kind}", rid, m["ResourceARN"]))
    return out


# Deletion order: each kind's resources depend only on kinds after it.
KINDS: list[Kind] = [
    Kind("schedule-group", _find_schedule_group, _delete_schedule_groups),
    Kind("sqs-queue", _find_queues, _delete_queues),
    Kind("instance", _find_instances, terminate_and_wait),
    Kind("capacity-reservation", _find_capacity_reservations, _cancel_capacity_reservations),
    Kind("fsx-file-system", _find_file_systems, _delete_file_systems),
    Kind("nat-gateway", _find_nat_gateways, _delete_nat_gateways),
    Kind("elastic-ip", _find_addresses, _release_addresses),
    Kind("vpc-endpoint", _find_vpc_endpoints, _delete_vpc_endpoints),
    Kind("network-interface", _find_network_interfaces, _delete_network_interfaces),
    Kind("volume", _find_volumes, _delete_volumes),
    Kind("launch-template", _find_launch_templates, _delete_launch_templates),
    Kind("placement-group", _find_placement_groups, _delete_placement_groups),
    Kind("key-pair", _find_key_pairs, _delete_key_pairs),
    Kind("instance-profile", _find_instance_profiles, _delete_instance_profiles),
    Kind("iam-role", _find_roles, _delete_roles),
    Kind("security-group", _find_security_groups, _delete_security_groups),
    Kind("internet-gateway", _find_internet_gateways, _delete_internet_gateways),
    Kind("route-table", _find_route_tables, _delete_route_tables),
    Kind("subnet", _find_subnets, _delete_subnets),
    Kind("vpc", _find_vpcs, _delete_vpcs),
    Kind("s3-bucket", _find_buckets, _delete_buckets),
    Kind("other tagged resource", _find_tagged_others, None,
         keep_reason="of a kind the sweep does not delete: delete it in the AWS console or with the "
                     "aws CLI, then run `fsdpctl down` again"),
]


@dataclass(frozen=True)
class Coverage:
    """How the sweep removes one resource type of the Pulumi program when `pulumi destroy` leaves
    it behind."""

    kind: str | None
    """The sweep kind (in KINDS) that deletes it; None: it exists only in the stack state."""
    note: str = ""
    """How it goes with `kind` when that kind's own resource is another one (e.g. a role's
    policies, a bucket's settings), or why there is nothing to sweep."""

    @property
    def own(self) -> bool:
        """The kind finds and deletes this type itself."""
        return self.kind is not None and not self.note


# Every resource type the program registers (infra/program.py), tied to the sweep by a test
# (tests/aws/test_sweep_coverage.py): a new type ships with its sweep step or a reason here.
PROGRAM_TYPES: dict[str, Coverage] = {
    "pulumi:providers:aws": Coverage(None, "the provider's settings, not a resource in AWS"),
    "time:index/rotating:Rotating": Coverage(None, "the expiry clock, a time kept in the stack state"),
    "aws:ec2/vpc:Vpc": Coverage("vpc"),
    "aws:ec2/subnet:Subnet": Coverage("subnet"),
    "aws:ec2/internetGateway:InternetGateway": Coverage("internet-gateway"),
    "aws:ec2/eip:Eip": Coverage("elastic-ip"),
    "aws:ec2/natGateway:NatGateway": Coverage("nat-gateway"),
    "aws:ec2/routeTable:RouteTable": Coverage("route-table"),
    "aws:ec2/routeTableAssociation:RouteTableAssociation": Coverage(
        "route-table", "disassociated before its route table is deleted"),
    "aws:ec2/vpcEndpoint:VpcEndpoint": Coverage("vpc-endpoint"),
    "aws:ec2/securityGroup:SecurityGroup": Coverage("security-group"),
    "aws:ec2/placementGroup:PlacementGroup": Coverage("placement-group"),
    "aws:ec2/capacityReservation:CapacityReservation": Coverage("capacity-reservation"),
    "aws:ec2/launchTemplate:LaunchTemplate": Coverage("launch-template"),
    "aws:ec2/instance:Instance": Coverage("instance"),
    "aws:ec2/keyPair:KeyPair": Coverage("key-pair"),
    "aws:iam/role:Role": Coverage("iam-role"),
    "aws:iam/rolePolicy:RolePolicy": Coverage("iam-role", "deleted with its role"),
    "aws:iam/rolePolicyAttachment:RolePolicyAttachment": Coverage("iam-role", "detached from its role"),
    "aws:iam/instanceProfile:InstanceProfile": Coverage("instance-profile"),
    "aws:fsx/lustreFileSystem:LustreFileSystem": Coverage("fsx-file-system"),
    "aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation": Coverage(
        "fsx-file-system", "deleted with its file system"),
    "aws:s3/bucket:Bucket": Coverage("s3-bucket"),
    "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock": Coverage(
        "s3-bucket", "deleted with its bucket"),
    "aws:s3/bucketVersioning:BucketVersioning": Coverage("s3-bucket", "deleted with its bucket"),
    "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration": Coverage(
        "s3-bucket", "deleted with its bucket"),
    "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration": Coverage(
        "s3-bucket", "deleted with its bucket"),
    "aws:scheduler/scheduleGroup:ScheduleGroup": Coverage("schedule-group"),
    "aws:scheduler/schedule:Schedule": Coverage("schedule-group", "deleted with its schedule group"),
    "aws:sqs/queue:Queue": Coverage("sqs-queue"),
}


def find_leftovers(aws: AwsClients, cluster: str, out: Out = print,
                   keep_kinds: frozenset[str] = frozenset()) -> SweepReport:
    report = SweepReport()
    for kind in KINDS:
        try:
            items = kind.find(aws, cluster)
            if kind.name in keep_kinds:
                report.kept += items
            else:
                report.found += items
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            report.listing_errors.append(f"{kind.name}: {error_text(e)}")
            out(f"  could not list {kind.name}s: {error_text(e)}")
    return report


def sweep(aws: AwsClients, cluster: str, *, force: bool = False, out: Out = print,
          keep_kinds: frozenset[str] = frozenset()) -> SweepReport:
    """Find the cluster's tagged leftovers; with force delete them in dependency order, then look
    again. The returned report's `found` is what is still there afterwards; kinds named in
    `keep_kinds` are listed in `kept` and never deleted."""
    out(f"sweeping {aws.region} for resources tagged {CLUSTER_TAG}={cluster} ...")
    report = find_leftovers(aws, cluster, out, keep_kinds)
    for item in report.kept:
        out(f"  keeping {item}")
    if not report.found:
        return report
    for item in report.found:
        out(f"  found {item}")
    if not force:
        return report
    for kind in KINDS:
        items = [i for i in report.found if _kind_of(i) is kind]
        if not items or kind.delete is None:
            continue
        failures = kind.delete(aws, items, out)
        failed = {f[0] for f in failures}
        report.failed += failures
        report.deleted += [i for i in items if i not in failed]
    after = find_leftovers(aws, cluster, out, keep_kinds)
    report.found, report.listing_errors = after.found, after.listing_errors
    return report


def _kind_of(item: Leftover) -> Kind:
    return next((k for k in KINDS if k.name == item.kind), KINDS[-1])


def describe_report(report: SweepReport, cluster: str) -> str:
    """What is left and what to do about it, for the CLI and CommandError messages."""
    lines = []
    for item, reason in report.failed:
        lines.append(f"  - could not delete {item}: {reason}")
    for item in report.found:
        kind = _kind_of(item)
        hint = kind.keep_reason or f"`fsdpctl down --cluster {cluster} --force` deletes it"
        lines.append(f"  - still there: {item}; {hint}")
    for error in report.listing_errors:
        lines.append(f"  - could not check {error}; grant the describe permission and run "
                     f"`fsdpctl down --cluster {cluster}` again")
    return "\n".join(lines)
