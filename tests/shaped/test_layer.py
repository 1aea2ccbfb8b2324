"""The local target's node-layer hook and the DLAMI-shaped layer itself, without booting nodes."""

from __future__ import annotations

import os

import pytest

from fsdpctl.errors import UsageError
from fsdpctl.targets.local.nodes import LAYER_ENV, node_layer
from tests.ansible.conftest import detect_hardware
from tests.shaped import dlami, ubuntu


def test_node_layer_names_the_variable_for_a_bad_value(monkeypatch, tmp_path):
    monkeypatch.delenv(LAYER_ENV, raising=False)
    assert node_layer() is None
    monkeypatch.setenv(LAYER_ENV, str(tmp_path))
    assert node_layer() == tmp_path
    for bad in ("relative/dir", str(tmp_path / "missing")):
        monkeypatch.setenv(LAYER_ENV, bad)
        with pytest.raises(UsageError, match=f"{LAYER_ENV}=.*not an absolute path to a directory"):
            node_layer()


@pytest.mark.parametrize(
    ("instance_type", "nvswitches", "efas", "model"),
    [("p4d.24xlarge", 6, 4, "NVIDIA A100-SXM4-40GB"), ("p5.48xlarge", 4, 32, "NVIDIA H100 80GB HBM3")],
)
def test_dlami_layer_has_the_types_hardware_with_links_that_resolve_inside_the_node(
    tmp_path, instance_type, nvswitches, efas, model
):
    layer = dlami.build_layer(tmp_path / "layer", instance_type, tmp_path)
    shape = layer / dlami.SHAPE.lstrip("/")
    links = [p for p in shape.rglob("*") if p.is_symlink()]
    assert links and not [p for p in links if os.path.isabs(os.readlink(p))]
    found = detect_hardware(shape)
    assert (found["gpu_count"], found["nvswitch_count"], found["efa_count"]) == (8, nvswitches, efas)
    # the loaded driver names the model and numbers the GPUs (its entry for each, as on the image)
    assert found["gpu_model"] == model
    assert [d["file"] for d in found["gpu_devices"]] == [f"/dev/nvidia{n}" for n in range(8)]
    assert len(found["nvme_instance_store"]) == 8
    assert set(map(tuple, found["nvme_holders"].values())) == {("md127",)}
    assert found["peermem_modules"] == ["efa_nv_peermem"] and found["nvidia_kernel_module"] == "open"
    assert found["container"] == "systemd-nspawn"
    packages = (layer / dlami.REPO.lstrip("/") / "Packages").read_text()
    assert "Package: libnccl-dev\nVersion: 2.29.3-1+cuda12.9" in packages
    assert "Depends: libnccl2 (= 2.29.3-1+cuda12.9)" in packages


def test_plain_ubuntu_layer_has_the_hardware_and_no_nvidia_software(tmp_path):
    layer = ubuntu.build_layer(tmp_path / "layer", "p4d.24xlarge", tmp_path, "node0")
    found = detect_hardware(layer / dlami.SHAPE.lstrip("/"))
    assert (found["gpu_count"], found["nvswitch_count"], found["efa_count"]) == (8, 6, 4)
    assert found["nvidia_kernel_module"] == "" and found["peermem_modules"] == []
    assert not any(found["nvme_holders"].values())  # blank instance store
    packages = (layer / ubuntu.ARCHIVE.lstrip("/") / "Packages").read_text()
    version = "535.183.01-0ubuntu0.22.04.1"
    # Ubuntu's Fabric Manager and NSCQ: exactly the kernel-common version
    for name in ("nvidia-fabricmanager-535", "libnvidia-nscq-535"):
        stanza = next(s for s in packages.split("\n\n") if s.startswith(f"Package: {name}\n"))
        assert f"\nVersion: {version}\n" in stanza
        assert f"\nDepends: nvidia-kernel-common-535-server (= {version})\n" in stanza
    assert "Package: nvidia-fabricmanager\n" not in packages  # NVIDIA's naming is its own repository's
