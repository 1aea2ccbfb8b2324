"""Clusters that an earlier test session left on this host, taken down before this one boots any node.

A session that is killed (SIGKILL, a CI timeout, the machine's job ending) never runs its fixtures'
teardown, so its local clusters stay: their state directories, bridges, routes and mounts. `fsdpctl up`
refuses a subnet that a cluster still holds, so the next `make test` on the same host would fail in
every module whose subnet the dead session used. fsdpctl itself rightly leaves such a cluster alone (its
state says it exists; only its owner may take it down); here the owner is known: every test cluster lives
under pytest's temporary root, in the directory of the session that made it.

Each session holds an exclusive lock on `SESSION_LOCK` in its own directory for as long as it lives (the
kernel drops it when the process dies, however it dies). At the start of a session, a cluster under
another session's directory whose lock nobody holds is a leftover and goes through `fsdpctl down`.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from fsdpctl.state import ClusterState, home_of
from fsdpctl.targets.local.nodes import BRIDGE_NAME, bridge_owner
from tests.local.conftest import fsdpctl

SESSION_LOCK = ".fsdp-test-session.lock"
_HELD_LOCK = pytest.StashKey[int]()


def hold_session_lock(session_dir: Path) -> int:
    """Lock `session_dir` as a live session's; the lock lasts as long as the returned descriptor."""
    fd = os.open(session_dir / SESSION_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def session_is_alive(session_dir: Path) -> bool:
    """Whether a live test session holds `session_dir`'s lock."""
    try:
        fd = os.open(session_dir / SESSION_LOCK, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def session_of(state_dir: Path, temp_root: Path) -> Path:
    """The directory of the test session a cluster's state directory under `temp_root` belongs to."""
    return temp_root / state_dir.relative_to(temp_root).parts[0]


def left_by_a_dead_session(state_dir: Path, temp_root: Path, current_session: Path) -> bool:
    """Whether the cluster in `state_dir` belongs to a test session under `temp_root` other than
    `current_session` that no longer lives."""
    if not state_dir.is_relative_to(temp_root):
        return False  # not a test cluster: never touched
    session_dir = session_of(state_dir, temp_root)
    return session_dir != current_session and not session_is_alive(session_dir)


def leftover_clusters(temp_root: Path, current_session: Path) -> list[Path]:
    """State directories of the clusters that dead test sessions left up on this host."""
    owners = (bridge_owner(link.name) for link in sorted(Path("/sys/class/net").glob("fsdp*br"))
              if BRIDGE_NAME.fullmatch(link.name))
    return [owner for owner in owners
            if owner is not None and ClusterState(name=owner.name, root=owner).exists()
            and left_by_a_dead_session(owner, temp_root, current_session)]


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if hasattr(config, "workerinput") or os.geteuid() != 0:
        return  # the controller cleans up once for its workers; only root can boot (or remove) nodes
    # The tmp_path_factory fixture's factory: fixtures are not available in a session hook.
    current_session = config._tmp_path_factory.getbasetemp()
    config.stash[_HELD_LOCK] = hold_session_lock(current_session)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    for state_dir in leftover_clusters(current_session.parent, current_session):
        result = fsdpctl(home_of(state_dir), "down", "--yes", "--cluster", state_dir.name, timeout=300,
                         check=False)
        outcome = "taken down" if result.returncode == 0 else f"NOT taken down:\n{result.stderr.strip()}"
        if reporter:
            reporter.write_line(f"cluster {state_dir.name} left by the killed test session "
                                f"{session_of(state_dir, current_session.parent).name}: {outcome}")


def pytest_unconfigure(config: pytest.Config) -> None:
    fd = config.stash.get(_HELD_LOCK, None)
    if fd is not None:
        os.close(fd)
