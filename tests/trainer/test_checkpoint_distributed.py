"""trainer.checkpoint across ranks: torchrun on loopback, gloo, a tiny FSDP2 model
(test_checkpoint_worker.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from tests.trainer.test_checkpoint_worker import free_port, losses, reference_run, run_job, worker_env
from trainer.checkpoint import committed_checkpoints, verify_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return reference_run(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(reference_dir: Path) -> dict[int, float]:
    return losses(reference_dir / "metrics.jsonl")


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_stop_at_5_resume_to_10_reproduces_the_straight_run(tmp_path: Path,
                                                            reference: dict[int, float]) -> None:
    metrics = tmp_path / "metrics.jsonl"
    # blocking saves here; the reference run used the default async save
    checkpoint = {"dir": str(tmp_path / "ckpt"), "interval": 2, "async_save": False}
    run_job(2, steps=5, metrics=metrics, checkpoint=checkpoint)
    manifest = json.loads((tmp_path / "ckpt" / "step_00000005" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "trainer_state_rank0.pt",
            "trainer_state_rank1.pt"} <= set(manifest["files"])
    log = run_job(2, steps=10, metrics=metrics, checkpoint=checkpoint)
    assert "resumed from" in log and "step_00000005" in log
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, 11))
    assert losses(metrics) == reference


def test_resume_on_fewer_ranks_reshards(tmp_path: Path, reference_dir: Path,
                                        reference: dict[int, float]) -> None:
    # The worker's loss curve does not depend on the world size (fixed global batch, no dropout), so the
    # 1-rank continuation of the 2-rank run's step-5 checkpoint must track that run up to the rounding
    # of a different reduction order.
    shutil.copytree(reference_dir / "ckpt" / "step_00000005", tmp_path / "ckpt" / "step_00000005")
    metrics = tmp_path / "metrics.jsonl"
    log = run_job(1, steps=8, metrics=metrics, checkpoint={"dir": str(tmp_path / "ckpt"), "interval": 5})
    assert "resharding 2 -> 1 ranks" in log
    assert "resumed from" in log
    resumed = losses(metrics)
    assert sorted(resumed) == [6, 7, 8]
    assert resumed == pytest.approx({step: reference[step] for step in resumed}, rel=1e-5)
    assert json.loads((tmp_path / "ckpt" / "step_00000008" / "manifest.json").read_text())["world_size"] == 1


def test_corrupt_copies_are_skipped_down_to_the_s3_mirror(tmp_path: Path,
                                                          reference: dict[int, float]) -> None:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port())
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{server._server.server_port}"
        aws = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket="ckpts")
        env = worker_env(**aws)
        checkpoint = {"dir": str(tmp_path / "ckpt"), "interval": 3, "mirror_dir": str(tmp_path / "mirror"),
                      "mirror_s3": "s3://ckpts/job", "keep_last": 2}
        metrics = tmp_path / "metrics.jsonl"
        log = run_job(2, steps=6, metrics=metrics, checkpoint=checkpoint, env=env)
        assert "mirrored step_00000006 to s3://ckpts/job/step_00000006, verified" in log
        assert [s for s, _ in committed_checkpoints(tmp_path / "mirror")] == [6, 3]
        # the newest checkpoint is damaged in both file-system copies; S3 still holds a good one
        flip_byte(tmp_path / "ckpt" / "step_00000006" / "__1_0.distcp")
        flip_byte(tmp_path / "mirror" / "step_00000006" / ".metadata")
        assert any("__1_0.distcp" in p for p in verify_checkpoint(tmp_path / "ckpt" / "step_00000006"))
        log = run_job(2, steps=10, metrics=metrics, checkpoint=checkpoint, env=env)
    finally:
        server.stop()
    assert "NOT loading" in log
    assert f"{tmp_path}/ckpt/step_00000006: __1_0.distcp: SHA256 mismatch" in log
    assert f"{tmp_path}/mirror/step_00000006: .metadata: SHA256 mismatch" in log
    assert "downloading s3://ckpts/job/step_00000006" in log
    assert "resumed from" in log and "step_00000006.from-s3.tmp (step 6)" in log
    assert losses(metrics) == reference
