"""trainer.hf.fetch: model.hf_dir as a local directory or an S3 prefix fetched once per node into a
cache, resumably, and data.path / eval.path as a local path, an S3 object or an S3 prefix of data files
fetched the same way. S3 is moto: in process, or a ThreadedMotoServer on 127.0.0.1 for two processes."""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import random
from collections import namedtuple
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import boto3
import pytest
from botocore.exceptions import ResponseStreamingError
from moto import mock_aws

from trainer.hf import fetch
from trainer.hf.fetch import FetchError, resolve_data_path, resolve_model_dir

URL = "s3://models/llama/3b"
PREFIX = "llama/3b"
BIG = "model-00001-of-00002.safetensors"
MODEL = {
    "config.json": b'{"model_type": "llama"}',
    BIG: random.Random(1).randbytes(1536 * 1024),
    "model-00002-of-00002.safetensors": random.Random(2).randbytes(1200 * 1024),
    "model.safetensors.index.json": b'{"weight_map": {}}',
    "tokenizer.json": b"{}",
    "tokenizer_config.json": b"{}",
    "generation_config.json": b"{}",
    "chat_template.jinja": b"{{ messages }}",
    "tokenizer.model": b"sentencepiece",
}
NOT_MODEL = {
    "original/consolidated.00.pth": random.Random(3).randbytes(64 * 1024),
    "original/params.json": b"{}",
    "pytorch_model.bin": b"pickle",
}
# beside the model in the bucket: a data prefix with files that are not its *.jsonl directly under it
DATA = {
    "corpus/a.jsonl": b'{"text": "a"}\n' * 1000,
    "corpus/b.jsonl": b'{"text": "b"}\n' * 2000,
    "corpus/a.jsonl.bak": b'{"text": "old"}\n',
    "corpus/README.txt": b"two shards",
    "corpus/old/c.jsonl": b'{"text": "c"}\n',
}


class Log(list):
    def __call__(self, message: str) -> None:
        self.append(message)

    def mentions(self, *words: str) -> bool:
        return any(all(word in line for word in words) for line in self)


class SimulatedKill(BaseException):
    """Stands for the SIGKILL of a requeued job: nothing in the code under test catches it."""


def recording_session() -> tuple[boto3.session.Session, list[tuple[str, str | None]]]:
    """A session whose clients record (key, Range) of every GetObject they send."""
    session = boto3.session.Session()
    gets: list[tuple[str, str | None]] = []
    session.events.register("before-parameter-build.s3.GetObject",
                            lambda params, **_: gets.append((params["Key"], params.get("Range"))))
    return session, gets


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "FSDP_MODEL_CACHE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def session(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[boto3.session.Session, list]]:
    """In-process moto with the bucket `models` holding MODEL and NOT_MODEL under PREFIX, and the
    recording session as boto3's default one, which `boto3.client` in fetch.py uses (set after mock_aws
    starts, which replaces the default session)."""
    with mock_aws():
        recording = recording_session()
        monkeypatch.setattr(boto3, "DEFAULT_SESSION", recording[0])
        client = boto3.client("s3")
        client.create_bucket(Bucket="models")
        put(client, {**MODEL, **NOT_MODEL})
        for key, data in DATA.items():
            client.put_object(Bucket="models", Key=key, Body=data)
        yield recording


@pytest.fixture
def s3(session: tuple[boto3.session.Session, list]) -> Any:
    return boto3.client("s3")


@pytest.fixture
def gets(session: tuple[boto3.session.Session, list]) -> list[tuple[str, str | None]]:
    return session[1]


def put(client: Any, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        client.put_object(Bucket="models", Key=f"{PREFIX}/{name}", Body=data)


def assert_complete_copy(directory: Path, files: dict[str, bytes] = MODEL) -> None:
    assert {p.name for p in directory.iterdir() if not p.name.startswith(".")} == set(files)
    for name, data in files.items():
        assert (directory / name).read_bytes() == data, name
    record = json.loads((directory / ".complete.json").read_text())
    assert record["source"] == URL and set(record["files"]) == set(files)
    assert not (directory / ".download.json").exists()


def kill_after(monkeypatch: pytest.MonkeyPatch, limit: int, error: BaseException) -> None:
    """Raise `error` once, in the download loop, as soon as `limit` bytes of this call reached disk."""
    original = fetch._Progress.add
    fired = []

    def add(progress: fetch._Progress, count: int) -> None:
        original(progress, count)
        if progress.done >= limit and not fired:
            fired.append(True)
            raise error

    monkeypatch.setattr(fetch._Progress, "add", add)


def test_a_local_directory_is_returned_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    log = Log()
    assert resolve_model_dir(str(tmp_path), None, log=log) == tmp_path
    assert log == []


@pytest.mark.parametrize(("location", "words"), [
    ("{tmp}", ["model.hf_dir={tmp}", "has no config.json"]),
    ("{tmp}/missing", ["model.hf_dir='{tmp}/missing'", "no such directory", "s3://<bucket>/<prefix>"]),
    ("meta-llama/Llama-3.1-8B", ["model.hf_dir='meta-llama/Llama-3.1-8B'",
                                 "not downloaded from the Hugging Face Hub", "hf download"]),
    ("", ["model.hf_dir=''", "no such directory"]),
])
def test_a_local_location_without_a_model_is_refused(tmp_path: Path, location: str, words: list[str]) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(FetchError) as raised:
        resolve_model_dir(location.format(tmp=tmp_path), str(tmp_path / "cache"))
    for word in words:
        assert word.format(tmp=tmp_path) in str(raised.value)


def test_an_s3_model_is_fetched_into_the_cache_without_the_other_objects(
        s3: Any, gets: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the default cache, under the home directory
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    log = Log()
    directory = resolve_model_dir(URL + "/", None, log=log)
    assert directory == tmp_path / "home/.cache/fsdp-cluster/models/models/llama/3b"
    assert_complete_copy(directory)
    assert sorted(key for key, _ in gets) == sorted(f"{PREFIX}/{name}" for name in MODEL)
    assert log.mentions("skipping 3 object(s)", "original/consolidated.00.pth", "pytorch_model.bin")
    for name, data in MODEL.items():
        assert log.mentions(f"model: {name}: {len(data) / 1e6:,.1f} MB")
    assert log.mentions(f"fetched {len(MODEL)} of {len(MODEL)} files of {URL}")


def test_a_second_call_downloads_nothing(s3: Any, gets: list, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_MODEL_CACHE", str(tmp_path / "cache"))
    directory = resolve_model_dir(URL, None, log=Log())
    times = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    gets.clear()
    log = Log()
    assert resolve_model_dir(URL, str(tmp_path / "cache"), log=log) == directory
    assert gets == []
    assert log.mentions(f"{URL} is already in {directory} ({len(MODEL)} files")
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()
            if p.name != ".lock"} == {name: t for name, t in times.items() if name != ".lock"}


def kill_mid_download(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A model download killed 512 KiB into its first file: one file at a time, largest first, in 256
    KiB chunks, so the kill lands inside BIG."""
    with monkeypatch.context() as patch:
        patch.setattr(fetch, "WORKERS", 1)
        patch.setattr(fetch, "CHUNK", 256 * 1024)
        kill_after(patch, 512 * 1024, SimulatedKill())
        with pytest.raises(SimulatedKill):
            resolve_model_dir(URL, str(tmp_path / "cache"), log=Log())


def test_a_killed_download_resumes_from_its_part_file(s3: Any, gets: list, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "cache/models/llama/3b"
    kill_mid_download(monkeypatch, tmp_path)
    assert (directory / f"{BIG}.part").stat().st_size == 512 * 1024
    assert not (directory / BIG).exists() and not (directory / ".complete.json").exists()
    # Until it sees the kill the one worker may go on with the next files: what it finished is kept,
    # what it started is resumed too.
    parts = {name: directory / f"{name}.part" for name in MODEL if not (directory / name).exists()}
    resume_at = {name: part.stat().st_size if part.exists() else 0 for name, part in parts.items()}

    gets.clear()
    log = Log()
    resolve_model_dir(URL, str(tmp_path / "cache"), log=log)
    assert_complete_copy(directory)
    assert sorted(gets) == sorted((f"{PREFIX}/{name}", f"bytes={offset}-")
                                  for name, offset in resume_at.items())
    assert log.mentions(f"model: {BIG}:", "resumed at 0.5 MB")


def test_a_part_file_of_a_replaced_object_is_not_resumed(s3: Any, gets: list, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    kill_mid_download(monkeypatch, tmp_path)
    # a new upload of the same size, as a re-trained model of the same shape is
    replaced = {**MODEL, BIG: random.Random(4).randbytes(len(MODEL[BIG]))}
    put(s3, {BIG: replaced[BIG]})
    gets.clear()
    directory = resolve_model_dir(URL, str(tmp_path / "cache"), log=Log())
    assert_complete_copy(directory, replaced)
    assert (f"{PREFIX}/{BIG}", "bytes=0-") in gets


def test_a_changed_prefix_is_followed(s3: Any, gets: list, tmp_path: Path) -> None:
    resolve_model_dir(URL, str(tmp_path / "cache"), log=Log())
    changed = {name: data for name, data in MODEL.items() if name != "tokenizer.model"}
    changed[BIG] = random.Random(5).randbytes(len(MODEL[BIG]))
    put(s3, {BIG: changed[BIG]})
    s3.delete_object(Bucket="models", Key=f"{PREFIX}/tokenizer.model")
    gets.clear()
    directory = resolve_model_dir(URL, str(tmp_path / "cache"), log=Log())
    assert_complete_copy(directory, changed)
    assert gets == [(f"{PREFIX}/{BIG}", "bytes=0-")]


def test_a_dropped_connection_resumes_within_the_call(s3: Any, gets: list, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "WORKERS", 1)
    monkeypatch.setattr(fetch, "CHUNK", 256 * 1024)
    monkeypatch.setattr(fetch, "RETRY_WAIT_S", 0)
    kill_after(monkeypatch, 512 * 1024, ResponseStreamingError(error="connection reset by peer"))
    log = Log()
    directory = resolve_model_dir(URL, str(tmp_path / "cache"), log=log)
    assert_complete_copy(directory)
    assert [rng for key, rng in gets if key.endswith(BIG)] == ["bytes=0-", f"bytes={512 * 1024}-"]
    assert log.mentions(BIG, "connection reset by peer", f"resuming at byte {512 * 1024}")


def _fetch_in_child(cache: str, queue: multiprocessing.Queue) -> None:
    session, gets = recording_session()
    boto3.DEFAULT_SESSION = session
    resolve_model_dir(URL, cache, log=lambda line: queue.put(("log", os.getpid(), line)))
    queue.put(("gets", os.getpid(), len(gets)))


def test_two_processes_on_one_cache_download_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moto.server import ThreadedMotoServer  # here, not at the top: it costs each child a second

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server._server.server_port}")
        client = boto3.client("s3")
        client.create_bucket(Bucket="models")
        put(client, MODEL)
        directory = tmp_path / "cache/models/llama/3b"
        directory.mkdir(parents=True)
        context = multiprocessing.get_context("spawn")  # no fork of a process running the server thread
        queue = context.Queue()
        children = [context.Process(target=_fetch_in_child, args=(str(tmp_path / "cache"), queue))
                    for _ in range(2)]
        messages = []
        # Holding the lock until both wait on it makes them contend for it for certain.
        with open(directory / ".lock", "a+") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            for child in children:
                child.start()
            while sum("waiting for" in m[2] for m in messages if m[0] == "log") < 2:
                messages.append(queue.get(timeout=60))
        while sum(m[0] == "gets" for m in messages) < 2:
            messages.append(queue.get(timeout=60))
        for child in children:
            child.join(timeout=60)
    finally:
        server.stop()
    assert [child.exitcode for child in children] == [0, 0]
    counts = {pid: count for kind, pid, count in messages if kind == "gets"}
    assert sorted(counts.values()) == [0, len(MODEL)]
    idle = next(pid for pid, count in counts.items() if count == 0)
    assert any(kind == "log" and pid == idle and "is already in" in line for kind, pid, line in messages)
    assert_complete_copy(directory)


def deny(operation: str):
    def handler(**_: Any) -> tuple[SimpleNamespace, dict[str, Any]]:
        return SimpleNamespace(status_code=403), {
            "Error": {"Code": "AccessDenied", "Message": "Access Denied"},
            "ResponseMetadata": {"HTTPStatusCode": 403}}
    return f"before-call.s3.{operation}", handler


@pytest.mark.parametrize(("url", "denied", "words"), [
    ("s3://nosuch/llama/3b", None, ["model.hf_dir=s3://nosuch/llama/3b", "bucket nosuch does not exist"]),
    # the prefix is a folder: s3://models/llam must not match the objects under llama/
    ("s3://models/llam", None, ["model.hf_dir=s3://models/llam", "no objects under it",
                                "aws s3 ls s3://models/llam/"]),
    ("s3://models/llama", None, ["no config.json directly under it (found 3b/", "aws s3 ls s3://models/llama/"]),
    (f"{URL}/original", None, ["no config.json directly under it", "consolidated.00.pth"]),
    (URL, "ListObjectsV2", [f"model.hf_dir={URL}: access denied listing it",
                            "s3:ListBucket on arn:aws:s3:::models and",
                            "s3:GetObject on arn:aws:s3:::models/llama/3b/*"]),
    (URL, "GetObject", ["access denied reading s3://models/llama/3b/",
                        "s3:GetObject on arn:aws:s3:::models/llama/3b/"]),
    ("s3://Models/llama", None, ["model.hf_dir='s3://Models/llama' is not an S3 location",
                                 "holds config.json"]),
    ("s3://models/../etc", None, ["model.hf_dir='s3://models/../etc' is not an S3 location"]),
])
def test_unusable_s3_locations_are_refused_with_the_fix(s3: Any, session: tuple, tmp_path: Path, url: str,
                                                        denied: str | None, words: list[str]) -> None:
    if denied:
        session[0].events.register(*deny(denied))
    with pytest.raises(FetchError) as raised:
        resolve_model_dir(url, str(tmp_path / "cache"), log=Log())
    for word in words:
        assert word in str(raised.value)


def test_a_cache_without_room_for_the_model_is_refused(s3: Any, gets: list, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch.shutil, "disk_usage", lambda _: namedtuple("Usage", "free")(1_000_000))
    needed = sum(len(data) for data in MODEL.values()) / 1e6
    with pytest.raises(FetchError, match=rf"has 1\.0 MB free, the download needs {needed:.1f} MB; fix: "
                       ".*FSDP_MODEL_CACHE"):
        resolve_model_dir(URL, str(tmp_path / "cache"), log=Log())
    assert gets == []


def data_names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if not p.name.startswith(".")}


def test_a_local_data_path_is_returned_unchanged() -> None:
    log = Log()
    assert resolve_data_path("~/corpus/missing.jsonl", ".jsonl", log=log) == "~/corpus/missing.jsonl"
    assert log == []


def test_an_s3_data_prefix_is_fetched_as_a_directory_of_its_files(s3: Any, gets: list,
                                                                   tmp_path: Path) -> None:
    log = Log()
    path = resolve_data_path("s3://models/corpus/", ".jsonl", tmp_path / "cache", log=log)
    directory = tmp_path / "cache/models/corpus"
    assert path == str(directory)
    assert data_names(directory) == {"a.jsonl", "b.jsonl"}
    for name in ("a.jsonl", "b.jsonl"):
        assert (directory / name).read_bytes() == DATA[f"corpus/{name}"]
    assert sorted(key for key, _ in gets) == ["corpus/a.jsonl", "corpus/b.jsonl"]
    assert log.mentions("data: skipping 3 object(s)", "not *.jsonl files directly under", "README.txt",
                        "old/c.jsonl", "a.jsonl.bak")
    assert log.mentions("data: fetched 2 of 2 files of s3://models/corpus")

    gets.clear()
    log = Log()
    assert resolve_data_path("s3://models/corpus", ".jsonl", tmp_path / "cache", log=log) == path
    assert gets == []
    assert log.mentions(f"data: s3://models/corpus is already in {directory} (2 files")


def test_s3_objects_are_fetched_as_files_beside_each_other(s3: Any, gets: list, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    train = resolve_data_path("s3://models/corpus/a.jsonl", ".jsonl", cache, log=Log())
    log = Log()
    evaluation = resolve_data_path("s3://models/corpus/b.jsonl", ".jsonl", cache, key="eval.path", log=log)
    directory = cache / "models/corpus"
    assert (train, evaluation) == (str(directory / "a.jsonl"), str(directory / "b.jsonl"))
    assert log.mentions("eval: b.jsonl:") and not log.mentions("skipping")
    # eval.path's fetch of the same cache directory keeps data.path's file, and fetches no more than its own
    assert data_names(directory) == {"a.jsonl", "b.jsonl"}
    assert Path(train).read_bytes() == DATA["corpus/a.jsonl"]
    assert Path(evaluation).read_bytes() == DATA["corpus/b.jsonl"]
    assert sorted(key for key, _ in gets) == ["corpus/a.jsonl", "corpus/b.jsonl"]

    # a second call, and a fetch of the whole prefix that holds both, download nothing
    gets.clear()
    assert resolve_data_path("s3://models/corpus/a.jsonl", ".jsonl", cache, log=Log()) == train
    assert resolve_data_path("s3://models/corpus", ".jsonl", cache, log=Log()) == str(directory)
    assert gets == []


@pytest.mark.parametrize(("url", "suffix", "key", "words"), [
    ("s3://models/llama/3b", ".parquet", "eval.path",
     ["eval.path=s3://models/llama/3b: no *.parquet objects directly under it (found chat_template.jinja",
      "aws s3 ls s3://models/llama/3b/"]),
    ("s3://models/nothing/", ".jsonl", "data.path",
     ["data.path=s3://models/nothing: no *.jsonl objects directly under it; fix"]),
    ("s3://models/corpus/c.jsonl", ".jsonl", "data.path",
     ["data.path=s3://models/corpus/c.jsonl: no such object", "aws s3 ls s3://models/corpus/c.jsonl`"]),
    ("s3://models/../corpus", ".jsonl", "data.path",
     ["data.path='s3://models/../corpus' is not an S3 location", "one .jsonl object"]),
])
def test_an_s3_data_location_without_data_files_is_refused(s3: Any, gets: list, tmp_path: Path, url: str,
                                                           suffix: str, key: str, words: list[str]) -> None:
    with pytest.raises(FetchError) as raised:
        resolve_data_path(url, suffix, tmp_path / "cache", key=key, log=Log())
    for word in words:
        assert word in str(raised.value)
    assert gets == []
