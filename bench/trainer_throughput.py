"""FSDP2 vs DDP vs one process: tokens/s of the same model and global batch, in one run.

    python bench/trainer_throughput.py [--config NAME] [--steps 5] [--warmup-steps 1]
                                       [--nproc 2] [--set KEY=VALUE ...] [--output result.json]

Launches itself under torchrun with --nproc ranks (CPU + gloo, or one GPU per rank) and times, in
the same process group and taking turns step by step (so load from other work on a shared host hits
both alike), the trainer's FSDP2 training step and a DistributedDataParallel step on the same model,
data and micro-batches (DDP skips gradient all-reduce with no_sync() on all but the last
micro-batch, as the trainer does with FSDP2). Then it times one process training the same global
batch without any wrapper. A second distributed run repeats FSDP2 vs DDP with --accumulation
micro-batches per step (the sharded gradients reduce-scatter on every micro-batch, DDP all-reduces
on the last). It prints tokens/s for each, the FSDP2/DDP ratios (target >= 0.9x), and,
where the device's peak is known (A100/H100/H200), MFU by the PaLM formula; the default config on a
GPU is the gpt-1b preset. The JSON result goes to --output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.config import derive_layout, load_config  # noqa: E402
from trainer.data import BatchLoader, build_source  # noqa: E402
from trainer.distributed import Runtime, exit_process, init_distributed, launch_sizes, shutdown  # noqa: E402
from trainer.loss import loss_fn  # noqa: E402
from trainer.metrics import device_peak_flops  # noqa: E402
from trainer.model import build_model  # noqa: E402
from trainer.parallelize import DTYPES  # noqa: E402
from trainer.train import (  # noqa: E402
    build_optimizer,
    build_parallel_model,
    build_scheduler,
    global_grad_norm_and_clip,
    train_step,
)

TARGET_RATIO = 0.9
# Without --config: on CPU a ~27M-parameter model (compute large enough that the comparison is not
# just collective latency: seq 256, 8 sequences per rank); on a GPU the 1B preset with 8 sequences of
# 2048 per rank. No gradient accumulation, so both wrappers communicate every step.
CPU_DEFAULT = ["model.vocab_size=8192", "model.dim=512", "model.n_layers=6", "model.n_heads=8",
               "model.ffn_dim=1408", "model.max_seq_len=256", "data.seq_len=256",
               "training.gradient_accumulation=1"]
GPU_DEFAULT = ["training.gradient_accumulation=1"]


def _loader(cfg, runtime: Runtime, micro_batch: int, rank: int, world: int) -> BatchLoader:
    return BatchLoader(build_source(cfg.data, cfg.model.vocab_size, cfg.training.seed),
                       micro_batch_size=micro_batch, rank=rank, world_size=world, seed=cfg.training.seed,
                       device=runtime.device, prefetch=cfg.data.prefetch)


def _plain_model(cfg, device: torch.device) -> torch.nn.Module:
    model = build_model(cfg.model)
    model.to_empty(device=device)
    model.init_weights(cfg.training.seed, buffer_device=device)
    return model


def _plain_step(model, optimizer, scheduler, loader, cfg, device, sync_context) -> None:
    """A step without FSDP: autocast stands in for FSDP2's parameter dtype."""
    accumulation = cfg.training.gradient_accumulation
    dtype = DTYPES[cfg.parallel.param_dtype]
    for micro in range(accumulation):
        batch = loader.next()
        sync = contextlib.nullcontext() if micro == accumulation - 1 else sync_context()
        with sync, torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_fn(model(batch.inputs), batch.targets)
            (loss / accumulation).backward()
    global_grad_norm_and_clip(model, cfg.optim.grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def _timed(step, device: torch.device) -> float:
    """Wall seconds of one step on the slowest rank."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    started = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _time_interleaved(steps_by_name: dict, steps: int, warmup: int, device: torch.device) -> dict[str, float]:
    """Mean seconds per step of each variant after `warmup` untimed steps. The variants take turns
    step by step, so a change in machine load (a shared host) hits them alike."""
    for _ in range(warmup):
        for step in steps_by_name.values():
            step()
    totals = dict.fromkeys(steps_by_name, 0.0)
    for _ in range(steps):
        for name, step in steps_by_name.items():
            totals[name] += _timed(step, device)
    return {name: total / steps for name, total in totals.items()}


def worker(args) -> None:
    cfg = load_config(args.config, args.overrides)
    world, local = launch_sizes()
    layout = derive_layout(cfg, world, local)
    runtime = init_distributed(cfg.distributed)
    tokens_per_step = cfg.training.global_batch_size * cfg.data.seq_len
    loaders = []

    def loader(micro_batch: int, rank: int, world_size: int) -> BatchLoader:
        loaders.append(_loader(cfg, runtime, micro_batch, rank, world_size))
        return loaders[-1]

    if args.mode == "distributed":
        fsdp = build_parallel_model(cfg, runtime, layout)
        fsdp_optimizer = build_optimizer(fsdp, cfg.optim)
        fsdp_scheduler = build_scheduler(fsdp_optimizer, cfg.optim, cfg.training.steps)
        fsdp_loader = loader(layout.micro_batch_size, runtime.rank, world)
        ddp = torch.nn.parallel.DistributedDataParallel(
            _plain_model(cfg, runtime.device),
            device_ids=None if runtime.device.index is None else [runtime.device.index])
        ddp_optimizer = build_optimizer(ddp, cfg.optim)
        ddp_scheduler = build_scheduler(ddp_optimizer, cfg.optim, cfg.training.steps)
        ddp_loader = loader(layout.micro_batch_size, runtime.rank, world)
        results = _time_interleaved({
            "fsdp2": lambda: train_step(
                fsdp, fsdp_optimizer, fsdp_scheduler, fsdp_loader, strategy=cfg.parallel.strategy,
                accumulation=cfg.training.gradient_accumulation, grad_clip=cfg.optim.grad_clip, scaler=None,
                device=runtime.device),
            "ddp": lambda: _plain_step(ddp, ddp_optimizer, ddp_scheduler, ddp_loader, cfg, runtime.device,
                                       ddp.no_sync),
        }, args.steps, args.warmup_steps, runtime.device)
    else:
        model = _plain_model(cfg, runtime.device)
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.training.steps)
        # A world of one: the layout puts the whole global batch in this process.
        single_loader = loader(layout.micro_batch_size, 0, 1)
        results = _time_interleaved({"single_process": lambda: _plain_step(
            model, optimizer, scheduler, single_loader, cfg, runtime.device, contextlib.nullcontext)},
            args.steps, args.warmup_steps, runtime.device)
    for each in loaders:
        each.close()
    if runtime.is_main:
        peak = device_peak_flops(runtime.device, cfg.metrics.peak_flops)
        out = {name: {"step_time_s": s, "tokens_per_s": tokens_per_step / s,
                      "mfu": (cfg.flops_per_token() * tokens_per_step / s
                              / (world * peak)) if peak else None}
               for name, s in results.items()}
        Path(args.worker_output).write_text(json.dumps(out))
    shutdown()


def launcher(args) -> int:
    cuda = torch.cuda.is_available()
    nproc = args.nproc or (torch.cuda.device_count() if cuda else 2)
    config, overrides = args.config, list(args.overrides)
    if config is None:
        config, defaults = ("gpt-1b", GPU_DEFAULT) if cuda else ("smoke", CPU_DEFAULT)
        overrides = [*defaults, f"training.global_batch_size={8 * nproc}", *overrides]
    common = ["--config", config, "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
              *[a for o in overrides for a in ("--set", o)]]
    # The repository first, then whatever the caller had (gpu_check.sh puts modules it installed there).
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath}
    # The accumulation case: the same micro-batches, `--accumulation` of them per optimizer step (the
    # global batch grows to match), FSDP2 reduce-scattering every micro-batch, DDP under no_sync().
    base = load_config(config, overrides).training
    per_micro_step = base.global_batch_size // base.gradient_accumulation
    accum = [f"training.gradient_accumulation={args.accumulation}",
             f"training.global_batch_size={per_micro_step * args.accumulation}"]
    accum_args = [a for o in accum for a in ("--set", o)]
    distributed = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = [("distributed", distributed, [], ""),
                # With one rank there is nothing to reduce-scatter or all-reduce: no accumulation case.
                *([("distributed", distributed, accum_args, "_accum")] if nproc > 1 else []),
                # One process gets every core the ranks shared.
                ("single", [sys.executable], [], "")]
        for mode, prefix, extra, suffix in runs:
            out = Path(tmp) / f"{mode}{suffix}.json"
            threads = "1" if mode == "distributed" or cuda else str(nproc)
            print(f"running {mode}{suffix} ({nproc if mode == 'distributed' else 1} process(es))...",
                  file=sys.stderr)
            proc = subprocess.run([*prefix, str(Path(__file__).resolve()), "--worker", "--mode", mode,
                                   "--worker-output", str(out), *common, *extra],
                                  env={**env, "OMP_NUM_THREADS": threads}, cwd=REPO)
            if proc.returncode:
                print(f"error: the {mode}{suffix} run failed (exit {proc.returncode}); see its output above",
                      file=sys.stderr)
                return proc.returncode
            results.update({name + suffix: r for name, r in json.loads(out.read_text()).items()})
    ratio = results["fsdp2"]["tokens_per_s"] / results["ddp"]["tokens_per_s"]
    accum_ratio = (results["fsdp2_accum"]["tokens_per_s"] / results["ddp_accum"]["tokens_per_s"]
                   if "fsdp2_accum" in results else None)
    summary = {"config": config, "overrides": overrides, "nproc": nproc, "device": "cuda" if cuda else "cpu",
               "steps": args.steps, "runs": results, "fsdp2_over_ddp": ratio, "target_ratio": TARGET_RATIO,
               "meets_target": ratio >= TARGET_RATIO, "accumulation": args.accumulation,
               "fsdp2_over_ddp_accumulation": accum_ratio}
    for name, r in results.items():
        mfu = "" if r["mfu"] is None else f"  MFU {r['mfu']:.1%}"
        print(f"{name:15s} {r['tokens_per_s']:12,.0f} tokens/s  {r['step_time_s']:.3f} s/step{mfu}")
    verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
    print(f"FSDP2 / DDP = {ratio:.2f}x (target >= {TARGET_RATIO}x: {verdict})")
    if accum_ratio is not None:
        print(f"FSDP2 / DDP with accumulation {args.accumulation} = {accum_ratio:.2f}x (FSDP2 "
              "reduce-scatters every micro-batch, DDP all-reduces on the last)")
    else:
        print("one rank: FSDP2 and DDP have nothing to communicate, so neither ratio means anything")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"result: {args.output}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", help="trainer config (default: smoke on CPU, gpt-1b on a GPU)")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup-steps", type=int, default=1, help="untimed steps first")
    parser.add_argument("--accumulation", type=int, default=4,
                        help="micro-batches per step of the accumulation case (default 4)")
    parser.add_argument("--nproc", type=int, help="ranks for FSDP2 and DDP (default: GPUs, or 2 on CPU)")
    parser.add_argument("--output", default="bench-results/trainer_throughput.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["distributed", "single"], help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    return launcher(args)


if __name__ == "__main__":
    exit_process(main())
