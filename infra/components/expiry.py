"""The dead-man's switch: EventBridge Scheduler schedules that, at the cluster's expiry time, stop
everything that bills by the hour, on AWS's side, so a forgotten cluster stops billing even when
no operator machine is running.

One one-time schedule per action, each a Scheduler universal target (an AWS API call, no code):

- ec2:TerminateInstances: one schedule per node and one for the bastion (their EBS volumes are
  deleted on termination; the bastion's public IPv4 goes with it). One call per instance because
  EC2 refuses a whole call when one of its ids is gone (a spot interruption, a reclaimed Capacity
  Block node, a `replace` whose update failed after the old node was terminated), and a single
  call for all would then leave every other node billing;
- ec2:CancelCapacityReservation: the all-or-nothing On-Demand Capacity Reservation (it bills
  whether or not instances run in it);
- ec2:DeleteNatGateway: the NAT gateway;
- fsx:DeleteFileSystem: the FSx for Lustre file system, with or without a final backup, unless
  `storage.fsx.at_expiry` keeps it;
- ec2:ReleaseAddress: the NAT gateway's Elastic IP, an hour later (an address still associated
  with a NAT gateway that is being deleted cannot be released).

A call that still fails after the retry policy goes to the schedules' dead-letter queue (SQS,
encrypted), where `fsdpctl status` reports it: nothing fails silently.

Order (see Compute): a schedule needs the id of what it stops, so it follows its resource; and
since Pulumi starts no new step after a failed one, GPU capacity, the step that fails
(InsufficientInstanceCapacity), is bought only once everything else billed has its schedule: the
NAT gateway, its address, the file system and the bastion before the reservation, the reservation
before the nodes, each node right after itself.

What stays: the checkpoint bucket (its lifecycle deletes every byte within retention_days), and
free resources (VPC, subnets, route tables, security groups, roles, the launch template, the
schedules, the queue). The Pulumi stack still lists what the schedules deleted: the next
`fsdpctl up` refreshes first, sees them gone and recreates them with a new expiry; `fsdpctl down`
removes the rest. The schedules' role may only act on resources tagged with this cluster.

Why Scheduler universal targets rather than a Lambda function or an SSM Automation runbook: no
code or runtime to deploy and patch, no extra service in the account's quota, each call scoped by
its own IAM statement, and each visible in the console as one schedule with its own retry policy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta

import pulumi
import pulumi_aws as aws

from infra.components.context import COMPONENT_PREFIX, ClusterContext, child_options
from infra.components.identity import assume_role_policy, tagged_statement
from infra.spec import FINAL_BACKUP_TAG, FsxAtExpiry

# The Elastic IP is released this long after the NAT gateway's deletion started.
EIP_RELEASE_DELAY = timedelta(hours=1)
# A throttled or failed call is retried for an hour, then handed to the dead-letter queue.
RETRY_POLICY = {"maximum_event_age_in_seconds": 3600, "maximum_retry_attempts": 10}
# How long a failed call waits in the dead-letter queue for `fsdpctl status` (SQS's longest).
DEAD_LETTER_RETENTION = timedelta(days=14)


def sdk_target(ctx: ClusterContext, service: str, action: str) -> str:
    """A Scheduler universal target (arn:<partition>:scheduler:::aws-sdk:<service>:<action>)."""
    return f"arn:{ctx.partition}:scheduler:::aws-sdk:{service}:{action}"


def schedule_group_name(cluster_name: str) -> str:
    return f"fsdp-cluster-{cluster_name}"


def parse_utc(expires_at: str) -> datetime:
    return datetime.fromisoformat(expires_at.replace("Z", "+00:00"))


def at_expression(expires_at: str, delay: timedelta = timedelta(0)) -> str:
    """A one-time Scheduler expression, e.g. at(2026-12-03T13:00:00) (its time zone is separate)."""
    return f"at({(parse_utc(expires_at) + delay).strftime('%Y-%m-%dT%H:%M:%S')})"


def expiry_policy(ctx: ClusterContext, queue_arn: str) -> str:
    """Only the calls the spec's schedules make, only on resources tagged with this cluster, and
    the dead letters of the ones that fail (Scheduler sends them with the schedule's role)."""
    spec = ctx.spec
    statements = [tagged_statement(ctx, "TerminateThisClustersInstances", ["ec2:TerminateInstances"],
                                   "ec2", "instance/*")]
    if spec.network.creates_vpc:
        statements.append(tagged_statement(ctx, "DeleteThisClustersNatGateway", ["ec2:DeleteNatGateway"],
                                           "ec2", "natgateway/*"))
        statements.append(tagged_statement(ctx, "ReleaseThisClustersNatAddress", ["ec2:ReleaseAddress"],
                                           "ec2", "elastic-ip/*"))
    if spec.capacity.reserves_on_demand:
        statements.append(tagged_statement(ctx, "CancelThisClustersReservation",
                                           ["ec2:CancelCapacityReservation"], "ec2",
                                           "capacity-reservation/*"))
    fsx = spec.storage.fsx
    if fsx.enabled and fsx.at_expiry is not FsxAtExpiry.KEEP:
        backup = fsx.at_expiry is FsxAtExpiry.BACKUP
        actions = ["fsx:DeleteFileSystem", "fsx:DeleteDataRepositoryAssociation"]
        statements.append(tagged_statement(ctx, "DeleteThisClustersFileSystem",
                                           [*actions, "fsx:CreateBackup"] if backup else actions, "fsx", "*"))
        if backup:
            # The final backup does not exist yet, so it has no tag a condition could check.
            statements.append({"Sid": "CreateTheFinalBackup", "Effect": "Allow",
                               "Action": ["fsx:CreateBackup", "fsx:TagResource"],
                               "Resource": f"arn:{ctx.partition}:fsx:{spec.region}:*:backup/*"})
    statements.append({"Sid": "ReportFailedCalls", "Effect": "Allow", "Action": "sqs:SendMessage",
                       "Resource": queue_arn})
    return json.dumps({"Version": "2012-10-17", "Statement": statements})


@dataclass
class BilledResources:
    """What the expiry stops besides the instances and the reservation (whose schedules Compute
    adds as it creates them): ids of the resources that bill by the hour, None where there is none."""

    nat_gateway_id: pulumi.Input[str] | None = None
    nat_allocation_id: pulumi.Input[str] | None = None
    file_system_id: pulumi.Input[str] | None = None


class Expiry(pulumi.ComponentResource):
    # Every schedule made so far: what must exist before GPU capacity is bought.
    schedules: list[aws.scheduler.Schedule]
    queue_url: pulumi.Output[str]

    def __init__(self, ctx: ClusterContext, expires_at: pulumi.Input[str], billed: BilledResources,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PREFIX}:Expiry", ctx.resource_name("expiry"), None, opts)
        self._ctx = ctx
        child = child_options(self)
        name = ctx.spec.name
        self._group = aws.scheduler.ScheduleGroup(
            ctx.resource_name("expiry"), name=schedule_group_name(name), tags=ctx.tags, opts=child)
        # Standard, not FIFO (Scheduler refuses a FIFO dead-letter queue); auto-named, so a new
        # cluster of the same name does not wait out SQS's 60 s before a deleted name is free.
        queue = aws.sqs.Queue(
            ctx.resource_name("expiry-failures"),
            sqs_managed_sse_enabled=True,
            message_retention_seconds=int(DEAD_LETTER_RETENTION.total_seconds()),
            tags=ctx.tags_named("expiry-failures"), opts=child)
        self._queue_arn = queue.arn
        self.queue_url = queue.url
        self._role = aws.iam.Role(
            ctx.resource_name("expiry"),
            description=f"fsdp-cluster {name}: lets the expiry schedules stop the billed resources",
            assume_role_policy=assume_role_policy("scheduler.amazonaws.com"),
            tags=ctx.tags_named("expiry"), opts=child)
        self._policy = aws.iam.RolePolicy(ctx.resource_name("expiry-stop"), role=self._role.name,
                                          policy=queue.arn.apply(lambda arn: expiry_policy(ctx, arn)),
                                          opts=child)
        self._when = pulumi.Output.from_input(expires_at)
        self.schedules = []
        if billed.nat_gateway_id is not None:
            self._schedule("expiry-nat", "delete the NAT gateway", "ec2", "deleteNatGateway",
                           {"NatGatewayId": billed.nat_gateway_id})
            self._schedule("expiry-nat-ip", "release the NAT gateway's Elastic IP", "ec2", "releaseAddress",
                           {"AllocationId": billed.nat_allocation_id}, delay=EIP_RELEASE_DELAY)
        if billed.file_system_id is not None:
            self._file_system(billed.file_system_id)
        self.register_outputs({"schedule_group": self._group.name, "queue_url": self.queue_url})

    def terminate(self, label: str, instance_id: pulumi.Input[str]) -> None:
        """Terminate one instance (`label`: node0, bastion) at the expiry, with a call of its own."""
        self._schedule(f"expiry-{label}", f"terminate {label}", "ec2", "terminateInstances",
                       {"InstanceIds": [instance_id]})

    def cancel_reservation(self, reservation_id: pulumi.Input[str]) -> None:
        # An unused reservation bills like a running instance: cancel it with the nodes.
        self._schedule("expiry-capacity", "cancel the capacity reservation", "ec2",
                       "cancelCapacityReservation", {"CapacityReservationId": reservation_id})

    def _file_system(self, file_system_id: pulumi.Input[str]) -> None:
        at_expiry = self._ctx.spec.storage.fsx.at_expiry
        if at_expiry is FsxAtExpiry.KEEP:
            return
        lustre: dict = {"SkipFinalBackup": at_expiry is FsxAtExpiry.DELETE}
        if at_expiry is FsxAtExpiry.BACKUP:
            lustre["FinalBackupTags"] = [{"Key": FINAL_BACKUP_TAG, "Value": self._ctx.spec.name},
                                         {"Key": "Name", "Value": self._ctx.resource_name("fsx-final")}]
        self._schedule("expiry-fsx", f"delete the FSx for Lustre file system ({at_expiry.value})", "fsx",
                       "deleteFileSystem", {"FileSystemId": file_system_id, "LustreConfiguration": lustre})

    def _schedule(self, suffix: str, what: str, service: str, action: str, payload: pulumi.Input[dict],
                  delay: timedelta = timedelta(0)) -> None:
        ctx, name, when = self._ctx, self._ctx.spec.name, self._when
        schedule_name = ctx.resource_name(suffix)
        self.schedules.append(aws.scheduler.Schedule(
            schedule_name,
            name=schedule_name,
            group_name=self._group.name,
            description=when.apply(lambda t: f"fsdp-cluster {name} expiry: {what} at {t}"
                                   + (f" + {delay}" if delay else "")),
            schedule_expression=when.apply(lambda t: at_expression(t, delay)),
            schedule_expression_timezone="UTC",
            flexible_time_window={"mode": "OFF"},
            target={
                "arn": sdk_target(ctx, service, action),
                "role_arn": self._role.arn,
                "input": pulumi.Output.from_input(payload).apply(json.dumps),
                "retry_policy": RETRY_POLICY,
                "dead_letter_config": {"arn": self._queue_arn},
            },
            opts=child_options(self, depends_on=[self._policy])))
