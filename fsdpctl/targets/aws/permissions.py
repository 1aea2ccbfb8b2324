"""The IAM permissions the aws target needs, and the policy document users attach to get them.

Three sources, each a table here:

- OPERATOR_CALLS: the AWS calls fsdpctl itself makes (pre-flight, the teardown sweep, stack
  look-ups, status);
- RESOURCE_ACTIONS: per Pulumi resource type the program registers, what the Terraform AWS
  provider behind pulumi-aws calls to create it, read it back (every refresh and preview), update
  it in place, delete it and tag it;
- LOOKUP_ACTIONS: the program's look-ups (invokes).

tests/aws/test_permissions.py derives the first from fsdpctl's source (every boto3 call, mapped to
its IAM action through botocore's service model) and the others from the program's resource graph
(run under Pulumi's mocks with every optional part on), and fails when a call, a resource type or a
look-up has no entry: a new one cannot ship without its permission.

`policy_document()` turns the tables into one customer managed policy (`fsdpctl preflight
--print-policy`, docs/aws.md); pre-flight's permission check simulates the same actions
(`simulation_requests`), so what the policy grants and what pre-flight checks cannot drift apart.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from itertools import chain


@dataclass(frozen=True)
class ResourceActions:
    """The IAM actions the provider calls for one resource type, by lifecycle step."""

    create: tuple[str, ...] = ()
    read: tuple[str, ...] = ()  # also every `pulumi refresh`, preview and update
    update: tuple[str, ...] = ()  # in-place changes (`extend`, a changed spec, template versions)
    delete: tuple[str, ...] = ()
    tag: tuple[str, ...] = ()

    @property
    def actions(self) -> tuple[str, ...]:
        return (*self.create, *self.read, *self.update, *self.delete, *self.tag)


# The service-linked roles AWS creates on first use in an account: FSx's own (its file systems'
# ENIs), the one FSx creates per file system linked to S3, and EC2's for spot instances.
SERVICE_LINKED_ROLE_SERVICES = ("fsx.amazonaws.com", "s3.data-source.lustre.fsx.amazonaws.com",
                                "spot.amazonaws.com")
# FSx attaches the S3 access policy to the service-linked role it creates for a linked file system,
# with the caller's rights (as the FSx CSI driver's documented minimal policy grants).
FSX_S3_LINK = ("iam:CreateServiceLinkedRole", "iam:AttachRolePolicy", "iam:PutRolePolicy", "s3:ListBucket")
# FSx reads the subnet, VPC and security groups with the caller's rights (forward access sessions;
# AmazonFSxFullAccess grants the same reads).
FSX_VPC_READS = ("ec2:DescribeSubnets", "ec2:DescribeVpcs", "ec2:DescribeSecurityGroups",
                 "ec2:GetSecurityGroupsForVpc", "ec2:DescribeRouteTables")
# Tags given at creation travel as TagSpecifications, which EC2 authorizes as ec2:CreateTags.
EC2_TAGS = ("ec2:CreateTags", "ec2:DeleteTags")
FSX_TAGS = ("fsx:TagResource", "fsx:UntagResource", "fsx:ListTagsForResource")
SCHEDULER_TAGS = ("scheduler:TagResource", "scheduler:UntagResource", "scheduler:ListTagsForResource")

RESOURCE_ACTIONS: dict[str, ResourceActions] = {
    # The explicit provider: it asks for the account id once per run.
    "pulumi:providers:aws": ResourceActions(read=("sts:GetCallerIdentity",)),
    # pulumiverse-time's clock keeps its time in the stack state: no cloud call.
    "time:index/rotating:Rotating": ResourceActions(),
    # ---- network
    "aws:ec2/vpc:Vpc": ResourceActions(
        create=("ec2:CreateVpc", "ec2:ModifyVpcAttribute"),
        read=("ec2:DescribeVpcs", "ec2:DescribeVpcAttribute", "ec2:DescribeNetworkAcls",
              "ec2:DescribeRouteTables", "ec2:DescribeSecurityGroups"),
        update=("ec2:ModifyVpcAttribute",), delete=("ec2:DeleteVpc",), tag=EC2_TAGS),
    "aws:ec2/subnet:Subnet": ResourceActions(
        create=("ec2:CreateSubnet",), read=("ec2:DescribeSubnets",),
        update=("ec2:ModifySubnetAttribute",),
        # The provider looks for ENIs other services left in the subnet before deleting it.
        delete=("ec2:DeleteSubnet", "ec2:DescribeNetworkInterfaces"), tag=EC2_TAGS),
    "aws:ec2/internetGateway:InternetGateway": ResourceActions(
        create=("ec2:CreateInternetGateway", "ec2:AttachInternetGateway"),
        read=("ec2:DescribeInternetGateways",),
        update=("ec2:AttachInternetGateway", "ec2:DetachInternetGateway"),
        delete=("ec2:DetachInternetGateway", "ec2:DeleteInternetGateway"), tag=EC2_TAGS),
    "aws:ec2/eip:Eip": ResourceActions(
        create=("ec2:AllocateAddress",), read=("ec2:DescribeAddresses", "ec2:DescribeAddressesAttribute"),
        delete=("ec2:DisassociateAddress", "ec2:ReleaseAddress"), tag=EC2_TAGS),
    "aws:ec2/natGateway:NatGateway": ResourceActions(
        create=("ec2:CreateNatGateway",), read=("ec2:DescribeNatGateways",),
        delete=("ec2:DeleteNatGateway",), tag=EC2_TAGS),
    "aws:ec2/routeTable:RouteTable": ResourceActions(
        create=("ec2:CreateRouteTable", "ec2:CreateRoute"), read=("ec2:DescribeRouteTables",),
        update=("ec2:CreateRoute", "ec2:ReplaceRoute", "ec2:DeleteRoute"),
        delete=("ec2:DeleteRouteTable",), tag=EC2_TAGS),
    "aws:ec2/routeTableAssociation:RouteTableAssociation": ResourceActions(
        create=("ec2:AssociateRouteTable",), read=("ec2:DescribeRouteTables",),
        update=("ec2:ReplaceRouteTableAssociation",), delete=("ec2:DisassociateRouteTable",)),
    "aws:ec2/vpcEndpoint:VpcEndpoint": ResourceActions(
        create=("ec2:CreateVpcEndpoint",), read=("ec2:DescribeVpcEndpoints", "ec2:DescribePrefixLists"),
        update=("ec2:ModifyVpcEndpoint",), delete=("ec2:DeleteVpcEndpoints",), tag=EC2_TAGS),
    # ---- security
    "aws:ec2/securityGroup:SecurityGroup": ResourceActions(
        # The provider revokes the default allow-all egress rule, then authorizes the declared rules.
        create=("ec2:CreateSecurityGroup", "ec2:RevokeSecurityGroupEgress",
                "ec2:AuthorizeSecurityGroupIngress", "ec2:AuthorizeSecurityGroupEgress"),
        read=("ec2:DescribeSecurityGroups", "ec2:DescribeSecurityGroupRules"),
        update=("ec2:AuthorizeSecurityGroupIngress", "ec2:AuthorizeSecurityGroupEgress",
                "ec2:RevokeSecurityGroupIngress", "ec2:RevokeSecurityGroupEgress",
                "ec2:UpdateSecurityGroupRuleDescriptionsIngress",
                "ec2:UpdateSecurityGroupRuleDescriptionsEgress"),
        delete=("ec2:DeleteSecurityGroup", "ec2:DescribeNetworkInterfaces"), tag=EC2_TAGS),
    # ---- storage
    "aws:s3/bucket:Bucket": ResourceActions(
        create=("s3:CreateBucket",),
        # HeadBucket (s3:ListBucket), then every bucket sub-configuration the resource reports.
        read=("s3:ListBucket", "s3:GetBucketLocation", "s3:GetBucketPolicy", "s3:GetBucketAcl",
              "s3:GetBucketCORS", "s3:GetBucketWebsite", "s3:GetBucketVersioning",
              "s3:GetAccelerateConfiguration", "s3:GetBucketRequestPayment", "s3:GetBucketLogging",
              "s3:GetLifecycleConfiguration", "s3:GetReplicationConfiguration",
              "s3:GetEncryptionConfiguration", "s3:GetBucketObjectLockConfiguration",
              "s3:GetBucketTagging"),
        # force_destroy empties the versioned bucket first.
        delete=("s3:ListBucketVersions", "s3:DeleteObject", "s3:DeleteObjectVersion", "s3:DeleteBucket"),
        tag=("s3:PutBucketTagging", "s3:GetBucketTagging")),
    # Deleting a bucket sub-configuration is authorized as writing it.
    "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock": ResourceActions(
        create=("s3:PutBucketPublicAccessBlock",), read=("s3:GetBucketPublicAccessBlock",),
        update=("s3:PutBucketPublicAccessBlock",), delete=("s3:PutBucketPublicAccessBlock",)),
    "aws:s3/bucketVersioning:BucketVersioning": ResourceActions(
        create=("s3:PutBucketVersioning",), read=("s3:GetBucketVersioning",),
        update=("s3:PutBucketVersioning",), delete=("s3:PutBucketVersioning",)),
    "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration":
        ResourceActions(create=("s3:PutEncryptionConfiguration",), read=("s3:GetEncryptionConfiguration",),
                        update=("s3:PutEncryptionConfiguration",), delete=("s3:PutEncryptionConfiguration",)),
    "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration": ResourceActions(
        create=("s3:PutLifecycleConfiguration",), read=("s3:GetLifecycleConfiguration",),
        update=("s3:PutLifecycleConfiguration",), delete=("s3:PutLifecycleConfiguration",)),
    "aws:fsx/lustreFileSystem:LustreFileSystem": ResourceActions(
        # The legacy (SCRATCH, PERSISTENT_1) import path links S3 on the file system itself.
        create=("fsx:CreateFileSystem", *FSX_VPC_READS, *FSX_S3_LINK),
        read=("fsx:DescribeFileSystems",), update=("fsx:UpdateFileSystem",),
        # A delete that keeps a final backup creates that backup with the caller's rights.
        delete=("fsx:DeleteFileSystem", "fsx:CreateBackup"), tag=FSX_TAGS),
    "aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation": ResourceActions(
        create=("fsx:CreateDataRepositoryAssociation", *FSX_S3_LINK),
        read=("fsx:DescribeDataRepositoryAssociations",), update=("fsx:UpdateDataRepositoryAssociation",),
        delete=("fsx:DeleteDataRepositoryAssociation",), tag=FSX_TAGS),
    # ---- identity
    "aws:iam/role:Role": ResourceActions(
        create=("iam:CreateRole",),
        read=("iam:GetRole", "iam:ListRolePolicies", "iam:GetRolePolicy", "iam:ListAttachedRolePolicies"),
        update=("iam:UpdateAssumeRolePolicy", "iam:UpdateRoleDescription", "iam:UpdateRole"),
        # The provider first takes the role out of any instance profile.
        delete=("iam:ListInstanceProfilesForRole", "iam:RemoveRoleFromInstanceProfile", "iam:DeleteRole"),
        tag=("iam:TagRole", "iam:UntagRole")),
    "aws:iam/rolePolicy:RolePolicy": ResourceActions(
        create=("iam:PutRolePolicy",), read=("iam:GetRolePolicy",), update=("iam:PutRolePolicy",),
        delete=("iam:DeleteRolePolicy",)),
    "aws:iam/rolePolicyAttachment:RolePolicyAttachment": ResourceActions(
        create=("iam:AttachRolePolicy",), read=("iam:ListAttachedRolePolicies",),
        delete=("iam:DetachRolePolicy",)),
    "aws:iam/instanceProfile:InstanceProfile": ResourceActions(
        # Adding a role to an instance profile passes the role.
        create=("iam:CreateInstanceProfile", "iam:AddRoleToInstanceProfile", "iam:PassRole"),
        read=("iam:GetInstanceProfile",),
        update=("iam:AddRoleToInstanceProfile", "iam:RemoveRoleFromInstanceProfile", "iam:PassRole"),
        delete=("iam:RemoveRoleFromInstanceProfile", "iam:DeleteInstanceProfile"),
        tag=("iam:TagInstanceProfile", "iam:UntagInstanceProfile")),
    "aws:ec2/keyPair:KeyPair": ResourceActions(
        create=("ec2:ImportKeyPair",), read=("ec2:DescribeKeyPairs",), delete=("ec2:DeleteKeyPair",),
        tag=EC2_TAGS),
    # ---- compute
    "aws:ec2/placementGroup:PlacementGroup": ResourceActions(
        create=("ec2:CreatePlacementGroup",), read=("ec2:DescribePlacementGroups",),
        delete=("ec2:DeletePlacementGroup",), tag=EC2_TAGS),
    "aws:ec2/capacityReservation:CapacityReservation": ResourceActions(
        create=("ec2:CreateCapacityReservation",), read=("ec2:DescribeCapacityReservations",),
        update=("ec2:ModifyCapacityReservation",), delete=("ec2:CancelCapacityReservation",),
        tag=EC2_TAGS),
    "aws:ec2/launchTemplate:LaunchTemplate": ResourceActions(
        create=("ec2:CreateLaunchTemplate",),
        read=("ec2:DescribeLaunchTemplates", "ec2:DescribeLaunchTemplateVersions"),
        # A changed template is a new version, made the default (update_default_version).
        update=("ec2:CreateLaunchTemplateVersion", "ec2:ModifyLaunchTemplate"),
        delete=("ec2:DeleteLaunchTemplate",), tag=EC2_TAGS),
    "aws:ec2/instance:Instance": ResourceActions(
        # RunInstances passes the node role (the instance profile); a first spot launch in the
        # account creates EC2's spot service-linked role.
        create=("ec2:RunInstances", "iam:PassRole", "iam:CreateServiceLinkedRole"),
        read=("ec2:DescribeInstances", "ec2:DescribeInstanceAttribute",
              "ec2:DescribeInstanceCreditSpecifications", "ec2:DescribeVolumes", "ec2:DescribeTags",
              "ec2:DescribeNetworkInterfaces", "ec2:DescribeInstanceTypes", "ec2:DescribeLaunchTemplates",
              "ec2:DescribeLaunchTemplateVersions"),
        update=("ec2:ModifyInstanceAttribute", "ec2:ModifyInstanceMetadataOptions",
                "ec2:ModifyInstanceCreditSpecification", "ec2:ModifyVolume",
                "ec2:ModifyNetworkInterfaceAttribute", "ec2:StopInstances", "ec2:StartInstances"),
        delete=("ec2:TerminateInstances",), tag=EC2_TAGS),
    # ---- expiry
    "aws:scheduler/scheduleGroup:ScheduleGroup": ResourceActions(
        create=("scheduler:CreateScheduleGroup",), read=("scheduler:GetScheduleGroup",),
        delete=("scheduler:DeleteScheduleGroup",), tag=SCHEDULER_TAGS),
    "aws:scheduler/schedule:Schedule": ResourceActions(
        # A schedule passes the expiry role to Scheduler on every create and update; its
        # dead-letter queue needs nothing more of the caller (the queue policy lets Scheduler in).
        create=("scheduler:CreateSchedule", "iam:PassRole"), read=("scheduler:GetSchedule",),
        update=("scheduler:UpdateSchedule", "iam:PassRole"), delete=("scheduler:DeleteSchedule",)),
    "aws:sqs/queue:Queue": ResourceActions(
        create=("sqs:CreateQueue",), read=("sqs:GetQueueAttributes", "sqs:ListQueueTags"),
        update=("sqs:SetQueueAttributes",), delete=("sqs:DeleteQueue",),
        tag=("sqs:TagQueue", "sqs:UntagQueue")),
    "aws:sqs/queuePolicy:QueuePolicy": ResourceActions(
        create=("sqs:SetQueueAttributes",), read=("sqs:GetQueueAttributes",),
        update=("sqs:SetQueueAttributes",), delete=("sqs:SetQueueAttributes",)),
}

# Invoke token -> the actions the provider calls to answer it.
LOOKUP_ACTIONS: dict[str, tuple[str, ...]] = {
    "aws:ssm/getParameter:getParameter": ("ssm:GetParameter",),
    "aws:ec2/getAmi:getAmi": ("ec2:DescribeImages",),
    "aws:index/getCallerIdentity:getCallerIdentity": ("sts:GetCallerIdentity",),
    "aws:index/getPartition:getPartition": (),  # answered from the provider's region
}

# What fsdpctl calls itself, with its own boto3 clients (fsdpctl/targets/aws/clients.py).
OPERATOR_CALLS: tuple[str, ...] = (
    # credentials and pre-flight (read-only)
    "sts:GetCallerIdentity", "ec2:DescribeInstanceTypes", "ec2:DescribeInstanceTypeOfferings",
    "ec2:DescribeInstances", "ec2:DescribeSpotInstanceRequests", "ec2:DescribeImages",
    "ec2:DescribeKeyPairs", "ec2:DescribeVpcs", "ec2:DescribeSubnets", "ec2:DescribeCapacityReservations",
    "ec2:DescribePlacementGroups", "servicequotas:GetServiceQuota",
    "servicequotas:GetAWSDefaultServiceQuota", "ssm:GetParameter", "s3:ListBucket",
    # the permission check itself (an assumed role is simulated as its role, read with GetRole)
    "iam:SimulatePrincipalPolicy", "iam:GetRole",
    # the teardown sweep: listings (IAM roles and profiles by name prefix, then their tags)
    "tag:GetResources", "ec2:DescribeAddresses", "ec2:DescribeNatGateways",
    "ec2:DescribeNetworkInterfaces", "ec2:DescribeVolumes", "ec2:DescribeLaunchTemplates",
    "ec2:DescribeSecurityGroups", "ec2:DescribeVpcEndpoints", "ec2:DescribeInternetGateways",
    "ec2:DescribeRouteTables", "fsx:DescribeFileSystems", "scheduler:GetScheduleGroup", "iam:ListRoles",
    "iam:ListInstanceProfiles", "iam:GetInstanceProfile", "iam:ListRolePolicies",
    "iam:ListAttachedRolePolicies", "s3:ListBucketVersions", "sqs:GetQueueUrl",
    # the teardown sweep: deletions
    "ec2:TerminateInstances", "ec2:CancelCapacityReservation", "fsx:DeleteFileSystem",
    "ec2:DeleteNatGateway", "ec2:ReleaseAddress", "ec2:DeleteVpcEndpoints", "ec2:DeleteNetworkInterface",
    "ec2:DeleteVolume", "ec2:DeleteLaunchTemplate", "ec2:DeletePlacementGroup", "ec2:DeleteKeyPair",
    "iam:RemoveRoleFromInstanceProfile", "iam:DeleteInstanceProfile", "iam:DeleteRolePolicy",
    "iam:DetachRolePolicy", "iam:DeleteRole", "ec2:RevokeSecurityGroupIngress",
    "ec2:RevokeSecurityGroupEgress", "ec2:DeleteSecurityGroup", "ec2:DetachInternetGateway",
    "ec2:DeleteInternetGateway", "ec2:DisassociateRouteTable", "ec2:DeleteRouteTable", "ec2:DeleteSubnet",
    "ec2:DeleteVpc", "scheduler:DeleteScheduleGroup", "s3:DeleteObject", "s3:DeleteObjectVersion",
    "s3:DeleteBucket", "sqs:DeleteQueue",
    # status and health: the expiry schedules' dead-letter queue (failed expiry calls)
    "sqs:GetQueueAttributes", "sqs:ReceiveMessage",
)


@dataclass(frozen=True)
class Scope:
    """Actions the policy grants more narrowly than on every resource: on the ARN patterns in
    `resources` (`{partition}`, `{account}` and `{cluster}` are filled in; `*` in a general policy),
    and, with a `condition_key`, only when the request's value of that key is one of
    `condition_values`."""

    sid: str
    actions: tuple[str, ...]
    resources: tuple[str, ...] = ("*",)
    condition_key: str | None = None
    condition_values: tuple[str, ...] = ()


ROLE_ARN = "arn:{partition}:iam::{account}:role/{cluster}"
SCOPES: tuple[Scope, ...] = (
    # Only the two roles the program creates (the node role, through its instance profile, and the
    # expiry schedules' role; Pulumi names them <cluster>-node-<suffix> and <cluster>-expiry-<suffix>)
    # may be passed to a service: never an existing, more powerful role.
    Scope("PassOnlyTheClustersRoles", ("iam:PassRole",),
          (f"{ROLE_ARN}-node-*", f"{ROLE_ARN}-expiry-*")),
    Scope("CreateOnlyTheseServiceLinkedRoles", ("iam:CreateServiceLinkedRole",),
          condition_key="iam:AWSServiceName", condition_values=SERVICE_LINKED_ROLE_SERVICES),
)
# Read-only metadata granted as one wildcard: it keeps the policy well under IAM's 6,144-character
# limit for a managed policy, and a provider release that reads one more EC2 attribute on refresh
# does not break `up`. Never a data read (s3:Get* would include GetObject; ssm:Get*, SecureString
# parameters): those stay listed one by one.
WILDCARDS = ("ec2:Describe*",)


def required_actions() -> tuple[str, ...]:
    """Every action fsdpctl and the provider may call, once each, sorted."""
    every = chain(OPERATOR_CALLS, *(r.actions for r in RESOURCE_ACTIONS.values()),
                  *LOOKUP_ACTIONS.values())
    return tuple(sorted(set(every)))


def _scoped_actions() -> set[str]:
    return {a for scope in SCOPES for a in scope.actions}


def _fill(pattern: str, cluster: str, partition: str, account: str) -> str:
    return pattern.format(cluster=cluster, partition=partition, account=account)


def _statement_id(service: str) -> str:
    return "".join(part.capitalize() for part in service.split("-"))


def policy_document(cluster: str = "*", partition: str = "*") -> dict:
    """The IAM policy (JSON-ready) that grants required_actions(): one statement per service on
    every resource, then the scoped statements. `cluster` narrows the scoped ones to one cluster's
    roles; the defaults fit any cluster in any partition (and the account is always `*`: the policy
    is written before anyone signs in)."""
    scoped = _scoped_actions()
    by_service: dict[str, set[str]] = {}
    for action in required_actions():
        if action in scoped:
            continue
        wildcard = next((w for w in WILDCARDS if fnmatch.fnmatchcase(action, w)), None)
        by_service.setdefault(action.split(":")[0], set()).add(wildcard or action)
    statements = [{"Sid": _statement_id(service), "Effect": "Allow", "Action": sorted(actions),
                   "Resource": "*"} for service, actions in sorted(by_service.items())]
    for scope in SCOPES:
        statement = {"Sid": scope.sid, "Effect": "Allow", "Action": list(scope.actions),
                     "Resource": [_fill(r, cluster, partition, "*") for r in scope.resources]
                     if scope.resources != ("*",) else "*"}
        if scope.condition_key:
            statement["Condition"] = {"StringEquals": {scope.condition_key: list(scope.condition_values)}}
        statements.append(statement)
    return {"Version": "2012-10-17", "Statement": statements}


def policy_json(cluster: str = "*", partition: str = "*") -> str:
    return json.dumps(policy_document(cluster, partition), indent=2)


@dataclass(frozen=True)
class SimulationRequest:
    """One iam:SimulatePrincipalPolicy call: these actions, on these resources (none: every
    resource), with one context key's value set (the condition a scoped statement tests)."""

    actions: tuple[str, ...]
    resource_arns: tuple[str, ...] = ()
    context_key: str | None = None
    context_value: str | None = None


def simulation_requests(cluster: str, partition: str, account: str) -> list[SimulationRequest]:
    """What pre-flight simulates for the caller: the unscoped actions on every resource, and each
    scoped action on the ARNs this cluster's requests will carry (a role's random name suffix is
    simulated as the pattern's `*`), once per condition value the program's requests can have."""
    scoped = _scoped_actions()
    requests = [SimulationRequest(tuple(a for a in required_actions() if a not in scoped))]
    for scope in SCOPES:
        resources = (() if scope.resources == ("*",)
                     else tuple(_fill(r, cluster, partition, account) for r in scope.resources))
        if scope.condition_key is None:
            requests.append(SimulationRequest(scope.actions, resources))
        else:
            requests += [SimulationRequest(scope.actions, resources, scope.condition_key, value)
                         for value in scope.condition_values]
    return requests

