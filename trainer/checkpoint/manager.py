"""`CheckpointManager`: save (async, on its own gloo group), commit, mirror, prune and resume."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer.checkpoint.config import CheckpointConfig, CheckpointError
from trainer.checkpoint.manifest import (
    MANIFEST,
    MANIFEST_FORMAT,
    TMP_SUFFIX,
    apply_retention,
    checkpoint_name,
    committed_checkpoints,
    files_for_shard,
    fsync_dir,
    hash_problems,
    interrupted_saves,
    rank_files,
    read_manifest,
    reference_problems,
    replace_dir,
    sha256_file,
    structure_problems,
    trainer_state_name,
    verify_checkpoint,
)
from trainer.checkpoint.mirror import S3Location
from trainer.side_groups import side_group


class _Group:
    """Object collectives on a dedicated gloo group: DCP's async save and our commit run in a background
    thread and must never share a group with FSDP's collectives (dcp.async_save deadlocks on the default
    group). Without an initialised process group everything degenerates to the single process."""

    def __init__(self) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.pg = side_group() if self.distributed else None

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

    def __init__(self, cfg: CheckpointConfig, *, rank: int, world_size: int, log: Callable[[str], None],
                 run_config: dict[str, Any] | None = None):
        """`run_config`: the trainer config, kept in each manifest so that `python -m trainer export`
        can rebuild the model from the checkpoint alone."""
        self.cfg = cfg
        self.run_config = run_config
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
        self._staging: Any = None  # future of the in-flight save's copy
        self.staging = "none"
        self.last_blocking_s: float | None = None
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

    def _make_stager(self) -> Any:
        """Staging for async saves: on CUDA, a copy of the state into pinned host memory on a side
        stream in a background thread (torchtitan's and DCP's zero-overhead checkpointing), so
        training blocks only for launching it and resumes before the copy ends; the next optimizer
        step waits for it (`wait_for_staging`). Without an accelerator pinned memory and side streams
        do not exist: the state is copied synchronously into ordinary host memory (DCP's default)."""
        if not torch.cuda.is_available():
            self.staging = "synchronous copy to host memory (no accelerator: no pinned memory)"
            return None
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.staging = "background copy to pinned host memory"
        return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                            use_async_staging=True, use_non_blocking_copy=True))

    def wait_for_staging(self) -> None:
        """Before parameters change (the optimizer step): the in-flight save's copy must be complete."""
        if self._staging is not None:
            self._staging.result()
            self._staging = None

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict[str, Any], *, blocking: bool = False) -> None:
        """Save `step`. Async (cfg.async_save) unless `blocking`: then the save is committed when this
        returns (a stop on a signal must not exit before its checkpoint exists)."""
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
            if not self.root.is_dir():  # deleted under a running job: saving again beats stopping it
                self.log(f"checkpoint: WARNING {self.root} is gone (deleted while training?); recreating it, "
                         "the checkpoints it held are lost")
                self.root.mkdir(parents=True)
            for stale in interrupted_saves(self.root):
                self.log(f"checkpoint: removing {stale} (left behind by an interrupted save; never loaded)")
                shutil.rmtree(stale)
            tmp.mkdir()

        self._on_rank0(prepare, f"cannot start checkpoint step {step} in {tmp}")

        torch.save(self._trainer_state(extra), tmp / trainer_state_name(self.rank))
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        self._last_saved_step = step
        if self.cfg.async_save and not blocking:
            # A stager per save, closed once its save is written: torch 2.11's DefaultStager closes its
            # copier after staging, so a second save through the same one fails with
            # `KeyError: <class 'type'>` (pytorch/pytorch#183413; seen on the H200 check).
            stager = self._make_stager()
            response = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group.pg,
                                      no_dist=not self._group.distributed, async_stager=stager)
            if hasattr(response, "upload_completion"):  # staged in the background
                self._staging, future = response.staging_completion, response.upload_completion
            else:
                future = response
            blocking = time.monotonic() - started
            self.last_blocking_s = blocking
            self._collective_work = self._start(self._finish_save, step, tmp, final, started, blocking,
                                                future, stager)
        else:
            try:
                dcp.save(state, checkpoint_id=str(tmp), process_group=self._group.pg,
                         no_dist=not self._group.distributed)
                failure = None
            except (Exception, CheckpointException) as exc:  # every rank gets here: DCP gathers errors
                failure = f"writing its shards failed: {_first_line(exc)}"
            blocking = time.monotonic() - started
            self.last_blocking_s = blocking
            committed = self._commit(step, tmp, final, started, blocking, failure)
            if committed is not None:
                self._local_work = self._start(self._after_commit, committed)

    def _space_hint(self) -> str:
        """What a failed write most often means on a shared file system: it is full."""
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return ""
        newest = next((p for p in sorted(self.root.glob("step_*"), reverse=True)
                       if not p.name.endswith(TMP_SUFFIX)), None)
        needed = sum(f.stat().st_size for f in newest.iterdir()) if newest else 0
        if free >= max(needed, 1 << 20):
            return ""
        return (f" ({self.root} has {free / 1e6:.1f} MB free" + (f", a checkpoint needs about "
                f"{needed / 1e6:.1f} MB" if needed else "") + "; free space there, lower "
                "checkpoint.keep_last, or point checkpoint.dir at a larger file system)")

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
            # DCP's CheckpointException is a BaseException: caught here too, or a failed async save
            # would end its thread silently and training would go on as if it had been saved
            except (Exception, CheckpointException) as exc:  # surfaced by wait() on the caller's thread
                self._errors.append(f"{type(exc).__name__}: {exc}")

        # Not a daemon: a process that exits without wait() still finishes committing its checkpoint.
        thread = threading.Thread(target=run, name=f"checkpoint-{target.__name__}")
        thread.start()
        return thread

    def _finish_save(self, step: int, tmp: Path, final: Path, started: float, blocking: float,
                     future: Any, stager: Any) -> None:
        try:
            future.result()
            failure = None
        except (Exception, CheckpointException) as exc:
            failure = f"writing its shards failed: {_first_line(exc)}"
        finally:
            if stager is not None:
                stager.close()  # its pinned buffers and staging thread
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
                own = {file.name: {"sha256": sha256_file(file), "size": file.stat().st_size}
                       for file in rank_files(tmp, self.rank)}
            except OSError as exc:
                failure = f"hashing its files failed: {exc}"
        gathered = self._group.gather((own, failure), self.rank, self.world_size)
        error = None
        if self.rank == 0:
            by_failure: dict[str, list[str]] = {}
            for rank, (_, failed) in enumerate(gathered):
                if failed:
                    by_failure.setdefault(failed, []).append(str(rank))
            try:
                if by_failure:
                    raise CheckpointError("; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(r)}: {f}"
                                                    for f, r in by_failure.items()) + self._space_hint())
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
                    "torch_version": torch.__version__, "trainer_config": self.run_config,
                    "files": dict(sorted(files.items()))}
        problems = structure_problems(tmp, manifest) + reference_problems(tmp, manifest)
        if problems:
            raise CheckpointError("; ".join(problems))
        manifest_tmp = tmp / f"{MANIFEST}{TMP_SUFFIX}"
        with manifest_tmp.open("w") as handle:
            json.dump(manifest, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        manifest_tmp.rename(tmp / MANIFEST)
        fsync_dir(tmp)
        replace_dir(tmp, final)

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
            replace_dir(tmp, target)
        except Exception as exc:
            self.log(f"checkpoint: ERROR mirroring {committed} to {self.mirror_root} failed, only the "
                     f"primary copy exists: {type(exc).__name__}: {exc}")
            return
        self.log(f"checkpoint: mirrored {committed.name} to {target}, verified "
                 f"({time.monotonic() - started:.1f}s)")
        apply_retention(self.mirror_root, keep_last=self.cfg.keep_last, max_age_days=self.cfg.max_age_days,
                        newest_verified=target, log=self.log)

    def verify_saved(self, step: int) -> list[str]:
        """Collective: every rank re-hashes a slice of the committed checkpoint of `step`; the merged
        problems (empty: it verifies)."""
        return self._verify_together(str(self.root / checkpoint_name(step)))

    def wait(self) -> None:
        """Finish in-flight saves, mirrors and pruning; raise if a save failed."""
        self.wait_for_staging()
        for attr in ("_collective_work", "_local_work"):
            thread = getattr(self, attr)
            if thread is not None:
                thread.join()
                setattr(self, attr, None)
        if self._errors:
            errors, self._errors = self._errors, []
            raise CheckpointError("; ".join(errors))

    # --- resuming -----------------------------------------------------------------------------------

    def will_resume(self) -> bool:
        """Collective: whether maybe_resume will load a checkpoint (or refuse for want of a valid one)
        rather than start fresh, so that the caller can skip filling weights the checkpoint replaces."""
        if not self.enabled or self.cfg.resume == "none":
            return False
        if self.cfg.resume != "auto":
            return True
        return bool(self._group.broadcast(bool(self._candidates()) if self.rank == 0 else None))

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
                                        files_for_shard(manifest, self.rank, self.world_size))
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
        problems = [problem] if problem else structure_problems(path, manifest)
        if not problems:
            problems = hash_problems(path, manifest, files_for_shard(manifest, self.rank, self.world_size))
        gathered = self._group.gather(problems, self.rank, self.world_size)
        if self.rank == 0:
            merged = sorted({p for per_rank in gathered for p in per_rank})
            if not merged:
                merged = reference_problems(path, manifest)
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
        trainer_state = torch.load(path / trainer_state_name(self.rank if same_world else 0),
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


def _first_line(exc: BaseException) -> str:
    """An exception as one line: DCP's CheckpointException carries every rank's whole traceback."""
    text = str(exc).strip()
    if isinstance(exc, CheckpointException):
        # its text is "CheckpointException ranks:... Traceback ... (RANK n) ... LastError: message"
        last = [line for line in text.splitlines() if line and not line.startswith((" ", "Traceback"))]
        text = last[-1] if last else text
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
