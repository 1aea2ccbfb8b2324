"""`up --target local` refuses clearly, before creating anything, when not root or when a host
command is missing (simulated by an injected check and by a PATH without the command)."""

from __future__ import annotations

import os
import shutil

import pytest

from fsdpctl.errors import CommandError
from fsdpctl.targets.local.host import REQUIRED_COMMANDS, require_host
from fsdpctl.targets.local.rootfs import cache_key, image_packages, role_packages
from tests.local.conftest import fsdpctl, missing_prerequisite, spec_file


def test_not_root_is_refused_with_the_fix():
    with pytest.raises(CommandError, match=r"needs root.*sudo"):
        require_host("fsdpctl up --target local", euid=1000, which=lambda cmd: f"/usr/bin/{cmd}")


def test_missing_commands_name_the_package_and_the_apt_get_command():
    present = {"ssh", "ip", "tar", "mount", "umount", "ssh-keygen", "nsenter"}
    with pytest.raises(CommandError) as err:
        require_host("fsdpctl up --target local", euid=0,
                     which=lambda cmd: f"/usr/bin/{cmd}" if cmd in present else None)
    message = str(err.value)
    assert "systemd-nspawn (package systemd-container)" in message
    assert "apt-get install -y --no-install-recommends debootstrap systemd-container zstd" in message


def test_cli_without_systemd_nspawn_on_path_creates_nothing(tmp_path):
    if os.geteuid() != 0:
        missing_prerequisite("the root check comes first; this case needs root to reach the command check")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for cmd in REQUIRED_COMMANDS:
        if cmd != "systemd-nspawn" and shutil.which(cmd):
            (bin_dir / cmd).symlink_to(shutil.which(cmd))
    home = tmp_path / "home"
    result = fsdpctl(home, "up", str(spec_file(tmp_path, "lnt-nopkg")), "--target", "local",
                     env={"PATH": str(bin_dir)}, check=False)
    assert result.returncode == 2
    assert "systemd-nspawn (package systemd-container)" in result.stderr
    assert "apt-get install" in result.stderr
    assert not (home / "clusters").exists()


def test_rootfs_packages_come_from_the_common_role(tmp_path):
    defaults = tmp_path / "main.yml"
    defaults.write_text("common_base_packages:\n  - jq\n  - ethtool\n")
    assert role_packages(defaults) == ["jq", "ethtool"]
    packages = image_packages(defaults)
    assert {"jq", "ethtool", "openssh-server", "systemd", "python3-venv"} <= set(packages)
    other = tmp_path / "other.yml"
    other.write_text("common_base_packages:\n  - jq\n")
    assert cache_key(packages) != cache_key(image_packages(other))
    with pytest.raises(CommandError, match=r"absent\.yml does not exist"):
        image_packages(tmp_path / "absent.yml")
    # The repository's own role is found from wherever fsdpctl is installed.
    assert "mdadm" in role_packages()
    defaults.write_text("common_base_packages: jq\n")
    with pytest.raises(CommandError, match="common_base_packages must be a list"):
        role_packages(defaults)
