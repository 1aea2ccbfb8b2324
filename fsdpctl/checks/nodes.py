"""The `inventory` check: every node answers, its MTU is the spec's, its GPU and EFA counts are the
instance type's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from fsdpctl import remote
from fsdpctl.checks.context import CheckContext, CheckResult, Details, Frozen
from fsdpctl.checks.torchrun import NODE_TIMEOUT_S
from fsdpctl.scripts import render_script


class NodeInventory(Frozen):
    """What one node reported about itself."""

    answers: bool
    error: str | None = None
    """Why it did not answer."""
    interface: str | None = None
    """The interface that carries the node's cluster address."""
    mtu: int | None = None
    gpus: int | None = None
    """GPUs counted; None where not counted (the local target has none) or none is visible."""
    efa: int | None = None
    """EFA devices counted; None as for `gpus`."""


class InventoryDetails(Details):
    check: Literal["inventory"] = "inventory"
    expected_mtu: int
    nodes: dict[int, NodeInventory]
    hardware_checks: str
    """What was counted on every node, or why nothing was."""


class InventoryResult(CheckResult):
    details: InventoryDetails | None = None

    @property
    def interfaces(self) -> dict[int, str]:
        """The cluster interface of every node that reported one: the training jobs bind gloo to it."""
        nodes = self.details.nodes if self.details else {}
        return {rank: node.interface for rank, node in nodes.items() if node.interface}


def _inventory_probe(address: str) -> str:
    """What a node reports about itself; `address` is its cluster address."""
    return render_script("checks/templates/inventory_probe.sh.j2", address=address)


def _device_count(raw: str, node: str, want: int, label: str, installer: str, instance: str,
                  problems: list[str]) -> int | None:
    """The devices a node counted (the probe's text), or None when it saw none; what is wrong with
    the count goes to `problems`."""
    if not raw.isdigit():
        problems.append(f"{node}: no {label} devices visible (expected {want} on {instance}); is the "
                        f"{installer} installed? rerun `fsdpctl configure`")
        return None
    if int(raw) != want:
        problems.append(f"{node}: {int(raw)} {label} device(s), expected {want} on {instance}")
    return int(raw)


def check_inventory(ctx: CheckContext) -> InventoryResult:
    nodes = {n.rank: n for n in remote.cluster_nodes(ctx.record)}
    expected_mtu = ctx.spec.network.mtu
    instance = ctx.spec.instance
    local = ctx.record.target == "local"
    problems: list[str] = []
    per_node: dict[int, NodeInventory] = {}
    with ThreadPoolExecutor(max_workers=min(32, len(ctx.ranks))) as pool:
        futures = {r: pool.submit(remote.run, ctx.record, r, _inventory_probe(nodes[r].address),
                                  timeout=NODE_TIMEOUT_S, check=False) for r in ctx.ranks}
        answers = {r: f.result() for r, f in futures.items()}
    for rank, proc in sorted(answers.items()):
        if proc.returncode != 0:
            why = f"no answer within {NODE_TIMEOUT_S} s" if proc.returncode == remote.TIMEOUT_RC \
                else f"ssh exit {proc.returncode}: {(proc.stderr or '').strip()[-200:]}"
            problems.append(f"node {rank} ({nodes[rank].address}) does not answer: {why}")
            per_node[rank] = NodeInventory(answers=False, error=why)
            continue
        # The probe prints key=value lines (checks/templates/inventory_probe.sh.j2).
        facts = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
        interface = facts.get("iface") or None
        mtu = int(facts["mtu"]) if facts.get("mtu", "").isdigit() else None
        if mtu != expected_mtu:
            problems.append(f"node {rank}: MTU of {interface or 'its interface'} is {mtu}, "
                            f"spec network.mtu is {expected_mtu} (rerun `fsdpctl configure --tags network`)")
        gpus = efa = None
        if not local:  # the local target has neither
            gpus = _device_count(facts.get("gpus", ""), f"node {rank}", instance.gpus, "GPU", "driver",
                                 instance.name, problems)
            efa = _device_count(facts.get("efa", ""), f"node {rank}", instance.efa_interfaces, "EFA",
                                "EFA installer", instance.name, problems)
        per_node[rank] = NodeInventory(answers=True, interface=interface, mtu=mtu, gpus=gpus, efa=efa)
    details = InventoryDetails(
        expected_mtu=expected_mtu, nodes=per_node,
        hardware_checks="skipped (local target has no GPU/EFA)" if local
        else f"{instance.gpus} GPUs and {instance.efa_interfaces} EFA per node")
    if problems:
        return InventoryResult(status="fail", summary="; ".join(problems), details=details)
    return InventoryResult(details=details, summary=(
        f"{len(ctx.ranks)} node(s) answer, MTU {expected_mtu}"
        + ("; GPU/EFA counts skipped (local target)" if local
           else f"; {instance.gpus} GPUs, {instance.efa_interfaces} EFA each")))
