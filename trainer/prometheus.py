"""Per-rank training metrics for Prometheus, through node exporter's textfile collector.

After every optimizer step each rank rewrites one file, `<metrics.prometheus_dir>/fsdp-trainer-<job>-
rank<R>.prom` (written to a temporary name, then renamed, so a scrape never reads half a file), and
removes it when training ends. Under Slurm `<job>` is the Slurm job id, not the run id: a worker
killed mid-step cannot remove its file, and the batch script's next attempt (a new run id) then
rewrites the same file and removes it at the end instead of leaving a copy exported for ever.

Node exporter serves the files with the node's own metrics, so Prometheus finds every rank of every job
without knowing ports or ranks in advance.

Why the textfile collector and not an HTTP port per rank: the node exporter is already scraped on
every node (its `up` is checked), nothing in the training process listens on a socket (no port to
allocate per local rank, no clash when torchrun restarts workers, no listener to bind to the right
address), and no Python dependency has to reach the offline nodes. The cost is resolution: a value
is seen once per scrape interval, which is what the dashboards and checks read anyway.

Every series carries `job` (torchrun's run id), `rank` and `host`. The exposition format is written
here directly (a handful of gauges; prometheus-client is not needed for that).
"""

from __future__ import annotations

import mmap
import os
import socket
import time
from pathlib import Path

from trainer.config import MetricsConfig
from trainer.distributed import Runtime
from trainer.errors import ConfigError, Problem
from trainer.metrics import current_memory_bytes
from trainer.records import StepRecord

MIB = 2**20
# name -> help; every one is a gauge (the step is a gauge too: a restart from a checkpoint lowers it).
METRICS = {
    "fsdp_trainer_step": "Optimizer steps done.",
    "fsdp_trainer_loss": "Training loss of the last step (mean over ranks).",
    "fsdp_trainer_tokens_per_second": "Tokens per second of the whole job (last step).",
    "fsdp_trainer_rank_tokens_per_second": "Tokens/s this rank processed (its share, its step time).",
    "fsdp_trainer_mfu": "Model FLOPs utilisation of the last step (0 when the device peak is unknown).",
    "fsdp_trainer_step_seconds": "Wall time of the last optimizer step on this rank.",
    "fsdp_trainer_grad_sync_share": "Share of the step spent in gradient synchronisation (NaN unmeasured).",
    "fsdp_trainer_peak_memory_bytes": "Peak memory of this rank (CUDA allocator peak; CPU: peak RSS).",
    "fsdp_trainer_host_rss_bytes": "Resident set size of this rank's process now.",
    "fsdp_trainer_device_memory_bytes": "Device memory allocated by this rank now (0 on CPU).",
    "fsdp_trainer_last_update_seconds": "Unix time of the last update of this file.",
}


class RankMetrics:
    """One rank's metrics file (and the test-only leak of metrics.fault_leak_*)."""

    def __init__(self, cfg: MetricsConfig, runtime: Runtime):
        self.cfg, self.runtime = cfg, runtime
        self.job = os.environ.get("TORCHELASTIC_RUN_ID") or "standalone"
        self.labels = {"job": self.job, "rank": str(runtime.rank), "host": socket.gethostname()}
        owner = os.environ.get("SLURM_JOB_ID") or self.job  # one file per rank for every attempt of a job
        name = f"fsdp-trainer-{_safe(owner)}-rank{runtime.rank}.prom"
        self.path = Path(cfg.prometheus_dir) / name if cfg.prometheus_dir else None
        self._leaked: list[mmap.mmap] = []

    @classmethod
    def create(cls, cfg: MetricsConfig, runtime: Runtime) -> RankMetrics | None:
        """None when neither export nor fault injection is configured; ConfigError when the directory
        cannot take the file."""
        directory = cfg.prometheus_dir
        if directory and not (os.path.isdir(directory) and os.access(directory, os.W_OK)):
            raise ConfigError([Problem("metrics.prometheus_dir", directory,
                                       "is not a directory this user can write",
                                       "run `fsdpctl configure --tags monitoring` (it creates node "
                                       "exporter's textfile directory), or leave metrics.prometheus_dir "
                                       "empty")])
        return cls(cfg, runtime) if directory or cfg.fault_leak_mib_per_step else None

    def after_step(self, records: list[StepRecord]) -> None:
        """After every step, with the records MetricsLogger.log_step wrote for it (none between log
        intervals: the file is rewritten at metrics.log_interval, from the newest record)."""
        if self.cfg.fault_leak_mib_per_step and self.runtime.rank == self.cfg.fault_leak_rank:
            self._leak(max(mmap.PAGESIZE, int(self.cfg.fault_leak_mib_per_step * MIB)))
        if records:
            self.update(records[-1])

    def _leak(self, size: int) -> None:
        """Keep `size` more bytes resident: fresh pages from the kernel, each written once (an unwritten
        page stays unbacked). Memory from malloc could be a chunk this process freed earlier and that is
        still resident, which grows nothing (seen in a test process that had run other tests first)."""
        block = mmap.mmap(-1, size)
        for offset in range(0, size, mmap.PAGESIZE):
            block[offset] = 1
        self._leaked.append(block)

    def update(self, record: StepRecord) -> None:
        """`record` is one of MetricsLogger.log_step's lines (global figures, this rank's memory)."""
        if self.path is None:
            return
        host_rss, device_memory = current_memory_bytes(self.runtime.device)
        values = {
            "fsdp_trainer_step": record.step,
            "fsdp_trainer_loss": record.loss,
            "fsdp_trainer_tokens_per_second": record.tokens_per_s,
            "fsdp_trainer_rank_tokens_per_second": record.tokens_per_s / self.runtime.world_size,
            "fsdp_trainer_mfu": record.mfu or 0.0,
            "fsdp_trainer_step_seconds": record.step_time_s,
            "fsdp_trainer_grad_sync_share": _or_nan(record.grad_sync_share),
            "fsdp_trainer_peak_memory_bytes": record.mem_bytes_per_rank[self.runtime.rank],
            "fsdp_trainer_host_rss_bytes": host_rss,
            "fsdp_trainer_device_memory_bytes": device_memory,
            "fsdp_trainer_last_update_seconds": time.time(),
        }
        self._write(render(values, self.labels))

    def _write(self, text: str) -> None:
        assert self.path is not None
        tmp = self.path.with_name(self.path.name + ".tmp")  # not *.prom: the collector skips it
        tmp.write_text(text)
        tmp.replace(self.path)

    def close(self) -> None:
        """The job is over: its series must not stay exported as if it were running."""
        for block in self._leaked:
            block.close()
        self._leaked.clear()
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def render(values: dict[str, float], labels: dict[str, str]) -> str:
    """Prometheus text exposition format, one gauge per metric."""
    label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    lines = []
    for name, value in values.items():
        lines += [f"# HELP {name} {METRICS[name]}", f"# TYPE {name} gauge",
                  f"{name}{{{label_text}}} {value!r}"]
    return "\n".join(lines) + "\n"


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
