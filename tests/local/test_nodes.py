"""Two real local nodes, booted once for the module: identity, network, isolation, SSH helpers, the
lifecycle commands around them, and a teardown that leaves nothing behind; and a one-node cluster of its
own whose login-blocking unit fails while it boots."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdpctl import remote
from fsdpctl.processes import alive
from fsdpctl.state import cluster_state
from tests.local.conftest import (
    LOGIN_USER,
    fsdpctl,
    host_leftovers,
    login_blocker_failing_once_per_boot,
    read_state,
    reboot,
    spec_file,
)

pytestmark = pytest.mark.root

SUBNET = "198.18.6.0/24"  # this module's own subnet
LOGIN_SUBNET = "198.18.8.0/24"  # its one-node cluster's

NAME = "lnt-nodes"


@pytest.fixture(scope="module")
def cluster(prerequisites, tmp_path_factory):
    """(home, spec path) of a 2-node cluster that is up for the module and down afterwards."""
    home = tmp_path_factory.mktemp("home")
    spec = spec_file(tmp_path_factory.mktemp("spec"), NAME, subnet=SUBNET)
    try:
        up = fsdpctl(home, "up", str(spec), "--target", "local")
        assert "2 node(s) up" in up.stdout
        yield home, spec
    finally:
        fsdpctl(home, "down", "--yes", "--cluster", NAME, check=False)


@pytest.fixture
def state(cluster, monkeypatch):
    home, _ = cluster
    monkeypatch.setenv("FSDPCTL_HOME", str(home))
    return cluster_state(NAME)


def test_state_records_nodes_ssh_and_shared_dir(cluster):
    home, _ = cluster
    data = read_state(home, NAME)
    assert data["target"] == "local"
    assert [(n["rank"], n["name"], n["address"]) for n in data["nodes"]] == [
        (0, f"{NAME}-node0", "198.18.6.2"), (1, f"{NAME}-node1", "198.18.6.3")]
    assert data["ssh"]["user"] == "root" and data["ssh"]["proxy_jump"] is None
    assert data["shared_dir"] == "/shared"


def test_each_node_has_its_own_identity(state):
    results = remote.run_all(state, "hostname; cat /etc/machine-id; "
                                    "ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub; "
                                    "ip -4 -o addr show dev eth0; systemctl is-system-running; "
                                    "systemctl --failed --no-legend --plain", timeout=60, check=False)
    lines = {rank: r.stdout.splitlines() for rank, r in results.items()}
    assert [lines[r][0] for r in (0, 1)] == [f"{NAME}-node0", f"{NAME}-node1"]
    assert lines[0][1] != lines[1][1], "machine-ids must differ"
    assert lines[0][2].split()[1] != lines[1][2].split()[1], "host keys must differ"
    assert "198.18.6.2/24" in lines[0][3] and "198.18.6.3/24" in lines[1][3]
    failed_units = {r: lines[r][5:] for r in (0, 1)}  # what `systemctl --failed` lists
    assert [lines[r][4] for r in (0, 1)] == ["running", "running"], failed_units


def test_bridge_allows_jumbo_frames_once_eth0_is_raised(state):
    bridge = state.read().local.bridge
    assert Path(f"/sys/class/net/{bridge}/mtu").read_text().strip() == "9000"
    # eth0 starts at 1500: raising it is the playbook's job, which the bridge must permit.
    assert remote.run(state, 0, "cat /sys/class/net/eth0/mtu").stdout.strip() == "1500"


def test_shared_dir_is_the_same_on_every_node(state):
    remote.run(state, 0, "echo written-on-node0 > /shared/probe")
    assert remote.run(state, 1, "cat /shared/probe").stdout.strip() == "written-on-node0"
    host_dir = state.read().local.shared_host_dir
    assert Path(f"{host_dir}/probe").read_text().strip() == "written-on-node0"


def test_nodes_reach_each_other_but_nothing_beyond_the_bridge(state):
    assert remote.run(state, 0, "ping -c1 -W5 198.18.6.3").returncode == 0
    # 198.18.7.9 is in the benchmark range but not on this bridge: the only route to it is the
    # dead-end gateway, so the connection attempt must fail without any packet leaving the bridge.
    route = remote.run(state, 0, "ip route get 198.18.7.9").stdout
    assert "via 198.18.6.254 dev eth0" in route
    probe = remote.run(state, 0, "timeout 5 bash -c 'exec 3<>/dev/tcp/198.18.7.9/22' && echo connected",
                       check=False)
    assert probe.returncode != 0 and "connected" not in probe.stdout
    bridge = state.read().local.bridge
    assert Path(f"/proc/sys/net/ipv4/conf/{bridge}/forwarding").read_text().strip() == "0"


def test_fsdpctl_ssh_runs_a_command_and_returns_its_status(cluster):
    home, _ = cluster
    out = fsdpctl(home, "ssh", "1", "--", "hostname")
    assert out.stdout.strip() == f"{NAME}-node1"
    failed = fsdpctl(home, "ssh", "0", "--", "exit 3", check=False)
    assert failed.returncode == 3
    missing = fsdpctl(home, "ssh", "7", "--", "true", check=False)
    assert missing.returncode == 2 and "no node with rank 7" in missing.stderr


def test_copy_to_and_popen(state, tmp_path):
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub/file.txt").write_text("tree file\n")
    single = tmp_path / "run.sh"
    single.write_text("#!/bin/sh\necho ran\n")
    single.chmod(0o755)
    remote.copy_to(state, 1, tree, "/opt/copied")
    remote.copy_to(state, 1, single, "/opt/bin/run.sh")
    out = remote.run(state, 1, "cat /opt/copied/sub/file.txt && /opt/bin/run.sh").stdout
    assert out.splitlines() == ["tree file", "ran"]
    proc = remote.popen(state, 0, "echo started; sleep 0.2; echo done", stdout=subprocess.PIPE, text=True)
    assert proc.communicate(timeout=60)[0].splitlines() == ["started", "done"]


SHARING = """
import json, sys
from fsdpctl import remote
from fsdpctl.state import cluster_state
state = cluster_state(sys.argv[1])
# $PPID: the sshd process of the connection that ran the command
parents = [remote.run(state, 0, "echo $PPID").stdout.strip() for _ in range(3)]
parents += [remote.run_all(state, "echo $PPID")[0].stdout.strip()]
print(json.dumps({"parents": parents, "sockets": str(remote._shared._dir)}))
"""


def test_commands_on_a_node_share_one_connection_which_ends_with_the_process(cluster):
    """Every command a process runs on a node goes through one SSH connection (OpenSSH's ControlMaster),
    and the process ends its connections when it exits."""
    home, _ = cluster
    done = subprocess.run([sys.executable, "-c", SHARING, NAME], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FSDPCTL_HOME": str(home)}, check=True)
    seen = json.loads(done.stdout)
    assert len(set(seen["parents"])) == 1, seen  # one sshd connection for all four commands
    sockets = seen["sockets"]
    assert not Path(sockets).exists()
    masters = subprocess.run(["pgrep", "-af", sockets], capture_output=True, text=True).stdout
    assert masters == "", masters


def test_run_reports_failures_and_timeouts_per_node(state):
    with pytest.raises(remote.RemoteCommandFailed, match=f"{NAME}-node1.*exited 4"):
        remote.run_all(state, "exit $(( $(hostname | tail -c 2) * 4 ))")
    slow = remote.run(state, 0, "sleep 30", timeout=2, check=False)
    assert slow.returncode == remote.TIMEOUT_RC and "timed out" in slow.stderr


def test_up_again_is_a_no_op_or_a_clear_error(cluster, tmp_path):
    home, spec = cluster
    again = fsdpctl(home, "up", str(spec), "--target", "local")
    assert "already up" in again.stdout
    bigger = fsdpctl(home, "up", str(spec), "--target", "local", "--nodes", "3", check=False)
    assert bigger.returncode == 2
    assert "already exists and differs" in bigger.stderr and "fsdpctl down --cluster" in bigger.stderr


def test_exclude_removes_the_node_from_inventory_and_later_stages(cluster, state):
    home, _ = cluster
    fsdpctl(home, "exclude", "1", "--reason", "flaky NIC in test")
    try:
        entry = read_state(home, NAME)["excluded"][0]
        assert entry["rank"] == 1 and entry["reason"] == "flaky NIC in test" and entry["time"]
        inventory = json.loads(fsdpctl(home, "inventory", "--format", "json").stdout)
        assert list(inventory["all"]["children"]["nodes"]["hosts"]) == [f"{NAME}-node0"]
        assert list(remote.run_all(state, "true")) == [0]
        status = fsdpctl(home, "status").stdout
        assert "excluded: flaky NIC in test" in status and "every node answers over SSH" in status
    finally:
        state.update(excluded=[])


def test_replace_boots_a_fresh_node_with_the_same_rank_name_and_address(cluster, state):
    home, _ = cluster
    remote.run_all(state, "echo old > /root/marker")
    old_id = remote.run(state, 1, "cat /etc/machine-id").stdout.strip()
    fsdpctl(home, "exclude", "1", "--reason", "replaced in test")
    refused = fsdpctl(home, "replace", "1", check=False)  # no terminal, no --yes
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert f"local node {NAME}-node1 and everything written on it" in refused.stdout
    assert remote.run(state, 1, "cat /root/marker").stdout == "old\n"  # nothing was done

    result = fsdpctl(home, "replace", "1", "--yes", timeout=900)
    # this module's cluster was never configured, so neither is the new node (docs/commands.md)
    assert f"{NAME}-node1 is left as booted" in result.stdout and f"{NAME}-node1 replaced in" in result.stdout
    # A new node: new identity, nothing of the old one's files, same name and address, reachable
    # with its new host key pinned; the other node is untouched; the exclusion is cleared.
    after = remote.run(state, 1, "hostname; cat /etc/machine-id; cat /root/marker 2>/dev/null; "
                                 "ip -4 -o addr show dev eth0").stdout.splitlines()
    assert after[0] == f"{NAME}-node1" and after[1] != old_id and "old" not in after
    assert "198.18.6.3/24" in after[-1]
    assert remote.run(state, 0, "cat /root/marker").stdout == "old\n"
    assert read_state(home, NAME)["excluded"] == []
    assert "every node answers over SSH" in fsdpctl(home, "status").stdout


def test_a_node_rebooted_from_inside_comes_back_as_a_machine_does(cluster, state):
    """`reboot` on a node (what the nvidia role does after a driver install on a machine): its keeper
    starts it again, with its files, name, address and host key, a new boot, its uptime from then, and
    its link back on the bridge; the other node is untouched."""
    home, _ = cluster
    node1 = read_state(home, NAME)["local"]["nodes"][1]
    remote.run(state, 1, "echo kept > /root/reboot-marker")
    old_pid = int(Path(node1["dir"], "nspawn.pid").read_text())
    other_boot = remote.run(state, 0, "cat /proc/sys/kernel/random/boot_id").stdout
    assert reboot(state, 1) == "running"  # a new boot
    assert int(Path(node1["dir"], "nspawn.pid").read_text()) != old_pid
    marker, uptime = remote.run(state, 1, "cat /root/reboot-marker; cut -d. -f1 /proc/uptime").stdout.split()
    log = Path(node1["dir"], "nspawn.log").read_text()
    assert marker == "kept"
    # Its boot clock starts again: node0, booted with it at the module's start, has been up longer.
    assert int(uptime) < int(remote.run(state, 0, "cut -d. -f1 /proc/uptime").stdout)
    assert "rebooted (systemd-nspawn exit 133): starting it again" in log
    bridge = state.read().local.bridge
    assert Path(f"/sys/class/net/{node1['veth']}/master").resolve().name == bridge
    assert remote.run(state, 0, "cat /proc/sys/kernel/random/boot_id").stdout == other_boot
    assert remote.run(state, 0, "ping -c 1 -W 2 198.18.6.3", check=False).returncode == 0
    assert "every node answers over SSH" in fsdpctl(home, "status").stdout


def test_a_login_blocking_unit_that_fails_while_booting_is_started_again_and_the_user_gets_in(
        prerequisites, tmp_path):
    """systemd-user-sessions failed once on a loaded CI host: /run/nologin then stays, and pam_nologin
    refuses every login but root's. `up` looks at the boot as root from the host, starts the unit again
    and then logs in as the login user (`ubuntu`, with no way to repair the node itself)."""
    layer_env = login_blocker_failing_once_per_boot(tmp_path / "layer")
    home = tmp_path / "home"
    name = "lnt-login"
    spec = spec_file(tmp_path, name, node_count=1, local={
        "subnet_cidr": LOGIN_SUBNET, "login_user": LOGIN_USER})
    try:
        up = fsdpctl(home, "up", str(spec), "--target", "local", env=layer_env)
        assert (f"local: {name}-node0: systemd-user-sessions.service failed while booting and was started "
                "again") in up.stdout
        logged_in = fsdpctl(home, "ssh", "0", "--cluster", name, "--",
                            "id -un; ls /run/failed-once; systemctl is-system-running")
        assert logged_in.stdout.split() == [LOGIN_USER, "/run/failed-once", "running"]
    finally:
        fsdpctl(home, "down", "--yes", "--cluster", name, check=False)


def test_up_on_a_broken_cluster_is_a_clear_error(cluster):
    """Kills node1's nspawn: its container's init lives on, orphaned, for `down` to find (next test)."""
    home, spec = cluster
    node1 = read_state(home, NAME)["local"]["nodes"][1]
    pid = int(Path(node1["dir"], "nspawn.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    while alive(pid):
        time.sleep(0.05)
    again = fsdpctl(home, "up", str(spec), "--target", "local", check=False)
    assert again.returncode == 2
    assert f"{NAME}-node1: not running" in again.stderr and "fsdpctl down --cluster" in again.stderr


def test_down_leaves_nothing_behind_and_is_safe_twice(cluster):
    """Last in the module: it takes the module's cluster down (one node's nspawn killed before)."""
    home, _ = cluster
    local = read_state(home, NAME)["local"]
    down = fsdpctl(home, "down", "--yes")
    assert "is down" in down.stdout
    assert host_leftovers(home, local) == []
    assert not (home / "current").exists()
    # A second down, or a mistyped name, is an error that names the known clusters, not a success.
    again = fsdpctl(home, "down", "--yes", "--cluster", NAME, check=False)
    assert again.returncode == 2 and f"no cluster named {NAME!r}" in again.stderr
