"""Pre-flight: everything AWS must already agree to before `pulumi up` creates anything.

`pulumi up` discovers a missing quota, an AZ without the instance type or a reservation in the
wrong zone only after it has created the VPC, the FSx file system and half the nodes. These checks
ask the read-only describe APIs first and report every problem at once, each with its fix.

Each check is a function `(spec, aws) -> Outcome` registered in CHECKS; `run_preflight` runs them
all (one failing API call fails only its own check) and `fsdpctl preflight SPEC.yaml` prints a
pass/fail table. The permission check simulates the caller's policies over the actions of
fsdpctl/targets/aws/permissions.py, whose policy document `fsdpctl preflight --print-policy` prints.
"""

from __future__ import annotations

import argparse
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field

import botocore.exceptions

from fsdpctl.console import print_json, say, warn
from fsdpctl.errors import EXIT_FAILED, EXIT_OK, CommandError, UsageError
from fsdpctl.targets.aws import permissions
from fsdpctl.targets.aws.clients import AwsClients, error_code, error_text
from infra import catalog
from infra.offline import region_partition
from infra.spec import CLUSTER_TAG, CapacityType, ClusterSpec, load_spec

# Service Quotas codes (EC2, counted in vCPUs, per region). Instances in an On-Demand Capacity
# Reservation count against the On-Demand quota.
ON_DEMAND_P_QUOTA = ("L-417A185B", "Running On-Demand P instances")
SPOT_P_QUOTA = ("L-7212CCBC", "All P Spot Instance Requests")
ACTIVE_STATES = ["pending", "running", "stopping", "stopped"]


@dataclass(frozen=True)
class Finding:
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.message}. Fix: {self.fix}"


@dataclass
class Outcome:
    detail: str
    findings: list[Finding] = field(default_factory=list)
    skipped: bool = False


@dataclass
class CheckResult:
    name: str
    outcome: Outcome

    @property
    def status(self) -> str:
        if self.outcome.skipped:
            return "skip"
        return "fail" if self.outcome.findings else "pass"


@dataclass
class PreflightReport:
    spec: ClusterSpec
    results: list[CheckResult]

    @property
    def ok(self) -> bool:
        return all(r.status != "fail" for r in self.results)

    @property
    def findings(self) -> list[tuple[str, Finding]]:
        return [(r.name, f) for r in self.results for f in r.outcome.findings]

    def table(self) -> str:
        width = max(len(r.name) for r in self.results)
        lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
        lines += [f"{r.name:<{width}}  {r.status.upper():<6}  {r.outcome.detail}" for r in self.results]
        return "\n".join(lines)

    def failure_text(self) -> str:
        return "\n".join(f"  - {name}: {finding}" for name, finding in self.findings)

    def as_dict(self) -> dict:
        return {"cluster": self.spec.name, "passed": self.ok,
                "checks": [{"name": r.name, "status": r.status, "detail": r.outcome.detail,
                            "findings": [{"message": f.message, "fix": f.fix} for f in r.outcome.findings]}
                           for r in self.results]}


Check = Callable[[ClusterSpec, AwsClients], Outcome]
CHECKS: list[tuple[str, Check]] = []


def check(name: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        CHECKS.append((name, fn))
        return fn
    return register


def _skip(reason: str) -> Outcome:
    return Outcome(detail=reason, skipped=True)


def _describe_instance_type(aws: AwsClients, instance_type: str) -> dict | None:
    found = aws.ec2.describe_instance_types(
        Filters=[{"Name": "instance-type", "Values": [instance_type]}])["InstanceTypes"]
    return found[0] if found else None


def _instances(aws: AwsClients, filters: list[dict]) -> list[dict]:
    pages = aws.ec2.get_paginator("describe_instances").paginate(Filters=filters)
    return [i for page in pages for r in page["Reservations"] for i in r["Instances"]]


def _own_active_instances(spec: ClusterSpec, aws: AwsClients) -> list[dict]:
    """This cluster's instances that already exist (a repeated `up` must not count them twice)."""
    return _instances(aws, [{"Name": f"tag:{CLUSTER_TAG}", "Values": [spec.name]},
                            {"Name": "instance-state-name", "Values": ACTIVE_STATES}])


def _vcpus(instance: dict) -> int:
    cpu = instance.get("CpuOptions") or {}
    if cpu.get("CoreCount"):
        return cpu["CoreCount"] * cpu.get("ThreadsPerCore", 1)
    known = catalog.CATALOG.get(instance.get("InstanceType", ""))
    return known.vcpus if known else 0


@check("instance type offered in AZ")
def check_offering(spec: ClusterSpec, aws: AwsClients) -> Outcome:
    def offered_in(filters: list[dict]) -> list[str]:
        pages = aws.ec2.get_paginator("describe_instance_type_offerings").paginate(
            LocationType="availability-zone",
            Filters=[{"Name": "instance-type", "Values": [spec.instance_type]}, *filters])
        return sorted(o["Location"] for page in pages for o in page["InstanceTypeOfferings"])

    if offered_in([{"Name": "location", "Values": [spec.availability_zone]}]):
        return Outcome(f"{spec.instance_type} is offered in {spec.availability_zone}")
    elsewhere = offered_in([])
    fix = (f"set availability_zone to one of {', '.join(elsewhere)}" if elsewhere
           else f"choose a region that offers {spec.instance_type} (see the EC2 instance-type docs)")
    return Outcome(f"not offered in {spec.availability_zone}", [Finding(
        f"availability_zone {spec.availability_zone}: {spec.instance_type} is not offered there "
        f"(offered in {spec.region}: {', '.join(elsewhere) or 'no zone'})", fix)])


@check("instance type GPUs/EFA match catalog")
def check_instance_facts(spec: ClusterSpec, aws: AwsClients) -> Outcome:
    info = _describe_instance_type(aws, spec.instance_type)
    fix_catalog = (f"correct the {spec.instance_type} entry in infra/catalog.py (the inventory, "
                   "launch template and smoke-test gates read it), or pick another instance_type")
    if info is None:
        return Outcome("unknown to EC2", [Finding(
            f"instance_type {spec.instance_type}: EC2 in {spec.region} does not know this type",
            f"choose a region where it exists, or {fix_catalog}")])
    expected = spec.instance
    network = info.get("NetworkInfo", {})
    actual = {
        "GPUs": sum(g.get("Count", 0) for g in info.get("GpuInfo", {}).get("Gpus", [])),
        "network cards": network.get("MaximumNetworkCards", 1),
        "EFA interfaces": network.get("EfaInfo", {}).get("MaximumEfaInterfaces", 0)
        if network.get("EfaSupported") else 0,
        "vCPUs": info.get("VCpuInfo", {}).get("DefaultVCpus"),
    }
    wanted = {"GPUs": expected.gpus, "network cards": expected.network_cards,
              "EFA interfaces": expected.efa_interfaces, "vCPUs": expected.vcpus}
    findings = [
        Finding(f"instance_type {spec.instance_type}: the catalog says {wanted[k]} {k}, "
                f"EC2 says {actual[k]}", fix_catalog)
        for k in wanted if actual[k] != wanted[k]
    ]
    return Outcome(f"{actual['GPUs']} GPUs, {actual['EFA interfaces']} EFA, "
                   f"{actual['network cards']} network cards", findings)


@check("service quota (vCPUs)")
def check_quota(spec: ClusterSpec, aws: AwsClients) -> Outcome:
    if spec.capacity.type is CapacityType.CAPACITY_BLOCK:
        return _skip("capacity blocks are sized by the reservation check")
    spot = spec.capacity.type is CapacityType.SPOT
    code, title = SPOT_P_QUOTA if spot else ON_DEMAND_P_QUOTA
    try:
        quota = aws.service_quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]
    except botocore.exceptions.ClientError as e:
        # An account that never asked for an increase has no applied value: the default applies.
        if error_code(e) != "NoSuchResourceException":
            raise
        quota = aws.service_quotas.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]
    limit = int(quota["Value"])

    own_ids = {i["InstanceId"] for i in _own_active_instances(spec, aws)}
    # The quota spans every P family (p3, p4d, p5, ...); filtered here because not every EC2
    # implementation honours wildcards in an instance-type filter.
    others = [i for i in _instances(aws, [{"Name": "instance-state-name", "Values": ["pending", "running"]}])
              if i["InstanceType"].startswith("p") and i["InstanceId"] not in own_ids
              and (i.get("InstanceLifecycle") == "spot") == spot]
    in_use = sum(_vcpus(i) for i in others)
    waiting = 0
    if spot:
        # Open (not yet fulfilled) spot requests hold their share of the spot quota too.
        pages = aws.ec2.get_paginator("describe_spot_instance_requests").paginate(
            Filters=[{"Name": "state", "Values": ["open"]}])
        for page in pages:
            for request in page["SpotInstanceRequests"]:
                itype = (request.get("LaunchSpecification") or {}).get("InstanceType", "")
                known = catalog.CATALOG.get(itype)
                if itype.startswith("p"):
                    waiting += known.vcpus if known else 0
        in_use += waiting
    needed = spec.node_count * spec.instance.vcpus
    detail = (f"{title}: quota {limit} vCPUs, {in_use} in use"
              + (f" ({waiting} by open spot requests)" if waiting else "") + f", cluster needs {needed}")
    if needed + in_use <= limit:
        return Outcome(detail)
    fits = max(0, (limit - in_use) // spec.instance.vcpus)
    return Outcome(detail, [Finding(
        f"node_count {spec.node_count}: {spec.node_count} x {spec.instance_type} need {needed} vCPUs of "
        f"the '{title}' quota ({code}) in {spec.region}, which allows {limit} with {in_use} already in use",
        f"request an increase to at least {needed + in_use} vCPUs (`aws service-quotas "
        f"request-service-quota-increase --service-code ec2 --quota-code {code} --desired-value "
        f"{needed + in_use} --region {spec.region}`), or lower node_count to {fits}"
        + ("" if spot else ", or use capacity.type capacity-block"))])


@check("AMI resolves (x86_64)")
def check_image(spec: ClusterSpec, aws: AwsClients) -> Outcome:
    if spec.image.ami_id:
        ami, source, field_name = spec.image.ami_id, "image.ami_id", "image.ami_id"
    else:
        field_name = "image.ssm_parameter"
        try:
            ami = aws.ssm.get_parameter(Name=spec.image.ssm_parameter)["Parameter"]["Value"]
        except botocore.exceptions.ClientError as e:
            if error_code(e) not in ("ParameterNotFound", "ValidationException"):
                raise
            return Outcome("SSM parameter not found", [Finding(
                f"{field_name} {spec.image.ssm_parameter}: no such parameter in {spec.region}",
                "check its spelling (list them with `aws ssm get-parameters-by-path --path "
                "/aws/service/deeplearning/ami/x86_64 --recursive`), or set image.ami_id")])
        source = f"{spec.image.ssm_parameter} -> {ami}"
    try:
        images = aws.ec2.describe_images(ImageIds=[ami])["Images"]
    except botocore.exceptions.ClientError as e:
        if not error_code(e).startswith("InvalidAMIID"):
            raise
        images = []
    if not images:
        return Outcome(f"{ami} does not exist", [Finding(
            f"{field_name}: AMI {ami} does not exist in {spec.region} (or is not shared with this account)",
            "use an AMI id from this region, or leave image.ami_id empty to use the Deep Learning AMI")])
    image = images[0]
    findings = []
    if image.get("Architecture") != "x86_64":
        findings.append(Finding(
            f"{field_name}: AMI {ami} is {image.get('Architecture')}, but {spec.instance_type} is x86_64",
            "use an x86_64 image, e.g. the default Deep Learning AMI parameter under "
            "/aws/service/deeplearning/ami/x86_64/"))
    if image.get("State", "available") != "available":
        findings.append(Finding(f"{field_name}: AMI {ami} is {image.get('State')}, not available",
                                "wait until it is available, or use another AMI"))
    root = next((m for m in image.get("BlockDeviceMappings", [])
                 if m.get("DeviceName") == image.get("RootDeviceName")), None)
    snapshot_gib = ((root or {}).get("Ebs") or {}).get("VolumeSize")
    if snapshot_gib and spec.storage.root_volume_gib < snapshot_gib:
        findings.append(Finding(
            f"storage.root_volume_gib {spec.storage.root_volume_gib}: smaller than the root snapshot of "
            f"AMI {ami} ({snapshot_gib} GiB); RunInstances refuses a root volume smaller than its snapshot",
            f"set storage.root_volume_gib to at least {snapshot_gib}"))
    return Outcome(f"{source} ({image.get('Name', 'unnamed')}, {image.get('Architecture')})", findings)


@check("key pair exists")
def check_key_pair(spec: ClusterSpec, aws: AwsClients) -> Outcome:
    name = spec.access.key_name
    if not name:
        return _skip("fsdpctl imports a public key" if spec.access.public_key
                     else "fsdpctl generates a key pair")
    try:
        aws.ec2.describe_key_pairs(KeyNames=[name])
    except botocore.exceptions.ClientError as e:
        if error_code(e) != "InvalidKeyPair.NotFound":
            raise
        return Outcome(f"{name} not found", [Finding(
            f"access.key_name {name}: no such key pair in {spec.region}",
            "create or import it in this region (`aws ec2 import-key-pair`), set access.public_key "
            "instead, or remove access.key_name to let fsdpctl generate one")])
    return Outcome(f"{name} exists")


@check("existing VPC and subnets")
def check_network(spec: ClusterSpec, aws: AwsClients) -> Outcome:
    net = spec.network
    if net.creates_vpc:
        return _skip("the stack creates its own VPC")
    try:
        aws.ec2.describe_vpcs(VpcIds=[net.vpc_id])
    except botocore.exceptions.ClientError as e:
        if error_code(e) != "InvalidVpcID.NotFound":
            raise
        return Outcome(f"{net.vpc_id} not found", [Finding(
            f"network.vpc_id {net.vpc_id}: no such VPC in {spec.region}",
            "give a VPC id of this region, or remove the network ids to let the stack create one")])
    findings = []
    subnets = {"network.private_subnet_id": net.private_subnet_id,
               "network.public_subnet_id": net.public_subnet_id}
    details = []
    for field_name, subnet_id in subnets.items():
        if not subnet_id:
            continue
        try:
            subnet = aws.ec2.describe_subnets(SubnetIds=[subnet_id])["Subnets"][0]
        except botocore.exceptions.ClientError as e:
            if error_code(e) != "InvalidSubnetID.NotFound":
                raise
            findings.append(Finding(f"{field_name} {subnet_id}: no such subnet in {spec.region}",
                                    f"give a subnet of {net.vpc_id}"))
            continue
        details.append(f"{subnet_id} in {subnet['AvailabilityZone']}")
        if subnet["VpcId"] != net.vpc_id:
            findings.append(Finding(
                f"{field_name} {subnet_id}: belongs to {subnet['VpcId']}, not {net.vpc_id}",
                f"give a subnet of {net.vpc_id}, or the VPC this subnet is in"))
        if field_name == "network.private_subnet_id" and subnet["AvailabilityZone"] != spec.availability_zone:
            findings.append(Finding(
                f"{field_name} {subnet_id}: is in {subnet['AvailabilityZone']}, but the nodes go to "
                f"{spec.availability_zone} (EFA does not span zones)",
                f"give a subnet in {spec.availability_zone}, or set availability_zone: "
                f"{subnet['AvailabilityZone']}"))
    return Outcome(f"{net.vpc_id}: " + ", ".join(details), findings)


@check("capacity reservation")
def check_reservation(spec: ClusterSpec, aws: AwsClients) -> Outcome:
    cap = spec.capacity
    if not cap.uses_reservation:
        return _skip(f"capacity.type {cap.type.value}")
    rid = cap.reservation_id
    try:
        found = aws.ec2.describe_capacity_reservations(CapacityReservationIds=[rid])["CapacityReservations"]
    except botocore.exceptions.ClientError as e:
        if not error_code(e).startswith("InvalidCapacityReservationId"):
            raise
        found = []
    if not found:
        return Outcome(f"{rid} not found", [Finding(
            f"capacity.reservation_id {rid}: no such reservation in {spec.region}",
            "copy the id from `aws ec2 describe-capacity-reservations --region "
            f"{spec.region}`, or set capacity.type: on-demand")])
    res = found[0]
    findings = []
    is_block = res.get("ReservationType") == "capacity-block"
    if (cap.type is CapacityType.CAPACITY_BLOCK) != is_block:
        kind, want = ("Capacity Block", "capacity-block") if is_block else ("capacity reservation",
                                                                          "capacity-reservation")
        findings.append(Finding(f"capacity.type {cap.type.value}: {rid} is a {kind}",
                                f"set capacity.type: {want}"))
    if res.get("State") != "active":
        scheduled = res.get("StartDate") and res.get("State") == "scheduled"
        when = f" (starts {res['StartDate']})" if scheduled else ""
        findings.append(Finding(f"capacity.reservation_id {rid}: is {res.get('State')}{when}, not active",
                                "wait until it is active, or use another reservation"))
    if res.get("InstanceType") != spec.instance_type:
        findings.append(Finding(
            f"instance_type {spec.instance_type}: reservation {rid} is for {res.get('InstanceType')}",
            f"set instance_type: {res.get('InstanceType')}, or use a reservation for {spec.instance_type}"))
    if res.get("AvailabilityZone") != spec.availability_zone:
        findings.append(Finding(
            f"availability_zone {spec.availability_zone}: reservation {rid} is in "
            f"{res.get('AvailabilityZone')}",
            f"set availability_zone: {res.get('AvailabilityZone')}"))
    end = res.get("EndDate")
    if is_block and end and spec.expiry_hours is not None:
        expiry = dt.datetime.now(dt.UTC) + dt.timedelta(hours=spec.expiry_hours)
        end_utc = end if end.tzinfo else end.replace(tzinfo=dt.UTC)
        if end_utc < expiry:
            hours_left = max(1, int((end_utc - dt.datetime.now(dt.UTC)).total_seconds() // 3600))
            findings.append(Finding(
                f"expiry_hours {spec.expiry_hours}: Capacity Block {rid} ends at {end_utc.isoformat()}, "
                f"before the cluster would expire ({expiry.replace(microsecond=0).isoformat()}); EC2 "
                "terminates the nodes at the block's end while the NAT gateway, bastion and file system "
                "keep billing until the expiry",
                f"set expiry_hours to at most {hours_left}, or extend the Capacity Block"))
    own_in_reservation = sum(
        1 for i in _own_active_instances(spec, aws)
        if i.get("CapacityReservationId") == rid)
    available = res.get("AvailableInstanceCount", 0) + own_in_reservation
    if available < spec.node_count:
        findings.append(Finding(
            f"node_count {spec.node_count}: reservation {rid} has {res.get('AvailableInstanceCount', 0)} of "
            f"{res.get('TotalInstanceCount')} instances available",
            f"lower node_count to {available}, free instances in the reservation, or extend it"))
    return Outcome(f"{rid}: {res.get('State')}, {res.get('InstanceType')} in {res.get('AvailabilityZone')}, "
                   f"{res.get('AvailableInstanceCount')}/{res.get('TotalInstanceCount')} available", findings)


@check("existing placement group")
def check_placement_group(spec: ClusterSpec, aws: AwsClients) -> Outcome:
    name = spec.placement_group.existing_name
    if not name:
        return _skip("the stack creates one" if spec.uses_placement_group else "no placement group")
    try:
        groups = aws.ec2.describe_placement_groups(GroupNames=[name])["PlacementGroups"]
    except botocore.exceptions.ClientError as e:
        if error_code(e) != "InvalidPlacementGroup.Unknown":
            raise
        groups = []
    if not groups:
        return Outcome(f"{name} not found", [Finding(
            f"placement_group.existing_name {name}: no such placement group in {spec.region}",
            "give the name of an existing cluster placement group, or remove existing_name to let the "
            "stack create one")])
    group, findings = groups[0], []
    if group.get("Strategy") != "cluster":
        findings.append(Finding(
            f"placement_group.existing_name {name}: is a {group.get('Strategy')} group; EFA traffic "
            "needs a cluster group", "use a placement group with strategy cluster"))
    if spec.capacity.uses_reservation:
        # A reservation made in a placement group can only be used inside that group (and one made
        # outside cannot be used inside any): a mismatch is an InsufficientInstanceCapacity at launch.
        try:
            res = aws.ec2.describe_capacity_reservations(
                CapacityReservationIds=[spec.capacity.reservation_id])["CapacityReservations"]
        except botocore.exceptions.ClientError as e:
            if not error_code(e).startswith("InvalidCapacityReservationId"):
                raise
            res = []  # reported by the reservation check
        arn = res[0].get("PlacementGroupArn", "") if res else ""
        if res and arn.rsplit("/", 1)[-1] != name:
            findings.append(Finding(
                f"placement_group.existing_name {name}: reservation {spec.capacity.reservation_id} was "
                + (f"created in {arn.rsplit('/', 1)[-1]}" if arn else "not created in a placement group"),
                f"set placement_group.existing_name to {arn.rsplit('/', 1)[-1]}" if arn else
                "remove placement_group.existing_name (the nodes then launch without a group)"))
    return Outcome(f"{name}: {group.get('Strategy')}, {group.get('State')}", findings)


@check("FSx S3 bucket")
def check_fsx_bucket(spec: ClusterSpec, aws: AwsClients) -> Outcome:
    fsx = spec.storage.fsx
    paths = {k: v for k, v in (("storage.fsx.s3_import_path", fsx.s3_import_path),
                               ("storage.fsx.s3_export_path", fsx.s3_export_path)) if v}
    if not fsx.enabled or not paths:
        return _skip("no FSx data repository")
    findings, seen = [], []
    for field_name, url in paths.items():
        bucket = url.removeprefix("s3://").split("/", 1)[0]
        if bucket in seen:
            continue
        seen.append(bucket)
        try:
            head = aws.s3.head_bucket(Bucket=bucket)
        except botocore.exceptions.ClientError as e:
            code = error_code(e)
            if code in ("404", "NoSuchBucket"):
                findings.append(Finding(f"{field_name} {url}: bucket {bucket} does not exist",
                                        f"create it (`aws s3 mb s3://{bucket} --region {spec.region}`) "
                                        "or fix the path"))
            elif code in ("403", "AccessDenied"):
                findings.append(Finding(f"{field_name} {url}: bucket {bucket} exists but this account "
                                        "cannot read it", "use a bucket of this account, or grant access"))
            else:
                raise
            continue
        region = head.get("BucketRegion") or head["ResponseMetadata"]["HTTPHeaders"].get(
            "x-amz-bucket-region")
        if region and region != spec.region:
            findings.append(Finding(f"{field_name} {url}: bucket {bucket} is in {region}, the file system "
                                    f"in {spec.region}", f"use a bucket in {spec.region}"))
    return Outcome(", ".join(seen), findings)


DENIED = ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation")


def principal_arn(caller_arn: str) -> str | None:
    """The IAM principal to simulate for an STS caller ARN: an assumed role's role (without its
    path, which the session ARN does not carry), a user as it is; None for the root user."""
    if ":assumed-role/" in caller_arn:
        prefix, _, resource = caller_arn.partition(":assumed-role/")
        return prefix.replace(":sts:", ":iam:") + f":role/{resource.split('/', 1)[0]}"
    if caller_arn.endswith(":root"):
        return None
    return caller_arn


@check("IAM permissions (simulated)")
def check_permissions(spec: ClusterSpec, aws: AwsClients) -> Outcome:
    caller = aws.sts.get_caller_identity()["Arn"]
    principal = principal_arn(caller)
    if principal is None:
        return _skip("the account's root user may do everything (and should not run clusters)")
    if ":role/" in principal:
        try:  # the role's real ARN, with its path
            principal = aws.iam.get_role(RoleName=principal.rsplit("/", 1)[-1])["Role"]["Arn"]
        except botocore.exceptions.ClientError as e:
            if error_code(e) not in (*DENIED, "NoSuchEntity"):
                raise
    _, partition, _, _, account, _ = caller.split(":", 5)
    results: list[tuple[permissions.SimulationRequest, dict]] = []
    try:
        for request in permissions.simulation_requests(spec.name, partition, account):
            results += [(request, result) for result in _simulate(aws, principal, request)]
    except botocore.exceptions.ClientError as e:
        if error_code(e) not in DENIED:
            raise
        return _skip(f"{principal} may not call iam:SimulatePrincipalPolicy; the policy it needs is "
                     "printed by `fsdpctl preflight --print-policy` (docs/aws.md)")
    denied = sorted({_denial(request, result) for request, result in results
                     if result["EvalDecision"] != "allowed"})
    allowed = sum(result["EvalDecision"] == "allowed" for _, result in results)
    detail = f"{principal}: {allowed}/{len(results)} simulated requests allowed"
    if not denied:
        return Outcome(detail)
    return Outcome(detail, [Finding(
        f"the caller {principal} is not allowed {', '.join(denied)} (iam:SimulatePrincipalPolicy; a "
        "service control policy or permissions boundary may deny more)",
        "attach the policy `fsdpctl preflight --print-policy` prints to the caller (docs/aws.md, "
        "\"IAM policy\"), or allow these actions in its own policy")])


def _simulate(aws: AwsClients, principal: str, request: permissions.SimulationRequest) -> list[dict]:
    extra: dict = {}
    if request.resource_arns:
        extra["ResourceArns"] = list(request.resource_arns)
    if request.context_key:
        extra["ContextEntries"] = [{"ContextKeyName": request.context_key, "ContextKeyType": "string",
                                    "ContextKeyValues": [request.context_value]}]
    pages = aws.iam.get_paginator("simulate_principal_policy").paginate(
        PolicySourceArn=principal, ActionNames=list(request.actions), **extra)
    return [r for page in pages for r in page["EvaluationResults"]]


def _denial(request: permissions.SimulationRequest, result: dict) -> str:
    """The denied action, with the resource and condition value it was denied for, if any."""
    resource = result.get("EvalResourceName", "*")
    return (result["EvalActionName"] + ("" if resource == "*" else f" on {resource}")
            + (f" ({request.context_key} {request.context_value})" if request.context_key else ""))


def run_preflight(spec: ClusterSpec, aws: AwsClients, out: Callable[[str], None] = print) -> PreflightReport:
    """Run every check, printing progress; one check's API error fails only that check."""
    results = []
    for n, (name, fn) in enumerate(CHECKS, 1):
        out(f"[{n}/{len(CHECKS)}] {name} ...")
        try:
            outcome = fn(spec, aws)
        except botocore.exceptions.ClientError as e:
            code = error_code(e)
            operation = e.operation_name
            fix = (f"allow the {operation} action in the caller's IAM policy" if code in (
                "AccessDenied", "AccessDeniedException", "UnauthorizedOperation")
                else "retry; if it persists, check the AWS service health for the region")
            outcome = Outcome(f"{operation} failed", [Finding(f"{operation} failed ({error_text(e)})", fix)])
        except botocore.exceptions.BotoCoreError as e:
            outcome = Outcome("AWS call failed", [Finding(f"AWS call failed ({e})",
                                                          "check the network connection and retry")])
        result = CheckResult(name, outcome)
        out(f"      {result.status}: {outcome.detail}")
        for finding in outcome.findings:
            out(f"      - {finding}")
        results.append(result)
    return PreflightReport(spec, results)


def cmd_preflight(args: argparse.Namespace) -> int:
    if args.print_policy:
        return print_policy(load_spec(args.spec) if args.spec else None)
    if args.spec is None:
        raise UsageError("preflight needs SPEC, the cluster spec to check (e.g. `fsdpctl preflight "
                         "examples/demo.yaml`); `--print-policy` alone prints the IAM policy")
    spec = load_spec(args.spec)
    out = (lambda _line: None) if args.json else say
    out(f"pre-flight for cluster {spec.name}: {spec.node_count} x {spec.instance_type} in "
        f"{spec.availability_zone} ({spec.capacity.type.value})")
    for warning in spec.warnings():
        warn(warning)
    report = run_preflight(spec, AwsClients.for_spec(spec), out=out)
    if args.json:
        print_json(report.as_dict())
        return EXIT_OK if report.ok else EXIT_FAILED
    say(f"\n{report.table()}")
    if report.ok:
        say("\npre-flight passed: `fsdpctl up` can create this cluster")
        return EXIT_OK
    raise CommandError(f"pre-flight failed, {len(report.findings)} problem(s); nothing was created:\n"
                       f"{report.failure_text()}")


def print_policy(spec: ClusterSpec | None) -> int:
    """The IAM policy document on stdout, ready for `aws iam create-policy --policy-document`; no
    AWS call. With a spec, its role statements name only that cluster's roles, in its partition."""
    if spec is None:
        say(permissions.policy_json())
    else:
        say(permissions.policy_json(cluster=spec.name, partition=region_partition(spec.region)[0]))
    return EXIT_OK
