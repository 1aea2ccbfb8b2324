"""trainer.checkpoint in one process (no process group): manifest, verification, selection, retention,
mirrors and the CLI. The multi-rank behaviour is in test_checkpoint_distributed.py."""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import Future
from pathlib import Path

import boto3
import pydantic
import pytest
import torch
from moto import mock_aws
from torch import nn

from trainer import checkpoint as ckpt
from trainer.checkpoint import CheckpointConfig, CheckpointError, CheckpointManager, verify_checkpoint

# DCP says so on every single-process save/load, which is exactly what this module tests.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


class Job:
    """A model, optimizer and extra state stepping deterministically."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        # dropout draws from the global RNG, so exact resumption needs the RNG state restored too
        self.model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.counter = Counter()
        self.extra = {"counter": self.counter}

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.counter.value += 1
            generator = torch.Generator().manual_seed(self.counter.value)
            inputs = torch.randn(4, 8, generator=generator)
            self.model(inputs).square().mean().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


class Log(list):
    def __call__(self, message: str) -> None:
        self.append(message)

    def mentions(self, *words: str) -> bool:
        return any(all(word in line for word in words) for line in self)


def manager(tmp_path: Path, log: Log, **settings) -> CheckpointManager:
    settings.setdefault("dir", str(tmp_path / "ckpt"))
    settings.setdefault("interval", 2)
    return CheckpointManager(CheckpointConfig(**settings), rank=0, world_size=1, log=log)


def train_and_save(tmp_path: Path, log: Log, steps: int, **settings) -> tuple[Job, CheckpointManager]:
    job = Job()
    mgr = manager(tmp_path, log, **settings)
    for step in range(1, steps + 1):
        job.train(1)
        if mgr.should_save(step, final=step == steps):
            mgr.save(step, job.model, job.optimizer, job.extra)
    mgr.wait()
    return job, mgr


def resume(tmp_path: Path, log: Log, **settings) -> tuple[Job, int]:
    job = Job()
    step = manager(tmp_path, log, **settings).maybe_resume(job.model, job.optimizer, job.extra)
    return job, step


def flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(autouse=True)
def fake_aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


def test_manifest_covers_every_file_and_verifies(tmp_path: Path) -> None:
    log = Log()
    train_and_save(tmp_path, log, 4, async_save=False)
    checkpoint = tmp_path / "ckpt" / "step_00000004"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["world_size"] == 1
    on_disk = {p.name for p in checkpoint.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    assert ".metadata" in on_disk and "trainer_state_rank0.pt" in on_disk
    assert verify_checkpoint(checkpoint) == []
    assert not list((tmp_path / "ckpt").glob("*.tmp"))


def test_every_interval_and_final_step(tmp_path: Path) -> None:
    log = Log()
    train_and_save(tmp_path, log, 5, interval=2, keep_last=10)
    steps = [step for step, _ in ckpt.committed_checkpoints(tmp_path / "ckpt")]
    assert steps == [5, 4, 2]


@pytest.mark.parametrize("async_save", [True, False])
def test_resume_restores_model_optimizer_and_extra_exactly(tmp_path: Path, async_save: bool) -> None:
    straight = Job()
    straight.train(7)
    train_and_save(tmp_path, Log(), 4, async_save=async_save)
    log = Log()
    job, step = resume(tmp_path, log)
    assert step == 4 and job.counter.value == 4
    job.train(3)
    assert all(torch.equal(a, b) for a, b in zip(job.weights(), straight.weights(), strict=True))
    assert log.mentions("resumed from", "step_00000004")


def test_flipped_byte_is_reported_and_older_checkpoint_loaded(tmp_path: Path) -> None:
    train_and_save(tmp_path, Log(), 4)
    shard = tmp_path / "ckpt" / "step_00000004" / "__0_0.distcp"
    flip_byte(shard)
    problems = verify_checkpoint(shard.parent)
    assert len(problems) == 1 and "step_00000004" in problems[0] and "__0_0.distcp" in problems[0]
    assert "SHA256 mismatch" in problems[0]
    log = Log()
    job, step = resume(tmp_path, log)
    assert step == 2 and job.counter.value == 2
    assert log.mentions("NOT loading", "step_00000004", "__0_0.distcp", "SHA256 mismatch")


def test_no_verified_checkpoint_refuses_to_start_over(tmp_path: Path) -> None:
    train_and_save(tmp_path, Log(), 4)
    for checkpoint in (tmp_path / "ckpt").iterdir():
        flip_byte(checkpoint / "__0_0.distcp")
    log = Log()
    with pytest.raises(CheckpointError, match=r"none of the 2 checkpoint\(s\) .* verified"):
        resume(tmp_path, log)
    assert log.mentions("NOT loading", "step_00000004") and log.mentions("NOT loading", "step_00000002")


def test_missing_manifest_and_interrupted_save_are_never_loaded(tmp_path: Path) -> None:
    train_and_save(tmp_path, Log(), 4)
    root = tmp_path / "ckpt"
    # a save killed before its commit leaves step_<n>.tmp; a hand-made copy may lack its manifest
    shutil.copytree(root / "step_00000004", root / "step_00000006.tmp")
    (root / "step_00000004" / "manifest.json").unlink()
    log = Log()
    job, step = resume(tmp_path, log)
    assert step == 2 and job.counter.value == 2
    assert log.mentions("ignoring", "step_00000006.tmp", "interrupted save")
    assert log.mentions("NOT loading", "step_00000004", "manifest.json is missing")
    # the next save removes the leftover
    mgr = manager(tmp_path, log)
    mgr.save(3, job.model, job.optimizer, job.extra)
    mgr.wait()
    assert not (root / "step_00000006.tmp").exists()


def test_unexpected_and_missing_files_are_problems(tmp_path: Path) -> None:
    train_and_save(tmp_path, Log(), 2)
    checkpoint = tmp_path / "ckpt" / "step_00000002"
    (checkpoint / "stray.bin").write_bytes(b"x")
    (checkpoint / "trainer_state_rank0.pt").unlink()
    problems = verify_checkpoint(checkpoint)
    assert any("stray.bin" in p and "not in the manifest" in p for p in problems)
    assert any("trainer_state_rank0.pt: missing" in p for p in problems)


def test_manifest_naming_a_path_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    train_and_save(tmp_path, Log(), 2)
    checkpoint = tmp_path / "ckpt" / "step_00000002"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["../../outside"] = {"sha256": "0" * 64, "size": 1}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    expected = f"{checkpoint}: manifest.json: malformed entry for '../../outside'"
    assert verify_checkpoint(checkpoint) == [expected]


def test_explicit_resume_path_refuses_a_corrupt_checkpoint(tmp_path: Path) -> None:
    train_and_save(tmp_path, Log(), 4)
    chosen = tmp_path / "ckpt" / "step_00000002"
    _, step = resume(tmp_path, Log(), resume=str(chosen))
    assert step == 2
    flip_byte(chosen / ".metadata")
    with pytest.raises(CheckpointError, match=r"step_00000002.*\.metadata.*SHA256"):
        resume(tmp_path, Log(), resume=str(chosen))


def test_nothing_to_resume_starts_at_zero(tmp_path: Path) -> None:
    log = Log()
    job, step = resume(tmp_path, log)
    assert step == 0 and job.counter.value == 0
    assert log.mentions("no checkpoint in")
    assert CheckpointManager(CheckpointConfig(), rank=0, world_size=1, log=log).maybe_resume(
        job.model, job.optimizer, job.extra) == 0


def test_resume_none_refuses_to_mix_runs_in_one_dir(tmp_path: Path) -> None:
    train_and_save(tmp_path, Log(), 2)
    with pytest.raises(CheckpointError, match=r"--resume none.*Fix"):
        resume(tmp_path, Log(), resume="none")


def test_retention_keeps_newest_and_drops_old(tmp_path: Path) -> None:
    log = Log()
    train_and_save(tmp_path, log, 10, interval=1, keep_last=3)
    root = tmp_path / "ckpt"
    assert [s for s, _ in ckpt.committed_checkpoints(root)] == [10, 9, 8]
    assert log.mentions("deleted", "step_00000007", "keep_last=3")
    # age: everything but the newest is older than max_age_days
    ten_days_later = time.time() + 10 * 86400
    deleted = ckpt.apply_retention(root, keep_last=3, max_age_days=7, newest_verified=root / "step_00000010",
                                   log=log, now=ten_days_later)
    assert sorted(p.name for p in deleted) == ["step_00000008", "step_00000009"]
    assert [s for s, _ in ckpt.committed_checkpoints(root)] == [10]
    # the newest verified one survives even when it is itself too old
    ckpt.apply_retention(root, keep_last=1, max_age_days=1, newest_verified=root / "step_00000010", log=log,
                         now=ten_days_later)
    assert (root / "step_00000010").is_dir()


def test_mirror_dir_is_verified_and_used_when_primary_is_corrupt(tmp_path: Path) -> None:
    log = Log()
    mirror = tmp_path / "mirror"
    train_and_save(tmp_path, log, 4, mirror_dir=str(mirror))
    assert log.mentions("mirrored step_00000004", "verified")
    assert [s for s, _ in ckpt.committed_checkpoints(mirror)] == [4, 2]
    assert verify_checkpoint(mirror / "step_00000004") == []
    flip_byte(tmp_path / "ckpt" / "step_00000004" / "trainer_state_rank0.pt")
    log = Log()
    job, step = resume(tmp_path, log, mirror_dir=str(mirror))
    assert step == 4 and job.counter.value == 4
    assert log.mentions("NOT loading", "primary", "trainer_state_rank0.pt")
    assert log.mentions("resumed from", str(mirror / "step_00000004"))


def test_s3_mirror_upload_verify_and_restore(tmp_path: Path) -> None:
    with mock_aws():
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="ckpt-bucket")
        url = "s3://ckpt-bucket/run1"
        log = Log()
        train_and_save(tmp_path, log, 4, mirror_s3=url)
        assert log.mentions("mirrored step_00000004 to s3://ckpt-bucket/run1", "verified")
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket="ckpt-bucket")["Contents"]}
        assert "run1/step_00000004/manifest.json" in keys and "run1/step_00000004/.metadata" in keys
        # a partial upload (no manifest) is ignored
        s3.put_object(Bucket="ckpt-bucket", Key="run1/step_00000006/__0_0.distcp", Body=b"partial")
        # the node lost its primary copy entirely
        shutil.rmtree(tmp_path / "ckpt")
        log = Log()
        job, step = resume(tmp_path, log, mirror_s3=url)
        assert step == 4 and job.counter.value == 4
        assert log.mentions("ignoring", "step_00000006", "partial upload")
        assert log.mentions("downloading", "step_00000004")
        # a corrupted object in S3 is detected after download and the older checkpoint used
        shard_key = "run1/step_00000004/__0_0.distcp"
        body = bytearray(s3.get_object(Bucket="ckpt-bucket", Key=shard_key)["Body"].read())
        body[50] ^= 0xFF
        s3.put_object(Bucket="ckpt-bucket", Key=shard_key, Body=bytes(body))
        shutil.rmtree(tmp_path / "ckpt")
        log = Log()
        job, step = resume(tmp_path, log, mirror_s3=url)
        assert step == 2
        assert log.mentions("NOT loading", "step_00000004", "__0_0.distcp", "SHA256 mismatch")


def test_s3_mirror_keeps_the_newest_keep_last(tmp_path: Path) -> None:
    with mock_aws():
        boto3.client("s3").create_bucket(Bucket="ckpt-bucket")
        log = Log()
        train_and_save(tmp_path, log, 6, mirror_s3="s3://ckpt-bucket/run", keep_last=2)
        committed, partial = ckpt.S3Location("s3://ckpt-bucket/run").checkpoints()
        keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="ckpt-bucket")["Contents"]}
    assert committed == [(6, "step_00000006"), (4, "step_00000004")] and partial == []
    assert not any(key.startswith("run/step_00000002/") for key in keys)
    assert log.mentions("deleted s3://ckpt-bucket/run/step_00000002", "keep_last=2")


def test_s3_mirror_failure_is_logged_and_training_continues(tmp_path: Path) -> None:
    with mock_aws():  # the bucket does not exist
        log = Log()
        train_and_save(tmp_path, log, 2, mirror_s3="s3://missing-bucket/run")
    assert log.mentions("ERROR mirroring step_00000002", "only the primary copy exists")
    assert verify_checkpoint(tmp_path / "ckpt" / "step_00000002") == []


@pytest.mark.parametrize(("settings", "message"), [
    ({"interval": 0}, "--checkpoint-interval"),
    ({"keep_last": 0}, "keep_last must be at least 1"),
    ({"max_age_days": 0}, "max_age_days"),
    ({"dir": "/x", "mirror_s3": "http://bucket"}, "not an S3 URL"),
    ({"mirror_dir": "/m"}, "needs a primary checkpoint dir"),
    ({"dir": "/x", "mirror_dir": "/x/"}, "is the checkpoint dir itself"),
    ({"dir": "/x", "bogus": 1}, "bogus"),
])
def test_bad_config_is_rejected_with_the_fix(settings: dict, message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        CheckpointConfig(**settings)


def test_cli_verify_and_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train_and_save(tmp_path, Log(), 4)
    root = tmp_path / "ckpt"
    assert ckpt.main(["verify", str(root)]) == 0
    assert ckpt.main(["verify", str(root / "step_00000002")]) == 0
    capsys.readouterr()
    flip_byte(root / "step_00000004" / ".metadata")
    assert ckpt.main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "step_00000004" in out and ".metadata" in out and "verified" in out
    assert ckpt.main(["list", str(root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["verified"]) for r in rows] == [(4, False), (2, True)]
    assert ckpt.main(["list", str(root)]) == 0
    assert "BAD" in capsys.readouterr().out
    assert ckpt.main(["verify", str(tmp_path / "nothing")]) == 2
    os.makedirs(tmp_path / "empty")
    assert ckpt.main(["verify", str(tmp_path / "empty")]) == 1


def test_failed_write_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_async_save(*_args, **_kwargs) -> Future:
        future: Future = Future()
        future.set_exception(OSError("No space left on device"))
        return future

    job = Job()
    mgr = manager(tmp_path, Log())
    monkeypatch.setattr(ckpt.manager.dcp, "async_save", failing_async_save)
    mgr.save(2, job.model, job.optimizer, job.extra)
    with pytest.raises(CheckpointError, match=r"step 2 .* not committed.*No space left on device"):
        mgr.wait()
    root = tmp_path / "ckpt"
    assert ckpt.committed_checkpoints(root) == []
    assert [p.name for p in ckpt.interrupted_saves(root)] == ["step_00000002.tmp"]
    monkeypatch.undo()
    log = Log()
    _, step = resume(tmp_path, log)
    assert step == 0 and log.mentions("ignoring", "step_00000002.tmp")


def test_unusable_checkpoint_dir_is_reported_at_start(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(CheckpointError, match=r"cannot prepare the checkpoint locations: .*a-file"):
        manager(tmp_path, Log(), dir=str(tmp_path / "a-file"))


def test_cli_verify_and_list_an_s3_copy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with mock_aws():
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="ckpt-bucket")
        train_and_save(tmp_path, Log(), 4, mirror_s3="s3://ckpt-bucket/run1")
        assert ckpt.main(["verify", "s3://ckpt-bucket/run1"]) == 0
        assert ckpt.main(["verify", "s3://ckpt-bucket/run1/step_00000002"]) == 0
        capsys.readouterr()
        key = "run1/step_00000004/.metadata"
        metadata = bytearray(s3.get_object(Bucket="ckpt-bucket", Key=key)["Body"].read())
        metadata[10] ^= 0x01
        s3.put_object(Bucket="ckpt-bucket", Key=key, Body=bytes(metadata))
        s3.put_object(Bucket="ckpt-bucket", Key="run1/step_00000006/__0_0.distcp", Body=b"partial")
        assert ckpt.main(["verify", "s3://ckpt-bucket/run1"]) == 1
        out = capsys.readouterr().out
        assert "FAILED s3://ckpt-bucket/run1/step_00000004" in out and ".metadata: SHA256 mismatch" in out
        assert "verified s3://ckpt-bucket/run1/step_00000002" in out
        assert ckpt.main(["list", "s3://ckpt-bucket/run1", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["verified"], r["committed"]) for r in rows] == [
        (4, False, True), (2, True, True), (None, False, False)]
    assert "partial upload" in rows[2]["problems"][0]
