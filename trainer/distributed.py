"""Process group and device for one rank: CUDA + NCCL when GPUs exist, CPU + gloo otherwise, through
the same code path. Reads the variables torchrun sets; without them the process is a world of one."""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from trainer import side_groups
from trainer.config import DistributedConfig
from trainer.errors import ConfigError, Problem


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str
    hostname: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def launch_sizes() -> tuple[int, int]:
    """(world size, ranks per node) of this launch, known before any process group exists."""
    return _env_int("WORLD_SIZE", 1), _env_int("LOCAL_WORLD_SIZE", 1)


def check_cuda_device(local_rank: int) -> None:
    """A ConfigError unless this rank has a CUDA device of its own (distributed.device cuda, or auto
    where CUDA is visible): none at all, or fewer GPUs than ranks on the node."""
    if not torch.cuda.is_available():
        raise ConfigError([Problem(
            "distributed.device", "cuda", "asks for a CUDA device, and none is visible to this process (no "
            "GPU, no driver, or an empty CUDA_VISIBLE_DEVICES)",
            "use distributed.device=auto (CPU and gloo where there is no GPU), or run on a GPU node")])
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError([Problem("LOCAL_RANK", local_rank, f"has no GPU of its own: the node shows {count}",
                                   f"start at most {count} rank(s) per node (torchrun --nproc-per-node "
                                   f"{count})")])


def init_distributed(cfg: DistributedConfig) -> Runtime:
    world_size, local_world_size = launch_sizes()
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        check_cuda_device(local_rank)
        # A failed NCCL collective aborts the communicator and raises, instead of hanging the job.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=cfg.timeout_s)
    side_groups.collective_timeout = timeout
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if use_cuda else None)
    else:
        # Not launched by torchrun: a world of one, so training still runs through FSDP2 unchanged.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Runtime(rank, world_size, local_rank, local_world_size, _env_int("GROUP_RANK", 0), device,
                   backend, socket.gethostname())


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """Exit as the interpreter would, minus the native teardown after it.

    After a finished multi-rank evaluation or HF-weights load, a native thread of the torch/gloo stack
    was seen to abort the process at interpreter teardown ("terminate called without an active
    exception", SIGABRT; about 1 in 7 two-rank runs on a loaded 2-core host, no Python frame left),
    turning a complete run into exit -6 under torchrun. So what Python does at exit is done here -
    non-daemon threads joined (a checkpoint still committing finishes), atexit handlers run (the
    trackers'), streams flushed - and then the process ends without the native teardown.

    Call it from the main thread, as the interpreter's own exit runs there."""
    # The interpreter's first exit step (Py_FinalizeEx calls threading._shutdown): threading's exit
    # hooks, then a join of every non-daemon thread. The hooks tell the idle workers of
    # concurrent.futures thread pools to stop; joining those workers without them waits for ever, which
    # is how a torch.compile run (inductor compiles in such a pool) hung after its last step.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
