"""The cluster spec: the one typed description of a cluster that every stage reads.

`pulumi up` (through the stack config object `fsdp-cluster:cluster`), the Ansible inventory, the
local target, the trainer launch and the smoke test all take a `ClusterSpec`; none re-derives what
the spec already says. Load it with `load_spec(path)` or `parse_spec(mapping)`: bad input raises
`SpecError` listing every problem at once, each naming the field, the bad value and the fix, before
anything is created.
"""

from __future__ import annotations

from infra.spec.constants import (
    BASTION_SSM_PARAMETERS,
    CLUSTER_TAG,
    DEFAULT_DLAMI_PARAMETER,
    EXPIRES_TAG,
    FINAL_BACKUP_TAG,
    FSX_PERSISTENT_THROUGHPUTS,
    PULUMI_CONFIG_KEY,
    RANK_TAG,
    TAG_PREFIX,
)
from infra.spec.load import MAX_YAML_VALUES, load_spec, parse_spec, parse_yaml, yaml_error_text
from infra.spec.model import (
    Access,
    Capacity,
    CapacityType,
    CheckpointBucket,
    ClusterSpec,
    Fsx,
    FsxAtExpiry,
    Image,
    LocalTarget,
    Network,
    PlacementGroup,
    Scaling,
    Software,
    Storage,
    Trainer,
)
from infra.spec.problems import Problem, SpecError
from infra.spec.rules import cross_field_problems

__all__ = [
    "BASTION_SSM_PARAMETERS", "CLUSTER_TAG", "DEFAULT_DLAMI_PARAMETER", "EXPIRES_TAG", "FINAL_BACKUP_TAG",
    "FSX_PERSISTENT_THROUGHPUTS", "MAX_YAML_VALUES", "PULUMI_CONFIG_KEY", "RANK_TAG", "TAG_PREFIX", "Access",
    "Capacity", "CapacityType", "CheckpointBucket", "ClusterSpec", "Fsx", "FsxAtExpiry", "Image",
    "LocalTarget", "Network", "PlacementGroup", "Problem", "Scaling", "Software", "SpecError", "Storage",
    "Trainer", "cross_field_problems", "load_spec", "parse_spec", "parse_yaml", "yaml_error_text",
]
