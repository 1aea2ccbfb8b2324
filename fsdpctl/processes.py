"""This machine's processes, read from /proc: what a command killed half-way left running.

A leaf module: the local target finds its nodes' processes with it, `configure` and `down` the
ansible-playbook a killed configure left behind, `configure` and `remote` the socket directories of
processes that are gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def processes(*, with_environ: bool = False) -> Iterator[tuple[int, list[str], bytes]]:
    """(pid, argv, environ) of every other process; environ is the raw NUL-separated block (empty
    unless asked for). Processes that exit while being read are passed over."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
            environ = Path(f"/proc/{entry}/environ").read_bytes() if with_environ else b""
        except OSError:
            continue
        yield int(entry), [a.decode(errors="replace") for a in raw.split(b"\0") if a], environ


def private_temp_dir(prefix: str) -> Path:
    """A new directory that only this user can enter, `/tmp/<prefix><pid>-<random>`, for what needs a short
    path (SSH control sockets: about 100 bytes at most). Its process removes it; one killed with SIGKILL
    cannot, so first the directories of this prefix left by this user's processes that are gone are
    removed."""
    tmp = Path("/tmp")
    for leftover in tmp.glob(f"{prefix}*-*"):
        pid = leftover.name[len(prefix):].split("-", 1)[0]
        with contextlib.suppress(OSError):
            mine = not leftover.is_symlink() and leftover.is_dir() and leftover.lstat().st_uid == os.getuid()
            if mine and pid.isdigit() and not alive(int(pid)):
                shutil.rmtree(leftover, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=tmp))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) is as good as gone.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def terminate(pids: list[int], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL what is still there after `timeout` seconds."""
    signal_all(pids, signal.SIGTERM)
    end = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    signal_all([p for p in pids if alive(p)], signal.SIGKILL)
