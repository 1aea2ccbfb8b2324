"""The dead-man's switch: an EventBridge Scheduler schedule that terminates the nodes at the
cluster's expiry time, on AWS's side, so a forgotten cluster stops billing even when no operator
machine is running. Its role may terminate only instances tagged with this cluster.
"""

from __future__ import annotations

import json
from datetime import datetime

import pulumi
import pulumi_aws as aws

from infra.components.context import COMPONENT_PREFIX, ClusterContext, child_options
from infra.components.identity import assume_role_policy
from infra.spec import CLUSTER_TAG


def sdk_target(ctx: ClusterContext, service: str, action: str) -> str:
    """A Scheduler universal target (arn:<partition>:scheduler:::aws-sdk:<service>:<action>)."""
    return f"arn:{ctx.partition}:scheduler:::aws-sdk:{service}:{action}"


def schedule_group_name(cluster_name: str) -> str:
    return f"fsdp-cluster-{cluster_name}"


def at_expression(expires_at: datetime) -> str:
    """A one-time Scheduler expression, e.g. at(2026-12-03T13:00:00) (its time zone is separate)."""
    return f"at({expires_at.strftime('%Y-%m-%dT%H:%M:%S')})"


def terminate_policy(ctx: ClusterContext) -> str:
    return json.dumps({
        "Version": "2012-10-17",
        "Statement": [{
            "Sid": "TerminateThisClusterOnly",
            "Effect": "Allow",
            "Action": "ec2:TerminateInstances",
            "Resource": f"arn:{ctx.partition}:ec2:{ctx.spec.region}:*:instance/*",
            "Condition": {"StringEquals": {f"aws:ResourceTag/{CLUSTER_TAG}": ctx.spec.name}},
        }],
    })


class Expiry(pulumi.ComponentResource):
    def __init__(self, ctx: ClusterContext, expires_at: datetime, instance_ids: list[pulumi.Input[str]],
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PREFIX}:Expiry", ctx.resource_name("expiry"), None, opts)
        child = child_options(self)
        group = aws.scheduler.ScheduleGroup(
            ctx.resource_name("expiry"), name=schedule_group_name(ctx.spec.name), tags=ctx.tags,
            opts=child)
        role = aws.iam.Role(
            ctx.resource_name("expiry"),
            description=f"fsdp-cluster {ctx.spec.name}: lets the expiry schedule terminate the nodes",
            assume_role_policy=assume_role_policy("scheduler.amazonaws.com"),
            tags=ctx.tags_named("expiry"), opts=child)
        policy = aws.iam.RolePolicy(ctx.resource_name("expiry-terminate"), role=role.name,
                                    policy=terminate_policy(ctx), opts=child)
        aws.scheduler.Schedule(
            ctx.resource_name("expiry"),
            name=ctx.resource_name("expiry"),
            group_name=group.name,
            description=f"Terminate the nodes of fsdp-cluster {ctx.spec.name} at {ctx.expires_at}",
            schedule_expression=at_expression(expires_at),
            schedule_expression_timezone="UTC",
            flexible_time_window={"mode": "OFF"},
            target={
                "arn": sdk_target(ctx, "ec2", "terminateInstances"),
                "role_arn": role.arn,
                "input": pulumi.Output.all(*instance_ids).apply(
                    lambda ids: json.dumps({"InstanceIds": list(ids)})),
                # A throttled or failed call is retried for an hour rather than silently dropped.
                "retry_policy": {"maximum_event_age_in_seconds": 3600, "maximum_retry_attempts": 10},
            },
            opts=child_options(self, depends_on=[policy]))
        self.register_outputs({"schedule_group": group.name})
