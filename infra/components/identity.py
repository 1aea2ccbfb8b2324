"""Who the nodes are to AWS: the node role and instance profile, and the SSH key pair.

Least privilege: Session Manager (the AWS managed AmazonSSMManagedInstanceCore policy) and
read/write on this cluster's checkpoint bucket only; no s3:* and no wildcard bucket.
"""

from __future__ import annotations

import json

import pulumi
import pulumi_aws as aws

from infra.components.context import COMPONENT_PREFIX, ClusterContext, child_options

SSM_CORE_POLICY = "AmazonSSMManagedInstanceCore"
CHECKPOINT_OBJECT_ACTIONS = [
    "s3:GetObject",
    "s3:PutObject",
    "s3:DeleteObject",
    "s3:AbortMultipartUpload",
    "s3:ListMultipartUploadParts",
]
CHECKPOINT_BUCKET_ACTIONS = ["s3:ListBucket", "s3:GetBucketLocation", "s3:ListBucketMultipartUploads"]


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


class Identity(pulumi.ComponentResource):
    instance_profile_arn: pulumi.Output[str]
    # The key pair nodes and bastion accept: imported, named by the user, or None (SSM only).
    key_name: pulumi.Output[str] | None

    def __init__(self, ctx: ClusterContext, checkpoint_bucket_arn: pulumi.Input[str],
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PREFIX}:Identity", ctx.resource_name("identity"), None, opts)
        spec, child = ctx.spec, child_options(self)
        role = aws.iam.Role(
            ctx.resource_name("node"), description=f"fsdp-cluster {spec.name}: GPU nodes",
            assume_role_policy=assume_role_policy("ec2.amazonaws.com"), tags=ctx.tags_named("node"),
            opts=child)
        aws.iam.RolePolicyAttachment(
            ctx.resource_name("node-ssm"), role=role.name,
            policy_arn=f"arn:{ctx.partition}:iam::aws:policy/{SSM_CORE_POLICY}", opts=child)
        aws.iam.RolePolicy(
            ctx.resource_name("node-checkpoints"), role=role.name,
            policy=pulumi.Output.from_input(checkpoint_bucket_arn).apply(checkpoint_bucket_policy),
            opts=child)
        profile = aws.iam.InstanceProfile(
            ctx.resource_name("node"), role=role.name, tags=ctx.tags_named("node"), opts=child)
        self.instance_profile_arn = profile.arn

        self.key_name = None
        if spec.access.public_key:
            key = aws.ec2.KeyPair(
                ctx.resource_name("key"), key_name=ctx.resource_name("key"),
                public_key=spec.access.public_key, tags=ctx.tags_named("key"), opts=child)
            self.key_name = key.key_name
        elif spec.access.key_name:
            self.key_name = pulumi.Output.from_input(spec.access.key_name)
        self.register_outputs({"instance_profile_arn": profile.arn})
