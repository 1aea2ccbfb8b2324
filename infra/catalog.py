"""Facts about the EC2 instance types a cluster can be built from.

The catalog is what offline planning, the Pulumi program, the Ansible inventory and the smoke test
read when no AWS credentials are at hand; `fsdpctl preflight` checks it against
`describe_instance_types` when they are. Sources: the AWS EC2 accelerated-computing instance docs and
the EFA user guide (see docs/aws-facts.md).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass


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
    # Network bandwidth of one instance (all network cards, EFA included), Gbit/s as AWS states it:
    # what `fsdpctl monitor` and the smoke test's monitoring check compare traffic with.
    network_gbps: float = 0.0


CATALOG: dict[str, InstanceType] = {
    t.name: t
    for t in (
        InstanceType(
            name="p4d.24xlarge", gpus=8, gpu_model="A100-SXM4-40GB", gpu_memory_gib=40, vcpus=96,
            memory_gib=1152, network_cards=4, efa_interfaces=4, nvme_devices=8, nvme_device_gb=1000,
            peak_bf16_tflops_per_gpu=312.0, nvswitch=True, allreduce_busbw_gate_gbps=70.0,
            network_gbps=400.0,
        ),
        InstanceType(
            name="p4de.24xlarge", gpus=8, gpu_model="A100-SXM4-80GB", gpu_memory_gib=80, vcpus=96,
            memory_gib=1152, network_cards=4, efa_interfaces=4, nvme_devices=8, nvme_device_gb=1000,
            peak_bf16_tflops_per_gpu=312.0, nvswitch=True, allreduce_busbw_gate_gbps=70.0,
            network_gbps=400.0,
        ),
        InstanceType(
            name="p5.48xlarge", gpus=8, gpu_model="H100-SXM5-80GB", gpu_memory_gib=80, vcpus=192,
            memory_gib=2048, network_cards=32, efa_interfaces=32, nvme_devices=8, nvme_device_gb=3800,
            peak_bf16_tflops_per_gpu=989.0, nvswitch=True, allreduce_busbw_gate_gbps=400.0,
            network_gbps=3200.0,
        ),
        InstanceType(
            name="p5en.48xlarge", gpus=8, gpu_model="H200-SXM5-141GB", gpu_memory_gib=141, vcpus=192,
            memory_gib=2048, network_cards=16, efa_interfaces=16, nvme_devices=8, nvme_device_gb=3840,
            peak_bf16_tflops_per_gpu=989.0, nvswitch=True, allreduce_busbw_gate_gbps=400.0,
            network_gbps=3200.0,
        ),
    )
}


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
