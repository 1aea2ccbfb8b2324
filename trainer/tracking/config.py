"""What a run reports to experiment trackers (`tracking.*` in the trainer config)."""

from __future__ import annotations

from typing import Literal

import pydantic


class _Section(pydantic.BaseModel):
    # As trainer.config's _Section (each field's docstring documents it; pydantic is not asked to read
    # them). Not that class: that module imports this one.
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


class WandbConfig(_Section):
    """A Weights & Biases run (needs `pip install 'fsdp-cluster[tracking]'`)."""

    project: str = pydantic.Field(min_length=1)
    """W&B project the run belongs to."""
    entity: str | None = None
    """W&B team or user; empty means the API key's default entity."""
    name: str | None = None
    """Display name of the run; empty lets W&B pick one."""
    mode: Literal["online", "offline"] = "offline"
    """offline: write the run to `<dir>/wandb/offline-run-*` and touch no network (upload later with
    `wandb sync`); online: stream to the W&B server (needs WANDB_API_KEY on the main rank's node)."""
    dir: str | None = None
    """Directory W&B writes its `wandb/` run folder into; empty means the metrics file's directory
    (no metrics.file: the working directory)."""


class MlflowConfig(_Section):
    """An MLflow run (needs `pip install 'fsdp-cluster[tracking]'`)."""

    tracking_uri: str | None = None
    """Where runs go: a server (`http://host:5000`) or a local file store (`file:/shared/mlruns`, no
    network); empty means `file:<metrics file's directory>/mlruns` (no metrics.file: `file:./mlruns`)."""
    experiment: str = pydantic.Field(min_length=1)
    """Experiment name; created when it does not exist."""
    run_name: str | None = None
    """Display name of the run; empty lets MLflow pick one."""


class TrackingConfig(_Section):
    """Experiment trackers: each gets exactly the records of the metrics JSONL (rank 0 writes them)."""

    tensorboard_dir: str | None = None
    """TensorBoard event files; empty: `<metrics file without .jsonl>.tensorboard/` next to metrics.file
    (no metrics.file: no TensorBoard)."""
    wandb: WandbConfig | None = None
    """A Weights & Biases run as well; empty: none."""
    mlflow: MlflowConfig | None = None
    """An MLflow run as well; empty: none."""
