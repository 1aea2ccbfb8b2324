"""Local nodes: systemd-nspawn containers on one bridge, each a full Debian host reached over SSH.

Each node boots systemd from a per-node overlay on the shared read-only base image, with its own
hostname (= spec.node_name(rank)), machine-id and SSH host key, and `eth0` (a veth whose host end is
a port of the cluster's bridge). The bridge has MTU 9000 so the playbook can raise eth0 to jumbo
frames. The nodes' default gateway is an address on the bridge that nobody answers, and the bridge
does not forward, so a node reaches the other nodes and the host's bridge address, nothing else.
A host directory is bind-mounted at /shared on every node (the stand-in for FSx).

`FSDPCTL_LOCAL_NODE_LAYER=DIR` copies the tree DIR onto every node's root before it boots (the
first layer of its overlay above the base image): a generic hook for giving nodes files the base
image lacks, e.g. the hardware-shaped profile the tests build (tests/shaped/). Nothing in it is
product code; without the variable nodes are plain.

Everything `up` will create is recorded in state (`local`) before it is created, so `down` can
remove it after any failure, including a SIGKILLed `up`: it finds processes by the node
directories they run from, not by pids that a killed run may never have written.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from fsdpctl.console import Out
from fsdpctl.errors import CommandError, StateError, UsageError
from fsdpctl.processes import processes, signal_all
from fsdpctl.remote import SSH_FAILED, close_control_masters, run_all, ssh_options
from fsdpctl.scripts import render_script
from fsdpctl.state import ClusterState, LocalNode, LocalRecord, Node, SshSettings, home_of
from fsdpctl.targets.local import keeper, rootfs
from fsdpctl.targets.local.host import require_host
from infra.spec import ClusterSpec

BRIDGE_MTU = 9000
SHARED_MOUNT = "/shared"
BOOT_TIMEOUT_S = 180
STOP_TIMEOUT_S = 30
KEEPER_EXIT_S = 2
"""How long a node's keeper may take to end after its nspawn did."""
NSPAWN_RUNTIME_DIRS = ("/run/systemd/nspawn/propagate", "/run/systemd/nspawn/unix-export")
NSPAWN_LOCKS_DIR = "/run/systemd/nspawn/locks"
LAYER_ENV = "FSDPCTL_LOCAL_NODE_LAYER"
# The environment of what fsdpctl runs inside a node from the host (not the operator's PATH or locale).
NODE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
# Every bridge `up` makes is named fsdp<6 hex digits>br and carries this alias + its state directory.
BRIDGE_NAME = re.compile(r"fsdp[0-9a-f]{6}br")
BRIDGE_ALIAS_PREFIX = "fsdpctl:"



def make_plan(state: ClusterState, spec: ClusterSpec, node_count: int, rootfs_dir: Path) -> LocalRecord:
    """Names and addresses of everything the cluster will consist of; nothing is created here."""
    subnet = ipaddress.ip_network(spec.local.subnet_cidr)
    hosts = list(subnet.hosts())
    capacity = len(hosts) - 2  # the bridge's address and the dead-end gateway
    if not 1 <= node_count <= capacity:
        raise UsageError(f"--nodes/node_count {node_count}: local.subnet_cidr {subnet} holds 1 to "
                           f"{capacity} nodes; pass a smaller --nodes or a larger local.subnet_cidr")
    # Link names are limited to 15 characters; a digest of the state directory keeps two clusters
    # (or two FSDPCTL_HOMEs) from ever sharing a link name.
    tag = hashlib.sha256(str(state.root.resolve()).encode()).hexdigest()[:6]
    nodes_dir = state.root / "local"
    nodes = [LocalNode(rank=rank, name=spec.node_name(rank), address=str(hosts[1 + rank]),
                      machine=f"fsdp-{tag}-{rank}", veth=f"fsdp{tag}v{rank}",
                      dir=str(nodes_dir / spec.node_name(rank)), machine_id=uuid.uuid4().hex)
             for rank in range(node_count)]
    return LocalRecord(subnet=str(subnet), bridge=f"fsdp{tag}br", bridge_address=str(hosts[0]),
                     gateway=str(hosts[-1]), rootfs=str(rootfs_dir),
                     shared_host_dir=str(state.root / "shared"), nodes=nodes)


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode:
        raise CommandError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")
    return result


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        path.unlink()
    path.write_text(text)
    path.chmod(mode)


def bridge_owner(bridge: str) -> Path | None:
    """The state directory of the cluster that made `bridge`, from the alias `up` gives it; None for
    a bridge of an fsdpctl older than the alias."""
    alias = Path(f"/sys/class/net/{bridge}/ifalias").read_text().strip()
    return Path(alias.removeprefix(BRIDGE_ALIAS_PREFIX)) if alias.startswith(BRIDGE_ALIAS_PREFIX) else None


def _owner_uses(owner: Path, bridge: str) -> bool:
    """Whether the cluster record in `owner` still names `bridge` (an unreadable record counts as yes:
    what cannot be judged is not removed)."""
    state = ClusterState(name=owner.name, root=owner)
    if not state.exists():
        return False
    try:
        record = state.read().local
    except StateError:
        return True
    return record is not None and record.bridge == bridge


def _orphan_bridges(subnet: ipaddress.IPv4Network | ipaddress.IPv6Network) -> dict[str, str]:
    """Bridges of local clusters that no longer exist (a SIGKILLed `up` or test run, a state
    directory deleted without `down`) holding an address in `subnet`: fsdpctl's name, no node
    attached, and no cluster record that still names them. Bridge -> who left it."""
    orphans = {}
    for link in Path("/sys/class/net").glob("fsdp*br"):
        if not BRIDGE_NAME.fullmatch(link.name) or any((link / "brif").iterdir()):
            continue
        if not any(ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}").network.overlaps(subnet)
                   for link_info in json.loads(_sh("ip", "-j", "-4", "addr", "show", "dev", link.name).stdout)
                   for a in link_info["addr_info"]):
            continue
        owner = bridge_owner(link.name)
        if owner is None:
            orphans[link.name] = "an older fsdpctl, for a cluster whose nodes are gone"
        elif not _owner_uses(owner, link.name):
            orphans[link.name] = f"the cluster at {owner}, which no longer exists"
    return orphans


def _owner_hint(route: list[str]) -> str:
    """For a route on another local cluster's bridge: how to take that cluster down."""
    device = route[route.index("dev") + 1] if "dev" in route else ""
    owner = bridge_owner(device) if BRIDGE_NAME.fullmatch(device) else None
    if owner is None:
        return ""
    return (f" (cluster {owner.name}'s bridge: `FSDPCTL_HOME={home_of(owner)} fsdpctl down "
            f"--cluster {owner.name}`)")


def _host_conflicts(plan: LocalRecord) -> list[str]:
    """Host routes or links that the new cluster would collide with."""
    problems = []
    subnet = ipaddress.ip_network(plan.subnet)
    for line in _sh("ip", "-4", "-o", "route", "show", "table", "all").stdout.splitlines():
        dest = line.split()[0]
        if dest in ("default", "local", "broadcast", "unreachable", "prohibit", "blackhole"):
            dest = line.split()[1] if dest != "default" else "0.0.0.0/0"
        try:
            net = ipaddress.ip_network(dest, strict=False)
        except ValueError:
            continue
        if net.prefixlen > 0 and net.overlaps(subnet):
            problems.append(f"host route `{line.strip()}` overlaps local.subnet_cidr {subnet}"
                            + _owner_hint(line.split()))
    problems += [f"link {name} already exists" for name in [plan.bridge, *(n.veth for n in plan.nodes)]
                 if keeper.link_exists(name)]
    return problems


def _remove_orphan_bridges(plan: LocalRecord, progress: Out) -> None:
    """A run that was killed before `down` leaves its bridge on the host, which would block this
    subnet for good; nothing uses it any more, so it goes."""
    for bridge, left_by in _orphan_bridges(ipaddress.ip_network(plan.subnet)).items():
        _sh("ip", "link", "del", bridge)
        progress(f"local: removed bridge {bridge} on {plan.subnet}, left by {left_by}")


def up(state: ClusterState, spec: ClusterSpec, node_count: int, progress: Out = print) -> None:
    """Create and boot the nodes; on any failure (or Ctrl-C) remove what was made, then raise."""
    require_host("fsdpctl up --target local")
    node_layer()  # a bad FSDPCTL_LOCAL_NODE_LAYER fails before anything is created
    started = time.monotonic()
    image = rootfs.ensure_rootfs(progress)
    plan = make_plan(state, spec, node_count, image)
    _remove_orphan_bridges(plan, progress)
    conflicts = _host_conflicts(plan)
    if conflicts:
        raise CommandError("cannot create the local nodes: " + "; ".join(conflicts) + ". Another cluster "
                           "uses this subnet: pick another local.subnet_cidr, or `fsdpctl down` it first")
    state.update(local=plan)  # recorded before anything exists, so `down` can always clean up
    try:
        _create(state, plan, spec.local.login_user, progress)
    except BaseException as e:
        progress(f"local: `up` failed ({type(e).__name__}: {e}); removing what it created")
        try:
            down(state, progress)
        except CommandError as cleanup:
            raise CommandError(f"{e}\nRemoving what `up` had created failed too: {cleanup}") from e
        if isinstance(e, CommandError):
            raise CommandError(f"{e}\nEverything `up` had created was removed; fix the cause and run "
                               f"`fsdpctl up` again.") from e
        raise
    progress(f"local: {len(plan.nodes)} node(s) up in {time.monotonic() - started:.1f} s on bridge "
             f"{plan.bridge} ({plan.subnet}); shared dir {plan.shared_host_dir} is {SHARED_MOUNT} on every "
             "node")


def _create(state: ClusterState, plan: LocalRecord, login_user: str, progress: Out) -> None:
    key_file = state.keys_dir / "id_ed25519"
    if not key_file.exists():
        state.keys_dir.mkdir(parents=True, exist_ok=True)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"fsdpctl@{state.name}", "-f", str(key_file))
    public_key = key_file.with_suffix(".pub").read_text()
    Path(plan.shared_host_dir).mkdir(parents=True, exist_ok=True)

    _sh("ip", "link", "add", plan.bridge, "mtu", str(BRIDGE_MTU), "type", "bridge")
    # Set before the address, so a bridge with an address and no alias is an older fsdpctl's.
    _sh("ip", "link", "set", "dev", plan.bridge, "alias", f"{BRIDGE_ALIAS_PREFIX}{state.root.resolve()}")
    _sh("ip", "addr", "add", f"{plan.bridge_address}/{ipaddress.ip_network(plan.subnet).prefixlen}",
        "dev", plan.bridge)
    # The host must not route for the nodes, and IPv6 link-local would be a second way out.
    Path(f"/proc/sys/net/ipv4/conf/{plan.bridge}/forwarding").write_text("0\n")
    Path(f"/proc/sys/net/ipv6/conf/{plan.bridge}/disable_ipv6").write_text("1\n")
    _sh("ip", "link", "set", plan.bridge, "up")

    known_hosts = []
    procs: dict[int, subprocess.Popen] = {}
    for node in plan.nodes:
        host_key = _prepare_node(node, plan, public_key, login_user)
        known_hosts.append(f"{node.address} {host_key}")
        progress(f"local: starting {node.name} ({node.address})")
        procs[node.rank] = _start_node(node, plan)
    known_hosts_file = state.known_hosts
    _write(known_hosts_file, "\n".join(known_hosts) + "\n")

    deadline = time.monotonic() + BOOT_TIMEOUT_S
    for node in plan.nodes:
        _attach_veth(node, plan, procs[node.rank], deadline)
    ssh = SshSettings(user=login_user, key_file=str(key_file), known_hosts=str(known_hosts_file))
    progress(f"local: waiting for {len(plan.nodes)} node(s) to boot (systemd, sshd)")
    for node in plan.nodes:
        _wait_booted(node, ssh, procs[node.rank], deadline, progress)
    state.update(nodes=[Node(rank=n.rank, name=n.name, address=n.address) for n in plan.nodes],
                 ssh=ssh, shared_dir=SHARED_MOUNT)


def _prepare_node(node: LocalNode, plan: LocalRecord, public_key: str, login_user: str) -> str:
    """Mount the node's overlay and write its identity and login user; returns its SSH host public
    key."""
    base = Path(node.dir)
    for sub in ("upper", "work", "merged"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    layer = node_layer()
    entries = sorted(str(entry) for entry in layer.iterdir()) if layer is not None else []
    if entries:
        # Its entries, not `LAYER/.`: that would give the node's / the layer directory's owner and mode
        # (0700 for a mktemp directory, which keeps dbus and every other non-root service out).
        _sh("cp", "-a", "--", *entries, str(base / "upper"))
    _mount_root(node, plan)
    root = node.root
    prefix = ipaddress.ip_network(plan.subnet).prefixlen
    _write(root / "etc/hostname", f"{node.name}\n")
    _write(root / "etc/hosts", f"127.0.0.1 localhost\n{node.address} {node.name}\n")
    _write(root / "etc/machine-id", node.machine_id + "\n", 0o444)
    _write(root / "etc/systemd/network/10-eth0.network",
           f"[Match]\nName=eth0\n\n[Network]\nAddress={node.address}/{prefix}\nGateway={plan.gateway}\n"
           "LinkLocalAddressing=no\nIPv6AcceptRA=no\n")
    _add_login_user(root, login_user, public_key)
    (root / SHARED_MOUNT.lstrip("/")).mkdir(exist_ok=True)
    host_key = root / "etc/ssh/ssh_host_ed25519_key"
    _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{node.name}", "-f", str(host_key))
    return " ".join(host_key.with_suffix(".pub").read_text().split()[:2])


def _add_login_user(root: Path, user: str, public_key: str) -> None:
    """The cluster's key authorized for `user` on the node whose root is `root`; a user other than root
    is made first, with passwordless sudo, as an AWS image's login user (ubuntu) is."""
    if user == "root":
        home = root / "root"
    else:
        _sh("useradd", "--root", str(root), "--create-home", "--shell", "/bin/bash", user)
        _write(root / f"etc/sudoers.d/90-{user}", f"{user} ALL=(ALL) NOPASSWD:ALL\n", 0o440)
        home = root / "home" / user
    (home / ".ssh").mkdir(mode=0o700, parents=True, exist_ok=True)
    _write(home / ".ssh/authorized_keys", public_key, 0o600)
    owner = home.stat()
    for path in (home / ".ssh", home / ".ssh/authorized_keys"):
        os.chown(path, owner.st_uid, owner.st_gid)


def _mount_root(node: LocalNode, plan: LocalRecord) -> None:
    """The node's root: its own upper directory over the shared read-only image."""
    base = Path(node.dir)
    mounted = _sh("mount", "-t", "overlay", "overlay", "-o",
                  f"lowerdir={plan.rootfs},upperdir={base / 'upper'},workdir={base / 'work'}", str(node.root),
                  check=False)
    if mounted.returncode:
        why = (mounted.stderr.strip() or f"exit {mounted.returncode}").splitlines()[0]
        raise CommandError(f"{node.name}: its root file system (an overlay on {plan.rootfs}) could not be "
                           f"mounted: {why}")


def node_layer() -> Path | None:
    """The directory named by FSDPCTL_LOCAL_NODE_LAYER (copied onto every node), if set."""
    value = os.environ.get(LAYER_ENV, "").strip()
    if not value:
        return None
    layer = Path(value)
    if not layer.is_absolute() or not layer.is_dir():
        raise UsageError(f"{LAYER_ENV}={value!r} is not an absolute path to a directory: give the directory "
                         "whose tree every local node gets on top of its image, or unset the variable")
    return layer


def _start_node(node: LocalNode, plan: LocalRecord) -> subprocess.Popen:
    """Start the node under its keeper (keeper.py: it starts nspawn, and again after a reboot from
    inside); returns the keeper, which ends with nspawn's status when the node ends other than by a
    reboot."""
    argv = [
        "systemd-nspawn", "--quiet", "-D", str(node.root), "--machine", node.machine,
        f"--hostname={node.name}", "--boot",
        # The host's PID 1 need not be systemd: do not register with machined or ask for a scope.
        "--register=no", "--keep-unit",
        "--resolv-conf=off", "--timezone=off", "--link-journal=no", "--console=passive",
        f"--network-veth-extra={node.veth}:eth0",
        f"--bind={plan.shared_host_dir}:{SHARED_MOUNT}",
    ]
    node_dir = Path(node.dir)
    settings = node_dir / "keeper.json"
    keeper.KeptNode(name=node.name, nspawn_argv=argv, veth=node.veth, bridge=plan.bridge, mtu=BRIDGE_MTU,
                    log=str(node_dir / "nspawn.log"), pid_file=str(node_dir / "nspawn.pid")).write(settings)
    (node_dir / "nspawn.pid").unlink(missing_ok=True)
    log_path = node_dir / "nspawn.log"
    log_path.write_text("")  # a new log for each start, which the keeper and every nspawn append to
    with open(log_path, "a") as log:
        # Its own session: a Ctrl-C at the terminal goes to fsdpctl, which then shuts nodes down in order.
        return subprocess.Popen([sys.executable, keeper.__file__, str(settings)], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _node_log(node: LocalNode) -> str:
    log = Path(node.dir) / "nspawn.log"
    return log.read_text(errors="replace")[-2000:] if log.exists() else ""


def _attach_veth(node: LocalNode, plan: LocalRecord, proc: subprocess.Popen, deadline: float) -> None:
    if not keeper.wait_for_link(node.veth, proc, deadline):
        if proc.poll() is not None:
            raise CommandError(f"{node.name}: systemd-nspawn exited {proc.returncode} while starting:\n"
                               f"{_node_log(node)}")
        raise CommandError(f"{node.name}: its network link {node.veth} did not appear within "
                           f"{BOOT_TIMEOUT_S} s:\n{_node_log(node)}")
    keeper.attach_link(node.veth, plan.bridge, BRIDGE_MTU)


def _wait_booted(node: LocalNode, ssh: SshSettings, proc: subprocess.Popen, deadline: float,
                 progress: Out) -> None:
    """Until the node's systemd has finished booting (what failed on the way started once more) and the
    login user can log in over SSH."""
    init_pid = settle_boot(node, proc, deadline, progress)
    _wait_for_login(node, ssh, proc, init_pid, deadline)


def settle_boot(node: LocalNode, proc: subprocess.Popen, deadline: float, progress: Out) -> int:
    """Until the node's systemd has finished booting; what failed on the way is started once more (a
    failed systemd-user-sessions would leave /run/nologin, which shuts every user but root out) and
    said. Returns the host pid of the node's systemd. `proc`: the node's keeper."""
    init_pid = _wait_for_init(node, proc, deadline)
    try:
        settled = _in_node(init_pid, render_script("targets/local/templates/boot_settle.sh.j2"),
                           timeout=max(5.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise CommandError(f"{node.name}: systemd did not finish booting within {BOOT_TIMEOUT_S} s; its "
                           f"jobs still waiting: {_node_view(init_pid, 'systemctl list-jobs --no-legend')}"
                           ) from None
    lines = settled.stdout.splitlines()
    system_state = lines[0].strip() if lines else ""
    if system_state not in ("running", "degraded"):
        raise CommandError(f"{node.name}: boot ended in state {system_state!r}: "
                           f"{settled.stderr.strip() or 'no output'}\n{_node_log(node)}")
    restarted = lines[1].split() if len(lines) > 1 else []
    still_failed = [unit for unit in lines[2:] if unit.strip()]
    if restarted:
        progress(f"local: {node.name}: {', '.join(restarted)} failed while booting and "
                 f"{'was' if len(restarted) == 1 else 'were'} started again")
    if system_state == "degraded":
        progress(f"local: {node.name} booted degraded; failed units: {', '.join(still_failed) or '?'}")
    return init_pid


def _wait_for_init(node: LocalNode, proc: subprocess.Popen, deadline: float) -> int:
    """Host pid of the node's systemd once it listens on its private socket (systemctl's way in)."""
    while (pid := _init_pid(node)) is None or not Path(f"/proc/{pid}/root/run/systemd/private").exists():
        if proc.poll() is not None:
            raise CommandError(f"{node.name}: the node stopped while booting (exit {proc.returncode}):\n"
                               f"{_node_log(node)}")
        if time.monotonic() > deadline:
            raise CommandError(f"{node.name}: its systemd did not start within {BOOT_TIMEOUT_S} s:\n"
                               f"{_node_log(node)}")
        time.sleep(0.1)
    return pid


def _has_container_uuid(environ: bytes, node: LocalNode) -> bool:
    """Whether a process's raw environment block holds the container_uuid nspawn gives `node`'s init."""
    return f"\0container_uuid={node.container_uuid}\0".encode() in b"\0" + environ


def _init_pid(node: LocalNode) -> int | None:
    """Host pid of the node's systemd: of the processes nspawn gave the node's container_uuid, the one
    that is PID 1 in its own namespace."""
    for pid, _argv, environ in processes(with_environ=True):
        if _has_container_uuid(environ, node):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            nspids = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            if nspids[-1:] == ["1"]:
                return pid
    return None


def _in_node(init_pid: int, script: str, *, timeout: float) -> subprocess.CompletedProcess:
    """`script` run by root inside the node whose systemd is `init_pid`, in its namespaces: the host's way
    in without a login, which works before the node lets users log in."""
    return subprocess.run(["nsenter", f"--target={init_pid}", "--mount", "--uts", "--ipc", "--net", "--pid",
                           "--root", "--wd", "/bin/sh", "-c", script],
                          env=NODE_ENV, capture_output=True, text=True, timeout=timeout)


def _node_view(init_pid: int, command: str) -> str:
    """What `command` prints in the node, for an error message; never raises."""
    try:
        done = _in_node(init_pid, command, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(`{command}` in the node failed: {e})"
    return (done.stdout.strip() or done.stderr.strip() or "nothing")[-2000:]


def _wait_for_login(node: LocalNode, ssh: SshSettings, proc: subprocess.Popen, init_pid: int,
                    deadline: float) -> None:
    """Until `ssh.user` can run a command on the node."""
    argv = ["ssh", *ssh_options(ssh), "-l", ssh.user, node.address, "true"]
    while True:
        try:
            result = subprocess.run(argv, capture_output=True, text=True,
                                    timeout=max(5.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            result = subprocess.CompletedProcess(argv, SSH_FAILED, "", "ssh did not return")
        if result.returncode == 0:
            return
        if result.returncode != SSH_FAILED:  # logged in, and the login shell failed `true`
            raise CommandError(f"{node.name}: ssh as {ssh.user} to {node.address} logs in, but a command "
                               f"exits {result.returncode} there: {result.stderr.strip() or 'no output'}")
        # ssh exits 255 when the session never began: sshd not listening yet, or pam_nologin ending the
        # session of every user but root while /run/nologin exists (and saying nothing at LogLevel=ERROR).
        stopped = proc.poll() is not None
        if stopped or time.monotonic() > deadline:
            why = result.stderr.strip() or "the connection was closed before the command ran"
            until = "the node stopped" if stopped else f"{BOOT_TIMEOUT_S} s had passed"
            inside = "" if stopped else "\nIn the node: " + _node_view(
                init_pid, "ls /run/nologin /etc/nologin 2>/dev/null; systemctl --failed --no-legend --plain")
            raise CommandError(f"{node.name}: ssh as {ssh.user} to {node.address} failed until {until}: "
                               f"{why}{inside}\n{_node_log(node)}")
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------- teardown
def _processes_of(plan: LocalRecord) -> dict[int, str]:
    """Host pids of the nodes' keepers and nspawn processes (by the keeper's settings file and the root
    directory on their command lines) and of their containers' init (by its container_uuid: it
    outlives a SIGKILLed nspawn); pid -> command."""
    names = [f" {n.root} " for n in plan.nodes] + [f" {Path(n.dir) / 'keeper.json'} " for n in plan.nodes]
    found = {}
    for pid, argv, environ in processes(with_environ=True):
        cmdline = " ".join(argv)
        if any(name in f" {cmdline} " for name in names) or any(_has_container_uuid(environ, n)
                                                                 for n in plan.nodes):
            found[pid] = cmdline
    return found


def _nspawn_pids(plan: LocalRecord) -> list[int]:
    return [pid for pid, cmd in _processes_of(plan).items() if "systemd-nspawn" in cmd.split(" ", 1)[0]]


def _stop_in_order(plan: LocalRecord, nspawn: list[int]) -> None:
    """SIGTERM makes nspawn ask the node's systemd to shut down. A node still booting may not have
    its signal handlers yet and drops the request, so repeat it until nspawn exits or time is up."""
    end = time.monotonic() + STOP_TIMEOUT_S
    while nspawn and time.monotonic() < end:
        signal_all(nspawn, signal.SIGTERM)
        resend = time.monotonic() + 2
        while (nspawn := _nspawn_pids(plan)) and time.monotonic() < min(resend, end):
            time.sleep(0.1)


def _wait_gone(plan: LocalRecord, timeout: float) -> dict[int, str]:
    end = time.monotonic() + timeout
    while (left := _processes_of(plan)) and time.monotonic() < end:
        time.sleep(0.1)
    return left


def _mounts_under(path: str) -> list[str]:
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    return [p for p in points if p == path or p.startswith(path + "/")]


def _stop_nodes(plan: LocalRecord, progress: Out) -> list[str]:
    """Stop the plan's nodes (in order, then by force) and remove their links, mounts and nspawn
    runtime dirs; returns what of them is still there."""
    # nspawn turns SIGTERM into an orderly shutdown of the node's systemd.
    nspawn = _nspawn_pids(plan)
    if nspawn:
        progress(f"local: stopping {len(nspawn)} node(s)")
        _stop_in_order(plan, nspawn)
    # Each keeper ends a moment after its nspawn. A killed nspawn leaves its container's init behind;
    # a stuck shutdown, everything.
    left = _wait_gone(plan, KEEPER_EXIT_S)
    if left:
        progress(f"local: killing {len(left)} leftover process(es)")
        signal_all(list(left), signal.SIGKILL)
        _wait_gone(plan, 10)
    for node in plan.nodes:
        if keeper.link_exists(node.veth):
            _sh("ip", "link", "del", node.veth, check=False)
        if node.root.is_mount():  # nspawn's image lock is named after the mounted root's inode
            root_stat = node.root.stat()
            Path(NSPAWN_LOCKS_DIR, f"inode-{root_stat.st_dev}:{root_stat.st_ino}").unlink(missing_ok=True)
        for point in sorted(_mounts_under(str(node.root)), key=len, reverse=True):
            if _sh("umount", point, check=False).returncode:
                _sh("umount", "-l", point, check=False)
        for runtime_dir in NSPAWN_RUNTIME_DIRS:
            shutil.rmtree(Path(runtime_dir) / node.machine, ignore_errors=True)
    return node_leftovers(plan)


def down(state: ClusterState, progress: Out = print) -> None:
    """Remove every process, link, mount and file of the local nodes; safe to repeat."""
    plan = state.read().local
    if plan is None:
        return
    for control_dir in state.reports_dir.glob("*-configure*/cp"):
        close_control_masters(control_dir)
    problems = _stop_nodes(plan, progress)
    if keeper.link_exists(plan.bridge):
        _sh("ip", "link", "del", plan.bridge, check=False)
    problems += [f"link {plan.bridge}"] if keeper.link_exists(plan.bridge) else []
    if problems:
        raise CommandError("local teardown left: " + "; ".join(problems) + ". Remove them by hand (or run "
                           "`fsdpctl down` again); the state is kept so `down` can retry")
    for node in plan.nodes:
        shutil.rmtree(node.dir, ignore_errors=True)
    shutil.rmtree(plan.shared_host_dir, ignore_errors=True)
    state.update(local=None)
    progress(f"local: removed {len(plan.nodes)} node(s), bridge {plan.bridge} and their files")


def node_leftovers(plan: LocalRecord) -> list[str]:
    """What of the plan's nodes still exists on the host (processes, links, mounts, runtime dirs)."""
    found = [f"process {pid} ({cmd[:80]})" for pid, cmd in _processes_of(plan).items()]
    found += [f"link {n.veth}" for n in plan.nodes if keeper.link_exists(n.veth)]
    for node in plan.nodes:
        found += [f"mount {p}" for p in _mounts_under(str(node.root))]
        found += [str(p) for d in NSPAWN_RUNTIME_DIRS if (p := Path(d) / node.machine).exists()]
    return found


def leftovers(plan: LocalRecord) -> list[str]:
    """What of the cluster still exists on the host, its bridge included."""
    return node_leftovers(plan) + ([f"link {plan.bridge}"] if keeper.link_exists(plan.bridge) else [])


def replace_node(state: ClusterState, rank: int, progress: Out = print) -> None:
    """A fresh node in place of the one with `rank`: stopped, its files removed, booted again from the
    image with the same name and address but a new machine-id and host key (the new host key
    replaces the old one in known_hosts)."""
    require_host("fsdpctl replace (local target)")
    record = state.read()
    plan = record.local
    if plan is None or record.ssh is None:
        raise UsageError(f"cluster {state.name} never finished coming up; run `fsdpctl down`, then "
                         "`fsdpctl up`")
    old = next(n for n in plan.nodes if n.rank == rank)
    problems = _stop_nodes(plan.model_copy(update={"nodes": [old]}), progress)
    if problems:
        raise CommandError(f"{old.name} could not be stopped: {'; '.join(problems)}. Run `fsdpctl replace "
                           f"{rank}` again, or `fsdpctl down`")
    shutil.rmtree(old.dir, ignore_errors=True)
    new = old.model_copy(update={"machine_id": uuid.uuid4().hex})
    state.update(local=plan.model_copy(update={"nodes": [new if n.rank == rank else n for n in plan.nodes]}))
    key_file = Path(record.ssh.key_file)
    host_key = _prepare_node(new, plan, key_file.with_suffix(".pub").read_text(), record.ssh.user)
    known_hosts = [line for line in state.known_hosts.read_text().splitlines()
                   if not line.startswith(f"{new.address} ")]
    _write(state.known_hosts, "\n".join([*known_hosts, f"{new.address} {host_key}"]) + "\n")
    progress(f"local: starting a new {new.name} ({new.address})")
    proc = _start_node(new, plan)
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    _attach_veth(new, plan, proc, deadline)
    _wait_booted(new, record.ssh, proc, deadline, progress)


def power_off(plan: LocalRecord, node: LocalNode, progress: Out) -> list[str]:
    """Stop one node as a shutdown would (Slurm powered it down): its processes, link and mounts go,
    its files stay for `power_on`. Returns what of it is still there."""
    return _stop_nodes(plan.model_copy(update={"nodes": [node]}), progress)


def power_on(plan: LocalRecord, node: LocalNode) -> subprocess.Popen:
    """Boot a powered-off node again from its own files (same identity, keys and configuration);
    returns its keeper once its network link is up, while it boots (`settle_boot` follows the boot)."""
    if not node.root.is_mount():
        _mount_root(node, plan)
    # Slurm takes a powered-up node back only if the boot time its slurmd reports (in whole seconds:
    # now minus the uptime rounded up) is not before the power-up request. A machine takes minutes;
    # a local node boots within the same second, so it starts on the next whole second.
    time.sleep(1 - time.time() % 1)
    proc = _start_node(node, plan)
    _attach_veth(node, plan, proc, time.monotonic() + BOOT_TIMEOUT_S)
    return proc


def running_ranks(plan: LocalRecord) -> set[int]:
    """Ranks whose systemd-nspawn runs."""
    commands = [cmd for cmd in _processes_of(plan).values() if cmd.startswith("systemd-nspawn")]
    return {n.rank for n in plan.nodes if any(f" {n.root} " in f" {c} " for c in commands)}


def health(state: ClusterState) -> list[str]:
    """Problems that make the cluster unusable (an empty list means every node answers over SSH)."""
    record = state.read()
    plan = record.local
    if plan is None or not record.nodes:
        return ["the cluster never finished coming up"]
    running = running_ranks(plan)
    # A node the power agent stopped for Slurm is powered down, not missing.
    problems = [f"{n.name}: not running" for n in plan.nodes
                if n.rank not in running and n.rank not in plan.powered_down]
    if problems:
        return problems
    results = run_all(state, "true", ranks=[n.rank for n in record.active_nodes() if n.rank in running],
                      timeout=20, check=False)
    names = {n.rank: n.name for n in record.nodes}
    return [f"{names[rank]}: ssh failed: {r.stderr.strip()[-200:]}"
            for rank, r in results.items() if r.returncode]

