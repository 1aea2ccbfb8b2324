"""What every component needs to know besides its own inputs: the spec, the expiry time, the tags
and the explicit AWS provider (pinned to the spec's region, so `aws:region` can never disagree)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_aws as aws

from infra.spec import EXPIRES_TAG, ClusterSpec

COMPONENT_PREFIX = "fsdp-cluster:index"
# The expires-at tag on a cluster created with expiry_hours: null.
NO_EXPIRY = "never"


def aws_partition(region: str) -> str:
    """The ARN partition of a region (arn:aws:..., arn:aws-us-gov:..., arn:aws-cn:...)."""
    if region.startswith("us-gov-"):
        return "aws-us-gov"
    if region.startswith("cn-"):
        return "aws-cn"
    if region.startswith("us-iso-"):
        return "aws-iso"
    if region.startswith("us-isob-"):
        return "aws-iso-b"
    return "aws"


@dataclass(frozen=True)
class ClusterContext:
    spec: ClusterSpec
    # ISO 8601 UTC time the expiry schedule terminates the nodes; None when expiry is disabled.
    expires_at: str | None
    provider: aws.Provider = field(repr=False)

    @property
    def tags(self) -> dict[str, str]:
        """Tags for every taggable resource: the sweep finds leftovers by the cluster tag."""
        return {**self.spec.base_tags(), EXPIRES_TAG: self.expires_at or NO_EXPIRY}

    def tags_named(self, suffix: str, **extra: str) -> dict[str, str]:
        """The cluster tags plus a console-friendly Name."""
        return {**self.tags, "Name": self.resource_name(suffix), **extra}

    def resource_name(self, suffix: str) -> str:
        return f"{self.spec.name}-{suffix}"

    @property
    def partition(self) -> str:
        return aws_partition(self.spec.region)

    def invoke_options(self) -> pulumi.InvokeOptions:
        return pulumi.InvokeOptions(provider=self.provider)


def child_options(parent: pulumi.Resource, **kwargs: Any) -> pulumi.ResourceOptions:
    return pulumi.ResourceOptions(parent=parent, **kwargs)
