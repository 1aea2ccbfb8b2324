"""A plain PyTorch DistributedDataParallel script, not fsdp-cluster's trainer: what `fsdpctl train
--command` runs as a requeueable Slurm job as easily as the trainer (docs/slurm.md).

It fits a linear model to noisy data with plain torch.distributed (nccl on GPUs, gloo on CPUs),
reads only what torchrun and the job's environment give it (RANK, WORLD_SIZE, LOCAL_RANK,
CHECKPOINT_DIR), saves a checkpoint every --checkpoint-every steps and resumes from it when the job
is requeued. On the cluster:

    fsdpctl train --command examples/plain_torchrun.py --nodes 2        # copied, run under torchrun
    fsdpctl train --nodes 2 --command 'torchrun --nnodes $NNODES --nproc-per-node $NPROC_PER_NODE \\
        --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT /shared/plain_torchrun.py --steps 50'

and on one machine: `torchrun --nproc-per-node 2 examples/plain_torchrun.py`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

FEATURES = 16
BATCH = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(FEATURES, 1).to(device),
                                    device_ids=[local_rank] if backend == "nccl" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    checkpoint = Path(os.environ.get("CHECKPOINT_DIR", ".")) / "plain_torchrun.pt"
    start = 0
    if checkpoint.exists():
        saved = torch.load(checkpoint, map_location=device)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["step"]
        if rank == 0:
            print(f"plain_torchrun: resumed from {checkpoint} (step {start})", flush=True)

    true_weights = torch.linspace(-1, 1, FEATURES, device=device)
    for step in range(start + 1, args.steps + 1):
        # Each rank its own batch, the same for a step whoever runs it (a resumed run repeats it).
        generator = torch.Generator().manual_seed(step * world + rank)
        inputs = torch.randn(BATCH, FEATURES, generator=generator).to(device)
        targets = inputs @ true_weights + 0.01 * torch.randn(BATCH, generator=generator).to(device)
        loss = torch.nn.functional.mse_loss(model(inputs).squeeze(-1), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0:
            print(f"plain_torchrun: step {step} loss {mean_loss.item() / world:.5f} ({world} processes)",
                  flush=True)
        if rank == 0 and (step % args.checkpoint_every == 0 or step == args.steps):
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            torch.save(state, checkpoint)
    dist.barrier()
    if rank == 0:
        print(f"plain_torchrun: done at step {args.steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
