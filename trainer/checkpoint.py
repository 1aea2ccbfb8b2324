"""Sharded, verified, mirrored training checkpoints.

A checkpoint is a directory ``step_<8 digits>`` holding the torch.distributed.checkpoint (DCP) shards of
the model and optimizer (``__<rank>_<n>.distcp`` plus ``.metadata``), one ``trainer_state_rank<r>.pt``
per rank (lr scheduler, data loader, grad scaler, RNG) and ``manifest.json`` with the SHA256 and size of
every other file. All ranks write into ``step_<n>.tmp``; rank 0 gathers every rank's hashes, writes the
manifest last and renames the directory, so a directory without ``.tmp`` is complete by construction and
its manifest proves it has not changed since. Resume loads only checkpoints whose manifest verifies.

See docs/checkpoints.md for the layout, the mirror, retention and elastic restarts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pydantic
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "fsdp-cluster-checkpoint/1"
DCP_METADATA = ".metadata"
TMP_SUFFIX = ".tmp"
_CHECKPOINT_NAME = re.compile(r"^step_(\d{8,})$")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_HASH_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, found or loaded; the message says which, why and what to do."""


class CheckpointConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    dir: str | None = None
    interval: int = 1000
    mirror_dir: str | None = None
    mirror_s3: str | None = None
    keep_last: int = 3
    max_age_days: float = 7.0
    async_save: bool = True
    resume: str = "auto"

    @pydantic.field_validator("interval")
    @classmethod
    def _positive_interval(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"checkpoint interval must be at least 1 step, got {value}; "
                             "fix: --checkpoint-interval 1000 (or leave --checkpoint-dir unset to disable)")
        return value

    @pydantic.field_validator("keep_last")
    @classmethod
    def _keep_at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"keep_last must be at least 1 (the newest checkpoint is never deleted), "
                             f"got {value}")
        return value

    @pydantic.field_validator("max_age_days")
    @classmethod
    def _positive_age(cls, value: float) -> float:
        if not value > 0:
            raise ValueError(f"max_age_days must be a positive number of days, got {value}; fix: e.g. 7")
        return value

    @pydantic.field_validator("mirror_s3")
    @classmethod
    def _s3_url(cls, value: str | None) -> str | None:
        if value is not None:
            parse_s3_url(value)
        return value

    @pydantic.field_validator("resume")
    @classmethod
    def _resume_choice(cls, value: str) -> str:
        if not value:
            raise ValueError("resume must be 'auto', 'none' or the path of a checkpoint directory, got ''")
        return value

    @pydantic.model_validator(mode="after")
    def _distinct_copies(self) -> CheckpointConfig:
        if self.mirror_dir is not None and self.dir is None:
            raise ValueError(f"mirror_dir={self.mirror_dir!r} needs a primary checkpoint dir; "
                             "fix: set --checkpoint-dir as well")
        if self.mirror_s3 is not None and self.dir is None:
            raise ValueError(f"mirror_s3={self.mirror_s3!r} needs a primary checkpoint dir; "
                             "fix: set --checkpoint-dir as well")
        if self.dir is not None and self.mirror_dir is not None and (
                Path(self.dir).resolve() == Path(self.mirror_dir).resolve()):
            raise ValueError(f"mirror_dir={self.mirror_dir!r} is the checkpoint dir itself, so it is no "
                             "second copy; fix: point it at another file system (e.g. /shared/checkpoints)")
        return self


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (bucket, "some/prefix") with no trailing slash."""
    match = re.fullmatch(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?", url)
    if match is None:
        raise ValueError(f"mirror_s3={url!r} is not an S3 URL; fix: s3://<bucket>[/<prefix>], e.g. "
                         "the stack output checkpoint_bucket as s3://<checkpoint_bucket>/<run name>")
    return match.group(1), (match.group(2) or "").strip("/")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rank_files(directory: Path, rank: int) -> list[Path]:
    """The files one rank wrote: its DCP shards (FileSystemWriter names them ``__<rank>_<n>``), its
    trainer state, and for rank 0 the DCP ``.metadata``."""
    files = sorted(directory.glob(f"__{rank}_*.distcp"))
    files.append(directory / _trainer_state_name(rank))
    if rank == 0:
        files.append(directory / DCP_METADATA)
    return files


def _trainer_state_name(rank: int) -> str:
    return f"trainer_state_rank{rank}.pt"


def read_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) or (None, problem)."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return None, f"{path}: {MANIFEST} is missing (save never committed, or the copy is partial)"
    try:
        text = manifest_path.read_text()
    except OSError as exc:
        return None, f"{path}: {MANIFEST} is unreadable: {exc}"
    return parse_manifest(text, str(path))


def parse_manifest(text: str, where: str) -> tuple[dict[str, Any] | None, str | None]:
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        return None, f"{where}: {MANIFEST} is unreadable: {exc}"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT or not isinstance(
            manifest.get("files"), dict) or not isinstance(manifest.get("step"), int):
        return None, f"{where}: {MANIFEST} is not a {MANIFEST_FORMAT} manifest"
    for name, entry in manifest["files"].items():
        # plain names only: a manifest must not make us read or download outside its directory
        if not _PLAIN_NAME.fullmatch(name) or name in (".", "..") or not isinstance(entry, dict) or not (
                isinstance(entry.get("sha256"), str) and isinstance(entry.get("size"), int)):
            return None, f"{where}: {MANIFEST}: malformed entry for {name!r}"
    return manifest, None


def _structure_problems(path: Path, manifest: dict[str, Any]) -> list[str]:
    problems = []
    listed = manifest["files"]
    for name, entry in sorted(listed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{path}: {name}: missing")
        elif file.stat().st_size != entry["size"]:
            problems.append(f"{path}: {name}: size {file.stat().st_size} bytes, "
                            f"manifest says {entry['size']}")
    for file in sorted(path.iterdir()):
        if file.name != MANIFEST and file.name not in listed:
            problems.append(f"{path}: {file.name}: not in the manifest (unexpected file)")
    return problems


def _hash_problems(path: Path, manifest: dict[str, Any], names: list[str]) -> list[str]:
    problems = []
    for name in names:
        expected = manifest["files"][name]["sha256"]
        actual = _sha256(path / name)
        if actual != expected:
            problems.append(f"{path}: {name}: SHA256 mismatch "
                            f"(manifest {expected[:16]}..., file {actual[:16]}...)")
    return problems


def _reference_problems(path: Path, manifest: dict[str, Any]) -> list[str]:
    """Every byte range the DCP metadata points at lies in a file the manifest covers. Call only after
    ``.metadata`` verified: reading it unpickles it."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        return [f"{path}: {DCP_METADATA}: unreadable: {type(exc).__name__}: {exc}"]
    problems = []
    for info in {(info.relative_path, info.offset + info.length) for info in metadata.storage_data.values()}:
        name, end = info
        entry = manifest["files"].get(name)
        if entry is None:
            problems.append(f"{path}: {name}: referenced by {DCP_METADATA} but not in the manifest")
        elif end > entry["size"]:
            problems.append(f"{path}: {name}: {DCP_METADATA} reads up to byte {end}, "
                            f"file has {entry['size']}")
    return sorted(problems)


def _files_for_shard(manifest: dict[str, Any], shard: int, shard_count: int) -> list[str]:
    return sorted(manifest["files"])[shard::shard_count]


def verify_checkpoint(path: str | os.PathLike) -> list[str]:
    """Problems with one checkpoint directory, each naming the checkpoint and the file; [] = verified."""
    path = Path(path)
    if not path.is_dir():
        return [f"{path}: not a directory"]
    manifest, problem = read_manifest(path)
    if problem:
        return [problem]
    problems = _structure_problems(path, manifest)
    if problems:
        return problems
    problems = _hash_problems(path, manifest, sorted(manifest["files"]))
    if problems:
        return problems
    return _reference_problems(path, manifest)


def committed_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoint directories under ``root`` (verified or not), newest step first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _CHECKPOINT_NAME.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found, reverse=True)


def interrupted_saves(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(entry for entry in root.iterdir() if entry.name.endswith(TMP_SUFFIX) and entry.is_dir())


def _replace_dir(source: Path, target: Path) -> None:
    """Atomically publish ``source`` as ``target``; an existing ``target`` (same step from an earlier
    attempt) is moved aside first and deleted after, so a crash never leaves neither."""
    trash = None
    if target.exists():
        trash = target.with_name(f"{target.name}.replaced-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
        target.rename(trash)
    source.rename(target)
    _fsync_dir(target.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _created_unix(path: Path) -> float:
    manifest, _ = read_manifest(path)
    if manifest is not None and isinstance(manifest.get("created_unix"), int | float):
        return float(manifest["created_unix"])
    return path.stat().st_mtime


def apply_retention(root: Path, *, keep_last: int, max_age_days: float, newest_verified: Path,
                    log: Callable[[str], None], now: float | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints and those older than ``max_age_days``; the
    checkpoint ``newest_verified`` is never deleted. Returns what was deleted."""
    now = time.time() if now is None else now
    deleted = []
    for index, (step, path) in enumerate(committed_checkpoints(root)):
        if path == newest_verified:
            continue
        age_days = (now - _created_unix(path)) / 86400
        if index >= keep_last:
            reason = f"more than keep_last={keep_last} newer checkpoints"
        elif age_days > max_age_days:
            reason = f"{age_days:.1f} days old > max_age_days={max_age_days:g}"
        else:
            continue
        shutil.rmtree(path)
        deleted.append(path)
        log(f"checkpoint: deleted {path} (step {step}): {reason}")
    return deleted


# ---------------------------------------------------------------------------------------------------
# S3 copy (boto3 honours AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3, which is how tests reach moto)


class S3Location:
    def __init__(self, url: str):
        try:
            import boto3  # only runs that mirror to S3 need boto3 on the node
        except ImportError:
            raise CheckpointError(f"mirror_s3={url} needs boto3 on every node; fix: pip install boto3 into "
                                  "the trainer's environment, or drop mirror_s3") from None

        self.url = url.rstrip("/")
        self.bucket, self.prefix = parse_s3_url(url)
        self.client = boto3.client("s3")

    def key(self, *parts: str) -> str:
        return "/".join(part for part in (self.prefix, *parts) if part)

    def checkpoints(self) -> tuple[list[tuple[int, str]], list[str]]:
        """(committed step names newest first, names of partial uploads without a manifest)."""
        names: dict[str, bool] = {}
        base = self.key() + "/" if self.prefix else ""
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            for item in page.get("Contents", []):
                name, _, rest = item["Key"][len(base):].partition("/")
                if _CHECKPOINT_NAME.match(name):
                    names[name] = names.get(name, False) or rest == MANIFEST
        committed = sorted(((int(_CHECKPOINT_NAME.match(n).group(1)), n) for n, ok in names.items() if ok),
                           reverse=True)
        return committed, sorted(n for n, ok in names.items() if not ok)

    def upload(self, path: Path, manifest: dict[str, Any]) -> None:
        """Upload the files, then the manifest last (its presence marks the copy committed), then read
        every object back and check it against the manifest."""
        for name in sorted(manifest["files"]):
            self.client.upload_file(str(path / name), self.bucket, self.key(path.name, name))
        self.client.upload_file(str(path / MANIFEST), self.bucket, self.key(path.name, MANIFEST))
        problems = self.verify(path.name)
        if problems:
            # Without its manifest the broken copy is never taken for a checkpoint.
            self.client.delete_object(Bucket=self.bucket, Key=self.key(path.name, MANIFEST))
            raise CheckpointError("the uploaded copy does not verify: " + "; ".join(problems))

    def read_manifest(self, name: str) -> tuple[dict[str, Any] | None, str | None]:
        where = f"{self.url}/{name}"
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(name, MANIFEST))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None, f"{where}: {MANIFEST} is missing (upload never finished)"
        return parse_manifest(body.decode(errors="replace"), where)

    def verify(self, name: str) -> list[str]:
        """The S3 copy's problems, like verify_checkpoint: listing, sizes, then SHA256 of every object."""
        manifest, problem = self.read_manifest(name)
        if problem:
            return [problem]
        where, base = f"{self.url}/{name}", self.key(name) + "/"
        sizes = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            sizes.update({item["Key"][len(base):]: item["Size"] for item in page.get("Contents", [])})
        problems = [f"{where}: {file}: not in the manifest (unexpected object)"
                    for file in sorted(sizes) if file != MANIFEST and file not in manifest["files"]]
        for file, entry in sorted(manifest["files"].items()):
            if file not in sizes:
                problems.append(f"{where}: {file}: missing")
            elif sizes[file] != entry["size"]:
                problems.append(f"{where}: {file}: size {sizes[file]} bytes, manifest says {entry['size']}")
        if problems:
            return problems
        for file, entry in sorted(manifest["files"].items()):
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(name, file))["Body"]
            digest = hashlib.sha256()
            for chunk in iter(lambda body=body: body.read(_HASH_CHUNK), b""):
                digest.update(chunk)
            if digest.hexdigest() != entry["sha256"]:
                problems.append(f"{where}: {file}: SHA256 mismatch")
        return problems

    def prune(self, keep_last: int, log: Callable[[str], None]) -> None:
        """Delete all but the newest ``keep_last`` committed checkpoints; call right after a verified
        upload, so the newest is a verified one."""
        committed, _ = self.checkpoints()
        for step, name in committed[keep_last:]:
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.key(name) + "/"):
                keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                # the manifest goes first, so that an interrupted deletion leaves an ignored partial copy
                keys.sort(key=lambda item: not item["Key"].endswith("/" + MANIFEST))
                if keys:
                    self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
            log(f"checkpoint: deleted {self.url}/{name} (step {step}): more than keep_last={keep_last} "
                "newer checkpoints")

    def download_manifest(self, name: str, target: Path) -> dict[str, Any]:
        self.client.download_file(self.bucket, self.key(name, MANIFEST), str(target / MANIFEST))
        manifest, problem = read_manifest(target)
        if problem:
            raise CheckpointError(f"{self.url}/{name}: {problem}")
        return manifest

    def download_files(self, name: str, target: Path, files: list[str]) -> None:
        for file in files:
            self.client.download_file(self.bucket, self.key(name, file), str(target / file))


# ---------------------------------------------------------------------------------------------------
# collectives on the checkpoint's own gloo group


class _Group:
    """Object collectives on a dedicated gloo group: DCP's async save and our commit run in a background
    thread and must never share a group with FSDP's collectives (dcp.async_save deadlocks on the default
    group). Without an initialised process group everything degenerates to the single process."""

    def __init__(self) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.pg = dist.new_group(backend="gloo") if self.distributed else None

    def broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def gather(self, obj: Any, rank: int, world_size: int) -> list[Any] | None:
        if not self.distributed:
            return [obj]
        out = [None] * world_size if rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.pg)
        return out


@dataclass(frozen=True)
class _Candidate:
    step: int
    where: str  # "primary" | "mirror" | "s3"
    location: str  # local path, or the checkpoint's name in the S3 mirror


class CheckpointManager:
    """Save, mirror, prune and resume checkpoints. Every rank constructs one with the same config and
    calls every method (they are collective), except ``should_save`` which is local."""

    def __init__(self, cfg: CheckpointConfig, *, rank: int, world_size: int, log: Callable[[str], None]):
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.log = log
        self.enabled = cfg.dir is not None
        self.root = Path(cfg.dir) if cfg.dir else None
        self.mirror_root = Path(cfg.mirror_dir) if cfg.mirror_dir else None
        self._last_saved_step = 0
        self._collective_work: threading.Thread | None = None
        self._local_work: threading.Thread | None = None
        self._errors: list[str] = []
        self._s3: S3Location | None = None
        if not self.enabled:
            return
        self._group = _Group()
        self._on_rank0(self._prepare_dirs, "cannot prepare the checkpoint locations")
        self._check_shared_dir()

    def _on_rank0(self, work: Callable[[], None], what: str) -> None:
        """Run ``work`` on rank 0 and raise its failure on every rank, so that none waits for rank 0 in a
        collective that never comes."""
        error = None
        if self.rank == 0:
            try:
                work()
            except Exception as exc:
                error = f"{what}: {type(exc).__name__}: {exc}"
        error = self._group.broadcast(error)
        if error:
            raise CheckpointError(error)

    def _prepare_dirs(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.mirror_root is not None:
            self.mirror_root.mkdir(parents=True, exist_ok=True)
        if self.cfg.mirror_s3:
            self._s3 = S3Location(self.cfg.mirror_s3)

    # --- setup --------------------------------------------------------------------------------------

    def _check_shared_dir(self) -> None:
        """All ranks write one checkpoint directory, so it must be one file system for every node: rank
        0 drops a probe file there and every rank must see it."""
        if not self._group.distributed:
            return
        probe = self.root / f".probe-{uuid.uuid4().hex}" if self.rank == 0 else None
        if probe is not None:
            probe.write_text("probe\n")
        probe = self._group.broadcast(None if probe is None else str(probe))
        seen = self._group.gather(Path(probe).exists(), self.rank, self.world_size)
        blind = [] if seen is None else [rank for rank, ok in enumerate(seen) if not ok]
        if self.rank == 0:
            Path(probe).unlink()
        blind = self._group.broadcast(blind)
        if blind:
            raise CheckpointError(
                f"checkpoint dir {self.root} is not shared: ranks {blind} cannot see files rank 0 writes "
                "there; fix: put --checkpoint-dir on the cluster's shared file system (e.g. /shared/...)")

    # --- saving -------------------------------------------------------------------------------------

    def should_save(self, step: int, *, final: bool) -> bool:
        if not self.enabled or step <= self._last_saved_step:
            return False
        return final or step % self.cfg.interval == 0

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict[str, Any]) -> None:
        if not self.enabled:
            return
        waited = time.monotonic()
        self.wait()
        waited = time.monotonic() - waited
        if waited > 1.0 and self.rank == 0:
            self.log(f"checkpoint: waited {waited:.1f}s for the previous checkpoint to finish")
        started = time.monotonic()
        final = self.root / checkpoint_name(step)
        tmp = final.with_name(final.name + TMP_SUFFIX)

        def prepare() -> None:
            for stale in interrupted_saves(self.root):
                self.log(f"checkpoint: removing {stale} (left behind by an interrupted save; never loaded)")
                shutil.rmtree(stale)
            tmp.mkdir()

        self._on_rank0(prepare, f"cannot start checkpoint step {step} in {tmp}")

        torch.save(self._trainer_state(extra), tmp / _trainer_state_name(self.rank))
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        self._last_saved_step = step
        if self.cfg.async_save:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group.pg,
                                    no_dist=not self._group.distributed)
            blocking = time.monotonic() - started
            self._collective_work = self._start(self._finish_save, step, tmp, final, started, blocking,
                                                future)
        else:
            dcp.save(state, checkpoint_id=str(tmp), process_group=self._group.pg,
                     no_dist=not self._group.distributed)
            blocking = time.monotonic() - started
            committed = self._commit(step, tmp, final, started, blocking)
            if committed is not None:
                self._local_work = self._start(self._after_commit, committed)

    def _trainer_state(self, extra: dict[str, Any]) -> dict[str, Any]:
        return {
            "extra": {name: obj.state_dict() for name, obj in extra.items()},
            # this rank's device only: get_rng_state_all() would open a context on every visible GPU
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
            "world_size": self.world_size,
        }

    def _start(self, target: Callable[..., None], *args: Any) -> threading.Thread:
        def run() -> None:
            try:
                target(*args)
            except Exception as exc:  # surfaced by wait() on the caller's thread
                self._errors.append(f"{type(exc).__name__}: {exc}")

        # Not a daemon: a process that exits without wait() still finishes committing its checkpoint.
        thread = threading.Thread(target=run, name=f"checkpoint-{target.__name__}")
        thread.start()
        return thread

    def _finish_save(self, step: int, tmp: Path, final: Path, started: float, blocking: float,
                     future: Any) -> None:
        try:
            future.result()
            failure = None
        except Exception as exc:
            failure = f"rank {self.rank}: writing its shards failed: {type(exc).__name__}: {exc}"
        committed = self._commit(step, tmp, final, started, blocking, failure)
        if committed is not None:
            self._after_commit(committed)

    def _commit(self, step: int, tmp: Path, final: Path, started: float, blocking: float,
                failure: str | None = None) -> Path | None:
        """Collective: every rank hashes its own files, rank 0 writes the manifest and renames. A rank
        that failed still takes part, so that no rank waits forever for it, and nothing is committed."""
        own: dict[str, Any] = {}
        if failure is None:
            try:
                own = {file.name: {"sha256": _sha256(file), "size": file.stat().st_size}
                       for file in _rank_files(tmp, self.rank)}
            except OSError as exc:
                failure = f"rank {self.rank}: hashing its files failed: {exc}"
        gathered = self._group.gather((own, failure), self.rank, self.world_size)
        error = None
        if self.rank == 0:
            failures = [failed for _, failed in gathered if failed]
            try:
                if failures:
                    raise CheckpointError("; ".join(failures))
                self._write_manifest_and_rename(step, tmp, final, [files for files, _ in gathered])
            except Exception as exc:
                error = (f"checkpoint step {step} in {tmp} was not committed (the next save removes it): "
                         f"{type(exc).__name__}: {exc}")
        error = self._group.broadcast(error)
        if error:
            raise CheckpointError(error)
        if self.rank != 0:
            return None
        size = sum(entry["size"] for files, _ in gathered for entry in files.values())
        self.log(f"checkpoint: saved {final} (step {step}, {size / 1e6:.1f} MB, world size "
                 f"{self.world_size}) in {time.monotonic() - started:.2f}s, training blocked {blocking:.2f}s")
        return final

    def _write_manifest_and_rename(self, step: int, tmp: Path, final: Path,
                                   gathered: list[dict[str, Any]]) -> None:
        files: dict[str, Any] = {}
        for per_rank in gathered:
            files.update(per_rank)
        manifest = {"format": MANIFEST_FORMAT, "step": step, "world_size": self.world_size,
                    "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
                    "created_unix": time.time(),
                    "torch_version": torch.__version__, "files": dict(sorted(files.items()))}
        problems = _structure_problems(tmp, manifest) + _reference_problems(tmp, manifest)
        if problems:
            raise CheckpointError("; ".join(problems))
        manifest_tmp = tmp / f"{MANIFEST}{TMP_SUFFIX}"
        with manifest_tmp.open("w") as handle:
            json.dump(manifest, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        manifest_tmp.rename(tmp / MANIFEST)
        _fsync_dir(tmp)
        _replace_dir(tmp, final)

    def _after_commit(self, committed: Path) -> None:
        """Rank 0, off the training thread: prune, then make and verify the second copies."""
        apply_retention(self.root, keep_last=self.cfg.keep_last, max_age_days=self.cfg.max_age_days,
                        newest_verified=committed, log=self.log)
        manifest, _ = read_manifest(committed)
        if self.mirror_root is not None:
            self._mirror_to_dir(committed)
        if self._s3 is not None:
            started = time.monotonic()
            try:
                self._s3.upload(committed, manifest)
                self.log(f"checkpoint: mirrored {committed.name} to {self._s3.url}/{committed.name}, "
                         f"verified ({time.monotonic() - started:.1f}s)")
                self._s3.prune(self.cfg.keep_last, self.log)
            except Exception as exc:
                self.log(f"checkpoint: ERROR mirroring {committed.name} to {self._s3.url} failed, only the "
                         f"primary copy exists: {type(exc).__name__}: {exc}")

    def _mirror_to_dir(self, committed: Path) -> None:
        started = time.monotonic()
        target = self.mirror_root / committed.name
        tmp = target.with_name(target.name + TMP_SUFFIX)
        try:
            for stale in interrupted_saves(self.mirror_root):
                shutil.rmtree(stale)
            shutil.copytree(committed, tmp)
            problems = verify_checkpoint(tmp)
            if problems:
                shutil.rmtree(tmp)
                raise CheckpointError("the copy does not verify: " + "; ".join(problems))
            _replace_dir(tmp, target)
        except Exception as exc:
            self.log(f"checkpoint: ERROR mirroring {committed} to {self.mirror_root} failed, only the "
                     f"primary copy exists: {type(exc).__name__}: {exc}")
            return
        self.log(f"checkpoint: mirrored {committed.name} to {target}, verified "
                 f"({time.monotonic() - started:.1f}s)")
        apply_retention(self.mirror_root, keep_last=self.cfg.keep_last, max_age_days=self.cfg.max_age_days,
                        newest_verified=target, log=self.log)

    def wait(self) -> None:
        """Finish in-flight saves, mirrors and pruning; raise if a save failed."""
        for attr in ("_collective_work", "_local_work"):
            thread = getattr(self, attr)
            if thread is not None:
                thread.join()
                setattr(self, attr, None)
        if self._errors:
            errors, self._errors = self._errors, []
            raise CheckpointError("; ".join(errors))

    # --- resuming -----------------------------------------------------------------------------------

    def maybe_resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     extra: dict[str, Any]) -> int:
        """Load the checkpoint chosen by ``cfg.resume`` in place; returns its step (0: start fresh)."""
        if not self.enabled or self.cfg.resume == "none":
            if self.enabled:
                self._refuse_mixing_runs()
            return 0
        if self.cfg.resume == "auto":
            candidates = self._group.broadcast(self._candidates() if self.rank == 0 else None)
        else:
            candidates = [_Candidate(step=-1, where="explicit", location=self.cfg.resume)]
        for candidate in candidates:
            path = self._fetch(candidate)
            problems = self._verify_together(path)
            if not problems:
                return self._load(path, model, optimizer, extra)
            if self.rank == 0:
                self.log(f"checkpoint: NOT loading {candidate.location} ({candidate.where} copy), it failed "
                         f"verification: " + "; ".join(problems))
            if candidate.where == "explicit":
                raise CheckpointError(f"--resume {self.cfg.resume}: checkpoint failed verification: "
                                      + "; ".join(problems) + "; fix: pick another checkpoint "
                                      f"(python -m trainer.checkpoint list {Path(self.cfg.resume).parent}) "
                                      "or --resume auto")
        if candidates:
            # Silently starting over would throw away the run and, by step order, let retention prune the
            # new checkpoints in favour of the damaged ones.
            raise CheckpointError(
                f"none of the {len(candidates)} checkpoint(s) in {self._copies()} verified (problems above); "
                "fix: restore a good copy, or move them away and start again with --resume none")
        if self.rank == 0:
            self.log(f"checkpoint: no checkpoint in {self._copies()}; starting from step 0")
        return 0

    def _copies(self) -> str:
        return ", ".join(str(c) for c in (self.root, self.mirror_root, self.cfg.mirror_s3) if c)

    def _refuse_mixing_runs(self) -> None:
        existing = committed_checkpoints(self.root)
        if existing:
            raise CheckpointError(
                f"--resume none but {self.root} already holds checkpoints of another run "
                f"(newest step {existing[0][0]}); a later --resume auto could load theirs. Fix: use an empty "
                "--checkpoint-dir, or --resume auto to continue that run")

    def _candidates(self) -> list[_Candidate]:
        """Rank 0: every committed checkpoint in every copy, newest step first, primary copy first."""
        found: list[_Candidate] = []
        for where, root in (("primary", self.root), ("mirror", self.mirror_root)):
            if root is None:
                continue
            for stale in interrupted_saves(root):
                self.log(f"checkpoint: ignoring {stale}: an interrupted save (no commit), never loaded")
            found += [_Candidate(step, where, str(path)) for step, path in committed_checkpoints(root)]
        if self._s3 is not None:
            try:
                committed, partial = self._s3.checkpoints()
            except Exception as exc:
                self.log(f"checkpoint: cannot list {self._s3.url}, resuming without it: {exc}")
                committed, partial = [], []
            for name in partial:
                self.log(f"checkpoint: ignoring {self._s3.url}/{name}: partial upload without {MANIFEST}")
            found += [_Candidate(step, "s3", name) for step, name in committed]
        order = {"primary": 0, "mirror": 1, "s3": 2}
        return sorted(found, key=lambda c: (-c.step, order[c.where]))

    def _fetch(self, candidate: _Candidate) -> str:
        """A local path all ranks can read. An S3 copy is downloaded into the primary dir as a ``.tmp``
        directory (removed by the next save): rank 0 fetches the manifest, then every rank a slice of
        the files, so a large checkpoint comes down in parallel."""
        if candidate.where != "s3":
            return candidate.location
        target = self.root / f"{candidate.location}.from-s3{TMP_SUFFIX}"
        error = None
        if self.rank == 0:
            shutil.rmtree(target, ignore_errors=True)
            self.log(f"checkpoint: downloading {self.cfg.mirror_s3}/{candidate.location} to {target}")
            try:
                target.mkdir(parents=True)
                self._s3.download_manifest(candidate.location, target)
            except Exception as exc:
                error = f"download failed: {type(exc).__name__}: {exc}"
        error = self._group.broadcast(error)
        if error is None:
            manifest, _ = read_manifest(target)
            try:
                if self._s3 is None:
                    self._s3 = S3Location(self.cfg.mirror_s3)
                self._s3.download_files(candidate.location, target,
                                        _files_for_shard(manifest, self.rank, self.world_size))
            except Exception as exc:
                error = f"rank {self.rank}: download failed: {type(exc).__name__}: {exc}"
            errors = self._group.gather(error, self.rank, self.world_size)
            merged = "; ".join(e for e in errors if e) if self.rank == 0 else None
            error = self._group.broadcast(merged or None)
        return f"{target} ({error})" if error else str(target)

    def _verify_together(self, path_text: str) -> list[str]:
        """Every rank hashes a slice of the files; rank 0 merges and all ranks get its verdict."""
        path = Path(path_text)
        manifest, problem = read_manifest(path) if path.is_dir() else (None, f"{path_text}: not a directory")
        problems = [problem] if problem else _structure_problems(path, manifest)
        if not problems:
            problems = _hash_problems(path, manifest, _files_for_shard(manifest, self.rank, self.world_size))
        gathered = self._group.gather(problems, self.rank, self.world_size)
        if self.rank == 0:
            merged = sorted({p for per_rank in gathered for p in per_rank})
            if not merged:
                merged = _reference_problems(path, manifest)
            problems = merged
        return self._group.broadcast(problems if self.rank == 0 else None)

    def _load(self, path_text: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              extra: dict[str, Any]) -> int:
        started = time.monotonic()
        path = Path(path_text)
        manifest, _ = read_manifest(path)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path), process_group=self._group.pg,
                 no_dist=not self._group.distributed)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        saved_world = manifest["world_size"]
        same_world = saved_world == self.world_size
        # Verified above; trainer state holds arbitrary state_dict() objects, hence a full unpickle.
        trainer_state = torch.load(path / _trainer_state_name(self.rank if same_world else 0),
                                   weights_only=False)
        for name, obj in extra.items():
            if name in trainer_state["extra"]:
                obj.load_state_dict(trainer_state["extra"][name])
            elif self.rank == 0:
                self.log(f"checkpoint: {path.name} has no state for {name!r}; it starts fresh")
        if same_world:
            torch.set_rng_state(trainer_state["rng"]["torch"])
            if trainer_state["rng"]["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(trainer_state["rng"]["cuda"])
        elif self.rank == 0:
            self.log(f"checkpoint: resharding {saved_world} -> {self.world_size} ranks; per-rank trainer "
                     "state (data loader, RNG) taken from rank 0's copy")
        step = manifest["step"]
        self._last_saved_step = step
        if self.rank == 0:
            self.log(f"checkpoint: resumed from {path} (step {step}) in {time.monotonic() - started:.2f}s")
        return step


# ---------------------------------------------------------------------------------------------------
# CLI: python -m trainer.checkpoint verify DIR | list DIR


def _checkpoint_dirs(path: Path) -> Iterator[Path]:
    """``path`` itself if it is one checkpoint, else every checkpoint under it, newest first."""
    if (path / MANIFEST).is_file() or _CHECKPOINT_NAME.match(path.name):
        yield path
    else:
        yield from (p for _, p in committed_checkpoints(path))


def _row(path: str, manifest: dict[str, Any] | None, problems: list[str], *,
         committed: bool = True) -> dict[str, Any]:
    return {"path": path, "step": manifest["step"] if manifest else None,
            "world_size": manifest.get("world_size") if manifest else None,
            "created_at": manifest.get("created_at") if manifest else None,
            "bytes": sum(e["size"] for e in manifest["files"].values()) if manifest else None,
            "verified": not problems, "problems": problems, "committed": committed}


def _local_rows(path: Path) -> list[dict[str, Any]]:
    rows = [_row(str(c), read_manifest(c)[0], verify_checkpoint(c)) for c in _checkpoint_dirs(path)]
    for stale in interrupted_saves(path):
        rows.append(_row(str(stale), None, [f"{stale}: interrupted save (never committed)"], committed=False))
    return rows


def _s3_rows(url: str) -> list[dict[str, Any]]:
    bucket, prefix = parse_s3_url(url)
    parent, _, last = prefix.rpartition("/")
    if _CHECKPOINT_NAME.match(last):
        s3, names, partial = S3Location(f"s3://{bucket}/{parent}"), [last], []
    else:
        s3 = S3Location(url)
        committed, partial = s3.checkpoints()
        names = [name for _, name in committed]
    rows = [_row(f"{s3.url}/{name}", s3.read_manifest(name)[0], s3.verify(name)) for name in names]
    for name in partial:
        rows.append(_row(f"{s3.url}/{name}", None, [f"{s3.url}/{name}: partial upload without {MANIFEST}"],
                         committed=False))
    return rows


def _cmd_verify(rows: list[dict[str, Any]], location: str) -> int:
    committed = [row for row in rows if row["committed"]]
    if not committed:
        print(f"no checkpoints in {location}", file=sys.stderr)
        return 1
    for row in committed:
        print(f"{'verified' if row['verified'] else 'FAILED'} {row['path']}")
        for problem in row["problems"]:
            print(f"  {problem}")
    return 0 if all(row["verified"] for row in committed) else 1


def _cmd_list(rows: list[dict[str, Any]], location: str, as_json: bool) -> int:
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no checkpoints in {location}")
        return 0
    print(f"{'step':>8}  {'ranks':>5}  {'MB':>9}  {'created (UTC)':<25}  status  path")
    for row in rows:
        size = f"{row['bytes'] / 1e6:9.1f}" if row["bytes"] is not None else f"{'-':>9}"
        print(f"{row['step'] if row['step'] is not None else '-':>8}  {row['world_size'] or '-':>5}  {size}  "
              f"{row['created_at'] or '-':<25}  {'ok' if row['verified'] else 'BAD':<6}  {row['path']}")
        for problem in row["problems"]:
            print(f"{'':>10}{problem}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.checkpoint",
                                     description="Inspect and verify training checkpoints, on disk or in S3.")
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser("verify", help="check every file of a checkpoint (or of all under a dir or S3 "
                                           "prefix) against its manifest; exit 1 on any problem")
    verify.add_argument("location", help="checkpoint dir, dir of checkpoints, or s3://bucket/prefix[/step_N]")
    listing = sub.add_parser("list", help="list the checkpoints under a dir or S3 prefix, verified")
    listing.add_argument("location", help="dir of checkpoints or s3://bucket/prefix")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.location.startswith("s3://"):
        try:
            rows = _s3_rows(args.location)
        except Exception as exc:  # credentials, bucket, network: say which, not a traceback
            print(f"{args.location}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
    elif not Path(args.location).is_dir():
        print(f"{args.location}: no such directory", file=sys.stderr)
        return 2
    else:
        rows = _local_rows(Path(args.location))
    if args.command == "verify":
        return _cmd_verify(rows, args.location)
    return _cmd_list(rows, args.location, args.json)


if __name__ == "__main__":
    sys.exit(main())
