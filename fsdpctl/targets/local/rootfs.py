"""The Debian bookworm root file system every local node boots from (read-only overlay base).

Built once by debootstrap, then cached under `$FSDPCTL_CACHE` (default `~/.cache/fsdp-cluster`) as
a zstd tarball plus its extracted tree. Nodes have no package repository, so the image carries
everything the `common` Ansible role installs: the list `common_base_packages` is read from that
role's defaults (one source of truth) and hashed into the cache key, so changing the list builds a
new image. Builds run under an fcntl lock, so concurrent `fsdpctl up` runs wait for one builder.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from fsdpctl.checkout import ANSIBLE_DIR
from fsdpctl.errors import CommandError
from fsdpctl.filelock import exclusive

SUITE = "bookworm"
# What a node needs to be a host Ansible and the trainer can use, whatever the roles add.
BASE_PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "openssh-server", "openssh-sftp-server", "python3",
    "python3-venv", "iproute2", "iputils-ping", "procps", "kmod", "sudo",
    # The slurm role's `slurm_packages` (Debian slurm-wlm and munge; tests/slurm checks they match).
    "munge", "slurm-client", "slurmctld", "slurmd",
)
# Bump when the customisation below changes, so cached images built the old way are not reused.
RECIPE_VERSION = 2
# Units that can only fail in a container (no NVMe-oF fabric), masked so a healthy node boots
# "running", not "degraded".
MASKED_UNITS = ("nvmf-autoconnect.service",)
COMMON_DEFAULTS = ANSIBLE_DIR / "roles/common/defaults/main.yml"
# Other roles whose packages the offline image must carry: (defaults file, list variable).
ROLE_PACKAGE_LISTS = ((ANSIBLE_DIR / "roles/monitoring/defaults/main.yml", "monitoring_packages"),)
# Services the image's packages enable at boot that a role starts where (and how) it is wanted:
# Prometheus runs on one node only, and both would listen on every address until configured.
DISABLED_UNITS = ("prometheus.service", "prometheus-node-exporter.service")
READY_MARKER = ".fsdp-rootfs-ready"


def cache_dir() -> Path:
    return Path(os.environ.get("FSDPCTL_CACHE") or Path.home() / ".cache/fsdp-cluster").absolute()


def role_packages(defaults_file: Path = COMMON_DEFAULTS, key: str = "common_base_packages") -> list[str]:
    """A package list (`common_base_packages` by default) from a role's defaults (the image must
    carry what the offline nodes cannot install)."""
    if not defaults_file.exists():
        raise CommandError(f"{defaults_file} does not exist: the node image's packages come from the common "
                           "role; run fsdpctl from a checkout of the fsdp-cluster repository")
    data = yaml.safe_load(defaults_file.read_text()) or {}
    packages = data.get(key, [])
    if not isinstance(packages, list) or not all(isinstance(p, str) and p for p in packages):
        raise CommandError(f"{defaults_file}: {key} must be a list of Debian package "
                           f"names (got {packages!r}); fix the role defaults")
    return packages


def image_packages(defaults_file: Path = COMMON_DEFAULTS) -> list[str]:
    extra = {p for path, key in ROLE_PACKAGE_LISTS for p in role_packages(path, key)}
    return sorted(set(BASE_PACKAGES) | set(role_packages(defaults_file)) | extra)


def cache_key(packages: list[str]) -> str:
    recipe = json.dumps({"suite": SUITE, "packages": packages, "recipe": RECIPE_VERSION}, sort_keys=True)
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def apt_mirror() -> str:
    """The Debian mirror this host's apt uses for the suite (deb822 sources first, then one-line)."""
    for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        for stanza in Path(path).read_text().split("\n\n"):
            fields = {}
            for line in stanza.splitlines():
                if ":" in line and not line.lstrip().startswith("#"):
                    key, value = line.split(":", 1)
                    fields[key.strip()] = value.strip()
            if "deb" in fields.get("Types", "").split() and SUITE in fields.get("Suites", "").split():
                return fields["URIs"].split()[0]
    for path in ["/etc/apt/sources.list", *glob.glob("/etc/apt/sources.list.d/*.list")]:
        if os.path.exists(path):
            for line in Path(path).read_text().splitlines():
                m = re.match(rf"\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+{SUITE}\s", line)
                if m:
                    return m.group(1)
    return "http://deb.debian.org/debian"


def ensure_rootfs(progress: Callable[[str], None] = print) -> Path:
    """The extracted, ready base image for the current package list; built or unpacked if needed."""
    packages = image_packages()
    key = cache_key(packages)
    root = cache_dir() / f"{SUITE}-{key}"
    if (root / READY_MARKER).exists():
        return root
    tarball = root.with_name(root.name + ".tar.zst")
    lock_path = cache_dir() / "rootfs.lock"
    with exclusive(lock_path):
        if (root / READY_MARKER).exists():  # another builder finished while we waited
            return root
        _remove_tree(root)
        if tarball.exists():
            progress(f"rootfs: unpacking cached image {tarball}")
            _unpack(tarball, root)
        else:
            progress(f"rootfs: building Debian {SUITE} image {key} with debootstrap (first use, about a "
                     f"minute); {len(packages)} packages requested")
            started = time.monotonic()
            build = root.with_name(root.name + ".build")
            partial = tarball.with_name(tarball.name + ".partial")
            _remove_tree(build)
            try:
                _debootstrap(build, packages, progress)
                _customise(build)
                progress("rootfs: compressing the image into the cache")
                _run(["tar", "--numeric-owner", "-I", "zstd -T0 -3", "-cf", str(partial), "-C", str(build),
                      "."])
                partial.rename(tarball)
                build.rename(root)
            except BaseException:
                progress("rootfs: build stopped; removing the partial image")
                _remove_tree(build)
                partial.unlink(missing_ok=True)
                raise
            progress(f"rootfs: image ready in {time.monotonic() - started:.0f} s: {tarball} "
                     f"({tarball.stat().st_size / 2**20:.0f} MiB)")
        (root / READY_MARKER).write_text(json.dumps({"packages": packages}) + "\n")
        _prune_images(keep=root, progress=progress)
    return root


def _prune_images(keep: Path, progress: Callable[[str], None]) -> None:
    """Remove images built for other package lists, unless a running node's overlay still uses one."""
    with open("/proc/self/mounts") as mounts:
        in_use = " ".join(line for line in mounts if line.startswith("overlay "))
    for old in keep.parent.glob(f"{SUITE}-*"):
        image = old.with_name(old.name.removesuffix(".tar.zst"))
        if image == keep or not re.fullmatch(rf"{SUITE}-[0-9a-f]{{16}}", image.name):
            continue
        if f"lowerdir={image}," in in_use or f"lowerdir={image}:" in in_use:
            continue
        progress(f"rootfs: removing {old.name}, built for another package list")
        if old.is_dir():
            _remove_tree(old)
        else:
            old.unlink(missing_ok=True)


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode:
        raise CommandError(f"`{' '.join(argv)}` failed ({result.returncode}): "
                           f"{result.stderr.strip()[-1500:]}")


def _remove_tree(path: Path) -> None:
    """Remove a half-built tree; a killed debootstrap can leave proc/sys mounted inside it."""
    if not path.exists():
        return
    prefix = str(path.resolve()) + "/"
    with open("/proc/self/mounts") as mounts:
        inside = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
    for mount_point in sorted(inside, key=len, reverse=True):
        subprocess.run(["umount", "-l", mount_point], capture_output=True)
    shutil.rmtree(path)


def _unpack(tarball: Path, root: Path) -> None:
    staging = root.with_name(root.name + ".unpack")
    _remove_tree(staging)
    staging.mkdir(parents=True)
    _run(["tar", "--numeric-owner", "-I", "zstd -d", "-xf", str(tarball), "-C", str(staging)])
    staging.rename(root)


def _debootstrap(target: Path, packages: list[str], progress: Callable[[str], None]) -> None:
    """Run debootstrap into target, showing its progress. A failed run removes target; an interrupted one
    is stopped with everything it started (the caller removes target)."""
    argv = ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", SUITE, str(target),
            apt_mirror()]
    target.parent.mkdir(parents=True, exist_ok=True)
    # Its own process group, so an interrupted build can stop debootstrap and everything it started.
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        tail = _follow_debootstrap(proc, progress)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.wait():
        log = target / "debootstrap/debootstrap.log"
        detail = "\n".join(tail[-15:])
        if log.exists():
            detail += "\n" + "\n".join(log.read_text().splitlines()[-15:])
        _remove_tree(target)
        raise CommandError(f"debootstrap of Debian {SUITE} failed (exit {proc.returncode}); a package in "
                           f"{COMMON_DEFAULTS.name} (common_base_packages) may not exist in {SUITE}, or the "
                           f"mirror is unreachable:\n{detail}")


def _follow_debootstrap(proc: subprocess.Popen, progress: Callable[[str], None]) -> list[str]:
    """Condense debootstrap's per-package log into one line per phase plus a heartbeat; returns the
    last lines of output (for an error message)."""
    tail: list[str] = []
    phase, count, last_report = "", 0, time.monotonic()
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = [*tail[-40:], line.rstrip()]
        m = re.match(r"I: (\w+)", line)
        if not m:
            continue
        # debootstrap alternates Retrieving/Validating per package: one download phase.
        verb = "Downloading" if m.group(1) in ("Retrieving", "Validating") else m.group(1)
        if verb != phase:
            phase, count = verb, 0
            progress("rootfs: " + ("Downloading packages" if verb == "Downloading" else line[3:].strip()))
            last_report = time.monotonic()
        count += 1
        if time.monotonic() - last_report > 10:
            progress(f"rootfs: {phase} ... {count} steps")
            last_report = time.monotonic()
    return tail


def _customise(root: Path) -> None:
    """Make the image node-neutral: per-node identity (keys, machine-id) is written at node start."""
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*_*",
                    "usr/share/doc/*", "usr/share/man/*", "usr/share/locale/*", "etc/ssh/ssh_host_*"):
        for path in glob.glob(str(root / pattern)):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
    # Nodes have no DNS server; a resolver that answers nothing at once keeps getfqdn from stalling.
    (root / "etc/resolv.conf").unlink(missing_ok=True)
    (root / "etc/resolv.conf").write_text("nameserver 127.0.0.1\n")
    # An empty machine-id means "generate on first boot"; each node gets its own before booting.
    (root / "etc/machine-id").write_text("")
    (root / "var/lib/dbus/machine-id").unlink(missing_ok=True)
    wants = root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    networkd = wants / "systemd-networkd.service"
    if not networkd.is_symlink():
        networkd.symlink_to("/lib/systemd/system/systemd-networkd.service")
    for unit in DISABLED_UNITS:
        (wants / unit).unlink(missing_ok=True)
    for unit in MASKED_UNITS:
        masked = root / "etc/systemd/system" / unit
        masked.unlink(missing_ok=True)
        masked.symlink_to("/dev/null")
