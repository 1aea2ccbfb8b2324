"""Stand-in commands for tests of scripts the nodes run: bash bodies found first on PATH."""

from __future__ import annotations

import os
from pathlib import Path


def stand_in_commands(tmp_path: Path, **scripts: str) -> dict[str, str]:
    """An environment whose PATH finds these stand-in commands (name -> bash body) first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
