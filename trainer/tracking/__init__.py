"""Experiment tracking: the metrics JSONL's records as TensorBoard event files (always, next to the
JSONL), and in a Weights & Biases or MLflow run when `tracking.wandb` / `tracking.mlflow` say so.

Wiring (the main rank writes, the others get a tracker that does nothing):
`Tracker.create(cfg.tracking, ...)` before the first step, `tracker.log(records)` with what each metrics
flush returns, `tracker.close(summary)` with the metrics summary.
"""

from __future__ import annotations

from trainer.tracking.config import MlflowConfig, TrackingConfig, WandbConfig
from trainer.tracking.trackers import Tracker

__all__ = ["MlflowConfig", "Tracker", "TrackingConfig", "WandbConfig"]
