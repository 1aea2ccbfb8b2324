"""One state directory per cluster: the spec, target, inventory, keys, run logs and reports.

Layout under `$FSDPCTL_HOME` (default `~/.fsdpctl`):

    current                      name of the cluster that commands act on without --cluster
    clusters/<name>/spec.yaml    the spec the cluster was brought up from (as given)
    clusters/<name>/state.json   target (aws|local), node list, stack outputs, excluded nodes
    clusters/<name>/inventory.ini
    clusters/<name>/keys/        SSH keys for the cluster
    clusters/<name>/runs/        one private ansible-runner data dir per configure run, logs
    clusters/<name>/report.json, report.html   the last smoke-test report
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.spec import ClusterSpec, load_spec


class StateError(RuntimeError):
    pass


def home() -> Path:
    return Path(os.environ.get("FSDPCTL_HOME") or Path.home() / ".fsdpctl")


@dataclass
class ClusterState:
    name: str
    root: Path

    @property
    def spec_path(self) -> Path:
        return self.root / "spec.yaml"

    @property
    def state_path(self) -> Path:
        return self.root / "state.json"

    @property
    def inventory_path(self) -> Path:
        return self.root / "inventory.ini"

    @property
    def keys_dir(self) -> Path:
        return self.root / "keys"

    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"

    def exists(self) -> bool:
        return self.state_path.exists()

    def spec(self) -> ClusterSpec:
        return load_spec(self.spec_path)

    def read(self) -> dict[str, Any]:
        if not self.state_path.exists():
            return {}
        return json.loads(self.state_path.read_text())

    def update(self, **fields: Any) -> dict[str, Any]:
        """Merge fields into state.json atomically and return the new state."""
        data = self.read()
        data.update(fields)
        data["updated_at"] = time.time()
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        tmp.replace(self.state_path)
        return data

    def new_run_dir(self, kind: str) -> Path:
        path = self.runs_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}"
        suffix = 0
        while path.exists():
            suffix += 1
            path = path.with_name(f"{path.name.split('.')[0]}.{suffix}")
        path.mkdir(parents=True)
        return path

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        current = home() / "current"
        if current.exists() and current.read_text().strip() == self.name:
            current.unlink()


def cluster_state(name: str) -> ClusterState:
    return ClusterState(name=name, root=home() / "clusters" / name)


def create(spec_file: Path, spec: ClusterSpec, target: str) -> ClusterState:
    """Start the state of a new cluster and make it the current one."""
    state = cluster_state(spec.name)
    state.root.mkdir(parents=True, exist_ok=True)
    (state.root / "spec.yaml").write_text(Path(spec_file).read_text())
    state.update(name=spec.name, target=target, created_at=time.time())
    set_current(spec.name)
    return state


def set_current(name: str) -> None:
    home().mkdir(parents=True, exist_ok=True)
    (home() / "current").write_text(name + "\n")


def resolve(name: str | None) -> ClusterState:
    """The cluster a command acts on: --cluster NAME, else the one brought up last."""
    if name is None:
        current = home() / "current"
        if not current.exists():
            raise StateError(f"no current cluster under {home()}: run `fsdpctl up SPEC.yaml` first, "
                             "or pass --cluster NAME")
        name = current.read_text().strip()
    state = cluster_state(name)
    if not state.exists():
        clusters = home() / "clusters"
        known = sorted(p.name for p in clusters.glob("*")) if clusters.exists() else []
        raise StateError(f"no cluster named {name!r} under {home()} (known: {', '.join(known) or 'none'})")
    return state
