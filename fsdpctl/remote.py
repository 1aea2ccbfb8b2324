"""Commands on cluster nodes over SSH, for both targets, from the `nodes` and `ssh` entries of state.

Every stage after `up` (configure, deploy, smoke, scale-test) reaches nodes through these helpers, so
there is one place that knows the key, the known_hosts file and the bastion hop.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from argparse import Namespace
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from fsdpctl import state as state_mod
from fsdpctl.errors import CommandError, UsageError
from fsdpctl.processes import private_temp_dir
from fsdpctl.state import ClusterRecord, ClusterState, Node, SshSettings

TIMEOUT_RC = 124  # what coreutils `timeout` returns; a timed-out command reports it too
SSH_FAILED = 255  # ssh's own exit status for an error (otherwise it passes on the command's)
# ssh's words for a connection that ended before the remote command started: sshd too busy to send its
# banner within ConnectTimeout, or shedding a burst of new connections (MaxStartups). Nothing ran, so
# another try is safe. A refused or timed-out connect (a node down) is not tried again.
BEFORE_SESSION = ("Connection timed out during banner exchange", "kex_exchange_identification:",
                  # A shared connection (below) that broke while idle: its node was replaced at the same
                  # address, say. The master ends; the next try makes a new connection.
                  "mux_client_request_session:")
SSH_ATTEMPTS = 3
SSH_RETRY_DELAY_S = 2.0


SHARED_IDLE_S = 60
"""How long a shared connection outlives its last command where its process could not close it (a
SIGKILLed `fsdpctl`)."""
SHARED_SOCKETS_PREFIX = "fsdpctl-ssh-"


class RemoteCommandFailed(CommandError):
    def __init__(self, node: Node, command: str, result: subprocess.CompletedProcess):
        self.node, self.command, self.result = node, command, result
        output = (result.stderr or result.stdout or "").strip()[-1500:]
        super().__init__(f"{node.name} ({node.address}): `{command}` exited {result.returncode}"
                         + (f": {output}" if output else ""))


ClusterNodes = ClusterRecord | ClusterState
"""Where the helpers below find the nodes and the SSH settings: the record a command read once at its
entry (`state.resolve_cluster`) and passes down, or a cluster's state, read on each call, where the nodes
are still being written (the targets, during `up` and `replace`)."""


def _record(cluster: ClusterNodes) -> ClusterRecord:
    return cluster.read() if isinstance(cluster, ClusterState) else cluster


def cluster_nodes(cluster: ClusterNodes, *, include_excluded: bool = False) -> list[Node]:
    """The cluster's nodes ordered by rank; nodes excluded with `fsdpctl exclude` are left out."""
    record = _record(cluster)
    return sorted(record.nodes, key=lambda n: n.rank) if include_excluded else record.active_nodes()


def node_by_rank(cluster: ClusterNodes, rank: int) -> Node:
    record = _record(cluster)
    nodes = cluster_nodes(record, include_excluded=True)
    for node in nodes:
        if node.rank == rank:
            return node
    ranks = ", ".join(str(n.rank) for n in nodes) or "none (is the cluster up?)"
    raise UsageError(f"cluster {record.name} has no node with rank {rank}; ranks: {ranks}")


def ssh_options(ssh: SshSettings) -> list[str]:
    """ssh(1) options for the cluster, bastion hop included, as one list for ssh, scp and Ansible.

    StrictHostKeyChecking=accept-new: local nodes' keys are written to known_hosts before they boot,
    so a changed key is refused; AWS nodes' keys are learnt on first contact and pinned from then on.
    """
    options = [
        "-o", "IdentitiesOnly=yes", "-i", ssh.key_file,
        "-o", f"UserKnownHostsFile={ssh.known_hosts}",
        "-o", "StrictHostKeyChecking=accept-new",
        "-o", "BatchMode=yes",
        "-o", "ConnectTimeout=15",
        "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4",
        "-o", "LogLevel=ERROR",
    ]
    if ssh.proxy_jump:
        # An explicit ProxyCommand, because ProxyJump does not hand -i/-o options to the jump hop.
        hop = ["ssh", *options, "-W", "%h:%p", ssh.proxy_jump]
        options += ["-o", f"ProxyCommand={shlex.join(hop)}"]
    return options


def _ssh_settings(record: ClusterRecord) -> SshSettings:
    if not record.ssh:
        raise CommandError(f"cluster {record.name} has no SSH settings in "
                           f"{state_mod.cluster_state(record.name).state_path}: `fsdpctl up` did not finish; "
                           "run it again, or `fsdpctl down` to clean up")
    return record.ssh


class _SharedConnections:
    """One SSH connection per node for the whole process (OpenSSH's ControlMaster), which every command on
    that node after the first opens a channel on, instead of a connection of its own with a key
    exchange, an authentication and a login session. On 2 local nodes an `ssh NODE true` cost 112 ms of
    CPU (client, sshd and the node's login session together) and 212 ms; through a shared connection 9-12
    ms and 8-15 ms. A smoke test runs about 100 commands on 2 nodes, its polls 4 a second; behind a
    bastion every new connection is two.

    The sockets live in a private directory of this process (a /tmp path: a socket's path is limited to
    about 100 bytes, and a state directory may be longer), closed when the process exits."""

    def __init__(self) -> None:
        self._dir: Path | None = None
        self._owner = 0  # the process that made the directory: a forked child must not close its masters
        self._lock = threading.Lock()

    def options(self, record: ClusterRecord, node: Node) -> list[str]:
        return ["-o", "ControlMaster=auto", "-o", f"ControlPath={self._socket(record, node)}",
                "-o", f"ControlPersist={SHARED_IDLE_S}"]

    def _socket(self, record: ClusterRecord, node: Node) -> Path:
        with self._lock:
            if self._dir is None or self._owner != os.getpid():
                self._dir = private_temp_dir(SHARED_SOCKETS_PREFIX)
                self._owner = os.getpid()
                atexit.register(self.close)
            directory = self._dir
        ssh = _ssh_settings(record)
        # Two clusters may have nodes at the same address (AWS VPCs, a local cluster made again).
        identity = "\0".join((record.name, ssh.user, node.address, ssh.proxy_jump or ""))
        return directory / hashlib.sha1(identity.encode()).hexdigest()[:20]

    def close(self) -> None:
        """End this process's shared connections."""
        with self._lock:
            directory, self._dir = self._dir, None
        if directory is not None and self._owner == os.getpid():
            close_control_masters(directory)
            shutil.rmtree(directory, ignore_errors=True)


_shared = _SharedConnections()


def ssh_argv(cluster: ClusterNodes, node: Node, command: str, *, shared: bool = True) -> list[str]:
    """ssh's command line for `command` on `node`; through this process's shared connection to the node
    unless `shared` is false (a tunnel: a shared connection would take its forwarding and exit at once)."""
    record = _record(cluster)
    ssh = _ssh_settings(record)
    sharing = _shared.options(record, node) if shared else []
    return ["ssh", *sharing, *ssh_options(ssh), "-l", ssh.user, node.address, command]


def failed_before_session(returncode: int, stderr: str) -> bool:
    """Whether ssh ended before the remote command started (so trying again cannot run it twice)."""
    return returncode == SSH_FAILED and any(words in stderr for words in BEFORE_SESSION)


def _until_the_session_starts(run_once: Callable[[], tuple[int, str]], *, deadline: float | None = None,
                              on_retry: Callable[[int], None] | None = None) -> None:
    """Call `run_once()` (which returns ssh's exit status and its last stderr) again while ssh ended before
    the remote command started, SSH_ATTEMPTS times at most and never past `deadline` (time.monotonic());
    `on_retry(attempt)` is told before each further try."""
    for attempt in range(1, SSH_ATTEMPTS + 1):
        code, stderr = run_once()
        if attempt == SSH_ATTEMPTS or not failed_before_session(code, stderr):
            return
        if deadline is not None and time.monotonic() + SSH_RETRY_DELAY_S >= deadline:
            return
        if on_retry is not None:
            on_retry(attempt + 1)
        time.sleep(SSH_RETRY_DELAY_S)


def _run_on(record: ClusterRecord, node: Node, command: str, timeout: float | None,
            check: bool) -> subprocess.CompletedProcess:
    argv = ssh_argv(record, node, command)
    deadline = None if timeout is None else time.monotonic() + timeout
    results: list[subprocess.CompletedProcess] = []

    def run_once() -> tuple[int, str]:
        left = None if deadline is None else max(deadline - time.monotonic(), 1.0)
        try:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=left,
                                    stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            def text(v: str | bytes | None) -> str:
                return v.decode(errors="replace") if isinstance(v, bytes) else (v or "")
            result = subprocess.CompletedProcess(argv, TIMEOUT_RC, text(e.stdout),
                                                 text(e.stderr) + f"\ntimed out after {timeout} s")
        results.append(result)
        return result.returncode, result.stderr

    _until_the_session_starts(run_once, deadline=deadline)
    result = results[-1]
    if check and result.returncode:
        raise RemoteCommandFailed(node, command, result)
    return result


def run(cluster: ClusterNodes, rank: int, command: str, *, timeout: float | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run a shell command on one node; output captured as text. A timeout returns exit 124."""
    record = _record(cluster)
    return _run_on(record, node_by_rank(record, rank), command, timeout, check)


def run_all(cluster: ClusterNodes, command: str, *, ranks: list[int] | None = None,
            timeout: float | None = None, check: bool = True,
            on_result: Callable[[int, subprocess.CompletedProcess], None] | None = None,
            ) -> dict[int, subprocess.CompletedProcess]:
    """Run a command on every (non-excluded) node, or on the given ranks, in parallel; results by rank.

    `on_result(rank, result)` is called as each node finishes (progress for long commands). With
    check=True every node still runs to completion; then the first failure (lowest rank) is raised.
    """
    record = _record(cluster)
    nodes = cluster_nodes(record) if ranks is None else [node_by_rank(record, r) for r in ranks]
    if not nodes:
        raise UsageError(f"cluster {record.name} has no nodes to run on (all excluded, or not up)")
    results: dict[int, subprocess.CompletedProcess] = {}
    with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        futures = {pool.submit(_run_on, record, n, command, timeout, False): n.rank for n in nodes}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            if on_result is not None:
                on_result(futures[future], results[futures[future]])
    if check:
        for node in nodes:
            if results[node.rank].returncode:
                raise RemoteCommandFailed(node, command, results[node.rank])
    return results


def popen(cluster: ClusterNodes, rank: int, command: str, **popen_kwargs: Any) -> subprocess.Popen:
    """Start a command on a node and return at once (long runs: training, benchmarks)."""
    record = _record(cluster)
    return subprocess.Popen(ssh_argv(record, node_by_rank(record, rank), command), **popen_kwargs)


def copy_to(cluster: ClusterNodes, rank: int, local_path: str | Path, remote_path: str) -> None:
    """Copy a file or a directory tree to `remote_path` on a node (created, parents included).

    Streams a tar archive over the SSH connection, so it needs nothing but tar on the node.
    """
    local_path = Path(local_path)
    if not local_path.exists():
        raise CommandError(f"cannot copy {local_path} to node rank {rank}: it does not exist")
    record = _record(cluster)
    node = node_by_rank(record, rank)
    target = shlex.quote(remote_path)
    if local_path.is_dir():
        command = f"mkdir -p {target} && tar -x -f - -C {target} --no-same-owner"
    else:
        command = (f"mkdir -p \"$(dirname {target})\" && tmp=$(mktemp {target}.XXXXXX) && "
                   f"tar -x -O -f - > \"$tmp\" && chmod {local_path.stat().st_mode & 0o7777:o} \"$tmp\" && "
                   f"mv \"$tmp\" {target}")
    proc = subprocess.Popen(ssh_argv(record, node, command), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None
    try:
        with tarfile.open(fileobj=proc.stdin, mode="w|") as archive:
            if local_path.is_dir():
                archive.add(local_path, arcname=".")
            else:
                archive.add(local_path, arcname=local_path.name)
    except BrokenPipeError:
        pass  # the remote side failed early; its exit status and stderr say why
    stdout, stderr = proc.communicate()
    if proc.returncode:
        raise RemoteCommandFailed(node, f"copy {local_path} -> {remote_path}", subprocess.CompletedProcess(
            proc.args, proc.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace")))


def close_control_masters(control_dir: Path) -> None:
    """Stop the ControlPersist ssh masters in a directory: Ansible's (they outlive its run) or this
    process's shared connections."""
    if not control_dir.is_dir():
        return
    for socket_path in control_dir.iterdir():
        # A master that does not answer on its own socket ends after its idle time.
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(["ssh", "-o", f"ControlPath={socket_path}", "-O", "exit", "fsdp-node"],
                           capture_output=True, timeout=15)


def _call_with_retries(node: Node, argv: list[str]) -> int:
    """Run ssh with the terminal's stdin and stdout, passing its stderr on as it comes, and try again
    while it ends before the remote command started."""
    codes: list[int] = []

    def call_once() -> tuple[int, str]:
        proc = subprocess.Popen(argv, env=os.environ, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        last_lines: deque[bytes] = deque(maxlen=5)  # ssh's own words come last
        for line in proc.stderr:
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
            last_lines.append(line)
        codes.append(proc.wait())
        return codes[-1], b"".join(last_lines).decode(errors="replace")

    def say_retry(attempt: int) -> None:
        print(f"fsdpctl ssh: {node.name} ({node.address}) did not start the session; trying again "
              f"({attempt} of {SSH_ATTEMPTS})", file=sys.stderr, flush=True)

    _until_the_session_starts(call_once, on_retry=say_retry)
    return codes[-1]


def cmd_ssh(args: Namespace) -> int:
    """`fsdpctl ssh RANK -- CMD`: run CMD on the node (no CMD: an interactive shell)."""
    words = list(args.remote_command)
    if "--" in words:  # options after RANK land in the command (argparse's REMAINDER): take them back
        options, words = words[:words.index("--")], words[words.index("--") + 1:]
        while options:
            option = options.pop(0)
            if option == "--cluster" and options:
                args.cluster = options.pop(0)
            elif option.startswith("--cluster="):
                args.cluster = option.split("=", 1)[1]
            else:
                raise UsageError(f"fsdpctl ssh: unknown option {option!r} before `--`; the form is "
                                 "`fsdpctl ssh [--cluster NAME] RANK -- CMD`")
    _state, record, _spec = state_mod.resolve_cluster(args.cluster)
    node = node_by_rank(record, args.rank)
    argv = ssh_argv(record, node, " ".join(words))
    if not words:  # an interactive login: no command, and a terminal when we have one
        argv = [argv[0], *(["-t"] if sys.stdin.isatty() else []), *argv[1:-1]]
    sys.stdout.flush()
    code = subprocess.call(argv, env=os.environ) if not words else _call_with_retries(node, argv)
    if code == SSH_FAILED:
        raise CommandError(f"ssh to {node.name} ({node.address}) exited {SSH_FAILED}: the connection failed "
                           "(ssh's own message is above) or the command exited so; `fsdpctl status` checks "
                           "every node")
    return code
