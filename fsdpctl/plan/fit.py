"""The memory fit of a trainer config on the planned cluster, for `fsdpctl plan`: the trainer's own
layout check and estimator (`fsdp-train --estimate`, docs/trainer.md) on every GPU of every node."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from fsdpctl.checks.batch import assignments, batch_settings
from fsdpctl.plan.render import WIDTH
from infra.spec import ClusterSpec

if TYPE_CHECKING:  # the trainer is an optional extra (memory_fit says when it is missing)
    from trainer.config import TrainConfig

# The estimator's --gpu names by the catalog's gpu_model (infra/data/instance_types.yaml).
ESTIMATOR_GPUS = {"A100-SXM4-40GB": "a100-40gb", "A100-SXM4-80GB": "a100-80gb", "H100-SXM5-80GB": "h100",
                  "H200-SXM5-141GB": "h200"}


class MemoryFit(BaseModel):
    """A trainer config's memory on the planned cluster, as `plan --json` shows it under `memory_fit`:
    only `skipped` where it could not be computed; the layout without figures where the trainer
    refuses the config on that many ranks; else the estimator's figures."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    skipped: str | None = None
    """Why the fit was not computed (the trainer not installed, a config it refuses to load)."""
    config: str | None = None
    """The trainer config: a shipped name or a YAML path."""
    smoke_test_batch: bool | None = None
    """Whether the config ran with the batch the smoke test and scale-test set for the world size."""
    world_size: int | None = None
    nodes: int | None = None
    ranks_per_node: int | None = None
    runs_on_spec: bool | None = None
    """False where the trainer refuses the config on world_size ranks (layout_problems say why)."""
    layout_problems: list[str] | None = None
    gpu: str | None = None
    """The estimator's name of the spec's GPU (`fsdp-train --estimate --gpu`)."""
    per_rank_gib: float | None = None
    usable_gib: float | None = None
    fits: bool | None = None
    smallest_fitting_world_size: int | None = None
    """The fewest ranks of this GPU the config fits on; None where no size fits as configured."""

    def as_json(self) -> dict[str, object]:
        """The fields that apply to this fit (those set), as `plan --json` writes them."""
        return self.model_dump(mode="json", exclude_unset=True)


def memory_fit(spec: ClusterSpec, config: str, *, smoke_test_batch: bool) -> MemoryFit:
    """Per-rank memory of the trainer config on node_count x (GPUs per node) ranks of the spec's GPU,
    and whether it fits; with `smoke_test_batch`, with the batch the smoke test and scale-test set
    (fsdpctl/checks/batch.py)."""
    try:  # the operator's venv has torch with the trainer extra (the default install), not always
        from trainer.config import derive_layout
        from trainer.errors import ConfigError as TrainerConfigError
        from trainer.estimate import GIB, estimate
    except ImportError as e:
        return MemoryFit(skipped=trainer_missing(e))
    instance = spec.instance
    gpu = ESTIMATOR_GPUS.get(instance.gpu_model)
    ranks_per_node = spec.trainer.nproc_per_node or instance.gpus
    world_size = spec.node_count * ranks_per_node
    try:
        cfg = load_trainer_config(config, world_size, smoke_test_batch=smoke_test_batch)
    except TrainerConfigError as e:
        return MemoryFit(skipped=f"trainer config {config!r}: {e.problems[0]}")
    layout = {"config": config, "smoke_test_batch": smoke_test_batch, "world_size": world_size,
              "nodes": spec.node_count, "ranks_per_node": ranks_per_node}
    try:
        derive_layout(cfg, world_size, min(ranks_per_node, world_size))
    except TrainerConfigError as e:
        return MemoryFit(**layout, runs_on_spec=False, layout_problems=[str(p) for p in e.problems])
    result = estimate(cfg, world_size, gpu, ranks_per_node=ranks_per_node)
    return MemoryFit(**layout, runs_on_spec=True, gpu=gpu, per_rank_gib=round(result.total / GIB, 2),
                     usable_gib=round((result.usable_bytes or 0) / GIB, 1), fits=result.fits,
                     smallest_fitting_world_size=result.smallest_fitting_world_size)


def trainer_missing(error: ImportError) -> str:
    return f"the trainer is not installed here ({error}); pip install -e '.[trainer]' adds it"


def load_trainer_config(config: str, world_size: int, *, smoke_test_batch: bool) -> TrainConfig:
    """The trainer config as it would run on `world_size` ranks: as it is, or with the batch the
    smoke test and scale-test set for that world size. Raises the trainer's ConfigError."""
    from trainer.config import load_config

    return load_config(config, assignments(batch_settings(world_size)) if smoke_test_batch else [])


def render_fit(fit: MemoryFit) -> str:
    return textwrap.fill(_fit_text(fit), WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def _fit_text(fit: MemoryFit) -> str:
    if fit.skipped is not None:
        return f"Memory fit: not computed: {fit.skipped}"
    batch = ", with the smoke test's batch," if fit.smoke_test_batch else ""
    config = f"trainer config {fit.config}{batch}"
    if not fit.runs_on_spec:
        return (f"Warning: {config} cannot run on this cluster's {fit.world_size} ranks ({fit.nodes} "
                f"nodes x {fit.ranks_per_node}; the trainer refuses it at launch): "
                f"{'; '.join(fit.layout_problems or [])}. Memory fit: not computed.")
    line = (f"Memory fit (fsdp-train --estimate): {config} on {fit.world_size} x {fit.gpu} needs "
            f"{fit.per_rank_gib:.1f} GiB per GPU of {fit.usable_gib:.1f} usable: ")
    if fit.fits:
        return line + "fits"
    return line + f"does NOT fit; {_instead(fit)} (docs/trainer.md, the estimator)"


def _instead(fit: MemoryFit) -> str:
    smallest = fit.smallest_fitting_world_size
    return (f"the smallest cluster that fits has {smallest} GPUs" if smallest
            else "no cluster size fits as configured")


def misfit(fit: MemoryFit) -> str | None:
    """What `plan` fails with when the trainer config does not fit the planned GPUs; None when it fits
    or was not computed."""
    if fit.fits is not False:
        return None
    return (f"trainer config {fit.config} does not fit: it needs {fit.per_rank_gib:.1f} GiB per GPU of "
            f"{fit.usable_gib:.1f} usable on {fit.world_size} x {fit.gpu}; {_instead(fit)}. Plan "
            "more or larger GPUs, or change the config (docs/trainer.md, \"Will it fit?\")")
