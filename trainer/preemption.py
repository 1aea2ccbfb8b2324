"""Stop cleanly on SIGUSR1 or SIGTERM (spot interruption, scheduler pre-emption, `fsdpctl` draining a
node): finish the current step, save a blocking, verified checkpoint, write a summary saying why the run
stopped, and exit 0.

A signal may reach only some ranks: torchrun forwards SIGTERM from its agent to the workers, but not
SIGUSR1, and an operator may signal one node's workers. So every rank installs the handler, which only
records the signal, and at every step boundary the ranks all-reduce the flag (MAX) on a small gloo
group of their own (a CPU tensor: no device synchronisation) and stop together at the same step.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

from trainer.side_groups import side_group

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopSignal:
    """Records the first stop signal; `agreed()` is the collective verdict of all ranks."""

    def __init__(self) -> None:
        self.received: int = 0
        self._group = side_group() if dist.is_initialized() else None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received = self.received or signum

    def agreed(self) -> str | None:
        """Collective: the signal's name if any rank received one, else None."""
        flag = torch.tensor([self.received], dtype=torch.int64)
        if self._group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return signal.Signals(int(flag)).name if int(flag) else None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
