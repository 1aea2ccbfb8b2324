"""Helpers for the local-target tests: real systemd-nspawn nodes, one FSDPCTL_HOME and one subnet per
module (`make test` runs node test modules side by side), and an independent look at the host for
anything a cluster left behind."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fsdpctl import remote
from fsdpctl.state import ClusterState
from fsdpctl.targets.local.host import missing_commands
from fsdpctl.targets.local.nodes import LAYER_ENV

REPO = Path(__file__).resolve().parents[2]
SUBNET = "198.18.1.0/24"  # test_configure's; every module that boots nodes has a subnet of its own
# Node-to-node SSH run on a node. BatchMode: fail instead of asking for a password or a host-key confirmation.
NODE_SSH = "ssh -o BatchMode=yes -o ConnectTimeout=10"
LOGIN_USER = "ubuntu"
"""The login user of the node tests' clusters (`local.login_user`): a user with passwordless sudo, as an AWS
image's is, so what fsdpctl runs on a node runs as it would there."""


def as_root(command: str) -> str:
    """`command` for a node whose login user is not root: run by root through the user's passwordless sudo
    (`-n`: fail rather than ask for a password)."""
    return f"sudo -n sh -c {shlex.quote(command)}"


def spec_file(directory: Path, name: str, *, node_count: int = 2, subnet: str = SUBNET, **overrides) -> Path:
    spec = {"name": name, "region": "us-east-1", "availability_zone": "us-east-1b",
            "instance_type": "p4d.24xlarge", "node_count": node_count, "ssh_cidr": "203.0.113.0/24",
            "local": {"subnet_cidr": subnet}, **overrides}
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def fsdpctl(home: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 600,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run the real CLI (the venv's `fsdpctl` script) in a subprocess, as a user would from a
    script: no terminal on stdin, so a question is an error unless --yes is given."""
    result = subprocess.run([str(Path(sys.executable).parent / "fsdpctl"), *args], cwd=REPO,
                            capture_output=True, stdin=subprocess.DEVNULL,
                            text=True, timeout=timeout,
                            env={**os.environ, "FSDPCTL_HOME": str(home), **(env or {})})
    if check and result.returncode:
        raise AssertionError(f"fsdpctl {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n"
                             f"{result.stderr}")
    return result


def require_local_prerequisites() -> None:
    """Fail (under CI) or skip (elsewhere) when this host cannot run local nodes."""
    problems = []
    if os.geteuid() != 0:
        problems.append("not root")
    missing = missing_commands()
    if missing:
        problems.append("missing commands: " + ", ".join(f"{c} ({p})" for c, p in missing.items()))
    if problems:
        missing_prerequisite("local nodes need root and systemd-nspawn, debootstrap, zstd, ssh, ip: "
                             + "; ".join(problems) + " (make host-packages installs them)")


def missing_prerequisite(message: str) -> None:
    """Under CI a missing prerequisite is a failure (the suite must really run there); elsewhere a skip."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def prerequisites() -> None:
    require_local_prerequisites()


def reboot(state: ClusterState, rank: int, *, within_s: float = 180) -> str:
    """`systemctl reboot` inside node `rank` (as a role would reboot a machine), then a wait until the node
    answers again from a new boot and its systemd has finished starting; returns systemd's state then
    (`running`, or `degraded` with a failed unit). Raises, with the node's nspawn log, if it does not."""
    boot_id = "cat /proc/sys/kernel/random/boot_id"
    before = remote.run(state, rank, boot_id).stdout.strip()
    remote.run(state, rank, "systemd-run --on-active=1 systemctl reboot")  # after this SSH session ends
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        after = remote.run(state, rank, f"{boot_id}; systemctl is-system-running --wait",
                           timeout=60, check=False)
        lines = after.stdout.split()
        if len(lines) == 2 and lines[0] != before:
            return lines[1]
        time.sleep(0.5)
    log = Path(state.read().local.nodes[rank].dir, "nspawn.log").read_text()[-2000:]
    raise AssertionError(f"node {rank} did not come back from a reboot within {within_s:.0f} s:\n{log}")


def login_blocker_failing_once_per_boot(directory: Path) -> dict[str, str]:
    """The environment for `fsdpctl up` under which every node gets a drop-in (through the node layer,
    FSDPCTL_LOCAL_NODE_LAYER, written under `directory`) that fails systemd-user-sessions' first start
    of each boot, as it failed once on a loaded CI host: /run/nologin then stays, and pam_nologin
    refuses every login but root's until the unit is started again."""
    drop_in = directory / "etc/systemd/system/systemd-user-sessions.service.d/fail-once.conf"
    drop_in.parent.mkdir(parents=True)
    drop_in.write_text("[Service]\nExecStartPre=/bin/sh -c "
                       "'test -e /run/failed-once || { touch /run/failed-once; exit 1; }'\n")
    return {LAYER_ENV: str(directory)}


def read_state(home: Path, name: str) -> dict:
    return json.loads((home / "clusters" / name / "state.json").read_text())


def host_leftovers(home: Path, local: dict) -> list[str]:
    """What of a cluster (its `local` state record) still exists, checked without the product's code:
    processes running from the home dir or inside the nodes, links, mounts, state files."""
    found = []
    uuids = [f"container_uuid={n['machine_id'][:8]}-" for n in local["nodes"]]
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = Path(f"/proc/{entry}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(home) in cmdline or any(u in environ for u in uuids):
            found.append(f"process {entry}: {cmdline[:100]}")
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    for name in [local["bridge"], *(n["veth"] for n in local["nodes"])]:
        if f" {name}:" in links or f" {name}@" in links:
            found.append(f"link {name}")
    found += [f"mount {line.split()[1]}" for line in Path("/proc/mounts").read_text().splitlines()
              if str(home) in line]
    found += [f"nspawn runtime dir {n['machine']}" for n in local["nodes"]
              if Path("/run/systemd/nspawn/propagate", n["machine"]).exists()]
    clusters = home / "clusters"
    if clusters.exists():
        found += [f"state dir {p}" for p in clusters.iterdir()]
    return found
