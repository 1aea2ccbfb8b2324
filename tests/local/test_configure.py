"""The real playbook on two real local nodes through `fsdpctl configure`, checked from outside over SSH;
each node then reaches the other over SSH by name and by address with the intra-cluster key, without a
prompt (what mpirun needs); then idempotence (a second run changes nothing, also after a deploy and a
smoke test), a user that is not root making directories in the shared directory (AWS logs in as
ubuntu), the common role stopping an automatic apt run that holds the dpkg lock, check mode,
cancelling, and a failing task named with its host.

The nodes are the session's demo cluster (tests/local/demo_cluster.py): its first configure is the
demo's configure stage."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdpctl import remote
from fsdpctl.configure import run_configure
from fsdpctl.state import cluster_state
from fsdpctl.targets.local import keeper
from tests.local.conftest import LOGIN_USER, NODE_SSH, REPO, as_root, fsdpctl
from tests.local.demo_cluster import ADDRESSES, NAME, NODES, DemoCluster

pytestmark = [pytest.mark.root, pytest.mark.slow]

GPU_ROLES = ("nvidia", "cuda", "efa", "nccl", "gpudirect")
RECAP = re.compile(r"^(\S+) ok=(\d+) changed=(\d+) failed=(\d+) skipped=(\d+)", re.MULTILINE)


@pytest.fixture
def cluster(demo: DemoCluster) -> Path:
    """FSDPCTL_HOME of the configured cluster."""
    return demo.home


@pytest.fixture
def first_run(demo: DemoCluster) -> tuple[str, dict[str, tuple[int, ...]]]:
    """The first configure (the demo's stage): (what it printed, recap per host)."""
    output = demo.stage_output("configure")
    return output, {m[0]: tuple(map(int, m[1:])) for m in RECAP.findall(output)}


@pytest.fixture
def state(cluster, monkeypatch):
    monkeypatch.setenv("FSDPCTL_HOME", str(cluster))
    return cluster_state(NAME)


def test_configure_succeeds_with_progress_and_a_recap_per_host(first_run):
    output, recap = first_run
    assert set(recap) == set(NODES), output[-4000:]
    for host, (ok, changed, failed, _skipped) in recap.items():
        assert failed == 0 and changed > 0 and ok >= changed, host
    # progress: one line per task result, naming status, host and role : task
    assert re.search(rf"^\s+changed\s+{NODES[0]}\s+network : ", output, re.MULTILINE)


def test_mtu_9000_live_and_persisted(first_run, state):
    for rank, r in remote.run_all(state, "cat /sys/class/net/eth0/mtu; "
                                         "grep -rhs MTUBytes /etc/systemd/network/").items():
        live, *persisted = r.stdout.split()
        assert live == "9000", NODES[rank]
        assert "MTUBytes=9000" in persisted, NODES[rank]


def test_sysctl_drop_in_values_are_live(first_run, state):
    # Keys a container can set (writable in the node's network namespace) must be live; the others
    # are the host's and the role reports them as skipped.
    script = r"""
    f=/etc/sysctl.d/90-fsdp-network.conf; test -s $f || exit 9
    grep -E '^net\.' $f | while IFS='=' read -r key value; do
      key=$(echo $key); value=$(echo $value)
      p=/proc/sys/$(echo $key | tr . /)
      if [ -w "$p" ]; then echo "$key|$value|$(sysctl -n $key | tr -s '[:space:]' ' ' | sed 's/ $//')"; fi
    done"""
    for rank, r in remote.run_all(state, as_root(script)).items():  # /proc/sys is writable by root only
        rows = [line.split("|") for line in r.stdout.splitlines()]
        assert len(rows) >= 3, (NODES[rank], r.stdout)
        for key, wanted, live in rows:
            assert " ".join(wanted.split()) == live, (NODES[rank], key)


def test_limits_sshd_keepalive_and_hosts(first_run, state):
    command = ("cat /etc/security/limits.d/90-fsdp-cluster.conf; echo ===; "  # sshd -T reads the host keys
               "sudo -n sshd -T | grep -Ei '^clientalive'; echo ===; cat /etc/hosts")
    for rank, r in remote.run_all(state, command).items():
        limits, sshd, hosts = r.stdout.split("===")
        assert re.search(r"^\*\s+hard\s+memlock\s+unlimited", limits, re.MULTILINE), NODES[rank]
        settings = dict(line.split() for line in sshd.strip().splitlines())
        assert settings["clientaliveinterval"] == "60" and settings["clientalivecountmax"] == "30"
        for name, address in zip(NODES, ADDRESSES, strict=True):
            line = rf"^{re.escape(address)}\s+.*\b{name}\b"
            assert re.search(line, hosts, re.MULTILINE), (NODES[rank], name)


def test_jumbo_ping_with_dont_fragment_crosses_between_nodes(first_run, state):
    r = remote.run(state, 0, f"ping -c2 -W3 -M do -s 8972 {ADDRESSES[1]}", check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    back = remote.run(state, 1, f"ping -c1 -W3 -M do -s 8972 {ADDRESSES[0]}", check=False)
    assert back.returncode == 0, back.stdout + back.stderr


def test_gpu_roles_report_skipped_not_ok(first_run, state):
    output, _ = first_run
    for role in GPU_ROLES:
        lines = [line for line in output.splitlines() if re.search(rf"\s{role} : ", line)]
        statuses = {line.split()[0] for line in lines}
        assert "skipped" in statuses, (role, lines)
        assert not statuses & {"changed", "failed"}, (role, lines)
        skip_lines = [line for line in lines if " : Skip " in line]
        assert skip_lines and all(line.split()[0] == "skipped" for line in skip_lines), (role, lines)


def test_nodes_reach_each_other_by_name_and_address_without_a_prompt(first_run, state):
    for rank, peer in ((0, 1), (1, 0)):
        for target in (NODES[peer], ADDRESSES[peer]):
            r = remote.run(state, rank, f"{NODE_SSH} {target} hostname", check=False, timeout=60)
            assert r.returncode == 0, (NODES[rank], target, r.stdout + r.stderr)
            assert r.stdout.strip() == NODES[peer]


def test_every_node_holds_the_same_private_key_readable_by_its_owner_only(first_run, state):
    answers = remote.run_all(state, "stat -c %a ~/.ssh/id_fsdp_cluster && sha256sum < ~/.ssh/id_fsdp_cluster")
    modes = {rank: r.stdout.split()[0] for rank, r in answers.items()}
    digests = {r.stdout.split()[1] for r in answers.values()}
    assert modes == {0: "600", 1: "600"}
    assert len(digests) == 1


def test_second_configure_changes_nothing(first_run, state):
    out: list[str] = []
    result = run_configure(state, out=out.append)
    assert result.ok, "\n".join(out[-40:])
    assert set(result.hosts) == set(NODES)
    assert {h: s.changed for h, s in result.hosts.items()} == dict.fromkeys(NODES, 0), "\n".join(
        line for line in out if line.lstrip().startswith("changed"))


def test_sigterm_cancels_configure_and_leaves_no_process(first_run, cluster):
    proc = subprocess.Popen([str(Path(sys.executable).parent / "fsdpctl"), "configure"], cwd=REPO, text=True,
                            env={**os.environ, "FSDPCTL_HOME": str(cluster)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # wait until tasks are running on the nodes
        seen.append(line)
        if line.split()[:1] in (["ok"], ["changed"], ["skipped"]):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, "".join(seen) + out + err
    assert "fsdpctl configure: configure canceled" in err
    deadline = time.monotonic() + 30  # killed workers may take a moment to be reaped
    while (left := processes_mentioning(cluster)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == []


def processes_mentioning(path: Path) -> list[str]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        # the nodes themselves (nspawn and its keeper) stay up
        if str(path) in cmdline and "systemd-nspawn" not in cmdline and keeper.__file__ not in cmdline:
            found.append(f"{entry}: {cmdline[:150]}")
    return found


def test_failing_task_exits_non_zero_naming_host_and_task(first_run, cluster):
    result = fsdpctl(cluster, "configure", "--tags", "network", "--limit", NODES[1],
                     "-e", "fsdp_mtu=70000", check=False)
    assert result.returncode == 1, result.stdout[-3000:]
    failed = result.stdout.split("\nFAILED\n", 1)[1]
    assert f"{NODES[1]}: task [network : " in failed
    assert NODES[0] not in failed
    assert "fsdpctl configure: the playbook failed" in result.stderr


def test_a_node_whose_host_key_is_not_known_yet_is_learnt_and_a_changed_key_refused(first_run, cluster, state,
                                                                                     tmp_path):
    """An AWS node's first configure finds no key of it in the cluster's known_hosts. Mitogen's ssh checks
    keys strictly ahead of the inventory's `accept-new`, so configure learns the key first (as the linear
    strategy's ssh does); a key that changed is refused all the same."""
    known_hosts = Path(state.read().ssh.known_hosts)
    kept = known_hosts.read_text()
    try:
        subprocess.run(["ssh-keygen", "-R", ADDRESSES[1], "-f", str(known_hosts)], check=True,
                       capture_output=True)
        result = fsdpctl(cluster, "configure", "--tags", "network", "--limit", NODES[1], check=False)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
        assert f"first contact with {NODES[1]}: learning the host key(s) into {known_hosts}" in result.stdout
        assert subprocess.run(["ssh-keygen", "-F", ADDRESSES[1], "-f", str(known_hosts)],
                              capture_output=True).returncode == 0

        other = tmp_path / "other_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
        subprocess.run(["ssh-keygen", "-R", ADDRESSES[1], "-f", str(known_hosts)], check=True,
                       capture_output=True)
        with known_hosts.open("a") as f:
            f.write(f"{ADDRESSES[1]} {' '.join(other.with_suffix('.pub').read_text().split()[:2])}\n")
        refused = fsdpctl(cluster, "configure", "--tags", "network", "--limit", NODES[1], check=False)
        assert refused.returncode == 1, refused.stdout[-3000:]
        assert "first contact" not in refused.stdout
        assert re.search(rf"{NODES[1]}: task \[Gathering Facts\]: .*host key", refused.stdout), \
            refused.stdout[-3000:]
    finally:
        known_hosts.write_text(kept)


def test_the_login_user_makes_its_directories_in_the_shared_directory(first_run, state):
    """As AWS's login user (ubuntu) makes the jobs' and smoke runs' directories in the FSx mount, whose
    root a new file system gives to root (the local target's host directory is made by root too)."""
    shared = state.read().shared_dir
    made_dir = f"{shared}/made-by-login-user"
    made = remote.run(state, 1, f"id -un; stat -c %a {shared}; mkdir {made_dir} && stat -c %U {made_dir}; "
                      f"rm -rf {made_dir}", check=False)
    assert made.stdout.split() == [LOGIN_USER, "1777", LOGIN_USER], made


APT_RUN_STAND_IN = """\
[Service]
ExecStartPre=
ExecStart=
ExecStart=/usr/bin/flock /var/lib/dpkg/lock-frontend sleep 600
KillMode=control-group
"""
"""apt-daily-upgrade.service as an image's timer starts it at first boot: unattended-upgrade holding the
dpkg lock (a drop-in in place of its command)."""


APT_TIMERS = ("apt-daily.timer", "apt-daily-upgrade.timer")
"""The image's apt timers, enabled and running as on a fresh image."""


def test_the_common_role_stops_an_automatic_apt_run_holding_the_dpkg_lock(first_run, cluster, state):
    """Before its apt tasks (skipped here: local nodes have no repository), which would wait on the lock
    and give up."""
    drop_in = "/run/systemd/system/apt-daily-upgrade.service.d"
    lock_free = "flock --nonblock /var/lib/dpkg/lock-frontend true"
    remote.run(state, 1, as_root(f"mkdir -p {drop_in} && cat > {drop_in}/stand-in.conf <<'EOF'\n"
                                 f"{APT_RUN_STAND_IN}EOF\nsystemctl daemon-reload && "
                                 f"systemctl enable --now {' '.join(APT_TIMERS)} && "
                                 "systemctl start --no-block apt-daily-upgrade.service && "
                                 f"for i in $(seq 50); do {lock_free} || exit 0; sleep 0.2; done; exit 1"),
               timeout=60)
    try:
        result = fsdpctl(cluster, "configure", "--tags", "common", "--limit", NODES[1], check=False)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
        assert re.search(rf"^\s+changed\s+{NODES[1]}\s+common : Stop the automatic apt runs",
                         result.stdout, re.MULTILINE), result.stdout[-3000:]
        unit = remote.run(state, 1, "systemctl is-active apt-daily-upgrade.service", check=False)
        assert unit.stdout.strip() in ("inactive", "failed"), unit
        # The timers first, and for good: one firing during the stop would start the run again.
        assert re.search(rf"^\s+changed\s+{NODES[1]}\s+common : Turn off the apt timers",
                         result.stdout, re.MULTILINE), result.stdout[-3000:]
        timers = remote.run(state, 1, f"systemctl is-enabled {' '.join(APT_TIMERS)}; "
                                      f"systemctl is-active {' '.join(APT_TIMERS)}", check=False)
        assert timers.stdout.split() == ["disabled", "disabled", "inactive", "inactive"], timers
        assert remote.run(state, 1, as_root(lock_free), check=False).returncode == 0
    finally:
        remote.run(state, 1, as_root(f"systemctl stop apt-daily-upgrade.service; rm -rf {drop_in}; "
                                     "systemctl daemon-reload"), timeout=60, check=False)


def test_a_limit_that_matches_no_node_is_an_error(first_run, cluster):
    result = fsdpctl(cluster, "configure", "--limit", "no-such-node", check=False)
    assert result.returncode == 2  # a usage error: nothing to run on
    assert "--limit 'no-such-node' names none of the cluster's nodes" in result.stderr


def test_check_mode_reports_what_would_change_and_changes_nothing(first_run, cluster, state):
    """`fsdpctl configure --check`: Ansible's check mode. A lower MTU would change the network role's
    settings, but the nodes keep 9000 and the cluster's last configure stays the real one; on nodes
    already configured, a check of the whole playbook would change nothing. The first check runs under
    Ansible's own linear strategy (`--strategy linear`: the suite's run of it on real nodes), the whole
    playbook under Mitogen's (the default)."""
    last = state.read().last_configure
    result = fsdpctl(cluster, "configure", "--check", "--tags", "network", "-e", "fsdp_mtu=8000",
                     "--strategy", "linear", check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    recap = {m[0]: tuple(map(int, m[1:])) for m in RECAP.findall(result.stdout)}
    assert set(recap) == set(NODES) and all(changed > 0 for _, changed, *_ in recap.values()), recap
    assert "task result(s) would change; nothing was changed" in result.stdout
    for rank, r in remote.run_all(state, "cat /sys/class/net/eth0/mtu; "
                                         "grep -rhs MTUBytes /etc/systemd/network/").items():
        live, *persisted = r.stdout.split()
        assert live == "9000" and "MTUBytes=9000" in persisted, NODES[rank]
        assert "MTUBytes=8000" not in persisted, NODES[rank]
    assert state.read().last_configure == last
    whole = fsdpctl(cluster, "configure", "--check", check=False)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-2000:]
    recap = {m[0]: tuple(map(int, m[1:])) for m in RECAP.findall(whole.stdout)}
    assert {host: changed for host, (_, changed, *_) in recap.items()} == dict.fromkeys(NODES, 0)
