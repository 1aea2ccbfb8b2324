"""`fsdpctl deploy`: install this checkout's trainer, offline, into a venv on every node.

Nodes have no package index (local nodes have no network at all; AWS nodes sit in a private subnet),
so the operator machine builds a *bundle*: the trainer wheel (the distribution `fsdp-trainer`: the
`trainer` package alone, with the requirements of the root pyproject's `trainer` extra) plus a
wheelhouse of its runtime dependencies (`pip download` for the nodes' Python, ABI and glibc, probed
on the nodes). Both are copied once to the cluster's shared file system when there is one,
else copied to every node, and installed with `pip --no-index --find-links`.

Caching, so that a second deploy is fast: the wheelhouse is keyed by the requirement list and the
node platform, the trainer wheel by the hash of the source files it packages; both live under
`$FSDPCTL_CACHE/deploy` on the operator machine and are shipped separately, so a code change ships
only the small trainer wheel. On the nodes a directory is complete once it holds `.complete`, and the
venv records the wheelhouse and trainer wheel it holds, so an unchanged deploy uploads and installs
nothing.

torch: a node whose system Python already has the operator's torch version (e.g. a Deep Learning
AMI) gets a `--system-site-packages` venv that reuses it; if every node has it, the wheelhouse leaves
torch out. GPU nodes get the public torch version from the index (the CUDA build), never the
operator's `+cpu` build.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpctl import remote
from fsdpctl import state as state_mod
from fsdpctl.checkout import REPO_ROOT
from fsdpctl.console import say, stage
from fsdpctl.errors import CommandError
from fsdpctl.filelock import exclusive
from fsdpctl.scripts import render_script
from fsdpctl.slurm_nodes import nodes_held_up
from fsdpctl.state import ClusterRecord, ClusterState, DeployRecord

PROJECT_ROOT = REPO_ROOT
# The trainer wheel holds the trainer package only (nodes never run the operator tool or the Pulumi
# program); a change in any of these files, or in the requirements, means a new wheel.
TRAINER_DISTRIBUTION = "fsdp-trainer"
_WHEEL_PACKAGE = "trainer"
_WHEEL_SUFFIXES = {".py", ".yaml", ".json"}  # .json: bundled config.json architectures
WHEELHOUSE_LAYOUT = "wheelhouse/2: wheels + constraints.txt"
PROBE_TIMEOUT_S = 30
INSTALL_TIMEOUT_S = 900


class DeployError(CommandError):
    """Building, uploading or installing the trainer failed, or it is not deployed yet."""


def cache_root() -> Path:
    return Path(os.environ.get("FSDPCTL_CACHE") or Path.home() / ".cache" / "fsdp-cluster") / "deploy"


@dataclass(frozen=True)
class NodePlatform:
    python: str  # "3.11"
    machine: str  # "x86_64"
    glibc: str  # "2.36"

    @property
    def abi(self) -> str:
        return "cp" + self.python.replace(".", "")

    def pip_target_args(self) -> list[str]:
        """`pip download` flags that select wheels this node can install."""
        major, minor = (int(x) for x in self.glibc.split(".")[:2])
        platforms = [f"manylinux_{major}_{m}_{self.machine}" for m in range(minor, 16, -1)]
        platforms += [f"manylinux2014_{self.machine}", f"linux_{self.machine}"]
        args = ["--only-binary=:all:", "--python-version", self.python, "--implementation", "cp",
                "--abi", self.abi, "--abi", "abi3", "--abi", "none"]
        for p in platforms:
            args += ["--platform", p]
        return args


@dataclass(frozen=True)
class Bundle:
    """The two halves of a deploy, each cached and shipped under its own content key: the dependency
    wheelhouse (large, rarely changes) and the trainer wheel (small, changes with the code)."""

    wheelhouse_key: str
    wheelhouse: Path  # operator side: the dependency wheels, constraints.txt, .complete
    trainer_key: str
    trainer_dir: Path  # operator side: the trainer wheel, .complete
    trainer_wheel: str  # its file name
    includes_torch: bool

    @property
    def key(self) -> str:
        return f"{self.wheelhouse_key}-{self.trainer_key}"


_log = stage("deploy")


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def trainer_pyproject(root: Path = PROJECT_ROOT) -> str:
    """The pyproject.toml of the trainer wheel: the root project's version, the `trainer` extra as
    its requirements (one source of truth), the `fsdp-train` script and the shipped configs."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    requirements = ",\n".join(f"    {json.dumps(r)}" for r in project["optional-dependencies"]["trainer"])
    return f"""[build-system]
requires = ["setuptools>=68", "wheel"]
build-backend = "setuptools.build_meta"

[project]
name = "{TRAINER_DISTRIBUTION}"
version = "{project['version']}"
description = "The fsdp-cluster FSDP2 trainer, as deployed to the nodes"
requires-python = "{project['requires-python']}"
dependencies = [
{requirements},
]

[project.scripts]
fsdp-train = "trainer.__main__:entry"

[tool.setuptools.packages.find]
include = ["trainer*"]

[tool.setuptools.package-data]
trainer = ["configs/*.yaml", "configs/hf/*.json"]
"""


def snapshot_sources(target: Path, root: Path = PROJECT_ROOT) -> str:
    """Write the trainer wheel's sources into `target` (the trainer package and its pyproject) and
    return their hash. Building from the snapshot keeps the wheel consistent with its hash while the
    checkout changes, and keeps pip's build/ and egg-info out of the checkout."""
    h = hashlib.sha256()
    pyproject = trainer_pyproject(root).encode()
    h.update(b"pyproject.toml\0" + pyproject + b"\0")
    (target / "pyproject.toml").parent.mkdir(parents=True, exist_ok=True)
    (target / "pyproject.toml").write_bytes(pyproject)
    package = root / _WHEEL_PACKAGE
    for path in sorted(p for p in package.rglob("*") if p.is_file() and p.suffix in _WHEEL_SUFFIXES
                       and "__pycache__" not in p.parts):
        relative = path.relative_to(root)
        data = path.read_bytes()
        h.update(str(relative).encode() + b"\0" + data + b"\0")
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        (target / relative).write_bytes(data)
    return h.hexdigest()[:16]


def trainer_requirements(torch_pin: str | None, root: Path = PROJECT_ROOT) -> list[str]:
    """The runtime requirements of the trainer (the root pyproject's `trainer` extra), with torch
    pinned to `torch_pin` or left out when None (the nodes reuse their own)."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    out = []
    for req in project["optional-dependencies"]["trainer"]:
        name = req.split(";")[0].split("[")[0]
        for sep in "<>=!~ ":
            name = name.split(sep)[0]
        if name.lower() == "torch":
            if torch_pin is not None:
                out.append(torch_pin)
        else:
            out.append(req)
    return out


def operator_torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise DeployError("torch is not installed on this machine; deploy pins the nodes' torch to the "
                          "operator's version: install it (CPU build: pip install torch --index-url "
                          "https://download.pytorch.org/whl/cpu) and rerun `fsdpctl deploy`") from None


def _public_version(version: str) -> str:
    return version.split("+")[0]


def _run_pip(args: list[str], what: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise DeployError(f"{what} failed (pip exit {proc.returncode}):\n{tail}")


def build_bundle(platform: NodePlatform, torch_pin: str | None) -> Bundle:
    """Build (or reuse from the cache) the trainer wheel and the dependency wheelhouse. Two deploys
    at once (two clusters) share the cache, so one builds while the other waits, then reuses it."""
    root = cache_root()
    with exclusive(root / ".build.lock"):
        return _build_bundle(root, platform, torch_pin)


def _build_bundle(root: Path, platform: NodePlatform, torch_pin: str | None) -> Bundle:
    requirements = trainer_requirements(torch_pin)
    # The layout version is part of the key: a cached wheelhouse of an older layout is not reused.
    wheelhouse_key = _digest(WHEELHOUSE_LAYOUT, *requirements, platform.python, platform.machine,
                             platform.glibc)
    wheelhouse = root / f"wheelhouse-{wheelhouse_key}"
    if (wheelhouse / ".complete").exists():
        _log(f"wheelhouse cached: {wheelhouse}")
    else:
        _log(f"downloading wheels for Python {platform.python} {platform.machine} glibc {platform.glibc}: "
             + ", ".join(requirements))
        partial = wheelhouse.with_name(wheelhouse.name + ".partial")
        subprocess.run(["rm", "-rf", str(partial)], check=True)
        partial.mkdir(parents=True)
        _run_pip(["download", "-q", "--dest", str(partial), *platform.pip_target_args(), *requirements],
                 "downloading the wheelhouse")
        (partial / "constraints.txt").write_text((torch_pin or "") + "\n")
        (partial / ".complete").touch()
        subprocess.run(["rm", "-rf", str(wheelhouse)], check=True)
        partial.rename(wheelhouse)

    with tempfile.TemporaryDirectory(prefix="fsdp-wheel-") as tmp:
        src_key = snapshot_sources(Path(tmp))
        wheel_dir = root / f"trainer-{src_key}"
        if not (wheel_dir / ".complete").exists():
            _log(f"building the trainer wheel from {PROJECT_ROOT} (sources {src_key})")
            subprocess.run(["rm", "-rf", str(wheel_dir)], check=True)
            _run_pip(["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheel_dir), tmp],
                     "building the trainer wheel")
            (wheel_dir / ".complete").touch()
        else:
            _log(f"trainer wheel cached (sources {src_key})")
    wheels = sorted(wheel_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise DeployError(f"expected one trainer wheel in {wheel_dir}, found {len(wheels)}: "
                          f"remove {wheel_dir} and rerun `fsdpctl deploy`")
    deps = list(wheelhouse.glob("*.whl"))
    _log(f"wheelhouse {wheelhouse_key}: {len(deps)} wheels, "
         f"{sum(p.stat().st_size for p in deps) / 1e6:.0f} MB; trainer wheel {wheels[0].name}")
    return Bundle(wheelhouse_key=wheelhouse_key, wheelhouse=wheelhouse, trainer_key=src_key,
                  trainer_dir=wheel_dir, trainer_wheel=wheels[0].name, includes_torch=torch_pin is not None)


def active_ranks(record: ClusterRecord, ranks: list[int] | None = None) -> list[int]:
    """Ranks of the cluster's nodes that are not excluded (or the requested subset of them)."""
    known = [n.rank for n in record.nodes]
    if not known:
        raise DeployError(f"cluster {record.name!r} has no nodes in "
                          f"{state_mod.cluster_state(record.name).state_path}: run `fsdpctl up` first")
    excluded = record.excluded_ranks()
    if ranks is None:
        return [r for r in known if r not in excluded]
    unknown = sorted(set(ranks) - set(known))
    if unknown:
        raise DeployError(f"rank(s) {unknown} are not nodes of cluster {record.name!r} (ranks: {known})")
    return list(ranks)


def probe_nodes(record: ClusterRecord, ranks: list[int]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    failures = []
    answers = remote.run_all(record, render_script("templates/deploy_probe.sh.j2"), ranks=ranks,
                             timeout=PROBE_TIMEOUT_S, check=False)
    for rank, proc in answers.items():
        try:
            if proc.returncode != 0:
                output = (proc.stderr or proc.stdout).strip()[-300:]
                raise DeployError(f"exit {proc.returncode}: {output}")
            out[rank] = json.loads(proc.stdout.strip().splitlines()[-1])
        except (DeployError, ValueError, IndexError) as e:
            failures.append(f"node {rank}: {e}")
    if failures:
        raise DeployError("could not probe the nodes' Python:\n  " + "\n  ".join(sorted(failures)))
    return out


def _common_platform(facts: dict[int, dict[str, Any]]) -> NodePlatform:
    platforms = {(f["python"], f["machine"]) for f in facts.values()}
    if len(platforms) != 1:
        detail = ", ".join(f"node {r}: Python {f['python']} {f['machine']}" for r, f in sorted(facts.items()))
        raise DeployError(f"the nodes run different Pythons ({detail}); one wheelhouse cannot serve them: "
                          "rebuild the odd nodes from the same image (`fsdpctl replace RANK` on aws)")
    missing_venv = sorted(r for r, f in facts.items() if not f["venv_module"])
    if missing_venv:
        raise DeployError(f"node(s) {missing_venv} lack Python's venv/ensurepip module: run "
                          "`fsdpctl configure` (the common role installs python3-venv) and deploy again")
    python, machine = platforms.pop()
    # Wheels must run on the oldest glibc among the nodes.
    glibc = min((f["glibc"] for f in facts.values()), key=lambda v: tuple(int(x) for x in v.split(".")))
    return NodePlatform(python=python, machine=machine, glibc=glibc)


def _install_script(bundle: Bundle, wheelhouse_dir: str, trainer_dir: str, venv: str,
                    torch_version: str) -> str:
    """The script that installs the bundle into `venv` on a node, or nothing that is there already."""
    return render_script("templates/deploy_install.sh.j2", venv=venv, wheelhouse=wheelhouse_dir,
                         wheel=f"{trainer_dir}/{bundle.trainer_wheel}", wheelhouse_key=bundle.wheelhouse_key,
                         trainer_key=bundle.trainer_key, torch_version=_public_version(torch_version))


def _upload(record: ClusterRecord, rank: int, local_dir: Path, remote_dir: str) -> str:
    """Copy local_dir to remote_dir on the node unless it is already complete there; returns what
    happened. A half-copied directory is never taken for complete: the copy lands beside it and is
    renamed, and completeness is its `.complete` file."""
    q = shlex.quote
    done = remote.run(record, rank, f"test -f {q(remote_dir)}/.complete", timeout=PROBE_TIMEOUT_S,
                      check=False)
    if done.returncode == 0:
        return "cached"
    partial = f"{remote_dir}.partial"
    remote.run(record, rank, f"rm -rf {q(partial)}", timeout=PROBE_TIMEOUT_S)
    remote.copy_to(record, rank, local_dir, partial)
    remote.run(record, rank, f"set -e; rm -rf {q(remote_dir)}; mv {q(partial)} {q(remote_dir)}",
               timeout=PROBE_TIMEOUT_S)
    return "uploaded"


def deploy(state: ClusterState, record: ClusterRecord, *, ranks: list[int] | None = None) -> DeployRecord:
    """Build, upload and install the trainer on the given ranks (default: every non-excluded node) of
    the cluster `record` holds (as the command read it). Returns the deploy record, also written to
    `state` (state.json's `deploy`)."""
    started = time.monotonic()
    ranks = active_ranks(record, ranks)
    _log(f"probing {len(ranks)} node(s)")
    facts = probe_nodes(record, ranks)
    platform = _common_platform(facts)
    homes = {f["home"] for f in facts.values()}
    if len(homes) != 1:
        raise DeployError(f"the nodes' SSH users have different home directories ({sorted(homes)}); "
                          "deploy installs the venv under one path on every node")
    home = homes.pop()
    venv = f"{home}/.fsdp-cluster/venv"

    operator_torch = operator_torch_version()
    any_gpu = any(f["gpus"] > 0 for f in facts.values())
    # GPU nodes need the index's default (CUDA) build of the same version, not the operator's +cpu.
    torch_version = _public_version(operator_torch) if any_gpu else operator_torch
    all_reuse = all(f["torch"] and _public_version(f["torch"]) == _public_version(operator_torch)
                    for f in facts.values())
    bundle = build_bundle(platform, None if all_reuse else f"torch=={torch_version}")

    shared_dir = record.shared_dir
    base = f"{shared_dir}/fsdp-cluster" if shared_dir else f"{home}/.fsdp-cluster"
    wheelhouse_dir = f"{base}/wheelhouse/{bundle.wheelhouse_key}"
    trainer_dir = f"{base}/trainer/{bundle.trainer_key}"
    # On a shared file system one copy (through the first node) serves every node.
    upload_ranks = ranks[:1] if shared_dir else ranks
    where = "shared file system" if shared_dir else "node"
    with ThreadPoolExecutor(max_workers=min(8, len(upload_ranks))) as pool:
        futures = {pool.submit(lambda r: (_upload(record, r, bundle.wheelhouse, wheelhouse_dir),
                                          _upload(record, r, bundle.trainer_dir, trainer_dir)), r): r
                   for r in upload_ranks}
        for fut in as_completed(futures):
            deps, trainer = fut.result()
            _log(f"{where} via node {futures[fut]}: wheelhouse {deps}, trainer wheel {trainer}")

    _log(f"installing into {venv} on {len(ranks)} node(s)")
    script = _install_script(bundle, wheelhouse_dir, trainer_dir, venv, torch_version)
    started_install = time.monotonic()

    def report(rank: int, proc: subprocess.CompletedProcess) -> None:
        if proc.returncode == 0:
            lines = proc.stdout.strip().splitlines()
            _log(f"node {rank}: {lines[-1] if lines else 'installed'} "
                 f"({time.monotonic() - started_install:.0f} s)")

    results = remote.run_all(record, script, ranks=ranks, timeout=INSTALL_TIMEOUT_S, check=False,
                             on_result=report)
    failures = [f"node {rank}: install timed out after {INSTALL_TIMEOUT_S} s"
                if proc.returncode == remote.TIMEOUT_RC
                else f"node {rank}: exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-500:]}"
                for rank, proc in sorted(results.items()) if proc.returncode]
    if failures:
        raise DeployError("installing the trainer failed:\n  " + "\n  ".join(sorted(failures)))

    deployed = DeployRecord(bundle=bundle.key, venv=venv, wheelhouse_dir=wheelhouse_dir,
                            trainer_dir=trainer_dir, ranks=sorted(ranks), torch=torch_version,
                            includes_torch=bundle.includes_torch, python=platform.python,
                            deployed_at=time.time())
    state.update(deploy=deployed)
    _log(f"done in {time.monotonic() - started:.0f} s")
    return deployed


def deployed_venv(record: ClusterRecord) -> str:
    """The venv that `fsdpctl deploy` installed the trainer into, or a DeployError saying to deploy."""
    if record.deploy is None:
        raise DeployError(f"the trainer is not deployed on cluster {record.name!r}: "
                          "run `fsdpctl deploy` first")
    return record.deploy.venv


def deploy_cluster(cluster: str | None = None) -> DeployRecord:
    """Build the trainer wheel and wheelhouse and install them on every node of the cluster (default:
    the one brought up last), offline; what is unchanged since the last deploy is skipped."""
    try:
        with state_mod.cluster_operation(cluster, "deploy") as (state, record, spec), \
                nodes_held_up(record, spec, say, what="deploy"):
            return deploy(state, record)
    except DeployError as e:
        raise DeployError(f"deploy to cluster {record.name!r} failed: {e}\n"
                          "Fix the cause and rerun `fsdpctl deploy` (finished steps are cached).") from None


def cmd_deploy(args: Namespace) -> int:
    deploy_cluster(args.cluster)
    return 0
