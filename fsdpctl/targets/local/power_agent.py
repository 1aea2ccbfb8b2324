"""The local power agent's process: `python -m fsdpctl.targets.local.power_agent STATE_DIR`, started by
`fsdpctl up` for a local cluster with power saving (fsdpctl.targets.local.power)."""

from __future__ import annotations

import sys
from pathlib import Path

from fsdpctl.state import ClusterState
from fsdpctl.targets.local.power import AGENT_MODULE, Agent


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: python -m {AGENT_MODULE} STATE_DIR", file=sys.stderr)
        return 2
    root = Path(argv[0])
    Agent(ClusterState(name=root.name, root=root)).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
