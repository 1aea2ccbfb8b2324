"""What the host needs before local nodes can exist: root, and a few commands from Debian packages."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

from fsdpctl.errors import UsageError

# command -> Debian package that provides it
REQUIRED_COMMANDS = {
    "systemd-nspawn": "systemd-container",
    "debootstrap": "debootstrap",
    "zstd": "zstd",
    "tar": "tar",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "ip": "iproute2",
    "mount": "mount",
    "umount": "mount",
    "nsenter": "util-linux",
}


def missing_commands(which: Callable[[str], str | None] = shutil.which) -> dict[str, str]:
    """The required commands that are not on PATH, each with the package that provides it."""
    return {cmd: pkg for cmd, pkg in REQUIRED_COMMANDS.items() if which(cmd) is None}


def require_host(action: str, *, euid: int | None = None,
                 which: Callable[[str], str | None] = shutil.which) -> None:
    """Raise UsageError naming what is missing and the command that fixes it."""
    if (os.geteuid() if euid is None else euid) != 0:
        raise UsageError(
            f"{action} needs root: local nodes are systemd-nspawn containers on a bridge with overlay "
            "mounts, which only root may create. Run it again as root (e.g. with sudo).")
    missing = missing_commands(which)
    if missing:
        packages = sorted(set(missing.values()))
        listed = ", ".join(f"{cmd} (package {pkg})" for cmd, pkg in missing.items())
        raise UsageError(
            f"{action} needs commands that are not on PATH: {listed}. Install them with: "
            f"apt-get update && apt-get install -y --no-install-recommends {' '.join(packages)}")
