"""The `inventory` check: every node answers, its MTU is the spec's, its GPU and EFA counts are the
instance type's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fsdpctl import remote
from fsdpctl.checks.context import CheckContext, CheckResult
from fsdpctl.checks.torchrun import NODE_TIMEOUT_S
from fsdpctl.scripts import render_script


def _inventory_probe(address: str) -> str:
    """What a node reports about itself; `address` is its cluster address."""
    return render_script("checks/templates/inventory_probe.sh.j2", address=address)


def check_inventory(ctx: CheckContext, result: CheckResult) -> None:
    nodes = {n.rank: n for n in remote.cluster_nodes(ctx.state)}
    expected_mtu = ctx.spec.network.mtu
    instance = ctx.spec.instance
    local = ctx.state.read().target == "local"
    problems, per_node = [], {}
    with ThreadPoolExecutor(max_workers=min(32, len(ctx.ranks))) as pool:
        futures = {r: pool.submit(remote.run, ctx.state, r, _inventory_probe(nodes[r].address),
                                  timeout=NODE_TIMEOUT_S, check=False) for r in ctx.ranks}
        answers = {r: f.result() for r, f in futures.items()}
    for rank, proc in sorted(answers.items()):
        if proc.returncode != 0:
            why = f"no answer within {NODE_TIMEOUT_S} s" if proc.returncode == remote.TIMEOUT_RC \
                else f"ssh exit {proc.returncode}: {(proc.stderr or '').strip()[-200:]}"
            problems.append(f"node {rank} ({nodes[rank].address}) does not answer: {why}")
            per_node[rank] = {"answers": False, "error": why}
            continue
        facts = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
        info: dict[str, Any] = {"answers": True, "interface": facts.get("iface") or None,
                                "mtu": int(facts["mtu"]) if facts.get("mtu", "").isdigit() else None}
        if info["interface"]:
            ctx.interfaces[rank] = info["interface"]
        if info["mtu"] != expected_mtu:
            problems.append(f"node {rank}: MTU of {info['interface'] or 'its interface'} is {info['mtu']}, "
                            f"spec network.mtu is {expected_mtu} (rerun `fsdpctl configure --tags network`)")
        for key, want, label in (("gpus", instance.gpus, "GPU"), ("efa", instance.efa_interfaces, "EFA")):
            raw = facts.get(key, "")
            if local:
                info[key] = "skipped: local node, no hardware"
            elif not raw.isdigit():
                info[key] = None
                problems.append(f"node {rank}: no {label} devices visible (expected {want} on "
                                f"{instance.name}); is the {'driver' if key == 'gpus' else 'EFA installer'} "
                                "installed? rerun `fsdpctl configure`")
            else:
                info[key] = int(raw)
                if int(raw) != want:
                    problems.append(f"node {rank}: {int(raw)} {label} device(s), expected {want} on "
                                    f"{instance.name}")
        per_node[rank] = info
    result.details = {"expected_mtu": expected_mtu, "nodes": per_node,
                      "hardware_checks": "skipped (local target has no GPU/EFA)" if local
                      else f"{instance.gpus} GPUs and {instance.efa_interfaces} EFA per node"}
    if problems:
        result.fail("; ".join(problems))
    else:
        result.summary = (f"{len(ctx.ranks)} node(s) answer, MTU {expected_mtu}"
                          + ("; GPU/EFA counts skipped (local target)" if local
                             else f"; {instance.gpus} GPUs, {instance.efa_interfaces} EFA each"))

