"""Keeps one local node running across reboots, as a machine's firmware does: it starts the node's
systemd-nspawn and, when the node's systemd rebooted it (nspawn exits REBOOT_EXIT), starts it again
and puts its new network link back on the cluster's bridge. Any other end of nspawn (a shutdown, a
kill, a failed start) ends the keeper with nspawn's status.

    python fsdpctl/targets/local/keeper.py NODE_DIR/keeper.json

`fsdpctl.targets.local.nodes` starts one per node, in its own session, so it outlives `fsdpctl up`.
It runs as a file, not as `-m`, and imports only the standard library: every node start pays its
Python start-up. Its messages go to the node's nspawn.log; nspawn.pid is always the running
nspawn's pid (what stops and faults signal).
"""

from __future__ import annotations

import ctypes
import json
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REBOOT_EXIT = 133
"""systemd-nspawn's exit status when the container's systemd asked for a reboot (systemd-nspawn(1),
"--boot"; systemd-nspawn@.service restarts on it: RestartForceExitStatus=133)."""
LINK_TIMEOUT_S = 60
"""How long a restarted nspawn may take to create the node's network link."""
CLONE_NEWTIME = 0x80


@dataclass(frozen=True)
class KeptNode:
    """What the keeper needs to start a node and reconnect it (written by nodes.py as keeper.json)."""

    name: str
    nspawn_argv: list[str]
    veth: str
    """The host side of the node's eth0, which nspawn creates anew at each start."""
    bridge: str
    mtu: int
    log: str
    pid_file: str

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def read(cls, path: Path) -> KeptNode:
        return cls(**json.loads(path.read_text()))


def own_boot_clock() -> None:
    """In the child, before it execs nspawn: a new time namespace whose boot clock reads zero now, so
    the node's uptime starts at its boot, as a machine's does, not at the host's. Slurm takes a
    powered-up node back only once the boot time its slurmd reports (now - uptime) is after the
    power-up request."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWTIME):
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWTIME) failed")
    seconds, nanoseconds = divmod(-time.clock_gettime_ns(time.CLOCK_BOOTTIME), 10**9)
    Path("/proc/self/timens_offsets").write_text(f"boottime {seconds} {nanoseconds}\n")


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def attach_link(veth: str, bridge: str, mtu: int) -> None:
    """The node's host-side link on the bridge, up, without IPv6 (a second way out of the bridge)."""
    Path(f"/proc/sys/net/ipv6/conf/{veth}/disable_ipv6").write_text("1\n")
    subprocess.run(["ip", "link", "set", veth, "mtu", str(mtu), "master", bridge, "up"], check=True,
                   capture_output=True, text=True)


def _say(node: KeptNode, message: str) -> None:
    with open(node.log, "a") as log:
        log.write(f"[keeper {time.strftime('%H:%M:%S')}] {node.name}: {message}\n")


def _start(node: KeptNode) -> subprocess.Popen:
    with open(node.log, "a") as log:
        nspawn = subprocess.Popen(node.nspawn_argv, stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=subprocess.STDOUT, preexec_fn=own_boot_clock)
    Path(node.pid_file).write_text(f"{nspawn.pid}\n")
    return nspawn


def wait_for_link(veth: str, starter: subprocess.Popen, deadline: float) -> bool:
    """Whether the node's link appeared; False when the process starting the node (its nspawn, or its
    keeper) ended or the deadline (time.monotonic()) passed first."""
    while not link_exists(veth):
        if starter.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _reconnect(node: KeptNode, nspawn: subprocess.Popen) -> None:
    # Without its link the node is not reachable anyway; the keep loop reports an exit.
    if wait_for_link(node.veth, nspawn, time.monotonic() + LINK_TIMEOUT_S):
        attach_link(node.veth, node.bridge, node.mtu)


def keep(node: KeptNode) -> int:
    """Run the node until it ends other than by a reboot, or by a reboot after a shutdown request; its
    last nspawn's exit status (128 + the signal for a killed one, as a shell reports it)."""
    nspawn: subprocess.Popen | None = None
    shutdown_requested = False

    def request_shutdown(_signum, _frame) -> None:
        nonlocal shutdown_requested
        shutdown_requested = True
        if nspawn is not None:
            nspawn.send_signal(signal.SIGTERM)

    # SIGTERM to the keeper is a shutdown request for the node, as SIGTERM to nspawn is. The handler is
    # set before the node starts: a request that came between the start (its pid file written) and the
    # handler would have ended the keeper by the default action and left the node running.
    signal.signal(signal.SIGTERM, request_shutdown)
    nspawn = _start(node)
    while True:
        if shutdown_requested:  # asked while this nspawn was being started
            nspawn.send_signal(signal.SIGTERM)
        status = nspawn.wait()
        # a reboot after a shutdown request ends the node, as the request asked
        if status != REBOOT_EXIT or shutdown_requested:
            return status if status >= 0 else 128 - status
        _say(node, "rebooted (systemd-nspawn exit 133): starting it again")
        nspawn = _start(node)
        _reconnect(node, nspawn)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: keeper.py NODE_DIR/keeper.json", file=sys.stderr)
        return 2
    return keep(KeptNode.read(Path(argv[0])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
