"""Which clusters the suite takes down at the start of a session as left by a killed earlier one
(tests/local/leftovers.py): the locks are real flocks, held by a real second process."""

import os
import subprocess
import sys
from pathlib import Path

from tests.local.leftovers import SESSION_LOCK, hold_session_lock, left_by_a_dead_session, session_is_alive


def _hold_in_another_process(session_dir: Path) -> subprocess.Popen:
    holder_code = ("import pathlib, sys, time; from tests.local.leftovers import hold_session_lock; "
                   "hold_session_lock(pathlib.Path(sys.argv[1])); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", holder_code, str(session_dir)], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[2])
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_session_holding_its_lock_is_alive_and_dead_once_its_process_is_killed(tmp_path):
    session = tmp_path / "pytest-7"
    session.mkdir()
    assert not session_is_alive(session)  # never locked: a session of a suite older than the lock, or none
    holder = _hold_in_another_process(session)
    try:
        assert session_is_alive(session)
    finally:
        holder.kill()
        holder.wait()
    assert (session / SESSION_LOCK).exists()
    assert not session_is_alive(session)  # SIGKILL ran no clean-up, and the kernel dropped the lock


def test_only_clusters_of_other_dead_sessions_under_the_temp_root_are_leftovers(tmp_path):
    root = tmp_path / "pytest-of-root"
    current, live, dead = (root / f"pytest-{n}" for n in (12, 11, 10))
    for session in (current, live, dead):
        session.mkdir(parents=True)
    held_here = hold_session_lock(current)
    holder = _hold_in_another_process(live)
    try:
        cluster = Path("popen-gw0/home2/clusters/hw-p5")
        assert left_by_a_dead_session(dead / cluster, root, current)
        assert not left_by_a_dead_session(live / cluster, root, current)
        assert not left_by_a_dead_session(current / cluster, root, current)
        assert not left_by_a_dead_session(tmp_path / "home/clusters/mine", root, current)  # a user's cluster
    finally:
        holder.kill()
        holder.wait()
        os.close(held_here)
    assert left_by_a_dead_session(live / cluster, root, current)
