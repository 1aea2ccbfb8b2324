"""One exclusive lock file, for work that two fsdpctl processes on one machine must not do at once."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an flock on `lock_path` (created with its directory) for the block; a second holder waits.
    The kernel drops the lock when its process dies, so a killed holder never blocks the next one."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
