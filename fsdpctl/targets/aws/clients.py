"""The boto3 clients the AWS operations use, bundled so checks and the sweep take one argument.

Clients are created on first use from one session (the spec's region). Tests build the bundle on a
moto session and swap in a botocore-stubbed client where moto lacks a call.
"""

from __future__ import annotations

from functools import cached_property

import boto3
import botocore.exceptions
import botocore.session

from fsdpctl.errors import UsageError
from infra.spec import ClusterSpec

CREDENTIALS_FIX = (
    "configure credentials: `aws configure`, `aws sso login --profile NAME` with AWS_PROFILE=NAME, or "
    "export AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (see docs/aws.md)"
)


class AwsClients:
    def __init__(self, session: boto3.Session):
        self.session = session
        self.region = session.region_name

    @classmethod
    def for_spec(cls, spec: ClusterSpec) -> AwsClients:
        """A bundle for the spec's region with verified credentials, or one UsageError saying how
        to provide them (not one error per check)."""
        try:
            session = boto3.Session(region_name=spec.region)
            credentials = session.get_credentials()
        except botocore.exceptions.ProfileNotFound as e:
            raise UsageError(unknown_profile(e.kwargs.get("profile"))) from None
        except botocore.exceptions.BotoCoreError as e:  # an SSO token expired, a credential process failed
            raise UsageError(f"could not load AWS credentials ({e}); {CREDENTIALS_FIX}") from None
        if credentials is None:
            raise UsageError(f"no AWS credentials found for region {spec.region}; {CREDENTIALS_FIX}")
        clients = cls(session)
        try:
            clients.sts.get_caller_identity()
        except botocore.exceptions.ClientError as e:
            err = e.response.get("Error", {})
            raise UsageError(f"AWS rejected the credentials ({err.get('Code')}: {err.get('Message')}); "
                               f"{CREDENTIALS_FIX}") from None
        except botocore.exceptions.BotoCoreError as e:
            raise UsageError(f"could not verify AWS credentials: {e}; {CREDENTIALS_FIX}") from None
        return clients

    def _client(self, service: str):
        return self.session.client(service, region_name=self.region)

    @cached_property
    def sts(self):
        return self._client("sts")

    @cached_property
    def ec2(self):
        return self._client("ec2")

    @cached_property
    def ssm(self):
        return self._client("ssm")

    @cached_property
    def s3(self):
        return self._client("s3")

    @cached_property
    def service_quotas(self):
        return self._client("service-quotas")

    @cached_property
    def fsx(self):
        return self._client("fsx")

    @cached_property
    def scheduler(self):
        return self._client("scheduler")

    @cached_property
    def iam(self):
        return self._client("iam")

    @cached_property
    def sqs(self):
        return self._client("sqs")

    @cached_property
    def tagging(self):
        return self._client("resourcegroupstaggingapi")


def unknown_profile(profile: str | None) -> str:
    """The error for an AWS profile (AWS_PROFILE) that no config or credentials file defines, with the
    profiles that are defined."""
    known = sorted(botocore.session.Session().available_profiles)
    return (f"AWS_PROFILE={profile!r} names no profile in ~/.aws/config or ~/.aws/credentials (or "
            f"AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE); profiles there: {', '.join(known) or 'none'}. "
            f"Fix: set AWS_PROFILE to one of them, or unset it, or create it with `aws configure --profile "
            f"{profile}`")


def error_code(e: botocore.exceptions.ClientError) -> str:
    return e.response.get("Error", {}).get("Code", "")


def error_text(e: Exception) -> str:
    if isinstance(e, botocore.exceptions.ClientError):
        err = e.response.get("Error", {})
        return f"{err.get('Code')}: {err.get('Message')}"
    return f"{type(e).__name__}: {e}"
