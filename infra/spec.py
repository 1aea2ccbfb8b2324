"""The cluster spec: the one typed description of a cluster that every stage reads.

`pulumi up` (through the stack config object `fsdp-cluster:cluster`), the Ansible inventory, the
local target, the trainer launch and the smoke test all take a `ClusterSpec`; none re-derives what
the spec already says. Load it with `load_spec(path)` or `parse_spec(mapping)`: bad input raises
`SpecError` listing every problem at once, each naming the field, the bad value and the fix, before
anything is created.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from infra import catalog

PULUMI_CONFIG_KEY = "fsdp-cluster:cluster"
TAG_PREFIX = "fsdp-cluster"
CLUSTER_TAG = f"{TAG_PREFIX}:cluster"
EXPIRES_TAG = f"{TAG_PREFIX}:expires-at"
RANK_TAG = f"{TAG_PREFIX}:node-rank"

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
_REGION_RE = re.compile(r"^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-\d$")
_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,30}[a-z0-9]$")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: where, what was given, and how to fix it."""

    field: str
    value: Any
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message} (got {self.value!r}). Fix: {self.fix}"


class SpecError(ValueError):
    def __init__(self, problems: list[Problem], source: str = "cluster spec"):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source} has {len(problems)} problem(s):\n{lines}")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class CapacityType(StrEnum):
    ON_DEMAND = "on-demand"
    SPOT = "spot"
    CAPACITY_RESERVATION = "capacity-reservation"
    CAPACITY_BLOCK = "capacity-block"


class Capacity(_Model):
    """How the nodes' capacity is bought. p4d/p5 on-demand capacity is often short
    (InsufficientInstanceCapacity): reservations and Capacity Blocks for ML guarantee it."""

    type: CapacityType = CapacityType.ON_DEMAND
    # On-demand capacity reservation id (cr-...), for capacity-reservation and capacity-block.
    reservation_id: str | None = None
    # Spot only: the most to pay per instance-hour (USD); None means up to the on-demand price.
    spot_max_price: float | None = Field(default=None, gt=0)

    @property
    def uses_reservation(self) -> bool:
        return self.type in (CapacityType.CAPACITY_RESERVATION, CapacityType.CAPACITY_BLOCK)


class PlacementGroup(_Model):
    """A cluster placement group keeps all nodes on one network spine (lowest EFA latency).
    `enabled: null` means: on, unless the capacity comes from a reservation or Capacity Block that
    was not created in a placement group (mixing the two is a classic InsufficientInstanceCapacity)."""

    enabled: bool | None = None
    # Use an existing group (e.g. the one a reservation was created in) instead of creating one.
    existing_name: str | None = None


class Network(_Model):
    # Leave all ids empty to create a VPC; otherwise give the VPC and the nodes' private subnet
    # (and a public subnet when a bastion is wanted).
    vpc_id: str | None = None
    private_subnet_id: str | None = None
    public_subnet_id: str | None = None
    vpc_cidr: str = "10.42.0.0/16"
    # Node interface MTU: 9001 is the VPC maximum; 9000 is the guide's value (jumbo frames).
    mtu: int = 9000

    @field_validator("mtu")
    @classmethod
    def _mtu_range(cls, v: int) -> int:
        if not 576 <= v <= 9001:
            raise ValueError("MTU must be between 576 and 9001 (9001 is the VPC maximum); use 9000")
        return v

    @field_validator("vpc_cidr")
    @classmethod
    def _vpc_cidr(cls, v: str) -> str:
        try:
            net = ipaddress.ip_network(v, strict=True)
        except ValueError as e:
            raise ValueError(f"not a network address ({e}); use e.g. 10.42.0.0/16") from None
        if not 16 <= net.prefixlen <= 24:
            raise ValueError("a VPC CIDR must be between /16 and /24; use e.g. 10.42.0.0/16")
        return v

    @property
    def creates_vpc(self) -> bool:
        return self.vpc_id is None


class Access(_Model):
    # A small instance in the public subnet, the SSH ProxyJump into the private node subnet
    # (nodes with several network cards cannot get a public IP).
    bastion: bool = True
    bastion_instance_type: str = "t3.micro"
    # SSM Session Manager (no open port at all); the node role always allows it.
    ssm: bool = True
    # An existing EC2 key pair name, or a public key (OpenSSH format) to import as one.
    key_name: str | None = None
    public_key: str | None = None
    ssh_user: str = "ubuntu"

    @field_validator("public_key")
    @classmethod
    def _public_key(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp\d+) [A-Za-z0-9+/=]+", v):
            raise ValueError("not an OpenSSH public key; paste the contents of ~/.ssh/id_ed25519.pub")
        return v


class Fsx(_Model):
    """FSx for Lustre, mounted on every node (datasets, shared checkpoints)."""

    enabled: bool = False
    deployment_type: str = "PERSISTENT_2"
    capacity_gib: int = 1200
    # MB/s per TiB of storage (PERSISTENT_2: 125, 250, 500, 1000).
    throughput_per_tib: int = 250
    # Data repository association: S3 path imported into (and exported from) the file system.
    s3_import_path: str | None = None
    s3_export_path: str | None = None
    mount_point: str = "/fsx"

    @field_validator("deployment_type")
    @classmethod
    def _deployment_type(cls, v: str) -> str:
        allowed = ("SCRATCH_2", "PERSISTENT_1", "PERSISTENT_2")
        if v not in allowed:
            raise ValueError(f"unknown FSx deployment type; use one of {', '.join(allowed)}")
        return v

    @field_validator("s3_import_path", "s3_export_path")
    @classmethod
    def _s3_path(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$", v):
            raise ValueError("not an S3 URL; use s3://bucket/prefix")
        return v


class Storage(_Model):
    # NVMe instance-store devices assembled as RAID0 and mounted here (fast local scratch).
    scratch_mount: str = "/scratch"
    root_volume_gib: int = Field(default=200, ge=50, le=16384)
    fsx: Fsx = Fsx()


class Image(_Model):
    # An explicit AMI id wins; otherwise the public SSM parameter is resolved at plan time.
    ami_id: str | None = None
    ssm_parameter: str = DEFAULT_DLAMI_PARAMETER

    @field_validator("ami_id")
    @classmethod
    def _ami(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^ami-[0-9a-f]{8,17}$", v):
            raise ValueError("not an AMI id; use ami- followed by 8 or 17 hex digits, or leave it empty")
        return v


class CheckpointBucket(_Model):
    # Objects (checkpoints) older than this many days expire; the guide's default is 7.
    retention_days: int = 7
    # Empty: derived from the cluster name, region and account.
    name: str | None = None
    # `fsdpctl down` (and `pulumi destroy`) empties and deletes the bucket with the cluster, so
    # nothing is left billing. Set true to keep it (and its checkpoints) after the cluster is gone.
    keep_on_down: bool = False

    @field_validator("retention_days")
    @classmethod
    def _retention(cls, v: int) -> int:
        if v < 1:
            raise ValueError("checkpoints must be kept at least 1 day; use 7 (the default)")
        return v


class Software(_Model):
    """Pinned versions the Ansible roles install. Defaults: AWS's reference containers, late 2026."""

    nvidia_driver_branch: str = "580"
    cuda_version: str = "12.9.1"
    gdrcopy_version: str = "2.5.1"
    efa_installer_version: str = "1.47.0"
    # SHA256 of aws-efa-installer-<version>.tar.gz; empty means: use the checksum AWS publishes
    # next to the tarball (the role downloads and compares it).
    efa_installer_sha256: str | None = None
    nccl_version: str = "2.29.3-1"
    nccl_tests_version: str = "2.17.9"


class Trainer(_Model):
    """How the smoke test and `fsdpctl train` launch the trainer."""

    config: str = "smoke"
    # Processes per node; empty means one per GPU, or `local.nproc_per_node` on the local target.
    nproc_per_node: int | None = Field(default=None, ge=1)
    master_port: int = Field(default=29500, ge=1024, le=65535)


class LocalTarget(_Model):
    """The embedded local target: systemd-nspawn nodes on one bridge (see docs/local-target.md)."""

    subnet_cidr: str = "198.18.0.0/24"
    nproc_per_node: int = Field(default=1, ge=1, le=8)

    @field_validator("subnet_cidr")
    @classmethod
    def _benchmark_range(cls, v: str) -> str:
        try:
            net = ipaddress.ip_network(v, strict=True)
        except ValueError as e:
            raise ValueError(f"not a network address ({e}); use 198.18.0.0/24") from None
        if not net.subnet_of(ipaddress.ip_network("198.18.0.0/15")) or net.prefixlen > 28:
            raise ValueError("local nodes live in 198.18.0.0/15 (benchmark range), /28 or larger; "
                             "use 198.18.0.0/24")
        return v


class ClusterSpec(_Model):
    name: str
    region: str
    availability_zone: str
    instance_type: str
    node_count: int
    ssh_cidr: str
    # 0.0.0.0/0 for SSH is refused unless this is set: an open SSH port on GPU nodes is scanned
    # within minutes.
    allow_ssh_from_anywhere: bool = False
    capacity: Capacity = Capacity()
    placement_group: PlacementGroup = PlacementGroup()
    network: Network = Network()
    access: Access = Access()
    storage: Storage = Storage()
    image: Image = Image()
    checkpoint_bucket: CheckpointBucket = CheckpointBucket()
    # Hours until the nodes terminate themselves (an AWS-side schedule), so a forgotten cluster
    # stops billing; null disables it.
    expiry_hours: int | None = Field(default=24, ge=1, le=24 * 365)
    tags: dict[str, str] = Field(default_factory=dict)
    software: Software = Software()
    trainer: Trainer = Trainer()
    local: LocalTarget = LocalTarget()

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError("is not a valid cluster name (it becomes part of host and bucket names); "
                             "use 2-32 lower-case letters, digits and dashes, starting with a letter, "
                             "e.g. demo")
        return v

    @field_validator("region")
    @classmethod
    def _region(cls, v: str) -> str:
        if not _REGION_RE.match(v):
            raise ValueError("not an AWS region name; use e.g. us-east-1")
        return v

    @field_validator("instance_type")
    @classmethod
    def _instance_type(cls, v: str) -> str:
        if v not in catalog.CATALOG:
            near = catalog.nearest_instance_types(v)
            hint = f"did you mean {near[0]}? " if near else ""
            raise ValueError(f"unknown instance type; {hint}known: {', '.join(catalog.CATALOG)}")
        return v

    @field_validator("node_count")
    @classmethod
    def _node_count(cls, v: int) -> int:
        if v < 1:
            raise ValueError("a cluster needs at least 1 node; use e.g. 2")
        if v > 256:
            raise ValueError("more than 256 nodes is beyond one placement group's practical size; "
                             "split the job or raise the limit deliberately")
        return v

    @field_validator("ssh_cidr")
    @classmethod
    def _ssh_cidr(cls, v: str) -> str:
        try:
            ipaddress.ip_network(v, strict=True)
        except ValueError as e:
            raise ValueError(f"not a CIDR block ({e}); use your office/VPN range, e.g. 203.0.113.0/24"
                             ) from None
        return v

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if key.lower().startswith("aws:") or key.startswith(f"{TAG_PREFIX}:"):
                raise ValueError(f"tag key {key!r} is reserved; choose another prefix")
        if len(v) > 40:
            raise ValueError("at most 40 extra tags (AWS allows 50 and the cluster adds its own)")
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> ClusterSpec:
        problems = cross_field_problems(self.model_dump(mode="json"))
        if problems:
            raise SpecError(problems)
        return self

    # ---- derived facts every stage shares -------------------------------------------------
    @property
    def instance(self) -> catalog.InstanceType:
        return catalog.CATALOG[self.instance_type]

    @property
    def uses_placement_group(self) -> bool:
        if self.placement_group.existing_name:
            return True
        if self.placement_group.enabled is None:
            return not self.capacity.uses_reservation
        return self.placement_group.enabled

    def node_name(self, rank: int) -> str:
        return f"{self.name}-node{rank}"

    def base_tags(self) -> dict[str, str]:
        """Tags on every taggable resource (the teardown sweep finds leftovers by the first)."""
        return {CLUSTER_TAG: self.name, **self.tags}

    def warnings(self) -> list[str]:
        out = []
        if self.capacity.uses_reservation and self.placement_group.enabled is None \
                and not self.placement_group.existing_name:
            out.append(
                "placement_group: no placement group is created because the capacity comes from "
                f"{self.capacity.type.value} {self.capacity.reservation_id}; a reservation made outside a "
                "placement group cannot be launched into one (InsufficientInstanceCapacity). If the "
                "reservation was created in a cluster placement group, name it in "
                "placement_group.existing_name."
            )
        if self.capacity.uses_reservation and self.placement_group.enabled \
                and not self.placement_group.existing_name:
            out.append(
                "placement_group.enabled is true together with a reservation: launches fail with "
                "InsufficientInstanceCapacity unless the reservation was created in that group."
            )
        if self.network.mtu < 9000:
            out.append(f"network.mtu {self.network.mtu} is below 9000: large TCP transfers (NCCL "
                       "bootstrap, FSx, data loading) will be slower.")
        if self.expiry_hours is None:
            out.append("expiry_hours is null: nothing stops a forgotten cluster from billing.")
        return out


def cross_field_problems(data: Mapping[str, Any]) -> list[Problem]:
    """Checks that need more than one field. Works on raw (possibly invalid) input so that a spec
    with both a bad field and a bad combination reports both at once."""
    problems: list[Problem] = []

    def sub(key: str) -> Mapping[str, Any]:
        v = data.get(key)
        return v if isinstance(v, Mapping) else {}

    region, az = data.get("region"), data.get("availability_zone")
    if (isinstance(region, str) and isinstance(az, str) and _REGION_RE.match(region)
            and not re.fullmatch(re.escape(region) + r"[a-z]", az)):
        problems.append(Problem(
            "availability_zone", az, f"is not an availability zone of region {region}",
            f"use {region} followed by a zone letter, e.g. {region}a, or change region"))

    cidr = data.get("ssh_cidr")
    if isinstance(cidr, str) and not data.get("allow_ssh_from_anywhere"):
        try:
            if ipaddress.ip_network(cidr, strict=False).prefixlen == 0:
                problems.append(Problem(
                    "ssh_cidr", cidr, "opens SSH to the whole internet",
                    "give your office/VPN CIDR, or set allow_ssh_from_anywhere: true to accept the risk"))
        except ValueError:
            pass  # reported by the field validator

    capacity = sub("capacity")
    ctype, reservation = capacity.get("type", "on-demand"), capacity.get("reservation_id")
    if ctype == "spot" and reservation:
        problems.append(Problem(
            "capacity.reservation_id", reservation, "cannot be combined with capacity.type spot",
            "remove reservation_id to use spot, or set capacity.type: capacity-reservation"))
    if ctype in ("capacity-reservation", "capacity-block") and not reservation:
        problems.append(Problem(
            "capacity.reservation_id", reservation, f"is required for capacity.type {ctype}",
            "give the reservation id (cr-...) from the EC2 console or describe-capacity-reservations"))
    if isinstance(reservation, str) and not re.fullmatch(r"cr-[0-9a-f]{8,17}", reservation):
        problems.append(Problem(
            "capacity.reservation_id", reservation, "is not a capacity reservation id",
            "use cr- followed by 17 hex digits"))
    if capacity.get("spot_max_price") is not None and ctype != "spot":
        problems.append(Problem(
            "capacity.spot_max_price", capacity.get("spot_max_price"), f"has no meaning for {ctype}",
            "remove it, or set capacity.type: spot"))

    network = sub("network")
    has_vpc = bool(network.get("vpc_id"))
    if has_vpc != bool(network.get("private_subnet_id")):
        problems.append(Problem(
            "network.private_subnet_id" if has_vpc else "network.vpc_id",
            network.get("private_subnet_id") if has_vpc else network.get("vpc_id"),
            "an existing VPC needs both vpc_id and private_subnet_id",
            "give both, or neither to let the program create the network"))
    access = sub("access")
    if has_vpc and access.get("bastion", True) and not network.get("public_subnet_id"):
        problems.append(Problem(
            "network.public_subnet_id", None, "a bastion in an existing VPC needs a public subnet",
            "give network.public_subnet_id, or set access.bastion: false and use SSM"))
    if not access.get("bastion", True) and not access.get("ssm", True):
        problems.append(Problem(
            "access", {"bastion": False, "ssm": False}, "leaves no way to reach the private nodes",
            "enable access.bastion or access.ssm"))
    ssh_user = access.get("ssh_user", "ubuntu")
    if access.get("bastion", True) and isinstance(ssh_user, str) and ssh_user not in BASTION_SSM_PARAMETERS:
        problems.append(Problem(
            "access.ssh_user", ssh_user,
            "has no matching bastion image (the bastion logs in as the same user)",
            f"use one of {', '.join(BASTION_SSM_PARAMETERS)}, or set access.bastion: false and use SSM"))
    if access.get("key_name") and access.get("public_key"):
        problems.append(Problem(
            "access.public_key", "<key>", "conflicts with access.key_name",
            "give either an existing key pair name or a public key to import, not both"))

    fsx = sub("storage").get("fsx")
    if isinstance(fsx, Mapping) and fsx.get("enabled"):
        problems.extend(_fsx_problems(fsx))
    return problems


def _fsx_problems(fsx: Mapping[str, Any]) -> list[Problem]:
    problems = []
    dtype = fsx.get("deployment_type", "PERSISTENT_2")
    cap = fsx.get("capacity_gib", 1200)
    if isinstance(cap, int) and not (cap in (1200, 2400) or (cap > 2400 and cap % 2400 == 0)):
        lower = max(1200, (cap // 2400) * 2400) if cap > 1200 else 1200
        upper = 2400 if cap < 2400 else lower + 2400
        problems.append(Problem(
            "storage.fsx.capacity_gib", cap, f"is not a size FSx for Lustre {dtype} accepts "
            "(1200, 2400, then steps of 2400 GiB)", f"use {lower} or {upper}"))
    tput = fsx.get("throughput_per_tib", 250)
    allowed = FSX_PERSISTENT_THROUGHPUTS.get(dtype)
    if allowed and tput not in allowed:
        problems.append(Problem(
            "storage.fsx.throughput_per_tib", tput, f"is not offered for {dtype}",
            f"use one of {', '.join(map(str, allowed))} MB/s/TiB"))
    export, imported = fsx.get("s3_export_path"), fsx.get("s3_import_path")
    if dtype == "PERSISTENT_2" and export and imported and export != imported:
        problems.append(Problem(
            "storage.fsx.s3_export_path", export,
            "differs from s3_import_path; PERSISTENT_2 links one S3 path for import and export",
            f"set it to {imported}, or leave it empty for import only"))
    if fsx.get("s3_export_path") and not fsx.get("s3_import_path"):
        problems.append(Problem(
            "storage.fsx.s3_export_path", fsx.get("s3_export_path"), "needs an import path too",
            "set storage.fsx.s3_import_path (usually the same bucket and prefix)"))
    return problems


def _problems_from_validation(err: ValidationError) -> list[Problem]:
    problems = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(spec)"
        value = e.get("input")
        ctx_err = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_err, SpecError):
            problems.extend(ctx_err.problems)
            continue
        msg = e["msg"].removeprefix("Value error, ")
        etype = e["type"]
        if etype == "extra_forbidden":
            problems.append(Problem(field, value, "is not a known field",
                                    "remove it or check its spelling against docs/cluster-spec.md"))
        elif etype == "missing":
            problems.append(Problem(field, None, "is required", "add it (see docs/cluster-spec.md)"))
        elif etype == "value_error" and ";" in msg:
            what, fix = msg.split(";", 1)
            problems.append(Problem(field, value, what.strip(), fix.strip()))
        else:
            problems.append(Problem(field, value, msg, "see docs/cluster-spec.md for the allowed values"))
    return problems


def parse_spec(data: Mapping[str, Any], source: str = "cluster spec") -> ClusterSpec:
    """Validate a mapping (YAML file or Pulumi config object) into a spec, or raise SpecError
    listing every problem."""
    if not isinstance(data, Mapping):
        raise SpecError([Problem("(spec)", data, "must be a mapping of fields",
                                 "write the spec as YAML keys: name, region, ...")], source)
    try:
        return ClusterSpec.model_validate(dict(data))
    except SpecError as e:
        raise SpecError(e.problems, source) from None
    except ValidationError as e:
        problems = _problems_from_validation(e)
    seen = {(p.field, p.message) for p in problems}
    problems += [p for p in cross_field_problems(data) if (p.field, p.message) not in seen]
    raise SpecError(problems, source) from None


def load_spec(path: str | Path) -> ClusterSpec:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError([Problem("(file)", str(path), "does not exist",
                                 "pass the path of a spec YAML, e.g. examples/demo.yaml")]) from None
    except yaml.YAMLError as e:
        raise SpecError([Problem("(file)", str(path), f"is not valid YAML: {e}",
                                 "fix the YAML syntax")]) from None
    return parse_spec(data or {}, source=str(path))
