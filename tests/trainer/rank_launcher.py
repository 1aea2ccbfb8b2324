"""Trainer ranks for the numerical tests, forked from one process that imported torch and the trainer once.

A `torchrun --standalone` launch of 2 ranks costs about 7 CPU-seconds before a rank does any work: the
agent's interpreter and torch, then in each rank torch, FSDP2/DTensor (which pulls in sympy) and the
trainer's modules (`python -X importtime -c 'import trainer.train'`: 2.3 s). The model-parity tests
launch about 45 such runs of tiny models, so most of their CPU went into imports. Here a zygote
process per test process imports those modules once, touches no tensor (so no OpenMP pool exists to be
broken by a fork) and forks the ranks of each launch from itself.

The ranks get torchrun's environment contract (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, ROLE_*, MASTER_ADDR/MASTER_PORT with rank 0 hosting the store,
TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT/MAX_RESTARTS), run the module or script as `__main__`
as `python -u -m` would, share one stdout and one stderr, and end through the interpreter's own exit.
The launch fails as torchrun's does with no restarts: the first rank to fail gets the others
SIGTERMed (SIGKILLed 30 s later) and the exit status is 1.

torchrun itself, its agent and its restarts, stays covered where it is what is tested:
test_elastic, test_preemption, test_collectives, test_exit_process, the checkpoint and fault tests
(`python -m torch.distributed.run`), and every Slurm job on the local nodes.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

# What every numerical test's ranks import; not the modules run as `-m` (runpy would warn that they are
# in sys.modules before their execution), nor transformers (the trainer must not import it).
PRELOADED = ("trainer.train", "trainer.commands")
# torchrun's grace between the SIGTERM to the surviving ranks of a failed launch and its SIGKILL.
STOP_GRACE_S = 30.0
POLL_S = 0.02


class RankLauncher:
    """The test process's handle on its zygote: started on first use, restarted if it died."""

    def __init__(self, repo: Path) -> None:
        self.repo = repo
        self.zygote: subprocess.Popen | None = None
        atexit.register(self.close)

    def run(self, nproc: int, args: list[str], env: dict[str, str], timeout: float
            ) -> subprocess.CompletedProcess:
        """`torchrun --standalone --nproc-per-node NPROC ARGS` with the ranks forked from the zygote."""
        zygote = self._zygote(env)
        with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            request = {"nproc": nproc, "args": args, "env": env, "cwd": str(self.repo), "stdout": str(out),
                       "stderr": str(err), "timeout": timeout}
            zygote.stdin.write(json.dumps(request) + "\n")
            zygote.stdin.flush()
            # The zygote ends the ranks itself at `timeout`; the margin covers its SIGTERM grace.
            ready, _, _ = select.select([zygote.stdout], [], [], timeout + STOP_GRACE_S + 30)
            reply = zygote.stdout.readline() if ready else ""
            if not reply:
                self.close()
                raise RuntimeError(f"the rank zygote did not answer (exit {zygote.poll()}): {args}")
            answer = json.loads(reply)
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        command = ["torchrun(forked)", f"--nproc-per-node={nproc}", *args]
        if answer["timed_out"]:
            raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(command, answer["returncode"], stdout, stderr)

    def _zygote(self, env: dict[str, str]) -> subprocess.Popen:
        if self.zygote is None or self.zygote.poll() is not None:
            # OMP_NUM_THREADS is read once, when libgomp loads: it must be in the zygote's own environment.
            self.zygote = subprocess.Popen([sys.executable, "-m", "tests.trainer.rank_launcher"],
                                           cwd=self.repo, env=env, stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True)
        return self.zygote

    def close(self) -> None:
        if self.zygote is not None and self.zygote.poll() is None:
            self.zygote.stdin.close()
            try:
                self.zygote.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.zygote.kill()
                self.zygote.wait()
        self.zygote = None


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_environment(env: dict[str, str], rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """What torchrun --standalone gives a worker (torch.distributed.elastic.agent.server's
    local_elastic_agent.py)."""
    sizes = {"WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc, "ROLE_WORLD_SIZE": nproc, "GROUP_WORLD_SIZE": 1}
    ranks = {"RANK": rank, "LOCAL_RANK": rank, "ROLE_RANK": rank, "GROUP_RANK": 0}
    return {**env, **{k: str(v) for k, v in {**sizes, **ranks}.items()}, "ROLE_NAME": "default",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "False"}


def _run_rank(request: dict, environment: dict[str, str]) -> None:
    """In a forked child: become the rank and run it as `python -u -m MODULE ARGS` would; never returns."""
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_APPEND),
                            (2, request["stderr"], os.O_WRONLY | os.O_APPEND)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(request["cwd"])
    args = request["args"]
    code: object = 0
    try:
        if args[0] == "-m":
            sys.path[0] = request["cwd"]
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = str(Path(args[0]).resolve().parent)
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # what an uncaught exception does to `python -m`: the traceback, exit 1
        traceback.print_exc()
        code = 1
    # Out through the interpreter's own exit, so atexit handlers and flushes run as in a process of its own.
    raise SystemExit(code)


def _launch(request: dict) -> dict:
    """Fork the launch's ranks into a process group of their own and wait for them as torchrun does."""
    nproc, port, run_id = request["nproc"], free_port(), uuid.uuid4().hex[:12]
    Path(request["stdout"]).touch()
    Path(request["stderr"]).touch()
    sys.stdout.flush()
    sys.stderr.flush()
    pids: list[int] = []
    for rank in range(nproc):
        environment = _rank_environment(request["env"], rank, nproc, port, run_id)
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, pids[0] if pids else 0)
            _run_rank(request, environment)
        # Both sides set it, so that the group exists whichever runs first; a child that already ended
        # has its status for waitpid below.
        with contextlib.suppress(ProcessLookupError):
            os.setpgid(pid, pids[0] if pids else pid)
        pids.append(pid)
    group, status, deadline, stop_at = pids[0], {}, time.monotonic() + request["timeout"], None
    timed_out = False
    while len(status) < nproc:
        for pid in pids:
            if pid not in status:
                done, wait_status = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[pid] = os.waitstatus_to_exitcode(wait_status)
        failed = any(code != 0 for code in status.values())
        now = time.monotonic()
        if stop_at is None and (failed or now > deadline):
            timed_out = not failed
            _signal_group(group, signal.SIGTERM if failed else signal.SIGKILL)
            stop_at = now + STOP_GRACE_S
        elif stop_at is not None and now > stop_at:
            _signal_group(group, signal.SIGKILL)
        time.sleep(POLL_S)
    returncode = 0 if all(code == 0 for code in status.values()) else 1
    return {"returncode": -signal.SIGKILL if timed_out else returncode, "timed_out": timed_out}


def _signal_group(group: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signum)


def serve() -> None:
    """The zygote: import once, then one launch per request line on stdin, one reply line on stdout."""
    for name in PRELOADED:
        __import__(name)
    requests, replies = sys.stdin, sys.stdout
    for line in requests:
        replies.write(json.dumps(_launch(json.loads(line))) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
