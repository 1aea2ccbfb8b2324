"""The spec's sections and `ClusterSpec`, each field documented by the docstring under it."""

from __future__ import annotations

import ipaddress
import re
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infra import catalog
from infra.spec.constants import (
    CLUSTER_TAG,
    DEFAULT_DLAMI_PARAMETER,
    FINAL_BACKUP_TAG,
    NAME_RE,
    REGION_RE,
    TAG_PREFIX,
)
from infra.spec.problems import SpecError
from infra.spec.rules import cross_field_problems


class _Model(BaseModel):
    # Each field's docstring documents it (docs/cluster-spec.md is checked against them:
    # tests/infra/test_docs.py). Pydantic is not asked to read them (use_attribute_docstrings): it
    # parses each class's source for that, at every `fsdpctl` start.
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
    """`on-demand`, `spot`, `capacity-reservation` (an On-Demand Capacity Reservation) or
    `capacity-block` (Capacity Blocks for ML)."""
    reservation_id: str | None = None
    """The reservation id (`cr-` plus 8 or 17 hex digits). Required for `capacity-reservation` and
    `capacity-block`; refused together with `spot`. The launch template targets it."""
    spot_max_price: float | None = Field(default=None, gt=0)
    """Spot only: the most to pay per instance-hour in USD; empty means up to the on-demand price."""
    all_or_nothing: bool = True
    """On-demand only: first reserve all node_count instances in one On-Demand Capacity
    Reservation (in the placement group), which EC2 grants whole or refuses with
    InsufficientInstanceCapacity, then launch the nodes into it; no cluster of 3 out of 4 nodes. It
    bills like the running nodes and goes with them (expiry, `fsdpctl down`). `false`: launch the
    nodes one by one without it."""

    @property
    def reserves_on_demand(self) -> bool:
        """The program creates the all-or-nothing reservation."""
        return self.type is CapacityType.ON_DEMAND and self.all_or_nothing

    @property
    def uses_reservation(self) -> bool:
        return self.type in (CapacityType.CAPACITY_RESERVATION, CapacityType.CAPACITY_BLOCK)

    @property
    def why_never_stopped(self) -> str | None:
        """Why power saving (`scaling`) stops none of these nodes, or None when it may: stopping a
        node in a reservation or Capacity Block saves nothing, and EC2 cannot stop the one-time spot
        instances the launch template asks for (infra/components/compute.py)."""
        if self.type is CapacityType.SPOT:
            return "spot nodes are one-time spot instances, which EC2 cannot stop"
        if self.uses_reservation:
            return f"{self.type.value} nodes bill whether running or stopped"
        return None


class PlacementGroup(_Model):
    """A cluster placement group keeps all nodes on one network spine (lowest EFA latency).
    `enabled: null` means: on, unless the capacity comes from a reservation or Capacity Block that
    was not created in a placement group (mixing the two is a classic InsufficientInstanceCapacity)."""

    enabled: bool | None = None
    """`null`: a cluster placement group is created and every node is launched in it, unless the
    capacity comes from a reservation or Capacity Block; then none is used and the plan warns (a
    reservation made outside a placement group cannot be launched into one:
    InsufficientInstanceCapacity). `true`/`false` force it on or off."""
    existing_name: str | None = None
    """Use this existing placement group (e.g. the one the reservation was created in) instead of
    creating one."""


class Network(_Model):
    vpc_id: str | None = None
    """Leave empty to create a VPC. Otherwise the VPC to use, together with `private_subnet_id`."""
    private_subnet_id: str | None = None
    """Existing VPC only: the subnet of the nodes (in `availability_zone`), with a route to the
    internet through a NAT."""
    public_subnet_id: str | None = None
    """Existing VPC only: the subnet of the bastion; required when `access.bastion` is on."""
    vpc_cidr: str = "10.42.0.0/16"
    """Created VPC only: its CIDR, /16 to /24. The first half becomes the private node subnet, the
    next quarter the public subnet (NAT gateway, bastion)."""
    mtu: int = 9000
    """Node interface MTU (jumbo frames), set by the Ansible role. 576 to 9001 (9001 is the VPC
    maximum); below 9000 the plan warns that TCP traffic (NCCL bootstrap, FSx, data loading) is
    slower."""

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
    bastion: bool = True
    """A small instance in the public subnet: SSH from `ssh_cidr` to it, and from it to the nodes."""
    bastion_instance_type: str = "t3.micro"
    """The bastion's instance type."""
    ssm: bool = True
    """Reach the nodes through SSM Session Manager (no open port). The node role always carries
    `AmazonSSMManagedInstanceCore`. Bastion and SSM cannot both be off."""
    key_name: str | None = None
    """An existing EC2 key pair for the nodes and the bastion."""
    public_key: str | None = None
    """An OpenSSH public key (`ssh-ed25519 ...`) to import as the key pair `<name>-key`. Not
    together with `key_name`. With neither, `fsdpctl up` generates a key pair in the cluster's
    state directory and passes its public key here."""
    ssh_user: str = "ubuntu"
    """The login user of the node image. The bastion runs the matching public image (`ubuntu`:
    Ubuntu 22.04, `ec2-user`: Amazon Linux 2023) so one `ssh_user@bastion` ProxyJump works; other
    users need `bastion: false`."""

    @field_validator("public_key")
    @classmethod
    def _public_key(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp\d+) [A-Za-z0-9+/=]+", v):
            raise ValueError("not an OpenSSH public key; paste the contents of ~/.ssh/id_ed25519.pub")
        return v


class FsxAtExpiry(StrEnum):
    DELETE = "delete"
    BACKUP = "backup"
    KEEP = "keep"


class Fsx(_Model):
    """FSx for Lustre, mounted on every node (datasets, shared checkpoints)."""

    enabled: bool = False
    """Create an FSx for Lustre file system in the private subnet, mounted on every node."""
    deployment_type: str = "PERSISTENT_2"
    """`PERSISTENT_2`, `PERSISTENT_1` or `SCRATCH_2`."""
    capacity_gib: int = 1200
    """Storage capacity. FSx accepts 1200, 2400, then multiples of 2400 GiB; other sizes are refused
    with the nearest valid ones as the fix."""
    throughput_per_tib: int = 250
    """MB/s per TiB: 125, 250, 500 or 1000 for `PERSISTENT_2`; 50, 100 or 200 for `PERSISTENT_1`;
    ignored for `SCRATCH_2`."""
    s3_import_path: str | None = None
    """An S3 URL (`s3://bucket/prefix`) linked to the file system: imported on `PERSISTENT_2` through a
    data repository association (new, changed and deleted objects follow automatically), on the
    older types as the file system's import path."""
    s3_export_path: str | None = None
    """Export changes back to S3. Needs `s3_import_path`; on `PERSISTENT_2` it must be the same path
    (one association imports and exports)."""
    mount_point: str = "/fsx"
    """Where the nodes mount it (the cluster's `shared_dir` when FSx is on)."""
    at_expiry: FsxAtExpiry = FsxAtExpiry.DELETE
    """What the expiry does with the file system: `delete` (no final backup: what is not in S3 is
    lost), `backup` (delete it after a final backup, tagged `fsdp-cluster:final-backup-of=<name>`,
    which outlives the cluster and bills as backup storage until you delete it; `PERSISTENT_1` or
    `PERSISTENT_2` without `s3_import_path` only) or `keep` (no expiry: it bills until
    `fsdpctl down`). The plan warns about each."""

    def expiry_warning(self, cluster: str) -> str:
        """What the expiry does to the file system, for the plan's and `up`'s warnings."""
        if self.at_expiry is FsxAtExpiry.KEEP:
            return (f"storage.fsx.at_expiry is keep: the {self.capacity_gib} GiB FSx file system keeps "
                    "billing after the expiry, until `fsdpctl down`.")
        if self.at_expiry is FsxAtExpiry.BACKUP:
            return ("storage.fsx.at_expiry is backup: the FSx file system's final backup (tagged "
                    f"{FINAL_BACKUP_TAG}={cluster}) bills as backup storage until you delete it; "
                    "`fsdpctl down` does not delete it.")
        exported = (f"; changes reach {self.s3_export_path} through the automatic export, the rest is lost"
                    if self.s3_export_path else "; whatever is only there is lost")
        return ("storage.fsx.at_expiry is delete: at the expiry the FSx file system is deleted without a "
                f"final backup{exported}. Set at_expiry: backup (persistent types without an S3 link), "
                "or keep (it bills until `fsdpctl down`), or copy what you need out before then.")

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
    scratch_mount: str = "/scratch"
    """Where the node's NVMe instance-store devices are mounted as one RAID0 array (fast local
    scratch), built by the Ansible role."""
    root_volume_gib: int = Field(default=200, ge=50, le=16384)
    """Size of each node's root volume (gp3, encrypted). 50 to 16384."""
    fsx: Fsx = Fsx()


class Image(_Model):
    ami_id: str | None = None
    """An explicit node AMI (`ami-` plus 8 or 17 hex digits). Wins over the SSM parameter."""
    ssm_parameter: str = DEFAULT_DLAMI_PARAMETER
    """The public SSM parameter of the Deep Learning AMI (Base OSS Nvidia Driver, Ubuntu 22.04),
    resolved at `pulumi up`. The AMI it resolves to at creation is pinned in the launch template,
    so a later AMI release does not give new nodes a different driver; set `image.ami_id` to move
    deliberately."""

    @field_validator("ami_id")
    @classmethod
    def _ami(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^ami-[0-9a-f]{8,17}$", v):
            raise ValueError("not an AMI id; use ami- followed by 8 or 17 hex digits, or leave it empty")
        return v


class CheckpointBucket(_Model):
    retention_days: int = 7
    """Every byte of a checkpoint is deleted within this many days, whatever time of day it was
    written. S3 rounds each lifecycle step up to the next midnight UTC (up to a day more each), so a
    checkpoint is current for days - 3, then 1 day as a noncurrent version. At least 4."""
    name: str | None = None
    """An explicit bucket name; empty means `<name>-checkpoints-` plus a unique suffix AWS assigns.
    The bucket is versioned, encrypted (SSE-S3, bucket key), blocks all public access, and is the
    only bucket the node role can read or write."""
    keep_on_down: bool = False
    """`fsdpctl down` (and `pulumi destroy`) empties and deletes the bucket with the cluster, so
    nothing is left billing. `true` keeps the bucket and its checkpoints: Pulumi forgets it
    instead of deleting it, and the teardown sweep reports it as kept rather than as a leftover."""

    @field_validator("retention_days")
    @classmethod
    def _retention(cls, v: int) -> int:
        # infra.components.storage.MIN_RETENTION_DAYS (that module needs pulumi; a test ties them).
        if v < 4:
            raise ValueError("S3 rounds each lifecycle step up to the next midnight UTC, so 4 days is "
                             "the shortest retention it can keep; use 7 (the default) or at least 4")
        return v


class Software(_Model):
    """Pinned versions the Ansible roles install. Defaults: AWS's reference containers, late 2026."""

    nvidia_driver_branch: str = "580"
    """The NVIDIA driver branch the nvidia role installs when the image has none at or above it."""
    cuda_version: str = "12.9.1"
    """The CUDA toolkit the cuda role installs."""
    gdrcopy_version: str = "2.5.1"
    """The GDRCopy version the cuda role builds and installs."""
    efa_installer_version: str = "1.47.0"
    """The EFA installer (libfabric, aws-ofi-nccl, Open MPI) the efa role installs."""
    efa_installer_sha256: str | None = None
    """SHA256 of `aws-efa-installer-<version>.tar.gz`; empty means the checksum AWS publishes next to
    the tarball is used."""
    nccl_version: str = "2.29.3-1"
    """The NCCL package version the nccl role installs."""
    nccl_tests_version: str = "2.17.9"
    """The nccl-tests release the nccl role builds (all_reduce_perf for the smoke test)."""


class Trainer(_Model):
    """How the smoke test and `fsdpctl train` launch the trainer."""

    config: str = "smoke"
    """Trainer config name or file."""
    nproc_per_node: int | None = Field(default=None, ge=1)
    """Processes per node; empty means one per GPU (or `local.nproc_per_node` on the local target)."""
    master_port: int = Field(default=29500, ge=1024, le=65535)
    """The rendezvous port on rank 0, 1024 to 65535."""


class LocalTarget(_Model):
    """The embedded local target: systemd-nspawn nodes on one bridge (see docs/local-target.md)."""

    subnet_cidr: str = "198.18.0.0/24"
    """The nodes' bridge network, inside 198.18.0.0/15, /28 or larger."""
    nproc_per_node: int = Field(default=1, ge=1, le=8)
    """Trainer processes per local node, 1 to 8."""
    login_user: str = "root"
    """The user fsdpctl and Ansible log in as. Another name than root makes a user with passwordless
    sudo on each node, as an AWS image's `ubuntu` is, so everything runs as it does on AWS."""

    @field_validator("login_user")
    @classmethod
    def _user_name(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", v):
            raise ValueError("not a user name: lower-case letters, digits, '_' and '-', starting with a "
                             "letter or '_', at most 32 characters; e.g. root or ubuntu")
        return v

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


class Scaling(_Model):
    """Slurm power saving: the nodes from rank `min_nodes` up are stopped when idle and started
    when a job needs them (docs/aws.md, "Elastic clusters")."""

    min_nodes: int | None = None
    """The nodes that are always on: ranks 0 to min_nodes-1 (rank 0 runs the Slurm controller); the
    others are stopped after `suspend_after_s` idle and started when a job needs them. 1 to
    node_count; `null`: node_count (a fixed cluster). Ignored, with a warning, for `spot` capacity
    (EC2 cannot stop one-time spot instances) and for `capacity-reservation` and `capacity-block`
    (they bill whether running or stopped). On-demand nodes in the all-or-nothing reservation
    (`capacity.all_or_nothing`) bill while stopped too; the plan warns."""
    max_nodes: int | None = None
    """The most nodes running at once; `null`: node_count. Every node is created by `up` and
    configured; nodes from rank min_nodes up are stopped when idle and started when a job needs them,
    so max_nodes must equal node_count when given."""
    suspend_after_s: int = 600
    """Seconds a node stays idle before it is stopped (Slurm's SuspendTime). 60 to 86400: a stopped
    node takes minutes to start again, so a shorter wait would stop nodes between two jobs."""

    @field_validator("min_nodes")
    @classmethod
    def _min_nodes(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("rank 0 runs the Slurm controller and is always on; use 1 or more, or leave "
                             "it out for a fixed cluster")
        return v

    @field_validator("suspend_after_s")
    @classmethod
    def _suspend_after(cls, v: int) -> int:
        if not 60 <= v <= 86400:
            raise ValueError("is outside 60 to 86400 seconds (a day): a stopped node takes minutes to "
                             "start again, so a shorter wait would stop nodes between two jobs; use e.g. 600")
        return v


class Recovery(_Model):
    """How a Slurm job of `fsdpctl train` recovers from a rank that stopped making progress (docs/slurm.md,
    "Recovery"). The job watcher on the controller ends a training step whose metrics file has not
    grown for `stall_factor` times its usual interval between writes, and at least `stall_min_s`; the
    job then starts again from its last checkpoint. It also asks a job whose every GPU stayed below
    `gpu_idle_pct` utilisation for `gpu_idle_s` to checkpoint and requeue, once per job."""

    stall_factor: float = Field(default=10, ge=2, le=1000)
    """How many usual intervals between two metrics writes (metrics.log_interval steps) of silence
    make a step stalled. 2 to 1000."""
    stall_min_s: int = Field(default=300, ge=10, le=86400)
    """The shortest silence that counts as a stall, in seconds: above the longest pause a healthy
    run makes between two writes (a checkpoint save, an evaluation). 10 to 86400. NCCL's own
    timeout (10 minutes) ends a hung collective later, if at all."""
    gpu_idle_pct: float = 5
    """A job whose every GPU stayed below this utilisation, in percent (dcgm-exporter's
    DCGM_FI_DEV_GPU_UTIL in the monitoring role's Prometheus), for the whole of `gpu_idle_s` is
    underused: the job watcher asks it to checkpoint and requeue (not counted as a failure), once per
    job. It catches a job that hangs before its first metrics, which the stall rule cannot judge.
    0 to 100; 0 turns the rule off."""
    gpu_idle_s: int = 1800
    """The window of `gpu_idle_pct`, in seconds of a running training step: longer than loading a
    large model (gpt-oss-120b from its Hugging Face weights) or its checkpoint, which leaves the GPUs
    idle. 300 to 86400."""

    @field_validator("gpu_idle_pct")
    @classmethod
    def _gpu_idle_pct(cls, v: float) -> float:
        if not 0 <= v <= 100:
            raise ValueError("is outside 0 to 100 percent; use e.g. 5, or 0 to turn the rule off")
        return v

    @field_validator("gpu_idle_s")
    @classmethod
    def _gpu_idle_s(cls, v: int) -> int:
        if not 300 <= v <= 86400:
            raise ValueError("is outside 300 to 86400 seconds (a day): a large model loads for minutes with "
                             "its GPUs idle, so a shorter window would requeue a job that is starting; use "
                             "e.g. 1800")
        return v


class ClusterSpec(_Model):
    name: str
    """Cluster name. It becomes part of host names (`<name>-node<rank>`), the bucket name, the
    Pulumi stack name and the tag `fsdp-cluster:cluster=<name>`."""
    region: str
    """AWS region, e.g. `us-east-1`."""
    availability_zone: str
    """The one AZ of every node, subnet and file system. EFA does not cross AZs, so the cluster is
    single-AZ."""
    instance_type: str
    """GPU instance type: `p4d.24xlarge`, `p4de.24xlarge`, `p5.48xlarge`, `p5e.48xlarge` or
    `p5en.48xlarge`
    (`infra/catalog.py`)."""
    node_count: int
    """Number of GPU nodes; ranks run 0 to node_count-1."""
    ssh_cidr: str
    """The network allowed to SSH in (to the bastion, or to the nodes when there is no bastion)."""
    allow_ssh_from_anywhere: bool = False
    """Accept `ssh_cidr: 0.0.0.0/0`. An open SSH port is scanned within minutes; prefer your office
    or VPN range."""
    capacity: Capacity = Capacity()
    placement_group: PlacementGroup = PlacementGroup()
    network: Network = Network()
    access: Access = Access()
    storage: Storage = Storage()
    image: Image = Image()
    checkpoint_bucket: CheckpointBucket = CheckpointBucket()
    expiry_hours: int | None = Field(default=24, ge=1, le=24 * 365)
    """Hours after `fsdpctl up` at which AWS-side schedules (EventBridge Scheduler) stop everything
    that bills by the hour, so a forgotten cluster stops billing: they terminate the nodes and the
    bastion, cancel the all-or-nothing capacity reservation, delete the NAT gateway (then release
    its Elastic IP) and the FSx file system (unless `storage.fsx.at_expiry` is `keep`). 1 to 8760;
    `null` disables it (with a warning). The time is pinned at first creation
    (`fsdp-cluster:expiresAt`) and does not move on later updates (`fsdpctl extend` moves it).
    Besides that, only the checkpoint bucket keeps billing (its lifecycle deletes every byte within
    `retention_days`). The free resources (VPC, subnets, security groups, roles, launch template)
    stay until `fsdpctl down`."""
    tags: dict[str, str] = Field(default_factory=dict)
    """Extra tags put on every taggable resource, next to `fsdp-cluster:cluster` and
    `fsdp-cluster:expires-at`. At most 40; keys starting with `aws:` or `fsdp-cluster:` are
    reserved."""
    scaling: Scaling = Scaling()
    recovery: Recovery = Recovery()
    software: Software = Software()
    trainer: Trainer = Trainer()
    local: LocalTarget = LocalTarget()

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("is not a valid cluster name (it becomes part of host and bucket names); "
                             "use 2-32 lower-case letters, digits and dashes, starting with a letter, "
                             "e.g. demo")
        return v

    @field_validator("region")
    @classmethod
    def _region(cls, v: str) -> str:
        if not REGION_RE.match(v):
            raise ValueError("not an AWS region name; use e.g. us-east-1")
        known = catalog.regions()
        if not known.zones(v):
            near = known.nearest(v)
            raise ValueError(f"is not an AWS region (infra/data/regions.yaml, as of {known.as_of}); "
                             + (f"did you mean {' or '.join(near)}?" if near else "use e.g. us-east-1"))
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
        # The security groups take it as an IPv4 rule (cidr_blocks); a bare address would silently be
        # a /32, which is rarely what was meant when it is an office or VPN range.
        if "/" not in v:
            raise ValueError(f"has no prefix length; write the network with its length, e.g. {v}/32 for "
                             "this one address or 203.0.113.0/24 for a range")
        try:
            net = ipaddress.ip_network(v, strict=True)
        except ValueError as e:
            raise ValueError(f"not a CIDR block ({e}); use your office/VPN range, e.g. 203.0.113.0/24"
                             ) from None
        if net.version != 4:
            raise ValueError("is an IPv6 network, and the security groups take SSH over IPv4; give your "
                             "office/VPN range's IPv4 CIDR, e.g. 203.0.113.0/24")
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

    @property
    def static_node_count(self) -> int:
        """Ranks below it are never powered down: scaling.min_nodes, or node_count for a fixed
        cluster and for capacity that power saving cannot stop (Capacity.why_never_stopped)."""
        if self.scaling.min_nodes is None or self.capacity.why_never_stopped is not None:
            return self.node_count
        return self.scaling.min_nodes

    @property
    def power_saving(self) -> bool:
        """Whether some nodes are stopped when idle (ranks static_node_count and up)."""
        return self.static_node_count < self.node_count

    def node_name(self, rank: int) -> str:
        return f"{self.name}-node{rank}"

    def base_tags(self) -> dict[str, str]:
        """Tags on every taggable resource (the teardown sweep finds leftovers by the first)."""
        return {CLUSTER_TAG: self.name, **self.tags}

    def stopped_at_expiry(self) -> str:
        """What the expiry schedules stop for this spec, as a phrase: "the nodes, the bastion, ..."."""
        parts = ["the nodes"]
        if self.access.bastion:
            parts.append("the bastion")
        if self.capacity.reserves_on_demand:
            parts.append("the capacity reservation")
        if self.network.creates_vpc:
            parts.append("the NAT gateway")
        if self.storage.fsx.enabled and self.storage.fsx.at_expiry is not FsxAtExpiry.KEEP:
            parts.append("the file system")
        return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]

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
        elif self.storage.fsx.enabled:
            out.append(self.storage.fsx.expiry_warning(self.name))
        out += self._scaling_warnings()
        table = catalog.offerings()
        if not table.offered(self.instance_type, self.region):
            out.append(
                f"region: {self.instance_type} is not offered in {self.region} according to the "
                f"offerings table of {table.as_of} (infra/data/offerings.yaml); it is offered in "
                f"{', '.join(table.regions(self.instance_type))}. `pulumi up` would fail there unless "
                "AWS added it since: pick one of those regions, or check with `fsdpctl preflight`.")
        return out

    def _scaling_warnings(self) -> list[str]:
        min_nodes, why_not = self.scaling.min_nodes, self.capacity.why_never_stopped
        if min_nodes is not None and min_nodes < self.node_count and why_not is not None:
            return [f"scaling.min_nodes: {min_nodes} ignored: {why_not}, so none is powered down."]
        if not self.power_saving:
            return []
        out = [f"scaling: nodes from rank {self.static_node_count} come back from a stop with "
               f"{self.storage.scratch_mount} empty (EC2 wipes instance-store NVMe on stop); keep what "
               "must last in the checkpoint bucket or on FSx."]
        if self.capacity.reserves_on_demand:
            out.append("scaling: the all-or-nothing capacity reservation (capacity.all_or_nothing) bills "
                       f"for all {self.node_count} nodes whether they run or are stopped, so stopping "
                       "them saves nothing; set capacity.all_or_nothing: false to save (a stopped node "
                       "may then meet InsufficientInstanceCapacity when it starts).")
        return out
