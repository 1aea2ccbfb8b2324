"""A checkpoint on disk: its name, its manifest (SHA256 and size of every file), verification,
which checkpoints are committed, and retention."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "fsdp-cluster-checkpoint/1"
# A Hugging Face export (trainer/hf/weights.py): the same file list, no step, no DCP metadata.
EXPORT_FORMAT = "fsdp-cluster-hf-export/1"
DCP_METADATA = ".metadata"
TMP_SUFFIX = ".tmp"
CHECKPOINT_NAME = re.compile(r"^step_(\d{8,})$")
PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
HASH_CHUNK = 8 << 20


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def sha256_file(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rank_files(directory: Path, rank: int) -> list[Path]:
    """The files one rank wrote: its DCP shards (FileSystemWriter names them ``__<rank>_<n>``), its
    trainer state, and for rank 0 the DCP ``.metadata``."""
    files = sorted(directory.glob(f"__{rank}_*.distcp"))
    files.append(directory / trainer_state_name(rank))
    if rank == 0:
        files.append(directory / DCP_METADATA)
    return files


def trainer_state_name(rank: int) -> str:
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
    known = isinstance(manifest, dict) and manifest.get("format") in (MANIFEST_FORMAT, EXPORT_FORMAT)
    if not known or not isinstance(manifest.get("files"), dict) or not (
            manifest["format"] == EXPORT_FORMAT or isinstance(manifest.get("step"), int)):
        return None, f"{where}: {MANIFEST} is not a {MANIFEST_FORMAT} or {EXPORT_FORMAT} manifest"
    for name, entry in manifest["files"].items():
        # plain names only: a manifest must not make us read or download outside its directory
        if not PLAIN_NAME.fullmatch(name) or name in (".", "..") or not isinstance(entry, dict) or not (
                isinstance(entry.get("sha256"), str) and isinstance(entry.get("size"), int)):
            return None, f"{where}: {MANIFEST}: malformed entry for {name!r}"
    return manifest, None


def structure_problems(path: Path, manifest: dict[str, Any]) -> list[str]:
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


def hash_problems(path: Path, manifest: dict[str, Any], names: list[str]) -> list[str]:
    problems = []
    for name in names:
        expected = manifest["files"][name]["sha256"]
        actual = sha256_file(path / name)
        if actual != expected:
            problems.append(f"{path}: {name}: SHA256 mismatch "
                            f"(manifest {expected[:16]}..., file {actual[:16]}...)")
    return problems


def reference_problems(path: Path, manifest: dict[str, Any]) -> list[str]:
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


def files_for_shard(manifest: dict[str, Any], shard: int, shard_count: int) -> list[str]:
    return sorted(manifest["files"])[shard::shard_count]


def verify_checkpoint(path: str | os.PathLike) -> list[str]:
    """Problems with one checkpoint directory, each naming the checkpoint and the file; [] = verified."""
    path = Path(path)
    if not path.is_dir():
        return [f"{path}: not a directory"]
    manifest, problem = read_manifest(path)
    if problem:
        return [problem]
    problems = structure_problems(path, manifest)
    if problems:
        return problems
    problems = hash_problems(path, manifest, sorted(manifest["files"]))
    if problems or manifest["format"] == EXPORT_FORMAT:
        return problems
    return reference_problems(path, manifest)


def committed_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoint directories under ``root`` (verified or not), newest step first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = CHECKPOINT_NAME.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found, reverse=True)


def interrupted_saves(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(entry for entry in root.iterdir() if entry.name.endswith(TMP_SUFFIX) and entry.is_dir())


def replace_dir(source: Path, target: Path) -> None:
    """Atomically publish ``source`` as ``target``; an existing ``target`` (same step from an earlier
    attempt) is moved aside first and deleted after, so a crash never leaves neither."""
    trash = None
    if target.exists():
        trash = target.with_name(f"{target.name}.replaced-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
        target.rename(trash)
    source.rename(target)
    fsync_dir(target.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def created_unix(path: Path) -> float:
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
        age_days = (now - created_unix(path)) / 86400
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

