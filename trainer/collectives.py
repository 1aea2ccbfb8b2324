"""All-reduce bus-bandwidth benchmark over the real torch.distributed back end.

Run it under torchrun on every node (the smoke test does):

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint NODE0:29500 \\
        -m trainer.collectives --output /shared/collectives.json

Each message size is all-reduced `--iters` times after `--warmup` untimed rounds; the time of a size
is the slowest rank's (a collective is as fast as its slowest member). Figures follow nccl-tests:
algorithm bandwidth = bytes / time, bus bandwidth = algbw * 2(n-1)/n for n ranks, which is the
per-link rate a ring all-reduce needs and so is comparable across cluster sizes. Rank 0 writes the
result as JSON (to `--output`, or stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

# Sizes whose peak bus bandwidth is meaningful: NCCL over EFA reaches its plateau at >= 1 GiB
# messages; gloo on CPU plateaus far earlier and 1 GiB rounds would take minutes.
DEFAULT_SIZES = {
    "nccl": [1 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30, 2 << 30],
    "gloo": [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20],
}
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30}


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: algbw * 2(n-1)/n (0 for a single rank: no traffic)."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    return algbw * 2 * (world_size - 1) / world_size


def parse_size(text: str) -> int:
    """'64K' / '16M' / '1G' / '4096' -> bytes (binary units, as nccl-tests prints them)."""
    raw = text.strip().upper()
    number = raw.rstrip("KMGB")
    unit = raw[len(number):]
    if not number.isdigit() or unit not in _UNITS:
        raise ValueError(f"not a message size: {text!r}; use e.g. 4096, 64K, 16M or 1G")
    size = int(number) * _UNITS[unit]
    if size < 4 or size % 4:
        raise ValueError(f"message size {text!r} must be a positive multiple of 4 bytes (float32)")
    return size


def _format_size(size: int) -> str:
    for unit, factor in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def run_benchmark(sizes: list[int] | None, *, iters: int, warmup: int) -> dict:
    """Benchmark all-reduce on the initialised default process group; every rank returns the result."""
    import torch
    import torch.distributed as dist

    backend = dist.get_backend()
    world = dist.get_world_size()
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    results = []
    for size in sizes or DEFAULT_SIZES.get(backend, DEFAULT_SIZES["gloo"]):
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.all_reduce(tensor)
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor)
        sync()
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds = float(elapsed.item())
        algbw = size / seconds / 1e9
        results.append({
            "bytes": size,
            "size": _format_size(size),
            "time_us": round(seconds * 1e6, 2),
            "algbw_gbps": algbw,
            "busbw_gbps": bus_bandwidth(algbw, world),
        })
        del tensor
    return {
        "backend": backend,
        "world_size": world,
        "nnodes": int(os.environ.get("GROUP_WORLD_SIZE") or os.environ.get("NNODES") or 0) or None,
        "device": device.type,
        "iters": iters,
        "warmup": warmup,
        "results": results,
        "peak_busbw_gbps": max((r["busbw_gbps"] for r in results), default=0.0),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.collectives", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", help="comma-separated message sizes, e.g. 64K,16M,1G "
                   "(default: up to 2G on nccl, up to 16M on gloo)")
    p.add_argument("--iters", type=int, default=10, help="timed all-reduces per size")
    p.add_argument("--warmup", type=int, default=3, help="untimed all-reduces per size")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="auto: nccl when CUDA is available, else gloo")
    p.add_argument("--output", type=Path, help="rank 0 writes the JSON result here (default: stdout)")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else None
    except ValueError as e:
        p.error(str(e))
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        p.error("run under torchrun (RANK/WORLD_SIZE are not set), e.g. "
                "torchrun --standalone --nproc-per-node 2 -m trainer.collectives")

    import torch
    import torch.distributed as dist

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)
    try:
        result = run_benchmark(sizes, iters=args.iters, warmup=args.warmup)
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        text = json.dumps(result, indent=2)
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.output.with_name(args.output.name + ".tmp")
            tmp.write_text(text)
            tmp.replace(args.output)
        else:
            print(text)
    return 0


if __name__ == "__main__":
    from trainer.distributed import exit_process

    exit_process(main())
