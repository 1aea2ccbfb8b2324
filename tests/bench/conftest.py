"""Shared by the GPU-check tests: the summary parser as a module, and a copy of a recorded run."""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Recorded by `bench/gpu_check.sh --dry-run` on a 2-core CPU machine (tests/bench/data/README.md).
SAMPLE = Path(__file__).parent / "data" / "cpu-dry-run"


def _load_summary_module():
    spec = importlib.util.spec_from_file_location("gpu_summary", REPO / "bench" / "gpu_summary.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_summary"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def gs():
    return _load_summary_module()


@pytest.fixture
def work(tmp_path) -> Path:
    """A writable copy of the recorded dry run's step directories."""
    target = tmp_path / "steps"
    shutil.copytree(SAMPLE, target)
    return target
