"""The training loop: build, shard, materialise, resume, then step until done.

Each optimizer step runs `gradient_accumulation` micro-batches; only the last one communicates
gradients (see parallelize.set_gradient_sync). The loss is averaged over micro-batches and ranks,
the gradient norm is the global one (clipped), and metrics go out once per optimizer step.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainer.checkpoint import CheckpointManager
from trainer.config import Layout, OptimConfig, Strategy, TrainConfig, derive_layout
from trainer.data import BatchLoader, build_source
from trainer.distributed import Runtime, init_distributed, launch_sizes, shutdown
from trainer.metrics import MetricsLogger, gather_loss_and_memory, stderr_log
from trainer.model import Transformer, build_model
from trainer.parallelize import build_mesh, parallelize, set_gradient_sync, sharding_report
from trainer.prometheus import RankMetrics


def lr_multiplier(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to min_ratio at `total` steps.
    `step` counts optimizer steps already taken (0 for the first)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW; matrices decay, norm gains do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_multiplier, warmup=cfg.warmup_steps, total=total_steps, min_ratio=cfg.min_lr_ratio))


def follow_schedule(optimizer: torch.optim.Optimizer, scheduler) -> None:
    """After a resume, set the learning rate the schedule gives for the restored step: the optimizer
    state carries the previous run's last value, which differs when --steps (the cosine's end) changed."""
    for group, multiplier in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["lr"] = group["initial_lr"] * multiplier(scheduler.last_epoch)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def global_grad_norm_and_clip(model: torch.nn.Module, max_norm: float | None) -> torch.Tensor:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or math.inf, foreach=True)
    # Sharded gradients give a DTensor norm: full_tensor() completes the reduction across ranks.
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's mean micro-batch loss
    grad_norm: float
    lr: float
    step_time_s: float
    grad_sync_s: float | None
    skipped: bool


def train_step(model: FSDPModule, optimizer, scheduler, loader: BatchLoader, *, strategy: Strategy,
               accumulation: int, grad_clip: float | None, scaler, device: torch.device) -> StepResult:
    started = time.perf_counter()
    micro_times = []
    loss_sum = torch.zeros((), device=device)
    for micro in range(accumulation):
        is_last = micro == accumulation - 1
        set_gradient_sync(model, strategy, is_last)
        inputs, targets = loader.next()
        micro_started = time.perf_counter()
        loss = loss_fn(model(inputs), targets)
        scaled = loss / accumulation
        (scaler.scale(scaled) if scaler else scaled).backward()
        loss_sum += loss.detach()
        _synchronize(device)
        micro_times.append(time.perf_counter() - micro_started)
    if scaler:
        # Found-inf flags of sharded gradients are reduced across ranks by DTensor, so every rank
        # skips the same steps.
        scaler.unscale_(optimizer)
    grad_norm = global_grad_norm_and_clip(model, grad_clip)
    lr = optimizer.param_groups[0]["lr"]
    if scaler:
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped = scaler.get_scale() < scale_before
    else:
        optimizer.step()
        skipped = False
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    _synchronize(device)
    grad_sync_s = None
    if accumulation > 1:
        compute_only = sum(micro_times[:-1]) / (accumulation - 1)
        grad_sync_s = max(0.0, micro_times[-1] - compute_only)
    return StepResult(loss_sum / accumulation, float(grad_norm), lr, time.perf_counter() - started,
                      grad_sync_s, skipped)


def build_parallel_model(cfg: TrainConfig, runtime: Runtime, layout: Layout) -> Transformer:
    """Meta-device model -> fully_shard -> allocate only this rank's shards -> initialise them."""
    model = build_model(cfg.model)
    mesh = build_mesh(layout, cfg.parallel.strategy, runtime.device.type)
    parallelize(model, mesh, cfg.parallel, runtime.device.type)
    model.to_empty(device="cpu" if cfg.parallel.cpu_offload else runtime.device)
    model.init_weights(cfg.training.seed, buffer_device=runtime.device)
    return model


def run(cfg: TrainConfig, runtime: Runtime, layout: Layout, *, print_sharding: bool = False,
        log: Callable[[str], None] = stderr_log) -> dict:
    main_log = log if runtime.is_main else (lambda _message: None)
    torch.manual_seed(cfg.training.seed)
    model = build_parallel_model(cfg, runtime, layout)
    main_log(f"model: {cfg.model.num_params:,} parameters, {cfg.parallel.strategy} on "
             f"{runtime.world_size} ranks ({runtime.num_nodes} node(s)), mesh replicate={layout.replicate} "
             f"x shard={layout.shard}, micro-batch {layout.micro_batch_size} x accumulation "
             f"{cfg.training.gradient_accumulation}, {runtime.device.type}/{runtime.backend}")
    if print_sharding:
        for line in sharding_report(model, cfg.parallel.param_dtype):
            main_log(line)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.training.steps)
    scaler = torch.amp.GradScaler(runtime.device.type) if cfg.parallel.param_dtype == "fp16" else None
    loader = BatchLoader(build_source(cfg.data, cfg.model.vocab_size, cfg.training.seed),
                         micro_batch_size=layout.micro_batch_size, rank=runtime.rank,
                         world_size=runtime.world_size, seed=cfg.training.seed, device=runtime.device,
                         prefetch=cfg.data.prefetch)
    extra = {"lr_scheduler": scheduler, "data": loader}
    if scaler:
        extra["grad_scaler"] = scaler
    checkpoints = CheckpointManager(cfg.checkpoint, rank=runtime.rank, world_size=runtime.world_size,
                                    log=main_log)
    start = checkpoints.maybe_resume(model, optimizer, extra)
    if start:
        follow_schedule(optimizer, scheduler)
    hosts = [None] * runtime.world_size
    dist.all_gather_object(hosts, runtime.hostname)
    metrics = MetricsLogger(
        cfg.metrics, runtime, total_steps=cfg.training.steps,
        tokens_per_step=cfg.training.global_batch_size * cfg.data.seq_len,
        samples_per_step=cfg.training.global_batch_size,
        flops_per_token=cfg.model.flops_per_token(cfg.data.seq_len),
        run_info={"strategy": str(cfg.parallel.strategy), "params": cfg.model.num_params}, hosts=hosts,
        log=main_log)
    rank_metrics = RankMetrics.create(cfg.metrics, runtime)  # Prometheus textfile (docs/monitoring.md)
    try:
        for step in range(start + 1, cfg.training.steps + 1):
            result = train_step(model, optimizer, scheduler, loader, strategy=cfg.parallel.strategy,
                                accumulation=cfg.training.gradient_accumulation,
                                grad_clip=cfg.optim.grad_clip, scaler=scaler, device=runtime.device)
            losses, mems = gather_loss_and_memory(result.loss, runtime.device)
            record = metrics.log_step(step=step, loss=sum(losses) / len(losses), lr=result.lr,
                                      grad_norm=result.grad_norm, step_time_s=result.step_time_s,
                                      grad_sync_s=result.grad_sync_s, mem_per_rank=mems,
                                      skipped=result.skipped)
            if rank_metrics:
                rank_metrics.update(record)
            if checkpoints.should_save(step, final=step == cfg.training.steps):
                checkpoints.save(step, model, optimizer, extra)
        checkpoints.wait()
    finally:
        loader.close()
        if rank_metrics:
            rank_metrics.close()
    summary = metrics.close()
    if summary["steps"]:
        main_log(f"done: {summary['steps']} steps, loss {summary['first_loss']:.4f} -> "
                 f"{summary['final_loss']:.4f}, {summary['tokens_per_s'] or 0:,.0f} tok/s")
    dist.barrier()
    return summary


def train(cfg: TrainConfig, *, print_sharding: bool = False) -> dict:
    # Meshes and batch splits that cannot work are refused before any process group exists.
    layout = derive_layout(cfg, *launch_sizes())
    runtime = init_distributed(cfg.distributed)
    try:
        return run(cfg, runtime, layout, print_sharding=print_sharding)
    finally:
        shutdown()
