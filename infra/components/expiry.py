"""The dead-man's switch: EventBridge Scheduler schedules that, at the cluster's expiry time, stop
everything that bills by the hour, on AWS's side, so a forgotten cluster stops billing even when
no operator machine is running.

One one-time schedule per action, each a Scheduler universal target (an AWS API call, no code):

- ec2:TerminateInstances: every node and the bastion (their EBS volumes are deleted on
  termination; the bastion's public IPv4 goes with it);
- ec2:CancelCapacityReservation: the all-or-nothing On-Demand Capacity Reservation (it bills
  whether or not instances run in it);
- ec2:DeleteNatGateway: the NAT gateway;
- fsx:DeleteFileSystem: the FSx for Lustre file system (no final backup), when there is one;
- ec2:ReleaseAddress: the NAT gateway's Elastic IP, an hour later (an address still associated
  with a NAT gateway that is being deleted cannot be released).

What stays: the checkpoint bucket (its lifecycle deletes every byte within retention_days), and
free resources (VPC, subnets, route tables, security groups, roles, the launch template, the
schedules). The Pulumi stack still lists what the schedules deleted: the next `fsdpctl up`
refreshes first, sees them gone and recreates them with a new expiry; `fsdpctl down` removes the
rest. The schedules' role may only act on resources tagged with this cluster.

Why Scheduler universal targets rather than a Lambda function or an SSM Automation runbook: no
code or runtime to deploy and patch, no extra service in the account's quota, each call scoped by
its own IAM statement, and each visible in the console as one schedule with its own retry policy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import pulumi
import pulumi_aws as aws

from infra.components.context import COMPONENT_PREFIX, ClusterContext, child_options
from infra.components.identity import assume_role_policy
from infra.spec import CLUSTER_TAG

# The Elastic IP is released this long after the NAT gateway's deletion started.
EIP_RELEASE_DELAY = timedelta(hours=1)
# A throttled or failed call is retried for an hour rather than silently dropped.
RETRY_POLICY = {"maximum_event_age_in_seconds": 3600, "maximum_retry_attempts": 10}


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


@dataclass
class BilledResources:
    """What the expiry stops: ids of the resources that bill by the hour."""

    instance_ids: list[pulumi.Input[str]] = field(default_factory=list)  # nodes and bastion
    nat_gateway_id: pulumi.Input[str] | None = None
    nat_allocation_id: pulumi.Input[str] | None = None
    file_system_id: pulumi.Input[str] | None = None
    capacity_reservation_id: pulumi.Input[str] | None = None  # the all-or-nothing reservation


def _statement(ctx: ClusterContext, sid: str, actions: list[str], service: str, resource: str) -> dict:
    return {
        "Sid": sid,
        "Effect": "Allow",
        "Action": actions if len(actions) > 1 else actions[0],
        "Resource": f"arn:{ctx.partition}:{service}:{ctx.spec.region}:*:{resource}",
        "Condition": {"StringEquals": {f"aws:ResourceTag/{CLUSTER_TAG}": ctx.spec.name}},
    }


def expiry_policy(ctx: ClusterContext, billed: BilledResources) -> str:
    """Only these calls, only on resources tagged with this cluster."""
    statements = [_statement(ctx, "TerminateThisClustersInstances", ["ec2:TerminateInstances"], "ec2",
                             "instance/*")]
    if billed.nat_gateway_id is not None:
        statements.append(_statement(ctx, "DeleteThisClustersNatGateway", ["ec2:DeleteNatGateway"], "ec2",
                                     "natgateway/*"))
        statements.append(_statement(ctx, "ReleaseThisClustersNatAddress", ["ec2:ReleaseAddress"], "ec2",
                                     "elastic-ip/*"))
    if billed.capacity_reservation_id is not None:
        statements.append(_statement(ctx, "CancelThisClustersReservation", ["ec2:CancelCapacityReservation"],
                                     "ec2", "capacity-reservation/*"))
    if billed.file_system_id is not None:
        statements.append(_statement(ctx, "DeleteThisClustersFileSystem",
                                     ["fsx:DeleteFileSystem", "fsx:DeleteDataRepositoryAssociation"],
                                     "fsx", "*"))
    return json.dumps({"Version": "2012-10-17", "Statement": statements})


class Expiry(pulumi.ComponentResource):
    schedule_names: list[str]

    def __init__(self, ctx: ClusterContext, expires_at: pulumi.Input[str], billed: BilledResources,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PREFIX}:Expiry", ctx.resource_name("expiry"), None, opts)
        child = child_options(self)
        name = ctx.spec.name
        group = aws.scheduler.ScheduleGroup(
            ctx.resource_name("expiry"), name=schedule_group_name(name), tags=ctx.tags, opts=child)
        role = aws.iam.Role(
            ctx.resource_name("expiry"),
            description=f"fsdp-cluster {name}: lets the expiry schedules stop the billed resources",
            assume_role_policy=assume_role_policy("scheduler.amazonaws.com"),
            tags=ctx.tags_named("expiry"), opts=child)
        policy = aws.iam.RolePolicy(ctx.resource_name("expiry-stop"), role=role.name,
                                    policy=expiry_policy(ctx, billed), opts=child)
        when = pulumi.Output.from_input(expires_at)
        self.schedule_names = []

        def schedule(suffix: str, what: str, service: str, action: str, payload: pulumi.Input[dict],
                     delay: timedelta = timedelta(0)) -> None:
            schedule_name = ctx.resource_name(suffix)
            self.schedule_names.append(schedule_name)
            aws.scheduler.Schedule(
                schedule_name,
                name=schedule_name,
                group_name=group.name,
                description=when.apply(lambda t: f"fsdp-cluster {name} expiry: {what} at {t}"
                                       + (f" + {delay}" if delay else "")),
                schedule_expression=when.apply(lambda t: at_expression(t, delay)),
                schedule_expression_timezone="UTC",
                flexible_time_window={"mode": "OFF"},
                target={
                    "arn": sdk_target(ctx, service, action),
                    "role_arn": role.arn,
                    "input": pulumi.Output.from_input(payload).apply(json.dumps),
                    "retry_policy": RETRY_POLICY,
                },
                opts=child_options(self, depends_on=[policy]))

        schedule("expiry", "terminate the nodes and the bastion", "ec2", "terminateInstances",
                 {"InstanceIds": pulumi.Output.all(*billed.instance_ids)})
        if billed.nat_gateway_id is not None:
            schedule("expiry-nat", "delete the NAT gateway", "ec2", "deleteNatGateway",
                     {"NatGatewayId": billed.nat_gateway_id})
            schedule("expiry-nat-ip", "release the NAT gateway's Elastic IP", "ec2", "releaseAddress",
                     {"AllocationId": billed.nat_allocation_id}, delay=EIP_RELEASE_DELAY)
        if billed.capacity_reservation_id is not None:
            # An unused reservation bills like a running instance: cancel it with the nodes.
            schedule("expiry-capacity", "cancel the capacity reservation", "ec2", "cancelCapacityReservation",
                     {"CapacityReservationId": billed.capacity_reservation_id})
        if billed.file_system_id is not None:
            schedule("expiry-fsx", "delete the FSx for Lustre file system", "fsx", "deleteFileSystem",
                     {"FileSystemId": billed.file_system_id,
                      "LustreConfiguration": {"SkipFinalBackup": True}})
        self.register_outputs({"schedule_group": group.name})
