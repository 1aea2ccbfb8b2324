"""Shared storage: the checkpoint bucket and the optional FSx for Lustre file system.

The bucket deletes every byte within `checkpoint_bucket.retention_days` (the guide's 7-day rule),
whatever time of day it was written: S3 rounds each lifecycle step up to the next midnight UTC, so a
checkpoint is current for retention_days - 3 days, then a noncurrent version for 1 day, each step up
to a day longer, then gone; expired delete markers and incomplete multipart uploads are removed too,
so versioning cannot keep anything alive longer.
Node-local scratch (the NVMe instance store as RAID0) needs no resource: the Ansible role builds it.
"""

from __future__ import annotations

import pulumi
import pulumi_aws as aws

from infra.components.context import COMPONENT_PREFIX, ClusterContext, child_options

# S3 bucket_prefix is at most 37 characters; AWS appends a unique suffix.
_BUCKET_PREFIX_MAX = 37
# Lustre version with PERSISTENT_2 and data repository associations.
LUSTRE_VERSION = "2.15"


# S3 adds a lifecycle step's days to when it starts and rounds up to the next midnight UTC: a step
# keeps a byte up to a day longer than its count. Both steps of the rule do: the expiration of the
# current version adds a delete marker some time on the day it falls due, and the noncurrent count
# starts then, not at midnight.
S3_ROUNDING_DAYS = 1
NONCURRENT_DAYS = 1
# 1 day current (S3's minimum) + NONCURRENT_DAYS, each rounded: the spec refuses less.
MIN_RETENTION_DAYS = 1 + NONCURRENT_DAYS + 2 * S3_ROUNDING_DAYS


def lifecycle_days(retention_days: int) -> tuple[int, int]:
    """(days as the current version, days as a noncurrent version) so that every byte is deleted
    within retention_days of being written, at whatever time of day (longest_kept_days of the
    result is retention_days). retention_days is at least MIN_RETENTION_DAYS."""
    return retention_days - NONCURRENT_DAYS - 2 * S3_ROUNDING_DAYS, NONCURRENT_DAYS


def longest_kept_days(current_days: int, noncurrent_days: int) -> int:
    """The most days a rule of current + noncurrent days keeps a byte, S3's rounding included."""
    return current_days + noncurrent_days + 2 * S3_ROUNDING_DAYS


def bucket_prefix(cluster_name: str) -> str:
    return f"{cluster_name}-checkpoints-"[:_BUCKET_PREFIX_MAX]


class Storage(pulumi.ComponentResource):
    bucket_name: pulumi.Output[str]
    bucket_arn: pulumi.Output[str]
    fsx_dns_name: pulumi.Output[str] | None
    fsx_mount_name: pulumi.Output[str] | None
    fsx_id: pulumi.Output[str] | None

    def __init__(self, ctx: ClusterContext, private_subnet_id: pulumi.Input[str],
                 security_group_id: pulumi.Input[str], opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PREFIX}:Storage", ctx.resource_name("storage"), None, opts)
        self._checkpoint_bucket(ctx)
        self.fsx_dns_name = self.fsx_mount_name = self.fsx_id = None
        if ctx.spec.storage.fsx.enabled:
            self._lustre(ctx, private_subnet_id, security_group_id)
        self.register_outputs({"bucket_name": self.bucket_name})

    def _checkpoint_bucket(self, ctx: ClusterContext) -> None:
        spec = ctx.spec
        days = spec.checkpoint_bucket.retention_days
        name_args = ({"bucket": spec.checkpoint_bucket.name} if spec.checkpoint_bucket.name
                     else {"bucket_prefix": bucket_prefix(spec.name)})
        keep = spec.checkpoint_bucket.keep_on_down
        # Versioned objects would block the delete: force_destroy empties the bucket on destroy,
        # unless the user asked to keep it, in which case Pulumi forgets it instead of deleting, and
        # forgets its settings with it: deleting those would leave a kept bucket without its public
        # access block, with versioning suspended and without the lifecycle that deletes its bytes.
        child = child_options(self, retain_on_delete=keep)
        bucket = aws.s3.Bucket(ctx.resource_name("checkpoints"), **name_args, force_destroy=not keep,
                               tags=ctx.tags_named("checkpoints"), opts=child)
        aws.s3.BucketPublicAccessBlock(
            ctx.resource_name("checkpoints"), bucket=bucket.id, block_public_acls=True,
            block_public_policy=True, ignore_public_acls=True, restrict_public_buckets=True, opts=child)
        aws.s3.BucketVersioning(
            ctx.resource_name("checkpoints"), bucket=bucket.id,
            versioning_configuration={"status": "Enabled"}, opts=child)
        aws.s3.BucketServerSideEncryptionConfiguration(
            ctx.resource_name("checkpoints"), bucket=bucket.id,
            rules=[{"apply_server_side_encryption_by_default": {"sse_algorithm": "AES256"},
                    "bucket_key_enabled": True}], opts=child)
        current_days, noncurrent_days = lifecycle_days(days)
        aws.s3.BucketLifecycleConfiguration(
            ctx.resource_name("checkpoints"), bucket=bucket.id,
            rules=[{
                "id": f"expire-checkpoints-within-{days}-days",
                "status": "Enabled",
                "filter": {"prefix": ""},
                # Versioned bucket: expiring the current version only adds a delete marker; the
                # bytes stay as a noncurrent version until noncurrent_version_expiration removes
                # them. Both steps rounded up by S3 add up to retention_days (lifecycle_days).
                "expiration": {"days": current_days},
                "noncurrent_version_expiration": {"noncurrent_days": noncurrent_days},
                # Interrupted multipart uploads of large shards are billed until aborted.
                "abort_incomplete_multipart_upload": {"days_after_initiation": 1},
            }, {
                # A delete marker with no versions left behind is removed too (S3 refuses it in the
                # same expiration block as `days`, hence its own rule).
                "id": "remove-expired-delete-markers",
                "status": "Enabled",
                "filter": {"prefix": ""},
                "expiration": {"expired_object_delete_marker": True},
            }], opts=child)
        self.bucket_name = bucket.bucket
        self.bucket_arn = bucket.arn

    def _lustre(self, ctx: ClusterContext, subnet_id: pulumi.Input[str],
                security_group_id: pulumi.Input[str]) -> None:
        fsx, child = ctx.spec.storage.fsx, child_options(self)
        persistent = fsx.deployment_type.startswith("PERSISTENT")
        # PERSISTENT_2 links S3 through a data repository association; the older types take the
        # import/export paths on the file system itself.
        legacy_paths = {}
        if fsx.deployment_type != "PERSISTENT_2" and fsx.s3_import_path:
            legacy_paths["import_path"] = fsx.s3_import_path
            if fsx.s3_export_path:
                legacy_paths["export_path"] = fsx.s3_export_path
        lustre = aws.fsx.LustreFileSystem(
            ctx.resource_name("fsx"),
            deployment_type=fsx.deployment_type,
            storage_capacity=fsx.capacity_gib,
            per_unit_storage_throughput=fsx.throughput_per_tib if persistent else None,
            file_system_type_version=LUSTRE_VERSION,
            # pulumi-aws v7: a single subnet id (Lustre lives in one AZ), not a list.
            subnet_ids=subnet_id,
            security_group_ids=[security_group_id],
            **legacy_paths,
            tags=ctx.tags_named("fsx"), opts=child)
        if fsx.deployment_type == "PERSISTENT_2" and fsx.s3_import_path:
            events = ["NEW", "CHANGED", "DELETED"]
            s3_policies = {"auto_import_policy": {"events": events}}
            if fsx.s3_export_path:
                s3_policies["auto_export_policy"] = {"events": events}
            aws.fsx.DataRepositoryAssociation(
                ctx.resource_name("fsx-s3"), file_system_id=lustre.id,
                data_repository_path=fsx.s3_import_path, file_system_path="/",
                batch_import_meta_data_on_create=True, s3=s3_policies,
                tags=ctx.tags_named("fsx-s3"), opts=child)
        self.fsx_id = lustre.id
        self.fsx_dns_name = lustre.dns_name
        self.fsx_mount_name = lustre.mount_name
