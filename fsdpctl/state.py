"""One state directory per cluster, and the typed record every command reads and writes.

Layout under `$FSDPCTL_HOME` (default `~/.fsdpctl`):

    current                          name of the cluster commands act on without --cluster
    clusters/<name>/spec.yaml        the spec the cluster was brought up from (as given)
    clusters/<name>/state.json       the `ClusterRecord` below (schema_version, target, nodes, ...)
    clusters/<name>/*.good           the last copy of spec.yaml and state.json that was read back
                                     whole after writing: what `down --force` falls back on when
                                     the file itself was truncated or edited into garbage
    clusters/<name>/state.lock       held for each read-modify-write of state.json
    clusters/<name>/inventory.ini    the Ansible inventory (`fsdpctl inventory`)
    clusters/<name>/keys/            SSH keys for the cluster
    clusters/<name>/known_hosts      the nodes' (and bastion's) host keys, as recorded at `up`
    clusters/<name>/local/           local target: each node's root file system and machine files
    clusters/<name>/shared/          local target: the directory every node mounts as the shared one
    locks/<name>.lock                held by the command that changes the cluster or runs on it
                                     (up, down, replace, configure, deploy, smoke, scale-test); it
                                     names the holder, so a second one refuses with who to wait for
    pulumi/                          aws target: Pulumi's local backend (unless PULUMI_BACKEND_URL
                                     names another)
    reports/<name>/<time>-<kind>/    one directory per run (configure, smoke, scale-test): logs,
                                     report.json, report.html; kept after `fsdpctl down`

state.json is written atomically (a temporary file renamed over it) under an exclusive lock held for
the whole read-modify-write (`update`, `change`), so two commands on one cluster never lose each
other's fields.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, ValidationError

from fsdpctl.errors import StateError, UsageError
from fsdpctl.filelock import exclusive
from infra.spec import ClusterSpec, SpecError, load_spec
from infra.spec.problems import echo, problems_from_validation

SCHEMA_VERSION = 1
"""The layout of state.json this fsdpctl writes; a newer one is refused, not misread."""

Target = Literal["aws", "local"]
"""Where a cluster's nodes come from: the one list of target names (fsdpctl/targets/ has a package
for each; `fsdpctl up --target` offers these)."""
TARGET_NAMES: tuple[Target, ...] = get_args(Target)


class _Record(BaseModel):
    # Each field's docstring documents it; pydantic is not asked to read them (infra/spec/model.py's
    # _Model says why).
    model_config = ConfigDict(extra="forbid")


class Node(_Record):
    """One node of the cluster, as every stage after `up` reaches it."""

    rank: int
    """Position in the cluster (0 .. node_count-1); torchrun's node rank and the Ansible `node_rank`."""
    name: str
    """Host name, `<cluster>-node<rank>`."""
    address: str
    """The address fsdpctl and the other nodes reach it at (a private IP on AWS)."""
    instance_id: str | None = None
    """The EC2 instance id (aws target only)."""


class SshSettings(_Record):
    user: str
    """Login user on the nodes."""
    key_file: str
    """Private key fsdpctl connects with."""
    known_hosts: str
    """The cluster's own known_hosts file; host keys are pinned there."""
    proxy_jump: str | None = None
    """`user@bastion` when the nodes are reached through a bastion."""


class Exclusion(_Record):
    rank: int
    reason: str
    time: str
    """When it was excluded (ISO 8601 UTC)."""


class HostRecap(_Record):
    """One host's task counts in a playbook run, as Ansible's recap gives them."""

    ok: int = 0
    """Tasks that ran fine, the changed ones included (as in Ansible's recap)."""
    changed: int = 0
    failed: int = 0
    skipped: int = 0
    unreachable: int = 0


class TaskFailure(_Record):
    """A task that failed on a host (or found it unreachable), and Ansible's message."""

    model_config = ConfigDict(frozen=True)

    host: str
    task: str
    """`role : task name`, or the task name alone outside a role."""
    message: str


class ConfigureRecord(_Record):
    """The outcome of the last `fsdpctl configure`."""

    time: str
    ok: bool
    status: str
    """ansible-runner's status: successful, failed, canceled or timeout."""
    run_dir: str
    hosts: dict[str, HostRecap] = {}
    failures: list[TaskFailure] = []


class DeployRecord(_Record):
    """What `fsdpctl deploy` installed, and where."""

    bundle: str
    venv: str
    """The venv on every node that holds the trainer."""
    wheelhouse_dir: str
    trainer_dir: str
    ranks: list[int]
    torch: str
    includes_torch: bool
    python: str
    deployed_at: float


class LocalNode(_Record):
    """A local node: a systemd-nspawn container booted from an overlay on the shared image."""

    rank: int
    name: str
    address: str
    machine: str
    """systemd-nspawn machine name, unique on the host."""
    veth: str
    """Host end of the node's eth0."""
    dir: str
    """upper/, work/, merged/ (the node's root), nspawn.log, nspawn.pid."""
    machine_id: str
    """Also the container_uuid in the environment of the node's init."""

    @property
    def container_uuid(self) -> str:
        return str(uuid.UUID(self.machine_id))

    @property
    def root(self) -> Path:
        return Path(self.dir) / "merged"


class LocalRecord(_Record):
    """Everything the local target creates, recorded before it is created so `down` can always
    remove it, even after a SIGKILLed `up`."""

    subnet: str
    bridge: str
    bridge_address: str
    gateway: str
    """A bridge address nobody answers: the nodes' default route leads nowhere."""
    rootfs: str
    shared_host_dir: str
    nodes: list[LocalNode]
    power_agent_pid: int | None = None
    """The power agent (fsdpctl.targets.local.power) of a cluster with power saving: it boots and
    stops nodes when Slurm asks. `down` stops it first."""
    powered_down: list[int] = []
    """Ranks the power agent stopped because Slurm powered them down (not a fault)."""


class ClusterRecord(_Record):
    """state.json: what fsdpctl knows of one cluster."""

    schema_version: int = SCHEMA_VERSION
    name: str
    target: Target
    created_at: float
    updated_at: float = 0.0
    node_count: int | None = None
    """Nodes asked for (the local target's --nodes, or the spec's node_count)."""
    nodes: list[Node] = []
    ssh: SshSettings | None = None
    shared_dir: str | None = None
    """A file system mounted at this path on every node (FSx, or /shared on local nodes)."""
    pulumi_stack: str | None = None
    """Set once `pulumi up` may have created something: from then on `down` runs `pulumi destroy`."""
    stack_outputs: dict[str, Any] = {}
    expires_at: str | None = None
    """When the AWS-side expiry removes the cluster's billed resources (ISO 8601 UTC)."""
    expiry_queue_url: str | None = None
    """The expiry schedules' dead-letter queue (SQS): the calls that failed, which `status` reports."""
    cost_per_hour: float | None = None
    """The plan's hourly estimate at `up`, for `fsdpctl list`; None when a price is unknown (spot, a
    Capacity Block, a type or region the price table lacks)."""
    cost_per_hour_max: float | None = None
    """The most it can cost per hour when the estimate is not exact (spot: at its max price)."""
    excluded: list[Exclusion] = []
    last_configure: ConfigureRecord | None = None
    last_report: str | None = None
    """The directory of the last smoke report."""
    deploy: DeployRecord | None = None
    local: LocalRecord | None = None

    def excluded_ranks(self) -> set[int]:
        return {entry.rank for entry in self.excluded}

    def active_nodes(self) -> list[Node]:
        """Nodes by rank, without those excluded with `fsdpctl exclude`."""
        skip = self.excluded_ranks()
        return [n for n in sorted(self.nodes, key=lambda n: n.rank) if n.rank not in skip]


def home() -> Path:
    return Path(os.environ.get("FSDPCTL_HOME") or Path.home() / ".fsdpctl")


def reports_dir(cluster: str) -> Path:
    """Where a cluster's run logs and reports are kept (they outlive the cluster)."""
    return home() / "reports" / cluster


@dataclass(frozen=True)
class ClusterState:
    """A cluster's state directory; `read()` gives its record, `update()` changes it safely."""

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
    def known_hosts(self) -> Path:
        return self.root / "known_hosts"

    @property
    def reports_dir(self) -> Path:
        return reports_dir(self.name)

    def exists(self) -> bool:
        return self.state_path.exists()

    def spec(self) -> ClusterSpec:
        """The cluster's copy of its spec, or a one-line StateError naming the file and the repair."""
        return self._spec_from(self.spec_path)

    def _spec_from(self, path: Path) -> ClusterSpec:
        try:
            return load_spec(path)
        except SpecError as e:
            raise StateError(f"{self.spec_path}: the cluster's copy of its spec is unreadable "
                             f"({e.problems[0]}); {self._repair(self.spec_path)}") from None

    def read(self) -> ClusterRecord:
        """The record, or a one-line StateError naming the file and how to repair it."""
        try:
            text = self.state_path.read_text()
        except FileNotFoundError:
            raise StateError(f"cluster {self.name} has no state file {self.state_path}: it was never "
                             f"brought up, or `fsdpctl down` removed it") from None
        try:
            return _parse_record(text)
        except ValueError as e:
            raise StateError(f"{self.state_path} {e}; {self._repair(self.state_path)}") from None

    def _repair(self, path: Path) -> str:
        backup = _backup(path)
        restore = (f"restore it from {backup} (the last good copy), or " if backup.exists()
                   else "restore it, or ")
        return f"{restore}remove the cluster with `fsdpctl down --cluster {self.name} --force`"

    def restore_unreadable(self, progress: Callable[[str], None]) -> None:
        """For `down --force`: put back the last good copy of state.json or of the spec copy where the
        file itself is unreadable, saying so; a StateError when the copy is unreadable too."""
        for path, check in ((self.state_path, lambda p: _parse_record(p.read_text())),
                            (self.spec_path, load_spec)):
            try:
                check(path)
                continue
            except (OSError, ValueError) as e:  # SpecError is a ValueError
                problem = str(e).splitlines()[-1].strip(" -")
            backup = _backup(path)
            try:
                check(backup)
                text = backup.read_text()
            except (OSError, ValueError):
                raise StateError(f"{path} is unreadable ({problem}) and so is its last good copy {backup}; "
                                 "remove what the cluster made by hand (docs/reliability.md says what "
                                 f"that is), then the directory {self.root}") from None
            progress(f"{path} is unreadable ({problem}); restored its last good copy {backup}")
            write_kept(path, text)

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return exclusive(self.root / "state.lock")

    def update(self, **fields: Any) -> ClusterRecord:
        """Set the given fields (validated) and return the new record; see `change`."""
        return self.change(lambda _record: fields)

    def change(self, fields_of: Callable[[ClusterRecord | None], dict[str, Any]]) -> ClusterRecord:
        """Set the fields `fields_of(current record)` returns, the read, the change and the atomic
        write all under the state lock: a field computed from the record (a list gaining an entry)
        cannot lose what another command wrote in the meantime."""
        with self._locked():
            record = self.read() if self.exists() else None
            current = record.model_dump() if record else {}
            for key, value in fields_of(record).items():
                current[key] = value.model_dump() if isinstance(value, BaseModel) else value
            current["updated_at"] = time.time()
            record = ClusterRecord.model_validate(current)
            write_kept(self.state_path, record.model_dump_json(indent=2))
        return record

    def new_run_dir(self, kind: str) -> Path:
        """A fresh directory for one run's logs and report, under reports/<cluster>/."""
        base = self.reports_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}"
        path, suffix = base, 0
        while True:
            try:
                path.mkdir(parents=True)
                return path
            except FileExistsError:
                suffix += 1
                path = base.with_name(f"{base.name}.{suffix}")

    @contextlib.contextmanager
    def operation(self, what: str) -> Iterator[None]:
        """Hold the cluster's operation lock while a command changes the cluster or runs on it: one at a
        time, so a second `up` failing half-way cannot tear down what the first is building, and
        `deploy` cannot replace the trainer under a running `smoke`. A second command refuses at
        once, naming the one it would have to wait for. The lock file lives outside the state
        directory, which `down` removes."""
        lock_dir = home() / "locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        with open(lock_dir / f"{self.name}.lock", "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                holder = lock.read().strip() or "another fsdpctl command"
                raise UsageError(f"cluster {self.name} is busy: {holder}; wait for it to finish (or stop "
                                 f"it), then run `fsdpctl {what}` again") from None
            lock.truncate(0)
            lock.write(f"fsdpctl {what} (pid {os.getpid()}) is running since "
                       f"{time.strftime('%H:%M:%S')}\n")
            lock.flush()
            try:
                yield
            finally:
                lock.truncate(0)

    def remove(self) -> None:
        """Remove the state directory (reports stay) and, if it was current, the current marker."""
        shutil.rmtree(self.root, ignore_errors=True)
        current = home() / "current"
        if current.exists() and current.read_text().strip() == self.name:
            current.unlink()


def _parse_record(text: str) -> ClusterRecord:
    """state.json's text as a record; a ValueError saying what is wrong (not JSON, a newer schema, a
    bad field)."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError("does not hold a JSON object")
    version = data.get("schema_version", SCHEMA_VERSION)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ValueError(f"has schema_version {version!r}, newer than this fsdpctl reads ({SCHEMA_VERSION}): "
                         "use the fsdpctl that wrote it, or upgrade")
    try:
        return ClusterRecord.model_validate(data)
    except ValidationError as e:
        first = problems_from_validation(e, ClusterRecord)[0]
        raise ValueError(f"has a bad {first.field}: it {first.message} (got {echo(first.value)})") from None


def _backup(path: Path) -> Path:
    return path.with_name(path.name + ".good")


def write_kept(path: Path, text: str) -> None:
    """Write `path` atomically (a synced temporary file renamed over it), then its `.good` copy the
    same way: whatever later truncates or garbles the file, the copy holds what was last written."""
    for target in (path, _backup(path)):
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(target)


def clusters_dir() -> Path:
    """Where the state directories of clusters live: `<FSDPCTL_HOME>/clusters/<name>`."""
    return home() / "clusters"


def home_of(state_dir: Path) -> Path:
    """The FSDPCTL_HOME a cluster's state directory is under (clusters_dir's inverse)."""
    return state_dir.parent.parent


def cluster_state(name: str) -> ClusterState:
    return ClusterState(name=name, root=clusters_dir() / name)


def create(spec_file: Path, spec: ClusterSpec, target: Target, **fields: Any) -> ClusterState:
    """Start the state of a new cluster and make it the current one."""
    state = cluster_state(spec.name)
    state.root.mkdir(parents=True, exist_ok=True)
    write_kept(state.spec_path, Path(spec_file).read_text())
    state.update(name=spec.name, target=target, created_at=time.time(), **fields)
    set_current(spec.name)
    return state


def set_current(name: str) -> None:
    home().mkdir(parents=True, exist_ok=True)
    (home() / "current").write_text(name + "\n")


def known_clusters() -> list[ClusterState]:
    clusters = clusters_dir()
    if not clusters.is_dir():
        return []
    return [cluster_state(p.name) for p in sorted(clusters.iterdir()) if (p / "state.json").exists()]


def resolve(name: str | None, *, readable: bool = True) -> ClusterState:
    """The cluster a command acts on: --cluster NAME, else the one brought up last. With `readable`
    (all but `down --force`) its state.json and spec copy are read first, so a broken one stops
    every command the same way before it does anything."""
    if name is None:
        current = home() / "current"
        if not current.exists():
            raise StateError(f"no current cluster under {home()}: run `fsdpctl up SPEC.yaml` first, "
                             "or pass --cluster NAME (`fsdpctl list` shows them)")
        name = current.read_text().strip()
    state = cluster_state(name)
    if not state.exists():
        known = [c.name for c in known_clusters()]
        near = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {near[0]}? " if near else ""
        raise StateError(f"no cluster named {name!r} under {home()}; {hint}known: "
                         f"{', '.join(known) or 'none'} (`fsdpctl list`)")
    if readable:
        state.read()
        state.spec()
    return state


def resolve_cluster(name: str | None) -> tuple[ClusterState, ClusterRecord, ClusterSpec]:
    """The cluster a command acts on (`state.resolve`: --cluster NAME, else the current one), with its
    record and spec: read once, here, for the command to pass down. They are what `resolve` would
    read to refuse a broken file, so a broken one stops the command the same way."""
    state = resolve(name, readable=False)
    return state, state.read(), state.spec()


@contextlib.contextmanager
def cluster_operation(name: str | None, what: str
                      ) -> Iterator[tuple[ClusterState, ClusterRecord, ClusterSpec]]:
    """`resolve_cluster` for a command that holds the cluster's operation lock while it runs
    (`ClusterState.operation`): the record and spec are read once the lock is held, so they are what
    the command before it left, and no other operation changes the nodes under it."""
    state = resolve(name, readable=False)
    with state.operation(what):
        yield state, state.read(), state.spec()
