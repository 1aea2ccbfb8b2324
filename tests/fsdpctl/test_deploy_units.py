"""Deploy's pure parts: the requirement list, the pip platform flags, the source hash, node agreement."""

from __future__ import annotations

import subprocess
import sys
import time
import tomllib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fsdpctl import deploy as deploy_mod
from fsdpctl.deploy import (
    DeployError,
    NodePlatform,
    _common_platform,
    snapshot_sources,
    trainer_pyproject,
    trainer_requirements,
)
from fsdpctl.targets.local.rootfs import role_packages


def test_requirements_pin_torch_or_leave_it_to_the_node():
    pinned = trainer_requirements("torch==2.13.0+cpu")
    assert "torch==2.13.0+cpu" in pinned
    assert not any(r.startswith("torch") and r != "torch==2.13.0+cpu" for r in pinned)
    assert {"numpy", "pydantic", "pyyaml"} <= {r.split(">")[0].split("=")[0].lower() for r in pinned}
    assert not any(r.lower().startswith("torch") for r in trainer_requirements(None))


def test_platform_flags_select_wheels_for_the_nodes_python_and_glibc():
    args = NodePlatform("3.11", "x86_64", "2.36").pip_target_args()
    assert args[args.index("--python-version") + 1] == "3.11"
    assert "cp311" in args and "--only-binary=:all:" in args
    platforms = [args[i + 1] for i, a in enumerate(args) if a == "--platform"]
    assert "manylinux_2_36_x86_64" in platforms and "manylinux_2_17_x86_64" in platforms
    assert "manylinux_2_37_x86_64" not in platforms  # newer than the node's glibc
    assert "manylinux2014_x86_64" in platforms


PYPROJECT = """[project]
name = "fsdp-cluster"
version = "1.2.3"
requires-python = ">=3.11"
dependencies = ["pydantic>=2.7", "shtab>=1.7"]

[project.optional-dependencies]
trainer = ["torch>=2.13", "numpy>=1.26", "pydantic>=2.7"]
"""


def _checkout(root):
    for rel, text in {"pyproject.toml": PYPROJECT, "README.md": "r\n", "infra/a.py": "A = 1\n",
                      "fsdpctl/cli.py": "C = 1\n", "trainer/b.py": "B = 1\n",
                      "trainer/configs/c.yaml": "c: 1\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "trainer/__pycache__").mkdir()
    (root / "trainer/__pycache__/b.cpython-311.pyc").write_bytes(b"\0")


def test_snapshot_holds_the_trainer_alone_and_its_hash_follows_content(tmp_path):
    root = tmp_path / "src"
    _checkout(root)
    first = snapshot_sources(tmp_path / "s1", root)
    assert snapshot_sources(tmp_path / "s2", root) == first
    files = sorted(str(p.relative_to(tmp_path / "s1")) for p in (tmp_path / "s1").rglob("*") if p.is_file())
    # The nodes get the trainer package and its own pyproject: no operator tool, no Pulumi program.
    assert files == ["pyproject.toml", "trainer/b.py", "trainer/configs/c.yaml"]
    (root / "trainer/b.py").write_text("B = 2\n")
    assert snapshot_sources(tmp_path / "s3", root) != first
    (root / "fsdpctl/cli.py").write_text("C = 2\n")  # operator code is not in the wheel
    assert snapshot_sources(tmp_path / "s4", root) == snapshot_sources(tmp_path / "s3", root)


def test_trainer_pyproject_takes_the_trainer_extra_as_its_requirements(tmp_path):
    _checkout(tmp_path)
    project = tomllib.loads(trainer_pyproject(tmp_path))["project"]
    assert project["name"] == "fsdp-trainer" and project["version"] == "1.2.3"
    assert project["dependencies"] == ["torch>=2.13", "numpy>=1.26", "pydantic>=2.7"]
    assert project["scripts"] == {"fsdp-train": "trainer.__main__:entry"}
    assert "shtab>=1.7" not in trainer_requirements(None, tmp_path)


def test_the_repository_trainer_wheel_installs_without_the_operator_tool(tmp_path):
    """Build the real wheel from this checkout and look inside: trainer only."""
    snapshot_sources(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(tmp_path / "src")], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("fsdp_trainer-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert packages == {"trainer"}
    assert "trainer/configs/smoke.yaml" in names and "trainer/checkpoint/__main__.py" in names


def _facts(python="3.11", machine="x86_64", glibc="2.36", venv=True):
    return {"python": python, "machine": machine, "glibc": glibc, "torch": None, "gpus": 0, "home": "/root",
            "venv_module": venv}


def test_nodes_must_agree_on_python_and_have_venv():
    assert _common_platform({0: _facts(glibc="2.36"), 1: _facts(glibc="2.35")}) == \
        NodePlatform("3.11", "x86_64", "2.35")
    with pytest.raises(DeployError, match="different Pythons"):
        _common_platform({0: _facts(), 1: _facts(python="3.10")})
    with pytest.raises(DeployError, match=r"node\(s\) \[1\] lack Python's venv") as missing:
        _common_platform({0: _facts(), 1: _facts(venv=False)})
    # what the message promises: the common role installs it (plain Ubuntu images lack it)
    assert "the common role installs python3-venv" in str(missing.value)
    assert "python3-venv" in role_packages()


def test_two_deploys_at_once_build_the_bundle_once_and_share_it(tmp_path, monkeypatch):
    """Two clusters deployed from one machine at once share the cache: pip (a stand-in here, as it
    would download) must never run for both at the same time, and the second reuses the first's."""
    monkeypatch.setenv("FSDPCTL_CACHE", str(tmp_path / "cache"))
    running, calls, overlaps = [], [], []

    def pip(args: list[str], what: str) -> None:
        overlaps.append(len(running))
        running.append(what)
        calls.append(args[0])
        time.sleep(0.3)
        out = Path(args[args.index("--dest" if args[0] == "download" else "-w") + 1])
        out.mkdir(parents=True, exist_ok=True)
        name = "numpy-2.0.0-cp311-cp311-manylinux_2_17_x86_64.whl" if args[0] == "download" else \
            "fsdp_cluster_trainer-0.1.0-py3-none-any.whl"
        (out / name).write_bytes(b"wheel")
        running.remove(what)

    monkeypatch.setattr(deploy_mod, "_run_pip", pip)
    platform = NodePlatform("3.11", "x86_64", "2.36")
    with ThreadPoolExecutor(2) as pool:
        bundles = list(pool.map(lambda _: deploy_mod.build_bundle(platform, "torch==2.13.0+cpu"), range(2)))
    assert overlaps == [0, 0] and calls == ["download", "wheel"]
    assert bundles[0] == bundles[1] and bundles[0].trainer_wheel.endswith(".whl")
