"""The short private directories fsdpctl keeps SSH control sockets in (fsdpctl/processes.py)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import uuid
from pathlib import Path

from fsdpctl.processes import private_temp_dir


def test_a_new_directory_is_private_and_those_of_processes_that_are_gone_are_removed():
    prefix = f"fsdpctl-test-{uuid.uuid4().hex[:8]}-"
    gone = subprocess.Popen(["true"])
    gone.wait()
    left = Path(f"/tmp/{prefix}{gone.pid}-abcd")  # what a SIGKILLed process leaves
    (left / "socket").mkdir(parents=True)
    live = Path(f"/tmp/{prefix}{os.getpid()}-efgh")  # another directory of a process still running
    live.mkdir()
    made = None
    try:
        made = private_temp_dir(prefix)
        assert made.name.startswith(f"{prefix}{os.getpid()}-") and made.parent == Path("/tmp")
        assert stat.S_IMODE(made.stat().st_mode) == 0o700
        assert not left.exists() and live.is_dir()
    finally:
        for directory in (left, live, made):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
