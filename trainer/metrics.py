"""Per-step metrics: one JSON object per optimizer step in `--metrics-file` (rank 0 writes it), a final
`{"event": "summary"}` object, and a progress line on stderr. The records are trainer/records.py's
types, which fsdpctl reads back.

Nothing here synchronises the device per step: losses and gradient norms stay device tensors until
the log interval, where one all-gather brings every rank's values and peak memory to rank 0.
grad_sync_s / grad_sync_share come from the collectives themselves on sampled steps
(trainer/commtime.py: the gradient reduce-scatter/all-reduce time that no compute overlapped) and
are null on the other steps. comm_bytes is what each rank handed to FSDP2's all-gathers, reduce-scatters
and all-reduces in the step (trainer/commbytes.py, counted on every step), null where not counted.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from trainer.commtime import CommTime
from trainer.config import MetricsConfig
from trainer.distributed import Runtime
from trainer.records import CommBytes, EvalRecord, RunFacts, StepRecord, SummaryRecord

if TYPE_CHECKING:
    from trainer.evaluate import EvalResult

# Dense bf16 tensor-core peak per device variant, by the name CUDA reports (NVIDIA data sheets); more
# specific names first. MFU is null for anything else unless metrics.peak_flops says.
PEAK_BF16_FLOPS = (
    ("H200 NVL", 835e12),
    ("H200", 989e12),  # SXM
    ("H100 NVL", 835e12),
    ("H100 PCIE", 756e12),
    ("H100", 989e12),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    ("A100", 312e12),  # 40 GB and 80 GB, SXM and PCIe
)


def peak_flops_for_name(name: str) -> float | None:
    upper = name.upper()
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in upper), None)


def device_peak_flops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device))


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the caching allocator's high-water mark. CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def current_memory_bytes(device: torch.device) -> tuple[int, int]:
    """This process's resident set now and, on CUDA, the device memory its tensors hold now (0 on
    CPU): what a leak grows, where the peak may hide it under an earlier high-water mark."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * resource.getpagesize()
    return rss, torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


@dataclass
class RankMemory:
    """One rank's memory at a flush, in bytes."""

    peak: int
    host_rss: int
    device: int


def gather_loss_and_memory(loss: torch.Tensor, device: torch.device) -> tuple[list[float], list[int]]:
    """Every rank's loss and peak memory, in one all-gather."""
    losses, memory = gather_steps([loss], device)
    return [per_rank[0] for per_rank in losses], [m.peak for m in memory]


def gather_steps(losses: list[torch.Tensor], device: torch.device
                 ) -> tuple[list[list[float]], list[RankMemory]]:
    """Every rank's losses of the buffered steps and its memory (peak, resident now, device now), in
    one all-gather and one device-to-host copy: the only synchronisation of a logging interval."""
    memory = [float(peak_memory_bytes(device)), *map(float, current_memory_bytes(device))]
    mine = torch.cat([torch.stack([loss.detach().double() for loss in losses]),
                      torch.tensor(memory, dtype=torch.float64, device=device)])
    gathered = torch.empty(dist.get_world_size() * mine.numel(), dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(gathered, mine)
    rows = gathered.view(dist.get_world_size(), -1).tolist()
    return [row[:-3] for row in rows], [RankMemory(*map(int, row[-3:])) for row in rows]


def drop_unfinished_line(path: Path, chunk: int = 1 << 16) -> None:
    """Cut a last line without its newline from a metrics file: a run killed while writing a line
    (a long one takes more than one write) leaves it so, and the lines a resumed run appends must
    not continue it. Every line of the file then is a whole record (trainer.records.parse_metrics
    refuses any other)."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        while end > 0:
            start = max(0, end - chunk)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                f.truncate(start + newline + 1)
                return
            end = start
        f.truncate(0)


def stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class _Pending:
    step: int
    loss: torch.Tensor  # this rank's mean micro-batch loss, still on the device
    grad_norm: torch.Tensor
    lr: float
    skipped: bool
    comm: CommTime | None
    step_time_s: float | None  # device-synchronised, profiled steps only
    comm_bytes: CommBytes | None
    # Mixture of experts only: this rank's load-balancing loss and top-k assignments per expert.
    router_aux_loss: torch.Tensor | None = None
    tokens_per_expert: torch.Tensor | None = None  # [MoE blocks, n_experts]


class MetricsLogger:
    """Buffers each step's loss and gradient norm as device tensors and, every `metrics.log_interval`
    steps (and after the first step, the last one, a checkpoint or a stop), gathers them over the ranks
    in one collective, then writes one record per buffered step. tokens/s is the wall time between two
    such flushes divided into the tokens of the steps between them (torchtitan's way): no
    per-step device synchronisation."""

    def __init__(self, cfg: MetricsConfig, runtime: Runtime, *, total_steps: int, tokens_per_step: int,
                 samples_per_step: int, flops_per_token: int, strategy: str, params: int,
                 hosts: list[str], log: Callable[[str], None] = stderr_log):
        self.cfg, self.runtime, self.total_steps, self.log = cfg, runtime, total_steps, log
        self.tokens_per_step, self.samples_per_step = tokens_per_step, samples_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = device_peak_flops(runtime.device, cfg.peak_flops)
        self.facts = RunFacts(world_size=runtime.world_size, nodes=runtime.num_nodes,
                              ranks_per_node=runtime.local_world_size, device=runtime.device.type,
                              strategy=strategy, params=params)
        self.hosts = hosts  # per rank; in the summary only, to keep step lines short at scale
        self.records: list[StepRecord] = []
        self.evals: list[EvalRecord] = []
        self.pending: list[_Pending] = []
        self.started = time.perf_counter()
        self.last_flush = self.started
        # The measured window: from the end of the run's first step (lazy initialisation, allocator
        # warm-up, compilation) to the last flush, less the profiler's own work.
        self.window_start: float | None = None
        self.window_steps = 0
        self.window_wall = 0.0
        self.overhead_s = 0.0
        self._file = None
        if runtime.is_main and cfg.file:
            Path(cfg.file).parent.mkdir(parents=True, exist_ok=True)
            # Append: a resumed run continues the same file.
            drop_unfinished_line(Path(cfg.file))
            self._file = open(cfg.file, "a")  # noqa: SIM115 - closed in close()

    def _write(self, record: StepRecord | EvalRecord | SummaryRecord) -> None:
        if self._file:
            # One write of the whole line: a reader sees a line without its newline only while it is
            # being written (trainer.records.parse_metrics leaves that one out).
            self._file.write(record.json_line() + "\n")
            self._file.flush()

    def start(self) -> None:
        """Call just before the first step: its wall time starts here."""
        self.last_flush = time.perf_counter()

    def should_profile(self, step: int, first_step: int) -> bool:
        """Sampled steps: the 2nd..(1+profile_steps)th of the run, then the same every profile_interval."""
        offset = (step - first_step) % self.cfg.profile_interval
        return self.cfg.profile_steps > 0 and 1 <= offset <= self.cfg.profile_steps

    def log_step(self, *, step: int, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor,
                 skipped: bool = False, comm: CommTime | None = None, step_time_s: float | None = None,
                 overhead_s: float = 0.0, flush: bool = False,
                 comm_bytes: CommBytes | None = None, router_aux_loss: torch.Tensor | None = None,
                 tokens_per_expert: torch.Tensor | None = None) -> list[StepRecord]:
        """`overhead_s`: wall time that was not training (the profiler's own work on a sampled step),
        left out of the throughput. `comm_bytes`: the step's CommBytes.take(). `router_aux_loss`,
        `tokens_per_expert`: a mixture-of-experts step's (trainer/moe.py). Returns the records
        written (empty between log intervals)."""
        self.overhead_s += overhead_s
        self.pending.append(_Pending(step, loss, grad_norm, lr, skipped, comm, step_time_s, comm_bytes,
                                     router_aux_loss, tokens_per_expert))
        if (flush or not self.records or step % self.cfg.log_interval == 0 or step == self.total_steps):
            return self.flush()
        return []

    def flush(self) -> list[StepRecord]:
        """Collective: every rank calls it at the same steps."""
        if not self.pending:
            return []
        pending, self.pending = self.pending, []
        values = [p.loss for p in pending] + [p.grad_norm.reshape(()) for p in pending]
        moe = pending[0].router_aux_loss is not None
        if moe:
            values += [p.router_aux_loss for p in pending]
            # The load over the whole job: every rank's assignments summed, one collective per flush.
            routed = torch.stack([p.tokens_per_expert for p in pending]).double()
            dist.all_reduce(routed)
        per_rank, memory = gather_steps(values, self.runtime.device)
        mems = [m.peak for m in memory]
        now = time.perf_counter()
        wall, n = now - self.last_flush - self.overhead_s, len(pending)
        self.last_flush, self.overhead_s = now, 0.0
        if self.window_start is None:
            self.window_start = now
        else:
            self.window_steps += n
            self.window_wall += wall
        step_time_s = wall / n
        tokens_per_s = self.tokens_per_step / step_time_s
        mfu = None
        if self.peak_flops:
            mfu = self.flops_per_token * tokens_per_s / self.runtime.world_size / self.peak_flops
        out = []
        for i, p in enumerate(pending):
            losses = [row[i] for row in per_rank]
            comm, own_time = p.comm, p.step_time_s or step_time_s
            aux_loss = tokens_per_expert = load_max_over_mean = None
            if moe:
                load = routed[i]
                aux_loss = sum(row[2 * n + i] for row in per_rank) / len(per_rank)
                tokens_per_expert = load.long().tolist()
                # Per MoE block: the busiest expert's tokens over the mean (1.0: perfectly balanced).
                load_max_over_mean = (load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-9)).tolist()
            # Memory now was read at this flush, i.e. after the flush's last step (leak fits).
            last = i == n - 1
            record = StepRecord(
                **self.facts.model_dump(),
                step=p.step, loss=sum(losses) / len(losses), lr=p.lr, grad_norm=per_rank[0][n + i],
                tokens_per_s=tokens_per_s, samples_per_s=self.samples_per_step / step_time_s,
                step_time_s=step_time_s,
                # Gradient reduce-scatter/all-reduce time no compute overlapped (profiled steps only).
                grad_sync_s=None if comm is None else comm.gradient_exposed_s,
                grad_sync_share=None if comm is None else comm.gradient_exposed_s / own_time,
                comm_s=None if comm is None else comm.total_s,
                comm_exposed_s=None if comm is None else comm.exposed_s,
                comm_exposed_share=None if comm is None else comm.exposed_s / own_time,
                profiled_step_time_s=p.step_time_s if comm is not None else None,
                comm_bytes=p.comm_bytes, mfu=mfu, max_mem_bytes=max(mems), mem_bytes_per_rank=mems,
                mem_max_min_ratio=max(mems) / max(1, min(mems)), skipped=p.skipped,
                router_aux_loss=aux_loss, tokens_per_expert=tokens_per_expert,
                expert_load_max_over_mean=load_max_over_mean,
                host_rss_bytes_per_rank=[m.host_rss for m in memory] if last else None,
                device_mem_bytes_per_rank=([m.device for m in memory]
                                           if last and self.runtime.device.type == "cuda" else None))
            self.records.append(record)
            self._write(record)
            out.append(record)
        if self.runtime.is_main:
            r = out[-1]
            sync = "-" if r.grad_sync_share is None else f"{r.grad_sync_share:.0%}"
            self.log(f"step {r.step}/{self.total_steps} loss {r.loss:.4f} lr {r.lr:.2e} "
                     f"grad_norm {r.grad_norm:.3f} {tokens_per_s:,.0f} tok/s step {step_time_s:.3f}s "
                     f"grad sync {sync} mem {r.max_mem_bytes / 2**30:.2f} GiB"
                     + ("" if mfu is None else f" MFU {mfu:.1%}")
                     + (" (skipped: inf/nan)" if any(p.skipped for p in pending) else ""))
        return out

    def log_eval(self, step: int, result: EvalResult) -> EvalRecord:
        """A validation result as a record of its own, `{"event": "eval", "step", "eval_loss",
        "eval_tokens"}`, in the JSONL and the progress log; returns it."""
        record = EvalRecord(step=step, eval_loss=result.loss, eval_tokens=result.tokens)
        self._write(record)
        self.evals.append(record)
        if self.runtime.is_main:
            self.log(f"eval: step {step} loss {result.loss:.4f} over {result.tokens:,} tokens")
        return record

    def close(self, *, stopped: str = "completed", signal_name: str | None = None) -> SummaryRecord:
        """Flush, then write and return the summary. Throughput is the measured window's total tokens
        over its wall time (the steps after the first); with a single step, that step's."""
        self.flush()
        records = self.records
        profiled = [r for r in records[1:] or records if r.grad_sync_s is not None]
        counted = [r.comm_bytes for r in records if r.comm_bytes is not None]
        comm_bytes = None
        if counted:
            comm_bytes = {kind: round(sum(c[kind] for c in counted) / len(counted)) for kind in counted[0]}

        if self.window_steps and self.window_wall > 0:
            step_time_s = self.window_wall / self.window_steps
        else:
            step_time_s = records[0].step_time_s if records else None
        tokens_per_s = self.tokens_per_step / step_time_s if step_time_s else None
        mfu = None
        if self.peak_flops and tokens_per_s:
            mfu = self.flops_per_token * tokens_per_s / self.runtime.world_size / self.peak_flops
        summary = SummaryRecord(
            **self.facts.model_dump(), steps=len(records),
            first_step=records[0].step if records else None,
            last_step=records[-1].step if records else None,
            first_loss=records[0].loss if records else None,
            final_loss=records[-1].loss if records else None,
            min_loss=min((r.loss for r in records), default=None),
            eval_loss=self.evals[-1].eval_loss if self.evals else None,
            tokens_per_s=tokens_per_s,
            samples_per_s=self.samples_per_step / step_time_s if step_time_s else None,
            step_time_s=step_time_s, measured_steps=self.window_steps,
            measured_wall_s=self.window_wall if self.window_steps else None,
            grad_sync_s=_mean(r.grad_sync_s for r in profiled),
            grad_sync_share=_mean(r.grad_sync_share for r in profiled),
            comm_exposed_share=_mean(r.comm_exposed_share for r in profiled), profiled_steps=len(profiled),
            comm_bytes_per_step=comm_bytes, mfu=mfu,
            max_mem_bytes=max((r.max_mem_bytes for r in records), default=None),
            mem_max_min_ratio=max((r.mem_max_min_ratio for r in records), default=None),
            skipped_steps=sum(r.skipped for r in records), stopped=stopped, signal=signal_name,
            wall_time_s=time.perf_counter() - self.started, rank_hosts=self.hosts)
        self._write(summary)
        if self._file:
            self._file.close()
            self._file = None
        return summary


def _mean(values: Iterable[float | None]) -> float | None:
    """The mean of the values that were measured (not None); None when none was."""
    measured = [v for v in values if v is not None]
    return sum(measured) / len(measured) if measured else None
