"""`fsdpctl configure`: run ansible/site.yml on the cluster's nodes through ansible-runner.

Each run gets a private data dir (`reports/<cluster>/<time>-configure/` under the fsdpctl home) that holds
Ansible's home, temp files and SSH control sockets, so nothing is written under ~/.ansible. Progress is
one line per task result; the end is a per-host recap and, on failure, which host failed which task
and why. Ctrl-C or SIGTERM cancels the run cleanly (ansible-runner's cancel_callback).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
from argparse import Namespace
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fsdpctl import state as state_mod
from fsdpctl.checkout import ANSIBLE_DIR, ANSIBLE_STRATEGIES, DEFAULT_ANSIBLE_STRATEGY
from fsdpctl.console import Out, line_buffered, say
from fsdpctl.errors import EXIT_OK, CommandError, Interrupted, UsageError
from fsdpctl.inventory import write_inventory
from fsdpctl.processes import private_temp_dir, processes, terminate
from fsdpctl.remote import close_control_masters, cluster_nodes, run_all
from fsdpctl.slurm_nodes import nodes_held_up
from fsdpctl.state import ClusterState, ConfigureRecord, HostRecap, TaskFailure

PLAYBOOK = "site.yml"
# Unix socket paths are limited to 107 bytes: Ansible appends "/<10-char hash>" to the directory, and
# ssh a ".<16 random chars>" suffix while it creates the socket.
MAX_CONTROL_DIR_LEN = 107 - 11 - 17
DEFAULT_SKIP_REASON = "Conditional result was False"  # says nothing; other reasons are shown


@dataclass(frozen=True)
class TaskResult:
    host: str
    role: str
    task: str
    status: str  # ok | changed | skipped | failed | unreachable | ignored


@dataclass
class ConfigureResult:
    status: str  # ansible-runner's: successful | failed | canceled | timeout
    rc: int
    run_dir: Path
    hosts: dict[str, HostRecap] = field(default_factory=dict)
    failures: list[TaskFailure] = field(default_factory=list)
    results: list[TaskResult] = field(default_factory=list)
    output_tail: str = ""  # the end of Ansible's own output, for errors outside any task

    @property
    def ok(self) -> bool:
        failed = any(s.failed or s.unreachable for s in self.hosts.values())
        return self.status == "successful" and bool(self.hosts) and not failed

    @property
    def canceled(self) -> bool:
        return self.status == "canceled"


def parse_extra_vars(pairs: list[str]) -> dict[str, Any]:
    """`-e key=value` pairs; values are read as YAML scalars, so 9000 is an int and true a bool."""
    extra = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"-e {pair!r} is not KEY=VALUE; write e.g. -e fsdp_mtu=9000")
        extra[key.strip()] = yaml.safe_load(value) if value else ""
    return extra


def _failure_message(res: dict[str, Any]) -> str:
    parts = [str(res[k]).strip() for k in ("msg", "stderr", "stdout") if res.get(k)]
    if not parts and "rc" in res:
        parts.append(f"exit status {res['rc']}")
    message = " | ".join(parts) or "no message"
    return message if len(message) <= 600 else message[:600] + " ..."


def _result_from_display(text: str) -> dict[str, Any]:
    """The result dict shown after `=>` in Ansible's display of an event; ansible-runner leaves `res`
    out of skipped events, and that is where a role's skip reason is."""
    _, sep, shown = text.replace("\r\n", "\n").partition("=>")
    if not sep:
        return {}
    try:
        parsed = yaml.safe_load(shown)
    except yaml.YAMLError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


class _EventPrinter:
    """ansible-runner event handler: one line per task result, plus the record for the result."""

    STATUS = {"runner_on_ok": "ok", "runner_on_failed": "failed", "runner_on_skipped": "skipped",
              "runner_on_unreachable": "unreachable"}

    def __init__(self, out: Callable[[str], None]):
        self.out = out
        self.results: list[TaskResult] = []
        self.failures: list[TaskFailure] = []
        self.width = 20

    def __call__(self, event: dict[str, Any]) -> bool:
        status = self.STATUS.get(event.get("event", ""))
        if status is None:
            return True
        data = event.get("event_data", {})
        res = data.get("res") or _result_from_display(event.get("stdout", ""))
        host, task, role = data.get("host", "?"), data.get("task", "?"), data.get("role") or ""
        if status == "ok" and res.get("changed"):
            status = "changed"
        if status == "failed" and data.get("ignore_errors"):
            status = "ignored"
        self.results.append(TaskResult(host, role, task, status))
        label = f"{role} : {task}" if role else task
        line = f"  {status:<11} {host:<{self.width}} {label}"
        if status in ("failed", "unreachable"):
            message = _failure_message(res)
            self.failures.append(TaskFailure(host=host, task=label, message=message))
            line += f"\n      {message}"
        elif status == "skipped" and res.get("skip_reason", DEFAULT_SKIP_REASON) != DEFAULT_SKIP_REASON:
            line += f"  ({res['skip_reason']})"
        self.out(line)
        return True


@contextlib.contextmanager
def _cancel_on_signals() -> Iterator[threading.Event]:
    """SIGINT/SIGTERM set an event that ansible-runner polls (and keep it from taking the signals)."""
    stop = threading.Event()

    def request_stop(signum: int, frame: Any) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _control_dir(run_dir: Path) -> Iterator[Path]:
    """The run's SSH control-socket dir: in the run dir, or, when that path is too long for a socket
    (Ansible resolves symlinks, so a link would not help), a private /tmp dir removed afterwards."""
    in_run_dir = run_dir / "cp"
    if len(str(in_run_dir)) <= MAX_CONTROL_DIR_LEN:
        in_run_dir.mkdir()
        yield in_run_dir
        return
    short = private_temp_dir("fsdpctl-cp-")
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)


def strategy_environment(strategy: str) -> dict[str, str]:
    """Ansible's settings for the strategy (ANSIBLE_STRATEGIES). Mitogen's strategy plugins ship inside its
    package, so their directory is wherever pip put it."""
    if strategy not in ANSIBLE_STRATEGIES:
        raise UsageError(f"--strategy {strategy!r} is not one of {', '.join(ANSIBLE_STRATEGIES)}")
    if strategy == "linear":
        return {"ANSIBLE_STRATEGY": "linear"}
    spec = importlib.util.find_spec("ansible_mitogen")
    if spec is None or not spec.submodule_search_locations:  # the CLI names the extra that installs it
        raise ModuleNotFoundError("No module named 'ansible_mitogen'", name="ansible_mitogen")
    plugins = Path(spec.submodule_search_locations[0]) / "plugins" / "strategy"
    return {"ANSIBLE_STRATEGY_PLUGINS": str(plugins), "ANSIBLE_STRATEGY": "mitogen_linear"}


def learn_host_keys(state: ClusterState, out: Out = say) -> None:
    """First contact with the nodes whose host key the cluster's known_hosts lacks (an AWS node before
    its first configure): one `ssh NODE true` with the cluster's options, whose `accept-new` pins the key.
    Mitogen's ssh puts `StrictHostKeyChecking yes` ahead of the inventory's options, and ssh takes an
    option's first value, so under Mitogen such a node would be refused as unreachable. A key that
    changed is not learnt: known_hosts holds the old one, and Mitogen's ssh refuses the node as before."""
    record = state.read()
    known_hosts = record.ssh.known_hosts if record.ssh else ""
    unknown = [node for node in cluster_nodes(record)
               if subprocess.run(["ssh-keygen", "-F", node.address, "-f", known_hosts],
                                 capture_output=True).returncode]
    if unknown:
        out(f"first contact with {', '.join(n.name for n in unknown)}: learning the host key(s) into "
            f"{known_hosts}")
        run_all(record, "true", ranks=[n.rank for n in unknown], timeout=60, check=False)


def orphaned_playbooks(state: ClusterState) -> list[int]:
    """ansible-playbook processes (and their forked workers) running on this cluster's inventory.
    Called under the cluster's operation lock, so any there is belongs to a configure that was killed:
    SIGKILL ends fsdpctl but not the playbook ansible-runner started, which may go on changing nodes."""
    inventory = str(state.inventory_path)
    return [pid for pid, argv, _ in processes()
            if any(Path(a).name == "ansible-playbook" for a in argv[:2]) and inventory in argv]


def stop_orphaned_playbooks(state: ClusterState, out: Out = say) -> None:
    pids = orphaned_playbooks(state)
    if pids:
        listed = ", ".join(map(str, pids))
        out(f"stopping ansible-playbook left running by an interrupted configure (pid {listed})")
        terminate(pids)


def run_configure(state: ClusterState, *, tags: str | list[str] | None = None, limit: str | None = None,
                  extra_vars: dict[str, Any] | None = None, check: bool = False,
                  strategy: str = DEFAULT_ANSIBLE_STRATEGY,
                  out: Out = say) -> ConfigureResult:
    """Run the playbook on the cluster (excluded nodes left out) and return what happened per host;
    with `check`, Ansible's check mode: what would change, nothing changed on the nodes, and the run is
    not recorded as the cluster's last configure; `strategy`: one of ANSIBLE_STRATEGIES."""
    import ansible_runner

    strategy_envvars = strategy_environment(strategy)
    playbook = ANSIBLE_DIR / PLAYBOOK
    if not playbook.exists():
        raise UsageError(f"{playbook} does not exist: fsdpctl configure needs the repository's ansible/ "
                           "directory (install fsdp-cluster from a checkout: pip install -e .)")
    stop_orphaned_playbooks(state, out)  # two playbooks at once would race on the same nodes
    inventory = write_inventory(state)
    if strategy == "mitogen":
        learn_host_keys(state, out)
    run_dir = state.new_run_dir("configure-check" if check else "configure")
    ansible_home = run_dir / "ansible-home"
    printer = _EventPrinter(out)
    printer.width = max([len(node.name) for node in cluster_nodes(state)] or [4])
    if isinstance(tags, list):
        tags = ",".join(tags)
    out(f"configure{' --check' if check else ''}: {playbook} on {state.name} (run dir {run_dir})")
    with _control_dir(run_dir) as control_dir, _cancel_on_signals() as stop:
        envvars = {
            # ansible-runner starts ansible-playbook by name: the one next to this Python.
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"),
            "ANSIBLE_HOME": str(ansible_home),
            "ANSIBLE_LOCAL_TEMP": str(ansible_home / "tmp"),
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(control_dir),
            # Host keys are pinned in the cluster's known_hosts; a user's environment must not turn that off.
            "ANSIBLE_HOST_KEY_CHECKING": "True",
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_RETRY_FILES_ENABLED": "False",
            **strategy_envvars,
        }
        try:
            runner = ansible_runner.run(
                private_data_dir=str(run_dir), project_dir=str(ANSIBLE_DIR), playbook=PLAYBOOK,
                inventory=str(inventory), envvars=envvars, extravars=extra_vars or None, tags=tags or None,
                limit=limit, cmdline="--check" if check else None, quiet=True, event_handler=printer,
                cancel_callback=stop.is_set, ident="ansible")
        finally:
            if stop.is_set():
                # ansible-runner kills ansible-playbook itself; its forked workers, busy with a task on a
                # node, outlive it by as long as that task takes. A canceled run leaves none behind.
                stop_orphaned_playbooks(state, out)
            close_control_masters(control_dir)
    stats = runner.stats or {}
    hosts: dict[str, HostRecap] = {}
    for key, attr in (("ok", "ok"), ("changed", "changed"), ("failures", "failed"), ("skipped", "skipped"),
                      ("dark", "unreachable")):
        for host, count in (stats.get(key) or {}).items():
            setattr(hosts.setdefault(host, HostRecap()), attr, count)
    # A failure a block rescued is not in the recap's failed count; report only hosts that ended failed.
    ended_failed = {h for h, s in hosts.items() if s.failed or s.unreachable}
    result = ConfigureResult(status=runner.status, rc=runner.rc, run_dir=run_dir,
                             hosts=dict(sorted(hosts.items())),
                             failures=[f for f in printer.failures if f.host in ended_failed],
                             results=printer.results, output_tail=_output_tail(run_dir))
    if check:  # a preview: the nodes are as the last real configure left them
        return result
    state.update(last_configure=ConfigureRecord(
        time=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), ok=result.ok, status=result.status,
        run_dir=str(run_dir), hosts=result.hosts, failures=result.failures))
    return result


def _output_tail(run_dir: Path, lines: int = 25) -> str:
    stdout = run_dir / "artifacts" / "ansible" / "stdout"
    if not stdout.exists():
        return ""
    return "\n".join(stdout.read_text(errors="replace").strip().splitlines()[-lines:])


def print_summary(result: ConfigureResult, out: Out = say) -> None:
    if not result.hosts:
        return
    width = max(len(h) for h in result.hosts)
    out("\nRECAP")
    for host, s in result.hosts.items():
        out(f"{host:<{width}} ok={s.ok} changed={s.changed} failed={s.failed} skipped={s.skipped} "
            f"unreachable={s.unreachable}")
    if result.failures:
        out("\nFAILED")
        for failure in result.failures:
            out(f"  {failure.host}: task [{failure.task}]: {failure.message}")


def configure(cluster: str | None = None, *, tags: str | list[str] | None = None, limit: str | None = None,
              extra_vars: Mapping[str, Any] | None = None, check: bool = False,
              strategy: str = DEFAULT_ANSIBLE_STRATEGY) -> ConfigureResult:
    """Run ansible/site.yml on the cluster's nodes (default: the cluster brought up last), printing a
    line per task result and a recap per host; `tags` and `limit` as ansible-playbook's; `check`:
    Ansible's check mode, a preview that reports what would change and changes nothing; `strategy`: how
    Ansible runs the tasks (ANSIBLE_STRATEGIES: Mitogen's, or Ansible's own `linear`). Raises
    CommandError when the playbook fails (the run is idempotent: run it again after the fix) and
    Interrupted when Ctrl-C or SIGTERM cancels it."""
    line_buffered()
    strategy_environment(strategy)  # a strategy that cannot run is said before the cluster is touched
    with state_mod.cluster_operation(cluster, "configure") as (state, record, spec), \
            nodes_held_up(record, spec, say, what="configure"):
        result = run_configure(state, tags=tags, limit=limit, extra_vars=dict(extra_vars or {}), check=check,
                               strategy=strategy)
    print_summary(result)
    if result.canceled:
        raise Interrupted(f"configure canceled; the nodes may be partly configured. Run `fsdpctl configure` "
                          f"again (log: {result.run_dir})")
    if not result.hosts and limit:
        raise UsageError(f"configure ran on no host: --limit {limit!r} names none of the cluster's "
                         "nodes (`fsdpctl status` lists them; excluded nodes are left out)")
    if not result.ok:
        if not result.failures:  # Ansible stopped before any task (playbook or inventory error)
            say(f"ansible-playbook exited {result.rc} ({result.status}); its last output:\n"
                f"{result.output_tail}")
        raise CommandError(f"the playbook failed; fix the cause and run `fsdpctl configure` again (it is "
                           f"idempotent). Full log: {result.run_dir / 'artifacts'}")
    if check:
        would = sum(s.changed for s in result.hosts.values())
        say(f"configure --check ok on {len(result.hosts)} host(s): {would} task result(s) would change; "
            "nothing was changed (run `fsdpctl configure` to apply)")
    else:
        say(f"configure ok on {len(result.hosts)} host(s)")
    return result


def cmd_configure(args: Namespace) -> int:
    configure(args.cluster, tags=args.tags, limit=args.limit, extra_vars=parse_extra_vars(args.extra_vars),
              check=args.check, strategy=args.strategy)
    return EXIT_OK
