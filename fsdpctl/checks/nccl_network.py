"""Which network NCCL really used, read from the NCCL_DEBUG=INFO log of a torch run.

On EFA instances a misconfigured node does not fail: NCCL falls back to TCP sockets (aws-ofi-nccl not
found or its init failed) or copies through host memory (no GPUDirect RDMA), and runs 4-10x slower.
The log says which it chose (aws-ofi-nccl and NCCL's own lines, e.g.):

    ip-10-1-0-5:1929:1937 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.18.0
    ip-10-1-0-5:1929:1937 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct (found 4 nics)
    ip-10-1-0-5:1929:1937 [0] NCCL INFO Using network Libfabric
    ip-10-1-0-5:1929:1940 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/Libfabric/0/GDRDMA

and for the fallback `NCCL INFO NET/Plugin: Could not find: libnccl-net.so` then `Using network
Socket`. A run passes the network gate only with the OFI plugin on the efa provider with every EFA
the instance has, and (between nodes) with GPUDirect RDMA on every network channel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# What a torch run on GPU nodes is started with so its log shows the network NCCL chose.
NCCL_DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}

_USING_NETWORK = re.compile(r"NCCL INFO Using network (\S.*?)\s*$", re.MULTILINE)
_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is (\S+?),?(?: fabric is \S+)? \(found (\d+) nics?\)")
_OFI_VERSION = re.compile(r"NET/OFI Initializing aws-ofi-nccl (\S+)")
# Channel 00/0 : 0[0] -> 8[0] [send] via NET/Libfabric/0/GDRDMA   (and NET/AWS Libfabric/1 without)
_NET_CHANNEL = re.compile(r"Channel \d+/\d+ : .* via NET/([^/]+)/(\d+)(/GDRDMA)?")
_PLUGIN_FAILURE = re.compile(r"NET/Plugin\s*:? ?(?:Could not find|.*dlerror|.*[Ff]ailed).*$", re.MULTILINE)
_OFI_WARNING = re.compile(r"NCCL WARN NET/OFI (.*)$", re.MULTILINE)


@dataclass
class NcclNetwork:
    """What the log shows; empty fields: the log does not say (NCCL_DEBUG was not INFO)."""

    networks: list[str] = field(default_factory=list)  # "Using network X", each distinct X
    provider: str = ""  # the libfabric provider aws-ofi-nccl selected ("efa")
    nics: int = 0  # NICs that provider found
    ofi_version: str = ""
    net_channels: int = 0  # channel connections over the network (between nodes)
    gdr_channels: int = 0  # of them, with GPUDirect RDMA
    plugin_errors: list[str] = field(default_factory=list)
    ofi_warnings: list[str] = field(default_factory=list)


def parse_nccl_network(log: str) -> NcclNetwork:
    found = NcclNetwork()
    for name in _USING_NETWORK.findall(log):
        if name not in found.networks:
            found.networks.append(name)
    providers = _PROVIDER.findall(log)
    if providers:
        found.provider = providers[0][0]
        found.nics = min(int(n) for _, n in providers)  # the worst rank counts
    version = _OFI_VERSION.search(log)
    found.ofi_version = version.group(1) if version else ""
    for _net, _dev, gdr in _NET_CHANNEL.findall(log):
        found.net_channels += 1
        found.gdr_channels += bool(gdr)
    found.plugin_errors = sorted({m.strip() for m in _PLUGIN_FAILURE.findall(log)})
    found.ofi_warnings = sorted({m.strip() for m in _OFI_WARNING.findall(log)})[:5]
    return found


def network_problems(found: NcclNetwork, *, efa_interfaces: int, multi_node: bool) -> list[str]:
    """Why the run did not use EFA (with GPUDirect RDMA between nodes) as an EFA instance must."""
    if efa_interfaces <= 0:
        return []
    if not found.networks:
        return ["the NCCL log names no network (`Using network ...` missing): the run did not get "
                "NCCL_DEBUG=INFO, or NCCL never initialised; expected aws-ofi-nccl on "
                f"{efa_interfaces} EFA(s)"]
    problems = []
    if any("socket" in n.lower() for n in found.networks) or not any("libfabric" in n.lower()
                                                                     for n in found.networks):
        detail = "; ".join(found.plugin_errors) or "no NET/OFI line in the log"
        problems.append(f"NCCL used network {', '.join(found.networks)}, not aws-ofi-nccl (Libfabric) on EFA "
                        f"({detail}): check /etc/ld.so.conf.d/fsdp-aws-ofi-nccl.conf and NCCL_NET_PLUGIN in "
                        "/etc/fsdp-cluster/nccl.env (rerun `fsdpctl configure --tags efa,nccl`)")
    elif found.provider != "efa":
        problems.append(f"aws-ofi-nccl selected provider {found.provider or 'none'}, not efa: "
                        "`fi_info -p efa` must list the EFA devices")
    elif found.nics < efa_interfaces:
        problems.append(f"aws-ofi-nccl found {found.nics} EFA NIC(s), the instance has {efa_interfaces}: "
                        "NCCL runs on a fraction of the bandwidth; replace the node")
    if multi_node and not problems:
        if found.net_channels == 0:
            problems.append("the NCCL log shows no channel over the network (`via NET/...`): "
                            "run with NCCL_DEBUG_SUBSYS including INIT")
        elif found.gdr_channels < found.net_channels:
            problems.append(f"{found.net_channels - found.gdr_channels} of {found.net_channels} network "
                            "channel(s) without GPUDirect RDMA (no /GDRDMA): NCCL copies through host "
                            "memory; check the peer-memory module or dma-buf "
                            "(fsdpctl configure --tags gpudirect)")
    return problems
