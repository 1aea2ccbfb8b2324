"""Without root: the names and addresses a local cluster will use, and the rootfs cache's lock and
unpack path (a small stand-in tarball under a private FSDPCTL_CACHE)."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fsdpctl.errors import CommandError
from fsdpctl.processes import alive
from fsdpctl.state import cluster_state
from fsdpctl.targets.local import rootfs
from fsdpctl.targets.local.nodes import make_plan
from infra.spec import load_spec
from tests.local.conftest import REPO, missing_prerequisite, spec_file


def test_plan_addresses_names_and_gateway(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    spec = load_spec(spec_file(tmp_path, "lnt-plan"))
    plan = make_plan(cluster_state("lnt-plan"), spec, 254 - 2, Path("/image"))
    assert (plan.bridge_address, plan.gateway) == ("198.18.1.1", "198.18.1.254")
    assert [n.address for n in plan.nodes[:2]] == ["198.18.1.2", "198.18.1.3"]
    assert plan.nodes[-1].address == "198.18.1.253"
    assert [n.name for n in plan.nodes[:2]] == ["lnt-plan-node0", "lnt-plan-node1"]
    assert all(len(name) <= 15 for name in [plan.bridge, *(n.veth for n in plan.nodes)])
    assert len({n.machine_id for n in plan.nodes}) == len(plan.nodes)
    # another FSDPCTL_HOME, same cluster name: no shared link names
    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "other-home"))
    assert make_plan(cluster_state("lnt-plan"), spec, 2, Path("/image")).bridge != plan.bridge


def test_plan_refuses_more_nodes_than_the_subnet_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    spec = load_spec(spec_file(tmp_path, "lnt-small", local={"subnet_cidr": "198.18.1.0/28"}))
    make_plan(cluster_state("lnt-small"), spec, 12, Path("/image"))
    with pytest.raises(CommandError, match=r"node_count 13: local.subnet_cidr 198.18.1.0/28 holds 1 to 12"):
        make_plan(cluster_state("lnt-small"), spec, 13, Path("/image"))


def test_rootfs_waits_for_the_lock_unpacks_the_cached_tarball_and_prunes_old_images(tmp_path, monkeypatch):
    if not shutil.which("zstd"):
        missing_prerequisite("zstd is not installed (make host-packages)")
    cache = tmp_path / "cache"
    monkeypatch.setenv("FSDPCTL_CACHE", str(cache))
    key = rootfs.cache_key(rootfs.image_packages())
    content = tmp_path / "content"
    (content / "etc").mkdir(parents=True)
    (content / "etc/os-release").write_text("ID=debian\n")
    cache.mkdir()
    tarball = cache / f"{rootfs.SUITE}-{key}.tar.zst"
    subprocess.run(["tar", "-I", "zstd", "-cf", str(tarball), "-C", str(content), "."], check=True)
    stale = cache / f"{rootfs.SUITE}-0123456789abcdef"  # an image for another package list
    (stale / "etc").mkdir(parents=True)
    stale.with_name(stale.name + ".tar.zst").write_bytes(b"old")
    (cache / "notes.txt").write_text("not an image\n")
    result: dict[str, Path] = {}
    messages: list[str] = []
    with open(cache / "rootfs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another builder is busy
        worker = threading.Thread(target=lambda: result.update(root=rootfs.ensure_rootfs(messages.append)))
        worker.start()
        worker.join(timeout=1)
        assert worker.is_alive() and not result, "ensure_rootfs must wait for the lock"
        fcntl.flock(lock, fcntl.LOCK_UN)
    worker.join(timeout=60)
    root = result["root"]
    assert root == cache / f"{rootfs.SUITE}-{key}"
    assert (root / "etc/os-release").read_text() == "ID=debian\n"
    assert (root / rootfs.READY_MARKER).exists()
    assert any("unpacking cached image" in m for m in messages)
    assert rootfs.ensure_rootfs(messages.append) == root  # ready: no lock, no work
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [root.name, tarball.name, "rootfs.lock", "notes.txt"])


def fake_debootstrap(bin_dir: Path, body: str) -> dict[str, str]:
    """PATH with a stand-in debootstrap (the real one needs root and a mirror)."""
    bin_dir.mkdir()
    script = bin_dir / "debootstrap"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


BUILD = """
from fsdpctl.targets.local import rootfs
print("ROOT", rootfs.ensure_rootfs(), flush=True)
"""


def test_failed_debootstrap_reports_its_error_and_leaves_no_partial_image(tmp_path):
    env = fake_debootstrap(tmp_path / "bin", 'echo "I: Retrieving InRelease"\n'
                                             'echo "E: Couldn\'t find these debs: no-such-package" >&2\n'
                                             'exit 1\n')
    cache = tmp_path / "cache"
    result = subprocess.run([sys.executable, "-c", BUILD], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, **env, "FSDPCTL_CACHE": str(cache)}, timeout=120)
    assert result.returncode != 0
    assert "debootstrap of Debian bookworm failed (exit 1)" in result.stderr
    assert "Couldn't find these debs: no-such-package" in result.stderr
    assert sorted(p.name for p in cache.iterdir()) == ["rootfs.lock"]


def test_interrupted_build_stops_debootstrap_and_removes_the_partial_image(tmp_path):
    env = fake_debootstrap(tmp_path / "bin", 'mkdir -p "$4/usr"; echo "I: Retrieving InRelease"\n'
                                             'echo "$$" > "$4/../debootstrap.pid"\nexec sleep 600\n')
    cache = tmp_path / "cache"
    # A shell that runs its jobs in the background hands them SIGINT ignored, and Python then never
    # turns SIGINT into KeyboardInterrupt: give the build the default disposition, as in a terminal.
    proc = subprocess.Popen([sys.executable, "-c", BUILD], cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, **env, "FSDPCTL_CACHE": str(cache)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pid_file = cache / "debootstrap.pid"
    while not pid_file.exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    debootstrap_pid = int(pid_file.read_text())
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert "build stopped; removing the partial image" in out
    assert sorted(p.name for p in cache.iterdir()) == ["debootstrap.pid", "rootfs.lock"]
    assert not alive(debootstrap_pid)
