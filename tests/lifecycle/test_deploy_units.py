"""Deploy's pure parts: the requirement list, the pip platform flags, the source hash, node agreement."""

from __future__ import annotations

import pytest

from infra.deploy import DeployError, NodePlatform, _common_platform, snapshot_sources, trainer_requirements


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


def test_source_hash_follows_content_and_snapshot_is_complete(tmp_path):
    root = tmp_path / "src"
    for rel, text in {"pyproject.toml": "[project]\n", "README.md": "r\n", "infra/a.py": "A = 1\n",
                      "trainer/b.py": "B = 1\n", "trainer/configs/c.yaml": "c: 1\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "infra/__pycache__").mkdir()
    (root / "infra/__pycache__/a.cpython-311.pyc").write_bytes(b"\0")
    first = snapshot_sources(tmp_path / "s1", root)
    assert snapshot_sources(tmp_path / "s2", root) == first
    assert (tmp_path / "s1/trainer/configs/c.yaml").read_text() == "c: 1\n"
    assert not (tmp_path / "s1/infra/__pycache__").exists()
    (root / "trainer/b.py").write_text("B = 2\n")
    assert snapshot_sources(tmp_path / "s3", root) != first


def _facts(python="3.11", machine="x86_64", glibc="2.36", venv=True):
    return {"python": python, "machine": machine, "glibc": glibc, "torch": None, "gpus": 0, "home": "/root",
            "venv_module": venv}


def test_nodes_must_agree_on_python_and_have_venv():
    assert _common_platform({0: _facts(glibc="2.36"), 1: _facts(glibc="2.35")}) == \
        NodePlatform("3.11", "x86_64", "2.35")
    with pytest.raises(DeployError, match="different Pythons"):
        _common_platform({0: _facts(), 1: _facts(python="3.10")})
    with pytest.raises(DeployError, match=r"node\(s\) \[1\] lack Python's venv"):
        _common_platform({0: _facts(), 1: _facts(venv=False)})
