"""Facts about the EC2 instance types a cluster can be built from.

The catalog is what offline planning, the Pulumi program, the Ansible inventory and the smoke test
read when no AWS credentials are at hand; `fsdpctl preflight` checks it against
`describe_instance_types` when they are. Sources: the AWS EC2 accelerated-computing instance docs and
the EFA user guide; every figure and its source page is in infra/data/instance_types.yaml.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass
from importlib import resources

import yaml


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpus: int
    gpu_model: str
    gpu_memory_gib: int  # per GPU
    vcpus: int
    memory_gib: int
    network_cards: int
    efa_interfaces: int
    nvme_devices: int
    nvme_device_gb: int  # per device, decimal GB as AWS states it
    peak_bf16_tflops_per_gpu: float  # dense, no sparsity
    nvswitch: bool
    # Healthy all-reduce bus bandwidth between two or more such nodes (nccl-tests busbw, >= 1 GB
    # messages), minus a margin: below it the cluster is on too few EFAs or on TCP sockets.
    allreduce_busbw_gate_gbps: float
    # How the launch template lays out the EFA interfaces: "basic" or "p5" (see the data file).
    efa_layout: str = "basic"
    # Network bandwidth of one instance (all network cards, EFA included), Gbit/s as AWS states it:
    # what `fsdpctl monitor` and the smoke test's monitoring check compare traffic with.
    network_gbps: float = 0.0


EFA_LAYOUTS = ("basic", "p5")


def _load() -> dict[str, InstanceType]:
    data = yaml.safe_load(resources.files("infra").joinpath("data/instance_types.yaml").read_text())
    fields = {f.name for f in dataclasses.fields(InstanceType)} - {"name"}
    return {name: InstanceType(name=name, **{k: v for k, v in entry.items() if k in fields})
            for name, entry in data["types"].items()}


CATALOG: dict[str, InstanceType] = _load()


@dataclass(frozen=True)
class Offerings:
    """The dated table of which regions offer which type (infra/data/offerings.yaml)."""

    as_of: str
    source: str
    prices: dict[str, dict[str, float | None]]  # type -> region -> on-demand USD/hour (None: no on-demand)

    def regions(self, instance_type: str) -> list[str]:
        return sorted(self.prices.get(instance_type, {}))

    def offered(self, instance_type: str, region: str) -> bool:
        return region in self.prices.get(instance_type, {})


def offerings() -> Offerings:
    data = yaml.safe_load(resources.files("infra").joinpath("data/offerings.yaml").read_text())
    return Offerings(as_of=str(data["as_of"]), source=str(data["source"]),
                     prices={t: dict(regions or {}) for t, regions in data["types"].items()})


@dataclass(frozen=True)
class Regions:
    """The dated table of AWS regions and their zone letters (infra/data/regions.yaml)."""

    as_of: str
    last_zone: dict[str, str]  # region -> the last letter of its Availability Zone names

    def zones(self, region: str) -> list[str]:
        """The zone names a region may have (empty: not a known region)."""
        last = self.last_zone.get(region)
        return [] if last is None else [f"{region}{chr(c)}" for c in range(ord("a"), ord(last) + 1)]

    def nearest(self, region: str) -> list[str]:
        """The (at most two) known regions closest to a misspelt one, best first; may be empty."""
        return difflib.get_close_matches(region, list(self.last_zone), n=2, cutoff=0.8)


@functools.cache
def regions() -> Regions:
    data = yaml.safe_load(resources.files("infra").joinpath("data/regions.yaml").read_text())
    return Regions(as_of=str(data["as_of"]), last_zone={r: str(z) for r, z in data["regions"].items()})


def nearest_instance_types(name: str, limit: int = 3) -> list[str]:
    """Known types closest to a misspelt one, best first (may be empty)."""
    return difflib.get_close_matches(name, list(CATALOG), n=limit, cutoff=0.4)


def lookup(name: str) -> InstanceType:
    try:
        return CATALOG[name]
    except KeyError:
        hint = nearest_instance_types(name)
        suggestion = f" Did you mean {hint[0]}?" if hint else ""
        raise KeyError(
            f"instance type {name!r} is not in the catalog ({', '.join(CATALOG)}).{suggestion}"
        ) from None
