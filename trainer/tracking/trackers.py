"""The metrics JSONL's records, step by step, in experiment trackers: TensorBoard event files always
(next to the JSONL), a Weights & Biases and an MLflow run when configured.

Only the main rank writes. wandb and mlflow are optional: imported only when configured, both when the
tracker is created (before the first step), so a missing library stops the run before any training.
Offline modes touch no network: W&B offline with its error reporting off, MLflow on a file store with
its usage telemetry off.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

import pydantic

from trainer.errors import ConfigError, Problem
from trainer.records import EvalRecord, StepRecord, SummaryRecord
from trainer.tracking.config import MlflowConfig, TrackingConfig, WandbConfig
from trainer.tracking.scalars import Steps, scalars, summary_step


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """Every leaf of a nested config as `section.key` -> its text (MLflow parameters are strings)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


class _Sink(Protocol):
    def log(self, steps: Steps) -> None: ...

    def close(self, summary: dict) -> None: ...


class WandbSink:
    def __init__(self, cfg: WandbConfig, directory: Path, run_config: dict):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name, mode=cfg.mode,
                              dir=directory, config=run_config, settings=wandb.Settings(silent=True))

    def log(self, steps: Steps) -> None:
        for step, values in steps:
            # commit: write the row now, not when the next step comes: otherwise the last row would be
            # written at finish(), after the run summary, and overwrite the summary's keys it shares.
            self.run.log(values, step=step, commit=True)

    def close(self, summary: dict) -> None:
        self.run.summary.update({key: value for key, value in summary.items() if key != "event"})
        self.run.finish()


class MlflowSink:
    def __init__(self, cfg: MlflowConfig, tracking_uri: str, run_config: dict):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=tracking_uri)
        experiment = self.client.get_experiment_by_name(cfg.experiment)
        experiment_id = (experiment.experiment_id if experiment
                         else self.client.create_experiment(cfg.experiment))
        self.run_id = self.client.create_run(experiment_id, run_name=cfg.run_name).info.run_id
        self.client.log_batch(self.run_id, params=[Param(key, value)
                                                   for key, value in flat_params(run_config).items()])

    def log(self, steps: Steps) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        # One call for the whole flush (the client splits it into the server's batch limits).
        metrics = [Metric(key, float(value), now_ms, step)
                   for step, values in steps for key, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, summary: dict) -> None:
        self.log([(summary_step(summary), scalars(summary, "summary/"))])
        # The whole summary too: how the run stopped, the hosts (not numbers, so not metrics).
        self.client.log_dict(self.run_id, summary, "summary.json")
        self.client.set_terminated(self.run_id)


def _is_file_store(uri: str) -> bool:
    return urlparse(uri).scheme in ("", "file")


def _missing_library(module: str, key: str, section: pydantic.BaseModel) -> Problem | None:
    try:
        importlib.import_module(module)
    except ImportError as error:
        return Problem(key, section.model_dump(),
                       f"needs the {module} package, which is not installed here ({error})",
                       f"pip install 'fsdp-cluster[tracking]' (wandb, mlflow-skinny) where the trainer runs, "
                       f"or remove {key}")
    return None


class Tracker:
    """Sends the metrics records to TensorBoard and the configured trackers. Call `log` with the records
    of each metrics flush and `close` with the run summary."""

    def __init__(self, sinks: list[_Sink]):
        self.sinks = sinks

    @classmethod
    def create(cls, cfg: TrackingConfig, *, metrics_file: str | None, run_config: dict,
               is_main: bool) -> Tracker:
        """Only the main rank (rank 0) writes anything; other ranks get a tracker that does nothing.
        run_config: the whole trainer config as a plain, JSON-able dict (logged as hyperparameters).
        Raises ConfigError naming every configured tracker whose library is not installed."""
        if not is_main:
            return cls([])
        metrics_dir = Path(metrics_file).parent if metrics_file else Path()
        mlflow_uri = None
        if cfg.mlflow:
            mlflow_uri = cfg.mlflow.tracking_uri or (metrics_dir / "mlruns").resolve().as_uri()
        _offline_environment(cfg, mlflow_uri)
        cls.check(cfg)
        sinks: list[_Sink] = []
        tensorboard_dir = cfg.tensorboard_dir or (
            metrics_file and metrics_file.removesuffix(".jsonl") + ".tensorboard")
        if tensorboard_dir:
            # Imported here, by the main rank alone: tensorboardX (with the boto3 it imports) is a tenth
            # of a second of every process's start.
            from trainer.tracking.tensorboard import TensorBoardSink

            sinks.append(TensorBoardSink(tensorboard_dir, run_config))
        if cfg.wandb:
            sinks.append(WandbSink(cfg.wandb, Path(cfg.wandb.dir) if cfg.wandb.dir else metrics_dir,
                                   run_config))
        if cfg.mlflow:
            sinks.append(MlflowSink(cfg.mlflow, mlflow_uri, run_config))
        return cls(sinks)

    @staticmethod
    def check(cfg: TrackingConfig) -> None:
        """ConfigError naming every configured tracker whose library is not installed: every rank calls
        it before any process group exists, so a missing library stops the launch, not rank 0 alone."""
        wanted = {"wandb": cfg.wandb, "mlflow": cfg.mlflow}
        problems = [problem for module, section in wanted.items() if section is not None
                    and (problem := _missing_library(module, f"tracking.{module}", section))]
        if problems:
            raise ConfigError(problems)

    def log(self, records: Sequence[StepRecord | EvalRecord]) -> None:
        """The records of one metrics flush (one per optimizer step), or an evaluation's: each numeric
        field becomes a scalar at the record's step, named as in the JSONL."""
        steps = [(record.step, scalars(record.model_dump(exclude={"step"}))) for record in records]
        if steps:
            for sink in self.sinks:
                sink.log(steps)

    def close(self, summary: SummaryRecord) -> None:
        """Write the run summary, flush and close every tracker (all of them, even if one fails)."""
        fields = summary.model_dump()
        with contextlib.ExitStack() as closing:
            for sink in self.sinks:
                closing.callback(sink.close, fields)


def _offline_environment(cfg: TrackingConfig, mlflow_uri: str | None) -> None:
    """Settings the libraries read from the environment only, set before they are imported; setdefault:
    what the user's environment says wins."""
    if cfg.wandb and cfg.wandb.mode == "offline":
        # wandb-core reports its own errors to W&B's servers unless told not to.
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    if mlflow_uri and _is_file_store(mlflow_uri):
        # MLflow 3 refuses a file store unless asked (it wants a database; mlflow-skinny has no SQL
        # driver), and `import mlflow` fetches its usage-telemetry settings from the internet.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
