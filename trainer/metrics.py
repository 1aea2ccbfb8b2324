"""Per-step metrics: one JSON object per optimizer step in `--metrics-file` (rank 0 writes it), a final
`{"event": "summary"}` object, and a progress line on stderr.

grad_sync_s is measured, not estimated. Every micro-batch but the last runs with gradient
communication switched off (gradient accumulation), the last one with it on; all of them do the same
forward/backward compute and the same parameter all-gathers. So the synchronising micro-batch's wall
time minus the mean wall time of the others is the gradient communication that was not hidden behind
compute (device-synchronised timings on CUDA). With gradient_accumulation = 1 there is no
non-synchronising micro-batch to compare with and the value is null.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.config import MetricsConfig
from trainer.distributed import Runtime

# Dense bf16 tensor-core peak per device (fsdp-facts.md); MFU is null for anything else unless
# metrics.peak_flops says.
PEAK_BF16_FLOPS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12))


def device_peak_flops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the caching allocator's high-water mark. CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def gather_loss_and_memory(loss: torch.Tensor, device: torch.device) -> tuple[list[float], list[int]]:
    """Every rank's loss and peak memory, in one all-gather."""
    mine = torch.stack([loss.detach().double(), torch.tensor(float(peak_memory_bytes(device)),
                                                             dtype=torch.float64, device=device)])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [float(g[0]) for g in gathered], [int(g[1]) for g in gathered]


def stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class MetricsLogger:
    def __init__(self, cfg: MetricsConfig, runtime: Runtime, *, total_steps: int, tokens_per_step: int,
                 samples_per_step: int, flops_per_token: int, run_info: dict, hosts: list[str],
                 log: Callable[[str], None] = stderr_log):
        self.cfg, self.runtime, self.total_steps, self.log = cfg, runtime, total_steps, log
        self.tokens_per_step, self.samples_per_step = tokens_per_step, samples_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = device_peak_flops(runtime.device, cfg.peak_flops)
        self.info = {"world_size": runtime.world_size, "nodes": runtime.num_nodes,
                     "ranks_per_node": runtime.local_world_size, "device": runtime.device.type, **run_info}
        self.hosts = hosts  # per rank; in the summary only, to keep step lines short at scale
        self.records: list[dict] = []
        self.started = time.perf_counter()
        self._file = None
        if runtime.is_main and cfg.file:
            Path(cfg.file).parent.mkdir(parents=True, exist_ok=True)
            # Append: a resumed run continues the same file.
            self._file = open(cfg.file, "a")  # noqa: SIM115 - closed in close()

    def _write(self, obj: dict) -> None:
        if self._file:
            self._file.write(json.dumps(obj) + "\n")
            self._file.flush()

    def log_step(self, *, step: int, loss: float, lr: float, grad_norm: float, step_time_s: float,
                 grad_sync_s: float | None, mem_per_rank: list[int], skipped: bool = False) -> dict:
        tokens_per_s = self.tokens_per_step / step_time_s
        mfu = None
        if self.peak_flops:
            mfu = self.flops_per_token * tokens_per_s / self.runtime.world_size / self.peak_flops
        record = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s, "samples_per_s": self.samples_per_step / step_time_s,
            "step_time_s": step_time_s, "grad_sync_s": grad_sync_s,
            "grad_sync_share": None if grad_sync_s is None else grad_sync_s / step_time_s,
            "mfu": mfu, "max_mem_bytes": max(mem_per_rank), "mem_bytes_per_rank": mem_per_rank,
            "mem_max_min_ratio": max(mem_per_rank) / max(1, min(mem_per_rank)),
            "skipped": skipped, **self.info,
        }
        self.records.append(record)
        self._write(record)
        if self.runtime.is_main and (step % self.cfg.log_interval == 0 or step == self.total_steps):
            sync = "-" if grad_sync_s is None else f"{record['grad_sync_share']:.0%}"
            self.log(f"step {step}/{self.total_steps} loss {loss:.4f} lr {lr:.2e} grad_norm {grad_norm:.3f} "
                     f"{tokens_per_s:,.0f} tok/s step {step_time_s:.3f}s grad sync {sync} "
                     f"mem {record['max_mem_bytes'] / 2**30:.2f} GiB"
                     + ("" if mfu is None else f" MFU {mfu:.1%}")
                     + (" (skipped: inf/nan)" if skipped else ""))
        return record

    def close(self) -> dict:
        """Write and return the summary: steady-state means exclude the first step (lazy init,
        allocator warm-up, compilation)."""
        steady = self.records[1:] or self.records

        def mean(key: str) -> float | None:
            values = [r[key] for r in steady if r[key] is not None]
            return sum(values) / len(values) if values else None

        summary = {
            "event": "summary", "steps": len(self.records),
            "first_step": self.records[0]["step"] if self.records else None,
            "last_step": self.records[-1]["step"] if self.records else None,
            "first_loss": self.records[0]["loss"] if self.records else None,
            "final_loss": self.records[-1]["loss"] if self.records else None,
            "min_loss": min((r["loss"] for r in self.records), default=None),
            "tokens_per_s": mean("tokens_per_s"), "samples_per_s": mean("samples_per_s"),
            "step_time_s": mean("step_time_s"), "grad_sync_s": mean("grad_sync_s"),
            "grad_sync_share": mean("grad_sync_share"), "mfu": mean("mfu"),
            "max_mem_bytes": max((r["max_mem_bytes"] for r in self.records), default=None),
            "mem_max_min_ratio": max((r["mem_max_min_ratio"] for r in self.records), default=None),
            "skipped_steps": sum(r["skipped"] for r in self.records),
            "wall_time_s": time.perf_counter() - self.started, **self.info, "rank_hosts": self.hosts,
        }
        self._write(summary)
        if self._file:
            self._file.close()
            self._file = None
        return summary
