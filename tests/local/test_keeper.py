"""fsdpctl/targets/local/keeper.py's loop, with a command in place of systemd-nspawn: a reboot (exit 133)
starts it again in a new boot clock, anything else ends the keeper with the command's status."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdpctl.targets.local import keeper

pytestmark = pytest.mark.root  # the keeper's child unshares a time namespace (CAP_SYS_ADMIN)


def _kept(tmp_path: Path, script: str) -> keeper.KeptNode:
    # No link is ever made: the keeper waits for it only while the restarted command runs.
    return keeper.KeptNode(name="node-under-test", nspawn_argv=["sh", "-c", script], veth="fsdpkeeptest0",
                           bridge="fsdpkeeptestbr", mtu=9000, log=str(tmp_path / "nspawn.log"),
                           pid_file=str(tmp_path / "nspawn.pid"))


def test_a_reboot_starts_the_node_again_in_a_new_boot_clock(tmp_path):
    """The first run records its uptime and reboots; the second records its uptime and shuts down."""
    runs = tmp_path / "runs"
    script = (f"cut -d. -f1 /proc/uptime >> {runs}; echo $$ >> {runs}.pids; "
              f"if [ $(wc -l < {runs}) -eq 1 ]; then sleep 1.2; exit 133; fi; exit 0")
    node = _kept(tmp_path, script)
    assert keeper.keep(node) == 0
    first, second = (int(line) for line in runs.read_text().split())
    assert first <= 1 and second <= 1  # each run's boot clock starts at its own start, not the host's
    pids = Path(f"{runs}.pids").read_text().split()
    assert len(pids) == 2 and Path(node.pid_file).read_text().strip() == pids[1]
    log = Path(node.log).read_text()
    assert "node-under-test: rebooted (systemd-nspawn exit 133): starting it again" in log


@pytest.mark.parametrize(("script", "status"), [("exit 0", 0), ("exit 1", 1), ("kill -KILL $$", 137)])
def test_any_other_end_ends_the_keeper_with_its_status(tmp_path, script, status):
    assert keeper.keep(_kept(tmp_path, script)) == status
    assert "rebooted" not in Path(tmp_path / "nspawn.log").read_text()


def test_sigterm_to_the_keeper_is_a_shutdown_request_for_the_node(tmp_path):
    """As SIGTERM to nspawn: the node's command gets it, and the keeper ends with its status."""
    node = _kept(tmp_path, "trap 'exit 0' TERM; while :; do sleep 0.1; done")
    settings = tmp_path / "keeper.json"
    node.write(settings)
    process = subprocess.Popen([sys.executable, keeper.__file__, str(settings)])
    deadline = time.monotonic() + 30
    while not Path(node.pid_file).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0


def test_a_reboot_after_a_shutdown_request_ends_the_node(tmp_path):
    """A node that reboots when asked to shut down (exit 133 on SIGTERM) is not started again."""
    runs = tmp_path / "runs"
    node = _kept(tmp_path, f"echo $$ >> {runs}; trap 'exit 133' TERM; while :; do sleep 0.1; done")
    settings = tmp_path / "keeper.json"
    node.write(settings)
    process = subprocess.Popen([sys.executable, keeper.__file__, str(settings)])
    deadline = time.monotonic() + 30
    while not runs.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    try:
        assert process.wait(timeout=30) == 133
    finally:  # a keeper that started the node again leaves it running
        process.kill()
        for pid in runs.read_text().split():
            subprocess.run(["kill", "-KILL", pid], stderr=subprocess.DEVNULL, check=False)
    assert len(runs.read_text().split()) == 1
    assert "rebooted" not in Path(node.log).read_text()


def test_bad_arguments_are_a_usage_line():
    result = subprocess.run([sys.executable, keeper.__file__], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr == "usage: keeper.py NODE_DIR/keeper.json\n"
