"""The memory fit of the spec's trainer config on the planned cluster, for `fsdpctl plan`: the
trainer's own estimator (`fsdp-train --estimate`, docs/trainer.md) on every GPU of every node."""

from __future__ import annotations

import textwrap
from typing import Any

from fsdpctl.plan.render import WIDTH
from infra.spec import ClusterSpec

# The estimator's --gpu names by the catalog's gpu_model (infra/data/instance_types.yaml).
ESTIMATOR_GPUS = {"A100-SXM4-40GB": "a100-40gb", "A100-SXM4-80GB": "a100-80gb", "H100-SXM5-80GB": "h100",
                  "H200-SXM5-141GB": "h200"}


def memory_fit(spec: ClusterSpec, config: str) -> dict[str, Any]:
    """Per-rank memory of the trainer config on node_count x (GPUs per node) ranks of the spec's GPU,
    and whether it fits; `{"skipped": why}` where it cannot be computed here."""
    try:  # the operator's venv has torch with the trainer extra (the default install), not always
        from trainer.config import load_config
        from trainer.errors import ConfigError as TrainerConfigError
        from trainer.estimate import GIB, estimate
    except ImportError as e:
        return {"skipped": f"the trainer is not installed here ({e}); pip install -e '.[trainer]' adds it"}
    instance = spec.instance
    gpu = ESTIMATOR_GPUS.get(instance.gpu_model)
    ranks_per_node = spec.trainer.nproc_per_node or instance.gpus
    world_size = spec.node_count * ranks_per_node
    try:
        result = estimate(load_config(config), world_size, gpu, ranks_per_node=ranks_per_node)
    except TrainerConfigError as e:
        return {"skipped": f"trainer config {config!r} on {world_size} ranks: {e.problems[0]}"}
    return {"config": config, "gpu": gpu, "world_size": world_size,
            "per_rank_gib": round(result.total / GIB, 2),
            "usable_gib": round((result.usable_bytes or 0) / GIB, 1),
            "fits": result.fits, "smallest_fitting_world_size": result.smallest_fitting_world_size}


def render_fit(fit: dict[str, Any]) -> str:
    return textwrap.fill(_fit_text(fit), WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def _fit_text(fit: dict[str, Any]) -> str:
    if "skipped" in fit:
        return f"Memory fit: not computed: {fit['skipped']}"
    line = (f"Memory fit (fsdp-train --estimate): trainer config {fit['config']} on {fit['world_size']} x "
            f"{fit['gpu']} needs {fit['per_rank_gib']:.1f} GiB per GPU of {fit['usable_gib']:.1f} usable: ")
    if fit["fits"]:
        return line + "fits"
    smallest = fit["smallest_fitting_world_size"]
    return line + ("does NOT fit; " + (f"the smallest cluster that fits has {smallest} GPUs" if smallest
                                       else "no cluster size fits as configured")
                   + " (docs/trainer.md, the estimator)")
