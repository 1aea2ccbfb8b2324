"""trainer.checkpoint across ranks: torchrun on loopback, gloo, a tiny FSDP2 model
(test_checkpoint_worker.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import boto3
import pytest

from tests.trainer.test_checkpoint_worker import losses, reference_run, run_job, worker_env
from trainer.checkpoint import S3Location, committed_checkpoints, read_manifest

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


def test_corrupt_copies_are_skipped_down_to_the_s3_mirror(tmp_path: Path, reference_dir: Path,
                                                          reference: dict[int, float], moto_s3) -> None:
    boto3.client("s3").create_bucket(Bucket="ckpts")
    # The reference run's step-5 checkpoint: intact in S3, damaged in both file-system copies.
    step5 = reference_dir / "ckpt" / "step_00000005"
    S3Location("s3://ckpts/job").upload(step5, read_manifest(step5)[0])
    for copy, damaged in (("ckpt", "__1_0.distcp"), ("mirror", ".metadata")):
        shutil.copytree(step5, tmp_path / copy / step5.name)
        flip_byte(tmp_path / copy / step5.name / damaged)
    checkpoint = {"dir": str(tmp_path / "ckpt"), "interval": 3, "mirror_dir": str(tmp_path / "mirror"),
                  "mirror_s3": "s3://ckpts/job", "keep_last": 2}
    metrics = tmp_path / "metrics.jsonl"
    log = run_job(2, steps=10, metrics=metrics, checkpoint=checkpoint, env=worker_env(**moto_s3))
    s3_names = S3Location("s3://ckpts/job").checkpoints()
    assert f"NOT loading {tmp_path}/ckpt/step_00000005 (primary copy)" in log
    assert f"{tmp_path}/ckpt/step_00000005: __1_0.distcp: SHA256 mismatch" in log
    assert f"{tmp_path}/mirror/step_00000005: .metadata: SHA256 mismatch" in log
    assert "downloading s3://ckpts/job/step_00000005" in log
    assert "step_00000005.from-s3.tmp (step 5)" in log
    assert losses(metrics) == {step: reference[step] for step in range(6, 11)}
    # the resumed run keeps mirroring, verified, to both second copies
    assert "mirrored step_00000010 to s3://ckpts/job/step_00000010, verified" in log
    assert [s for s, _ in committed_checkpoints(tmp_path / "mirror")] == [10, 9]
    assert s3_names == ([(10, "step_00000010"), (9, "step_00000009")], [])  # keep_last=2
    assert not (tmp_path / "ckpt" / "step_00000005.from-s3.tmp").exists()
