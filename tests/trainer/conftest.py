from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.trainer.rank_launcher import RankLauncher, free_port

REPO = Path(__file__).resolve().parents[2]


_ranks = RankLauncher(REPO)


def torchrun(nproc: int, args: list[str], *, timeout: float = 240, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess:
    """A CPU/gloo launch of NPROC ranks on loopback as `torchrun --standalone` makes it, the ranks forked
    from a process that imported torch and the trainer once (rank_launcher.py says why, and which tests
    run the real torchrun); `env` instead of this process's environment."""
    environment = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    environment.pop("CUDA_VISIBLE_DEVICES", None)
    return _ranks.run(nproc, args, environment, timeout)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                    f"--- stderr\n{proc.stderr[-8000:]}")


@pytest.fixture
def moto_s3(monkeypatch):
    """An S3 stand-in on loopback (moto's server) for tests whose subprocesses use S3: the AWS_*
    variables pointing at it are set in this process's environment (subprocesses inherit them) and
    returned."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    aws = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    for name, value in aws.items():
        monkeypatch.setenv(name, value)
    try:
        yield aws
    finally:
        server.stop()


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> tuple[Path, list[str]]:
    """12 deterministic text documents as a jsonl file ({"text": ...} per line) and as strings, for
    the Hugging Face model tests."""
    import json

    from tests.trainer.hf_fixtures import documents

    texts = documents(12)
    path = tmp_path_factory.mktemp("hf-docs") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path, texts
