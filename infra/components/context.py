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


@dataclass(frozen=True)
class ClusterContext:
    spec: ClusterSpec
    # ISO 8601 UTC time the expiry schedules stop the billed resources (a plain value from the
    # stack config, or the program's clock resource); None when expiry is disabled.
    expires_at: pulumi.Input[str] | None
    provider: aws.Provider = field(repr=False)
    # The ARN partition (aws, aws-us-gov, aws-cn, ...) and the reverse DNS prefix of service names
    # (com.amazonaws, cn.com.amazonaws), from aws.get_partition for the provider's region: never a
    # hard-coded arn:aws.
    partition: str = "aws"
    reverse_dns_prefix: str = "com.amazonaws"

    @property
    def tags(self) -> dict[str, str]:
        """Tags for every taggable resource: the sweep finds leftovers by the cluster tag."""
        return {**self.spec.base_tags(), EXPIRES_TAG: self.expires_at or NO_EXPIRY}

    def tags_named(self, suffix: str, **extra: str) -> dict[str, str]:
        """The cluster tags plus a console-friendly Name."""
        return {**self.tags, "Name": self.resource_name(suffix), **extra}

    def resource_name(self, suffix: str) -> str:
        return f"{self.spec.name}-{suffix}"

    def invoke_options(self) -> pulumi.InvokeOptions:
        return pulumi.InvokeOptions(provider=self.provider)


def child_options(parent: pulumi.Resource, **kwargs: Any) -> pulumi.ResourceOptions:
    return pulumi.ResourceOptions(parent=parent, **kwargs)
