"""Who the nodes are to AWS: the node role and instance profile, the controller's when the cluster
powers nodes down, and the SSH key pair.

Least privilege: Session Manager (the AWS managed AmazonSSMManagedInstanceCore policy) and
read/write on this cluster's checkpoint bucket only; no s3:* and no wildcard bucket. With power
saving (spec `scaling`), the controller (rank 0) gets a role of its own with the same policies plus
starting and stopping this cluster's nodes that may be powered down, and no other instance.
"""

from __future__ import annotations

import json

import pulumi
import pulumi_aws as aws

from infra.components.context import COMPONENT_PREFIX, ClusterContext, child_options
from infra.spec import CLUSTER_TAG, RANK_TAG

SSM_CORE_POLICY = "AmazonSSMManagedInstanceCore"
CHECKPOINT_OBJECT_ACTIONS = [
    "s3:GetObject",
    "s3:PutObject",
    "s3:DeleteObject",
    "s3:AbortMultipartUpload",
    "s3:ListMultipartUploadParts",
]
CHECKPOINT_BUCKET_ACTIONS = ["s3:ListBucket", "s3:GetBucketLocation", "s3:ListBucketMultipartUploads"]
# What Slurm's resume and suspend programs on the controller call (docs/aws.md, "Elastic clusters").
POWER_ACTIONS = ["ec2:StartInstances", "ec2:StopInstances"]
# The node role and the controller's. Both names start with `<cluster>-node-` once Pulumi has added
# its suffix: the only roles the operator's policy lets `up` pass to EC2 (fsdpctl/targets/aws/permissions.py).
NODE_ROLE = "node"
CONTROLLER_ROLE = "node-controller"


def assume_role_policy(service: str) -> str:
    return json.dumps({
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"}],
    })


def checkpoint_bucket_policy(bucket_arn: str) -> str:
    return json.dumps({
        "Version": "2012-10-17",
        "Statement": [
            {"Sid": "CheckpointBucket", "Effect": "Allow", "Action": CHECKPOINT_BUCKET_ACTIONS,
             "Resource": bucket_arn},
            {"Sid": "CheckpointObjects", "Effect": "Allow", "Action": CHECKPOINT_OBJECT_ACTIONS,
             "Resource": f"{bucket_arn}/*"},
        ],
    })


def tagged_statement(ctx: ClusterContext, sid: str, actions: list[str], service: str, resource: str,
                     more_tags: dict[str, list[str]] | None = None) -> dict:
    """Allow `actions` on `service` resources of the cluster's region that carry its cluster tag and
    each tag of `more_tags` with one of its values."""
    tags: dict[str, str | list[str]] = {CLUSTER_TAG: ctx.spec.name, **(more_tags or {})}
    return {
        "Sid": sid,
        "Effect": "Allow",
        "Action": actions if len(actions) > 1 else actions[0],
        "Resource": f"arn:{ctx.partition}:{service}:{ctx.spec.region}:*:{resource}",
        "Condition": {"StringEquals": {f"aws:ResourceTag/{key}": value for key, value in tags.items()}},
    }


def power_policy(ctx: ClusterContext) -> str:
    """Start and stop only this cluster's nodes that Slurm may power down (ranks static_node_count
    and up, by their rank tag, which the nodes' own roles cannot change), and see instance states
    (ec2:DescribeInstances takes no resource-level condition)."""
    spec = ctx.spec
    powered = [str(rank) for rank in range(spec.static_node_count, spec.node_count)]
    return json.dumps({"Version": "2012-10-17", "Statement": [
        tagged_statement(ctx, "StartAndStopThisClustersPoweredNodes", POWER_ACTIONS, "ec2", "instance/*",
                         {RANK_TAG: powered}),
        {"Sid": "ReadInstanceStates", "Effect": "Allow", "Action": "ec2:DescribeInstances", "Resource": "*"},
    ]})


class Identity(pulumi.ComponentResource):
    instance_profile_arn: pulumi.Output[str]
    # The controller's (rank 0) instance profile when the cluster powers nodes down, else None (rank 0
    # takes the launch template's, like every node).
    controller_instance_profile_name: pulumi.Output[str] | None
    # The key pair nodes and bastion accept: imported, named by the user, or None (SSM only).
    key_name: pulumi.Output[str] | None

    def __init__(self, ctx: ClusterContext, checkpoint_bucket_arn: pulumi.Input[str],
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PREFIX}:Identity", ctx.resource_name("identity"), None, opts)
        spec, child = ctx.spec, child_options(self)
        profile = self._instance_profile(ctx, NODE_ROLE, "GPU nodes", checkpoint_bucket_arn)
        self.instance_profile_arn = profile.arn
        self.controller_instance_profile_name = None
        if spec.power_saving:
            controller = self._instance_profile(
                ctx, CONTROLLER_ROLE, "the controller (rank 0), which starts and stops idle nodes",
                checkpoint_bucket_arn, power_policy(ctx))
            self.controller_instance_profile_name = controller.name

        self.key_name = None
        if spec.access.public_key:
            key = aws.ec2.KeyPair(
                ctx.resource_name("key"), key_name=ctx.resource_name("key"),
                public_key=spec.access.public_key, tags=ctx.tags_named("key"), opts=child)
            self.key_name = key.key_name
        elif spec.access.key_name:
            self.key_name = pulumi.Output.from_input(spec.access.key_name)
        self.register_outputs({"instance_profile_arn": profile.arn})

    def _instance_profile(self, ctx: ClusterContext, role_name: str, who: str,
                          checkpoint_bucket_arn: pulumi.Input[str],
                          power: str | None = None) -> aws.iam.InstanceProfile:
        """A role for nodes (Session Manager, the checkpoint bucket and, given `power`, that policy
        too) and its instance profile, both named `<cluster>-<role_name>`."""
        child = child_options(self)
        role = aws.iam.Role(
            ctx.resource_name(role_name), description=f"fsdp-cluster {ctx.spec.name}: {who}",
            assume_role_policy=assume_role_policy("ec2.amazonaws.com"), tags=ctx.tags_named(role_name),
            opts=child)
        aws.iam.RolePolicyAttachment(
            ctx.resource_name(f"{role_name}-ssm"), role=role.name,
            policy_arn=f"arn:{ctx.partition}:iam::aws:policy/{SSM_CORE_POLICY}", opts=child)
        aws.iam.RolePolicy(
            ctx.resource_name(f"{role_name}-checkpoints"), role=role.name,
            policy=pulumi.Output.from_input(checkpoint_bucket_arn).apply(checkpoint_bucket_policy),
            opts=child)
        if power is not None:
            aws.iam.RolePolicy(ctx.resource_name(f"{role_name}-power"), role=role.name, policy=power,
                               opts=child)
        return aws.iam.InstanceProfile(
            ctx.resource_name(role_name), role=role.name, tags=ctx.tags_named(role_name), opts=child)
