"""Names and AWS facts the spec, the Pulumi program and the operator tool share."""

from __future__ import annotations

import re

PULUMI_CONFIG_KEY = "fsdp-cluster:cluster"
TAG_PREFIX = "fsdp-cluster"
CLUSTER_TAG = f"{TAG_PREFIX}:cluster"
EXPIRES_TAG = f"{TAG_PREFIX}:expires-at"
RANK_TAG = f"{TAG_PREFIX}:node-rank"
# On the FSx final backup the expiry takes (storage.fsx.at_expiry: backup): not CLUSTER_TAG, since the
# backup is kept on purpose and the teardown sweep must not count it as a leftover.
FINAL_BACKUP_TAG = f"{TAG_PREFIX}:final-backup-of"

DEFAULT_DLAMI_PARAMETER = (
    "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
)
# The bastion runs the public image whose login user is the nodes' `access.ssh_user`, so one
# `ssh_user@bastion` ProxyJump works with the same key.
BASTION_SSM_PARAMETERS = {
    "ubuntu": "/aws/service/canonical/ubuntu/server/22.04/stable/current/amd64/hvm/ebs-gp2/ami-id",
    "ec2-user": "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64",
}
FSX_PERSISTENT_THROUGHPUTS = {
    "PERSISTENT_1": (50, 100, 200),
    "PERSISTENT_2": (125, 250, 500, 1000),
}
REGION_RE = re.compile(r"^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-\d$")
NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,30}[a-z0-9]$")
