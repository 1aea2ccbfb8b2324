"""The training loop: check what can be checked before any process group (prepare), build, shard,
fill (Hugging Face weights, a random initialisation, or nothing when a checkpoint is about to be
loaded), resume, then step until done, evaluate every eval.interval steps, export at the end.

Each optimizer step runs `gradient_accumulation` micro-batches; sharded strategies reduce-scatter
every micro-batch (gradients stay sharded), HYBRID_SHARD and NO_SHARD defer the all-reduce across
replicas to the last one (see parallelize.set_gradient_sync). The loss is the mean over every counted
target of every micro-batch and rank, the gradient norm is the global one (clipped). Nothing
synchronises the device per step: metrics are gathered at the log interval (trainer/metrics.py),
communication is profiled on sampled steps (trainer/commtime.py). SIGUSR1/SIGTERM stop the run at a
step boundary agreed by all ranks, after a blocking, verified checkpoint (trainer/preemption.py).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from trainer.batch import IGNORE
from trainer.checkpoint import CheckpointError, CheckpointManager
from trainer.commbytes import CommBytes
from trainer.commtime import StepProfiler
from trainer.config import Layout, OptimConfig, Strategy, TrainConfig, derive_layout
from trainer.data import BatchLoader, SampleSource, build_source
from trainer.distributed import Runtime, init_distributed, launch_sizes, shutdown
from trainer.documents import PackedSource
from trainer.errors import ConfigError, Problem
from trainer.evaluate import Validator, evaluation_source
from trainer.hf.fetch import resolve_data_path
from trainer.hf.weights import check_weights, export_trained, load_weights
from trainer.lora import apply_lora, init_lora
from trainer.loss import token_nll_sum
from trainer.metrics import MetricsLogger, stderr_log
from trainer.model import Transformer, build_model
from trainer.parallelize import DTYPES, build_mesh, parallelize, set_gradient_sync, sharding_report
from trainer.preemption import StopSignal
from trainer.prometheus import RankMetrics
from trainer.records import SummaryRecord
from trainer.tokenizer import Tokenizer
from trainer.tracking import Tracker


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
    # torch refuses foreach and fused together: one or the other.
    implementation = {"fused": True} if cfg.fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **implementation)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_multiplier, warmup=cfg.warmup_steps, total=total_steps, min_ratio=cfg.min_lr_ratio))


def follow_schedule(optimizer: torch.optim.Optimizer, scheduler, cfg: OptimConfig,
                    log: Callable[[str], None]) -> None:
    """After a resume: the restored optimizer and scheduler carry the previous run's hyperparameters.
    Apply this run's optim.* values (logging each change), then set the learning rate the schedule
    gives for the restored step (it also differs when --steps, the cosine's end, changed)."""
    wanted = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
    old_lr = optimizer.param_groups[0].get("initial_lr", optimizer.param_groups[0]["lr"])
    if old_lr != cfg.lr:
        log(f"resume: optim.lr changed {old_lr:g} -> {cfg.lr:g}; the schedule continues with the new peak")
    for key in ("betas", "eps"):
        old = optimizer.param_groups[0][key]
        old = tuple(old) if isinstance(old, (list, tuple)) else old
        if old != wanted[key]:
            log(f"resume: optim.{key} changed {old} -> {wanted[key]}")
    old_wd = optimizer.param_groups[0]["weight_decay"]
    if old_wd != cfg.weight_decay:
        log(f"resume: optim.weight_decay changed {old_wd:g} -> {cfg.weight_decay:g}")
    for index, group in enumerate(optimizer.param_groups):
        group["initial_lr"] = cfg.lr
        group["betas"], group["eps"] = wanted["betas"], cfg.eps
        # Group 0 decays (matrices), group 1 does not (norm gains): see build_optimizer.
        group["weight_decay"] = cfg.weight_decay if index == 0 else 0.0
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, multiplier in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["lr"] = group["initial_lr"] * multiplier(scheduler.last_epoch)


def global_grad_norm_and_clip(model: torch.nn.Module, max_norm: float | None) -> torch.Tensor:
    """The norm of every gradient together, then each clipped by it. Gradients on different meshes
    (expert parallelism gives the experts a mesh of their own) cannot meet in one foreach kernel:
    their norms are taken per mesh, completed across ranks (full_tensor) and combined."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for param in model.parameters():
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(param)
    if not by_mesh:
        return torch.zeros(())
    norms = []
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm or math.inf, total, foreach=True)
    return total


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's share: the mean over ranks is the step's loss (on the device)
    grad_norm: torch.Tensor  # global, before clipping (on the device)
    lr: float
    skipped: bool
    # Mixture of experts (None for a dense model): this rank's load-balancing loss, the mean over its
    # micro-batches, and its top-k assignments per expert summed over them, [MoE blocks, n_experts].
    router_aux_loss: torch.Tensor | None = None
    tokens_per_expert: torch.Tensor | None = None


def train_step(model: FSDPModule, optimizer, scheduler, loader: BatchLoader, *, strategy: Strategy,
               accumulation: int, grad_clip: float | None, scaler, device: torch.device,
               before_update: Callable[[], None] | None = None) -> StepResult:
    """One optimizer step. Returns device tensors: no host synchronisation (except the fp16 loss
    scaler's own check of whether it skipped the step). `before_update` runs before the parameters
    change (an async checkpoint's staging copy must be complete by then)."""
    loss_sum = torch.zeros((), device=device)
    batches = [loader.next() for _ in range(accumulation)]
    # The step's loss is the mean over every counted target of every rank and micro-batch (packed chat
    # data counts different numbers per row). One small all-reduce gives the total before backward;
    # FSDP averages gradients over the ranks, hence the world size in the scale.
    counted = torch.stack([(batch.targets != IGNORE).sum() for batch in batches]).sum().float()
    dist.all_reduce(counted)
    scale = dist.get_world_size() / counted.clamp(min=1)
    aux_sum = routed = None
    aux_coef = model.cfg.router_aux_loss_coef
    for micro, batch in enumerate(batches):
        set_gradient_sync(model, strategy, micro == accumulation - 1)
        logits = model(batch.inputs, batch.positions, batch.document_ids)
        loss = token_nll_sum(logits, batch.targets) * scale
        loss_sum += loss.detach()
        aux = model.router_aux_loss()
        if aux is not None:
            # transformers adds coef x aux to the mean NLL; FSDP averages the ranks' gradients, so each
            # rank adds its own mean over its micro-batches. The logged loss stays the NLL alone.
            if aux_coef > 0:
                loss = loss + aux * (aux_coef / accumulation)
            aux_sum = aux.detach() / accumulation + (0 if aux_sum is None else aux_sum)
            per_expert = model.tokens_per_expert()
            routed = per_expert if routed is None else routed + per_expert
        (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        # Found-inf flags of sharded gradients are reduced across ranks by DTensor, so every rank
        # skips the same steps.
        scaler.unscale_(optimizer)
    grad_norm = global_grad_norm_and_clip(model, grad_clip)
    lr = optimizer.param_groups[0]["lr"]
    if before_update is not None:
        before_update()
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
    return StepResult(loss_sum, grad_norm.detach(), lr, skipped, aux_sum, routed)


def build_parallel_model(cfg: TrainConfig, runtime: Runtime, layout: Layout,
                         log: Callable[[str], None] = lambda _message: None, *,
                         fill: bool = True) -> Transformer:
    """Meta-device model -> LoRA adapters (if any) -> fully_shard -> allocate only this rank's shards
    -> fill them: from model.hf_dir's safetensors (each rank reads its own rows) or a seeded random
    initialisation; adapters start as LoRA prescribes. fill=False leaves the shards to a checkpoint
    about to be loaded (reading a 70B model's files only to overwrite them would cost minutes)."""
    model = build_model(cfg.model)
    lora = cfg.parallel.lora
    if lora.enabled:
        apply_lora(model, lora, DTYPES[cfg.parallel.param_dtype])
    mesh = build_mesh(layout, cfg.parallel.strategy, runtime.device.type)
    parallelize(model, mesh, cfg.parallel, runtime.device.type)
    model.to_empty(device="cpu" if cfg.parallel.cpu_offload else runtime.device)
    model.init_buffers(runtime.device)
    if not fill:
        return model
    if cfg.model.hf_dir:
        load_weights(model, Path(cfg.model.hf_dir), log)
    else:
        model.init_weights(cfg.training.seed, buffer_device=runtime.device)
    if lora.enabled:
        init_lora(model, cfg.training.seed)
    return model


def run(cfg: TrainConfig, runtime: Runtime, prepared: Prepared, *, print_sharding: bool = False,
        log: Callable[[str], None] = stderr_log) -> SummaryRecord:
    layout, source, eval_source = prepared.layout, prepared.source, prepared.eval_source
    main_log = log if runtime.is_main else (lambda _message: None)
    torch.manual_seed(cfg.training.seed)
    checkpoints = CheckpointManager(cfg.checkpoint, rank=runtime.rank, world_size=runtime.world_size,
                                    log=main_log, run_config=cfg.model_dump(mode="json"))
    model = build_parallel_model(cfg, runtime, layout, main_log, fill=not checkpoints.will_resume())
    comm_counter = CommBytes.install(model)  # bytes of FSDP2's collectives per step (trainer/commbytes.py)
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
    loader = BatchLoader(source, micro_batch_size=layout.micro_batch_size, rank=runtime.rank,
                         world_size=runtime.world_size, seed=cfg.training.seed, device=runtime.device,
                         prefetch=cfg.data.prefetch, log=main_log)
    extra = {"lr_scheduler": scheduler, "data": loader}
    if scaler:
        extra["grad_scaler"] = scaler
    start = checkpoints.maybe_resume(model, optimizer, extra)
    if start:
        follow_schedule(optimizer, scheduler, cfg.optim, main_log)
    hosts = [None] * runtime.world_size
    dist.all_gather_object(hosts, runtime.hostname)
    metrics = MetricsLogger(
        cfg.metrics, runtime, total_steps=cfg.training.steps,
        tokens_per_step=cfg.training.global_batch_size * cfg.data.seq_len,
        samples_per_step=cfg.training.global_batch_size,
        flops_per_token=cfg.flops_per_token(),
        strategy=str(cfg.parallel.strategy), params=cfg.model.num_params, hosts=hosts, log=main_log)
    rank_metrics = RankMetrics.create(cfg.metrics, runtime)  # Prometheus textfile (docs/monitoring.md)
    tracker = Tracker.create(cfg.tracking, metrics_file=cfg.metrics.file,
                             run_config=cfg.model_dump(mode="json"), is_main=runtime.is_main)
    validator = Validator(eval_source, cfg.eval.batch_size, runtime.device) if eval_source else None
    stop = StopSignal()
    stopped_by = None
    step_kwargs = {"strategy": cfg.parallel.strategy, "accumulation": cfg.training.gradient_accumulation,
                   "grad_clip": cfg.optim.grad_clip, "scaler": scaler, "device": runtime.device,
                   "before_update": checkpoints.wait_for_staging}
    try:
        metrics.start()
        for step in range(start + 1, cfg.training.steps + 1):
            comm, profiled_time, overhead = None, None, 0.0
            if metrics.should_profile(step, start + 1):
                with StepProfiler(runtime.device) as profiler:
                    result = train_step(model, optimizer, scheduler, loader, **step_kwargs)
                comm, profiled_time, overhead = profiler.result, profiler.step_time_s, profiler.overhead_s
            else:
                result = train_step(model, optimizer, scheduler, loader, **step_kwargs)
            stopped_by = stop.agreed()
            final = step == cfg.training.steps
            saving = checkpoints.should_save(step, final=final)
            records = metrics.log_step(step=step, loss=result.loss, lr=result.lr, grad_norm=result.grad_norm,
                                       skipped=result.skipped, comm=comm, step_time_s=profiled_time,
                                       overhead_s=overhead, flush=saving or stopped_by is not None,
                                       comm_bytes=comm_counter.take(), router_aux_loss=result.router_aux_loss,
                                       tokens_per_expert=result.tokens_per_expert)
            if rank_metrics:
                rank_metrics.after_step(records)
            tracker.log(records)
            if validator and (step % cfg.eval.interval == 0 or final):
                tracker.log([metrics.log_eval(step, validator.run(model))])
                comm_counter.take()  # the evaluation's all-gathers are no training step's traffic
            if stopped_by is not None:
                _stop_for_signal(stopped_by, step, checkpoints, model, optimizer, extra, main_log)
                break
            if saving:
                checkpoints.save(step, model, optimizer, extra)
        checkpoints.wait()
    finally:
        stop.restore()
        loader.close()
        if rank_metrics:
            rank_metrics.close()
    summary = metrics.close(stopped="signal" if stopped_by else "completed", signal_name=stopped_by)
    tracker.close(summary)
    if summary.steps:
        main_log(f"done: {summary.steps} steps, loss {summary.first_loss:.4f} -> "
                 f"{summary.final_loss:.4f}, {summary.tokens_per_s or 0:,.0f} tok/s"
                 + (f"; stopped for {stopped_by}" if stopped_by else ""))
    if cfg.checkpoint.hf_export_dir and stopped_by is None:
        export_trained(model, cfg, Path(cfg.checkpoint.hf_export_dir), main_log)
    dist.barrier()
    return summary


def _stop_for_signal(signal_name: str, step: int, checkpoints: CheckpointManager, model, optimizer,
                     extra: dict, log: Callable[[str], None]) -> None:
    """All ranks, at the same step: wait for an in-flight async save, save this step blocking, verify it."""
    log(f"stop: {signal_name} received; step {step} finished, saving a checkpoint before exiting")
    if not checkpoints.enabled:
        log("stop: WARNING no checkpoint.dir, nothing saved; the run restarts from its last checkpoint")
        return
    checkpoints.wait()
    checkpoints.save(step, model, optimizer, extra, blocking=True)
    checkpoints.wait()
    problems = checkpoints.verify_saved(step)
    if problems:
        raise CheckpointError(f"stop: the checkpoint of step {step} does not verify: " + "; ".join(problems))
    log(f"stop: checkpoint of step {step} saved and verified; exiting")


@dataclass(frozen=True)
class Prepared:
    """What a launch checked and built before any process group exists."""

    layout: Layout
    source: SampleSource
    eval_source: PackedSource | None


# What an s3:// data.path / eval.path holds, by source.
DATA_SUFFIXES = {"jsonl": ".jsonl", "parquet": ".parquet", "tokens": ".bin"}


def with_local_data(cfg: TrainConfig, log: Callable[[str], None]) -> TrainConfig:
    """The config with an s3:// data.path and eval.path replaced by their local copies, downloaded once
    per node (trainer/hf/fetch.py) into model.cache_dir; FetchError names the key and the fix."""
    data, evaluation = cfg.data, cfg.eval
    if data.path and data.path.startswith("s3://") and data.source in DATA_SUFFIXES:
        data = data.model_copy(update={"path": resolve_data_path(
            data.path, DATA_SUFFIXES[data.source], cfg.model.cache_dir, key="data.path", log=log)})
    if evaluation.path and evaluation.path.startswith("s3://"):
        evaluation = evaluation.model_copy(update={"path": resolve_data_path(
            evaluation.path, DATA_SUFFIXES[evaluation.source], cfg.model.cache_dir, key="eval.path",
            log=log)})
    return cfg.model_copy(update={"data": data, "eval": evaluation})


def prepare(cfg: TrainConfig, log: Callable[[str], None]) -> Prepared:
    """Everything that can be refused before a process group exists: the mesh and batch split, the
    weights against the architecture (headers only), the tokenizer against the embedding, the data and
    the evaluation set, the tracking libraries."""
    layout = derive_layout(cfg, *launch_sizes())
    problems = []
    needs_tokenizer = cfg.data.source in ("jsonl", "parquet") or cfg.eval.interval
    if needs_tokenizer and not cfg.model.hf_dir:
        problems.append(Problem("model.hf_dir", None, f"is required for data.source={cfg.data.source} and "
                                "evaluation (records are tokenized with the model's own tokenizer)",
                                "set model.hf_dir to the model's directory"))
    if cfg.parallel.lora.enabled and not cfg.model.hf_dir:
        problems.append(Problem("parallel.lora.rank", cfg.parallel.lora.rank, "adapts a model that is not "
                                "loaded (no model.hf_dir): the frozen base would be random",
                                "set model.hf_dir, or parallel.lora.rank=0"))
    if problems:
        raise ConfigError(problems)
    tokenizer = None
    if cfg.model.hf_dir:
        check_weights(build_model(cfg.model), Path(cfg.model.hf_dir))
        if (Path(cfg.model.hf_dir) / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_dir(Path(cfg.model.hf_dir))
            if tokenizer.vocab_size > cfg.model.vocab_size:
                raise ConfigError([Problem("model.hf_dir", f"{cfg.model.hf_dir}/tokenizer.json",
                                           f"has {tokenizer.vocab_size} token ids, more than the embedding's "
                                           f"{cfg.model.vocab_size} rows (config.json vocab_size)",
                                           "use the tokenizer that belongs to this model")])
    Tracker.check(cfg.tracking)
    cfg = with_local_data(cfg, log)
    source = build_source(cfg.data, cfg.model.vocab_size, cfg.training.seed, tokenizer, log=log)
    eval_source = None
    if cfg.eval.interval:
        eval_data = cfg.data.model_copy(update={"source": cfg.eval.source, "path": cfg.eval.path})
        eval_source = evaluation_source(eval_data, tokenizer, cfg.model.vocab_size, log)
    return Prepared(layout, source, eval_source)


def train(cfg: TrainConfig, *, print_sharding: bool = False) -> SummaryRecord:
    rank_zero = int(os.environ.get("RANK", "0")) == 0
    prepared = prepare(cfg, stderr_log if rank_zero else (lambda _message: None))
    runtime = init_distributed(cfg.distributed)
    try:
        return run(cfg, runtime, prepared, print_sharding=print_sharding)
    finally:
        shutdown()
