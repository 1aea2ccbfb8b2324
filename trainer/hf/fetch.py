"""Inputs that may live in S3: model.hf_dir (a Hugging Face model directory), data.path and eval.path (a
.jsonl or .parquet file, or a directory of them). An s3:// location is downloaded once per node into a
cache and the local copy used instead.

This runs before any process group exists, so the ranks of a node agree through an exclusive flock in
the cache directory: the first one downloads, the others wait and then find the copy complete. A
download survives a kill and a requeue: each file is written as NAME.part, resumed with a ranged GET of
the same object version (If-Match on its ETag) and renamed once its size is right. The journal
.download.json names the object version (size, ETag) that each NAME or NAME.part in the directory
holds, so that a later call keeps what is current and never joins bytes of two versions;
.complete.json, written when a download is done, takes its place. Several fetches may share a cache
directory (data.path and eval.path naming two objects of one prefix, a model and its data under one
prefix): the records are the directory's, and each fetch changes only the names it selects. boto3
honours AWS_ENDPOINT_URL, which is how tests reach moto.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

Log = Callable[[str], None]

MODEL_KEY = "model.hf_dir"
# What training reads of a Hugging Face model directory (weights, config, tokenizer, chat template),
# directly under the prefix. Left out: pickled *.bin / *.pth weights and subfolders such as original/
# (Meta's consolidated checkpoint), each as large as the model; and dot files, which would clash with
# this module's own records.
MODEL_FILE = re.compile(r"[^./][^/]*\.(?:safetensors|json|jinja|txt)|tokenizer\.model")
LOCK, JOURNAL, COMPLETE = ".lock", ".download.json", ".complete.json"
CHUNK = 8 << 20
# One GET stream reaches roughly 100 MB/s; several files at once fill a node's network link.
WORKERS = 8
RETRIES = 5
RETRY_WAIT_S = 1.0
PROGRESS_EVERY_S = 2.0
DEFAULT_CACHE = "~/.cache/fsdp-cluster/models"


def print_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class FetchError(ValueError):
    """A model or data location cannot be used; the message names the setting, the URL or file, what is
    wrong and the fix."""


@dataclass(frozen=True)
class _Object:
    name: str  # the key below the prefix, which is also the file's name in the cache directory
    key: str
    size: int
    etag: str

    def version(self) -> dict[str, Any]:
        return {"size": self.size, "etag": self.etag}


@dataclass(frozen=True)
class _Fetch:
    """What one call takes from S3: some of the objects directly under `prefix`, which
    <cache>/<bucket>/<prefix> mirrors."""

    key: str  # the setting that errors name; its section ("model", "data", "eval") starts the log lines
    url: str
    bucket: str
    prefix: str
    listed: str  # the listing's Prefix: "<prefix>/" for the whole prefix, or the key of the one object
    wanted: Callable[[str], bool]  # of a name below the prefix: whether to fetch it
    # what the listing (wanted, other objects) lacks, with the fix; None when it has what is needed
    missing: Callable[[list[_Object], list[_Object]], str | None]
    skipping: str | None  # why the other objects are left out, for the log; None: no line about them

    def error(self, problem: str) -> FetchError:
        return FetchError(f"{self.key}={self.url}: {problem}")


def resolve_model_dir(location: str, cache_dir: str | Path | None = None, *,
                      log: Log = print_to_stderr) -> Path:
    """The local directory of model.hf_dir.

    A local path is returned as it is, ~ expanded (it must be a directory with config.json).
    ``s3://bucket/prefix`` is downloaded into ``<cache_dir>/<bucket>/<prefix>/`` (cache_dir default:
    $FSDP_MODEL_CACHE, else ~/.cache/fsdp-cluster/models) under an exclusive flock on ``.lock`` there:
    only the files a model directory needs (MODEL_FILE), resuming an interrupted download and keeping
    the files that match the listing's size and ETag. Raises FetchError naming the location, the
    problem and the fix.
    """
    if not location.startswith("s3://"):
        return _local_dir(location)
    url = location.rstrip("/")
    bucket, prefix = _parse_s3_url(url, MODEL_KEY, "the prefix that holds config.json and *.safetensors")

    def missing(wanted: list[_Object], others: list[_Object]) -> str | None:
        if not wanted and not others:
            return (f"no objects under it; fix: check the prefix with `aws s3 ls {url}/` (the model "
                    "directory's files must be directly under it)")
        if "config.json" not in {obj.name for obj in wanted}:
            return (f"no config.json directly under it (found {_names(wanted + others, 8)}); fix: the "
                    f"prefix of the model directory itself, check with `aws s3 ls {url}/`")
        return None

    return _fetch(_Fetch(MODEL_KEY, url, bucket, prefix, _below(prefix), MODEL_FILE.fullmatch, missing,
                         "that a Hugging Face model directory does not need (only *.safetensors, *.json, "
                         "*.jinja, *.txt and tokenizer.model directly under the prefix are fetched)"),
                  cache_dir, log)


def resolve_data_path(location: str, suffix: str, cache_dir: str | Path | None = None, *,
                      key: str = "data.path", log: Log = print_to_stderr) -> str:
    """The local path of data.path or eval.path (`key`, which the messages name) for files ending in
    `suffix` (".jsonl" or ".parquet").

    A local path is returned unchanged: the data reader checks that it exists. An s3:// URL ending in
    `suffix` names one object: it is downloaded and the local file returned. Any other
    ``s3://bucket/prefix`` (a prefix whose name ends in `suffix` is written with a trailing /) is a
    directory: every object directly under prefix/ whose name ends in `suffix` is downloaded and the
    local directory returned. The download is resolve_model_dir's, into the same cache, which holds data
    too: ``<cache_dir>/<bucket>/<prefix>/``, for one object the directory of its prefix, under the
    same flock, resumed, and skipped when current. Raises FetchError naming `key`, the URL, the problem
    and the fix.
    """
    if not location.startswith("s3://"):
        return location
    url = location.rstrip("/")
    bucket, prefix = _parse_s3_url(url, key, f"a prefix of *{suffix} objects, or one {suffix} object")
    if url == location and prefix.endswith(suffix):
        parent, _, name = prefix.rpartition("/")

        def no_object(wanted: list[_Object], _: list[_Object]) -> str | None:
            return None if wanted else (f"no such object; fix: check it with `aws s3 ls {url}` (a prefix "
                                        f"whose name ends in {suffix} is written with a trailing /)")

        # the listing of its key also holds longer keys (train.jsonl.bak): not worth a line
        one = _Fetch(key, url, bucket, parent, prefix, lambda found: found == name, no_object, None)
        return str(_fetch(one, cache_dir, log) / name)

    def missing(wanted: list[_Object], others: list[_Object]) -> str | None:
        found = f" (found {_names(others, 8)})" if others else ""
        return None if wanted else (f"no *{suffix} objects directly under it{found}; fix: the prefix that "
                                    f"holds the {suffix} files, check it with `aws s3 ls {url}/`")

    # no dot files: they would clash with this module's own records
    data_file = re.compile(rf"[^./][^/]*{re.escape(suffix)}").fullmatch
    return str(_fetch(_Fetch(key, url, bucket, prefix, _below(prefix), data_file, missing,
                             f"that are not *{suffix} files directly under the prefix"), cache_dir, log))


def _local_dir(location: str) -> Path:
    path = Path(location).expanduser()
    if not location or not path.is_dir():
        raise FetchError(
            f"{MODEL_KEY}={location!r}: no such directory; fix: a local Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer files) or s3://<bucket>/<prefix> holding one. Models "
            "are not downloaded from the Hugging Face Hub: fetch one with `hf download <repo> --local-dir "
            "DIR` and upload it with `aws s3 sync DIR s3://<bucket>/<prefix>`")
    if not (path / "config.json").is_file():
        raise FetchError(f"{MODEL_KEY}={location}: {path} has no config.json; fix: the directory that holds "
                         "the model's config.json and *.safetensors files")
    return path


def _parse_s3_url(url: str, key: str, hint: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (bucket, "some/prefix"); the prefix becomes a path in the cache, so
    it may not climb out of it."""
    match = re.fullmatch(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?", url)
    prefix = (match.group(2) or "") if match else ""
    if match is None or (prefix and any(part in ("", ".", "..") for part in prefix.split("/"))):
        raise FetchError(f"{key}={url!r} is not an S3 location; fix: s3://<bucket>/<prefix>, {hint}")
    return match.group(1), prefix


def _below(prefix: str) -> str:
    """The listing's Prefix for the objects under `prefix` (the whole bucket for "")."""
    return f"{prefix}/" if prefix else ""


def _fetch(fetch: _Fetch, cache_dir: str | Path | None, log: Log) -> Path:
    """The cache directory of fetch.prefix, holding the current version of every object `fetch` selects."""
    root = Path(cache_dir or os.environ.get("FSDP_MODEL_CACHE") or DEFAULT_CACHE).expanduser()
    target = (root / fetch.bucket / fetch.prefix).absolute()
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise fetch.error(f"cannot create the cache directory {target}: {error}; fix: a writable cache "
                          "directory (FSDP_MODEL_CACHE)") from None
    topic = fetch.key.partition(".")[0]

    def say(message: str) -> None:
        log(f"{topic}: {message}")

    # boto3 takes a fifth of a second to import: only a run that fetches from S3 pays for it.
    import boto3

    with _locked(target / LOCK, fetch, say):
        _sync(boto3.client("s3"), fetch, target, say)
    return target


@contextlib.contextmanager
def _locked(path: Path, fetch: _Fetch, log: Log) -> Iterator[None]:
    with open(path, "a+") as handle:
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                log(f"waiting for {holder}, which holds {path} (fetching {fetch.url})")
                fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as error:
            raise fetch.error(
                f"cannot lock {path}: {error}; fix: a cache directory on a file system with flock (a "
                "node-local disk, or Lustre mounted with -o flock), set with FSDP_MODEL_CACHE") from None
        # names the holder in the waiting ranks' log line
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
        handle.flush()
        yield


def _sync(client: Any, fetch: _Fetch, target: Path, log: Log) -> None:
    wanted, skipped = _list(client, fetch)
    expected = {obj.name: obj.version() for obj in wanted}
    complete = _read_record(target / COMPLETE)
    known = {**complete, **_read_record(target / JOURNAL)}
    todo = [obj for obj in wanted
            if known.get(obj.name) != obj.version() or _size(target / obj.name) != obj.size]
    # e.g. the shards of an older upload to the same prefix; only this fetch's names, as the directory
    # may hold another fetch's files
    stale = sorted(name for name in known if fetch.wanted(name) and name not in expected)
    total = sum(obj.size for obj in wanted)
    if not todo and not stale and all(complete.get(name) == version for name, version in expected.items()):
        log(f"{fetch.url} is already in {target} ({len(wanted)} files, {_mb(total)} MB)")
        return

    if skipped and fetch.skipping:
        log(f"skipping {len(skipped)} object(s) under {fetch.url} ({_mb(sum(o.size for o in skipped))} MB) "
            f"{fetch.skipping}: {_names(skipped, 6)}")

    for name in stale:
        (target / name).unlink(missing_ok=True)
        (target / f"{name}.part").unlink(missing_ok=True)
    for obj in todo:
        (target / obj.name).unlink(missing_ok=True)
        if known.get(obj.name) != obj.version():
            # unknown origin or another version of the object: its bytes cannot start this one
            (target / f"{obj.name}.part").unlink(missing_ok=True)
    files = {name: version for name, version in known.items() if name not in stale} | expected
    # From here on every NAME and NAME.part in the directory holds the version the journal names.
    _write_record(target / JOURNAL, fetch.url, files)
    (target / COMPLETE).unlink(missing_ok=True)

    needed = sum(obj.size - (_size(target / f"{obj.name}.part") or 0) for obj in todo)
    free = shutil.disk_usage(target).free
    if needed > free:
        raise fetch.error(f"{target} has {_mb(free)} MB free, the download needs {_mb(needed)} MB; fix: free "
                          "space there, or set FSDP_MODEL_CACHE to a larger volume (the node's NVMe)")
    progress = _Progress(needed, log)
    if todo:
        cancel = threading.Event()
        with ThreadPoolExecutor(min(WORKERS, len(todo))) as pool:
            # largest first: the long downloads start at once and the small files fill in around them
            futures = [pool.submit(_download, client, fetch, obj, target, progress, cancel)
                       for obj in sorted(todo, key=lambda obj: -obj.size)]
            try:
                for future in as_completed(futures):
                    future.result()
            finally:
                # after a failure the running downloads stop at their next chunk (their .part files
                # stay) and the queued ones do not start
                cancel.set()
                pool.shutdown(cancel_futures=True)
    _write_record(target / COMPLETE, fetch.url, files)
    (target / JOURNAL).unlink()
    log(f"fetched {len(todo)} of {len(wanted)} files of {fetch.url}: {_mb(progress.done)} MB in "
        f"{progress.elapsed():.1f} s ({progress.rate()} MB/s) into {target}")


def _list(client: Any, fetch: _Fetch) -> tuple[list[_Object], list[_Object]]:
    """(the objects to fetch, the others) of the listing."""
    base = _below(fetch.prefix)
    wanted: list[_Object] = []
    skipped: list[_Object] = []
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=fetch.bucket, Prefix=fetch.listed)
        for page in pages:
            for item in page.get("Contents", []):
                name = item["Key"][len(base):]
                if not name or name.endswith("/"):  # folder markers of the S3 console
                    continue
                obj = _Object(name, item["Key"], item["Size"], item["ETag"])
                (wanted if fetch.wanted(name) else skipped).append(obj)
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code", "")
        if code == "NoSuchBucket":
            raise fetch.error(f"bucket {fetch.bucket} does not exist; fix: check the name with `aws s3 ls`"
                              ) from None
        if code in ("AccessDenied", "AllAccessDisabled", "403"):
            raise fetch.error(
                "access denied listing it; fix: the node's instance profile (or AWS credentials) needs "
                f"s3:ListBucket on arn:aws:s3:::{fetch.bucket} and s3:GetObject on "
                f"arn:aws:s3:::{fetch.bucket}/{base}*") from None
        raise fetch.error(f"listing it failed: {error}") from None
    except NoCredentialsError:
        raise fetch.error("this node has no AWS credentials; fix: an instance profile with s3:ListBucket and "
                          "s3:GetObject on the bucket, or AWS_PROFILE / AWS_ACCESS_KEY_ID") from None
    except BotoCoreError as error:
        raise fetch.error(f"listing it failed: {error}; fix: check that the node reaches S3 (network, "
                          "AWS_ENDPOINT_URL)") from None
    problem = fetch.missing(wanted, skipped)
    if problem:
        raise fetch.error(problem)
    return wanted, skipped


def _names(objects: list[_Object], shown: int) -> str:
    return ", ".join(obj.name for obj in objects[:shown]) + (
        f" and {len(objects) - shown} more" if len(objects) > shown else "")


def _download(client: Any, fetch: _Fetch, obj: _Object, target: Path, progress: _Progress,
              cancel: threading.Event) -> None:
    part = target / f"{obj.name}.part"
    part.touch()
    start, resumed = time.monotonic(), part.stat().st_size
    for attempt in range(1, RETRIES + 1):
        offset = part.stat().st_size
        if offset > obj.size:  # longer than the object: not a start of it
            part.write_bytes(b"")
            offset = 0
        if offset == obj.size:
            break
        try:
            body = client.get_object(Bucket=fetch.bucket, Key=obj.key, IfMatch=obj.etag,
                                     Range=f"bytes={offset}-")["Body"]
            with open(part, "ab") as out:
                for chunk in body.iter_chunks(CHUNK):
                    if cancel.is_set():
                        return
                    out.write(chunk)
                    progress.add(len(chunk))
        except ClientError as error:
            raise _get_error(fetch, obj, error) from None
        except BotoCoreError as error:
            # a dropped connection: the next attempt resumes from what reached the .part
            if attempt == RETRIES:
                raise fetch.error(f"downloading {obj.name} failed {RETRIES} times, last: {error}; fix: run "
                                  "again, the download resumes") from None
            progress.log(f"{obj.name}: {error}; resuming at byte {part.stat().st_size} "
                         f"(attempt {attempt + 1} of {RETRIES})")
            time.sleep(RETRY_WAIT_S * attempt)
    size = part.stat().st_size
    if size != obj.size:
        raise fetch.error(f"{obj.name}: received {size} bytes, the listing says {obj.size}; fix: run again, "
                          "the download resumes")
    os.replace(part, target / obj.name)
    seconds = time.monotonic() - start
    note = f", resumed at {_mb(resumed)} MB" if resumed else ""
    progress.log(f"{obj.name}: {_mb(obj.size)} MB in {seconds:.1f} s "
                 f"({_mb((obj.size - resumed) / max(seconds, 1e-6))} MB/s{note})")


def _get_error(fetch: _Fetch, obj: _Object, error: ClientError) -> FetchError:
    code = error.response.get("Error", {}).get("Code", "")
    if code in ("PreconditionFailed", "NoSuchKey", "412", "404"):
        return fetch.error(f"{obj.name} changed or was deleted during the download ({code}); fix: run again "
                           f"once the upload to {fetch.url} is finished (the files already downloaded are "
                           "kept)")
    if code in ("AccessDenied", "403"):
        return fetch.error(f"access denied reading s3://{fetch.bucket}/{obj.key}; fix: the node's instance "
                           f"profile needs s3:GetObject on arn:aws:s3:::{fetch.bucket}/{obj.key} (and "
                           "kms:Decrypt on the bucket's key if it uses SSE-KMS)")
    return fetch.error(f"downloading s3://{fetch.bucket}/{obj.key} failed: {error}")


class _Progress:
    """The bytes every download thread has fetched in this call; a line every PROGRESS_EVERY_S at most."""

    def __init__(self, total: int, log: Log):
        self.total, self.log = total, log
        self.done = 0
        self.start = self.last = time.monotonic()
        self.lock = threading.Lock()

    def add(self, count: int) -> None:
        with self.lock:
            self.done += count
            now = time.monotonic()
            due = now - self.last >= PROGRESS_EVERY_S
            if due:
                self.last = now
        if due:
            self.log(f"{_mb(self.done)} of {_mb(self.total)} MB, {self.rate()} MB/s")

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def rate(self) -> str:
        return _mb(self.done / max(self.elapsed(), 1e-6))


def _read_record(path: Path) -> dict[str, Any]:
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        # no record (or a damaged one): nothing in the directory counts as a known version
        return {}
    return files if isinstance(files, dict) else {}


def _write_record(path: Path, url: str, files: dict[str, Any]) -> None:
    scratch = path.with_name(f"{path.name}.tmp")
    scratch.write_text(json.dumps({"source": url, "files": files}, indent=1, sort_keys=True) + "\n")
    os.replace(scratch, path)


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _mb(count: float) -> str:
    return f"{count / 1e6:,.1f}"
