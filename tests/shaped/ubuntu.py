# ruff: noqa: E501 (package tables read better unwrapped)
"""A node layer shaped like a plain Ubuntu 22.04 p4d/p5 instance (no NVIDIA software), for the local
target's FSDPCTL_LOCAL_NODE_LAYER hook. Everything here is a stand-in and lives under tests/:

- the instance type's sys/proc/run tree under /opt/fsdp-shape (dlami.shape_tree) with no NVIDIA module
  loaded (no /proc/driver/nvidia/version) and blank NVMe instance store;
- a local apt repository standing in for Ubuntu's archive, the only source the node lists: the driver
  packages of branch 535 as canonical/nvidia-graphics-drivers (535-server-jammy, 535.183.01-0ubuntu0.22.04.1)
  declares them, open kernel modules flavour, with their real names, versions and relations, and Ubuntu's
  Fabric Manager and NSCQ (`nvidia-fabricmanager-535`, `libnvidia-nscq-535`) depending on exactly that
  `nvidia-kernel-common-535-server` version (LP #2129682 quotes the relation). NVIDIA's own naming
  (`nvidia-fabricmanager`, no branch) is not in it: that is NVIDIA's CUDA repository, which a plain image
  does not list;
- the DKMS package's postinst stands in for `dkms install`: the modules are built for the running kernel
  (modprobe can load them from then on) and the nvidia module's version banner is kept where the stand-in
  modprobe makes /proc/driver/nvidia/version from it on loading. Until then the stand-in nvidia-smi
  cannot reach the driver, as the real one cannot before a reboot or a modprobe;
- what the cuda and efa roles download (upstream.py): NVIDIA's cuda-keyring and its CUDA repository, GDRCopy's
  source release, the EFA installer; and in the archive, GDRCopy's build dependencies;
- a boot stand-in (templates/shape-boot.sh.j2, a unit early in every boot): the tree's modules are unloaded
  and the shaped devices' drivers loaded where the kernel has them, as udev's coldplug does, so that a reboot
  after the driver install loads the new nvidia module and nothing else does; nothing is mounted and no
  array assembled (the block-device stand-ins' state below);
- stand-in blkid, mdadm, mkfs.xfs, mount, findmnt and udevadm first on PATH (/usr/local/sbin), the ones the
  scratch program's tests use (tests/stand_ins.py), keeping the devices' signatures and the mount table
  under BLOCK_STATE: the kernel has no md driver and the instance store is no block device.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.shaped import dlami, upstream
from tests.stand_ins import block_device_stand_ins

ARCHIVE = f"{dlami.SHAPE}/archive"  # the stand-in Ubuntu archive (a flat apt repository)
# The stand-in block-device tools' state: each device's signatures, the mount table, their calls
BLOCK_STATE = f"{dlami.SHAPE}/block"
BRANCH = "535"
UPSTREAM = "535.183.01"
VERSION = f"{UPSTREAM}-0ubuntu0.22.04.1"  # every binary package of the source shares it
# What the image's boot does before anyone configures the node: its packages are installed. Its package
# index (none: the base image's lists are removed) dates from when the image was built, days before the
# node boots; apt's cache_valid_time reads that date, which on the freshly built local base image would be
# minutes old, so that an install would not fetch the index of the archive this layer adds.
BAKE = f"set -e; dpkg -i {dlami.IMAGE_DEBS}/*.deb >/dev/null; touch -d '30 days ago' /var/lib/apt/lists"
# Runs the boot stand-in early in every boot, before any unit that reads the driver.
BOOT_UNIT = """[Unit]
Description=Stand-in kernel and udev coldplug of the shaped node (tests/shaped)
DefaultDependencies=no
Before=sysinit.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/local/sbin/fsdp-shape-boot

[Install]
WantedBy=sysinit.target
"""
# dkms install, for the running kernel: what modprobe can load from now on, and the module's banner.
DKMS_POSTINST = f"""#!/bin/sh
set -e
mkdir -p {os.path.dirname(dlami.BUILT_NVIDIA)}
printf '%s' '{dlami.nvrm_banner(UPSTREAM)}' > {dlami.BUILT_NVIDIA}
for module in nvidia nvidia_uvm nvidia_modeset nvidia_drm; do
  grep -qx "$module" {dlami.SHAPE}/modules.available || echo "$module" >> {dlami.SHAPE}/modules.available
done
"""


def _alias(name: str) -> dict[str, str]:
    """Conflicts/Replaces/Provides of one virtual name: only one package of any branch provides it."""
    return {"Conflicts": name, "Replaces": name, "Provides": name}


def archive_packages() -> list[tuple[str, str, dict[str, bytes], str, dict[str, str], str]]:
    """(name, version, files, Depends, other relations, postinst) of every package in the archive."""
    b, v, up = BRANCH, VERSION, UPSTREAM
    # the driver packages' bound on the kernel-common package: any Ubuntu revision of this upstream release
    common = f"nvidia-kernel-common-{b}-server (<= {up}-1), nvidia-kernel-common-{b}-server (>= {up})"
    library = "/usr/lib/x86_64-linux-gnu"
    return [
        ("dkms", "2.8.7-2ubuntu2", {"/usr/sbin/dkms": b"#!/bin/sh\n"}, "", {}, ""),
        (f"nvidia-firmware-{b}-server-{up}", v, {f"/lib/firmware/nvidia/{up}/gsp_ga10x.bin": b"\0"}, "", {}, ""),
        (f"nvidia-kernel-common-{b}-server", v, {"/lib/udev/rules.d/71-nvidia.rules": b"# stand-in\n"},
         f"nvidia-firmware-{b}-server-{up}", _alias("nvidia-kernel-common"), ""),
        (f"nvidia-kernel-source-{b}-server-open", v, {f"/usr/src/nvidia-srv-{up}/dkms.conf": b"PACKAGE_NAME=nvidia-srv\n"},
         "", _alias("nvidia-kernel-source"), ""),
        (f"nvidia-dkms-{b}-server-open", v, {f"/usr/share/doc/nvidia-dkms-{b}-server-open/README": b"stand-in\n"},
         f"dkms, nvidia-kernel-source-{b}-server-open (<= {up}-1), nvidia-kernel-source-{b}-server-open (>= {up}), {common}",
         _alias("nvidia-dkms-kernel"), DKMS_POSTINST),
        (f"libnvidia-compute-{b}-server", v, {f"{library}/libnvidia-ml.so.{up}": b"\0"}, "",
         _alias("libnvidia-compute"), ""),
        (f"libnvidia-cfg1-{b}-server", v, {f"{library}/libnvidia-cfg.so.{up}": b"\0"}, "", _alias("libnvidia-cfg1-any"), ""),
        (f"nvidia-compute-utils-{b}-server", v,
         {"/usr/bin/nvidia-persistenced": dlami.PERSISTENCED.encode(),
          "/lib/systemd/system/nvidia-persistenced.service": dlami.PERSISTENCED_UNIT.encode()},
         f"libnvidia-compute-{b}-server, adduser", _alias("nvidia-compute-utils, nvidia-persistenced"), ""),
        (f"nvidia-utils-{b}-server", v, {"/usr/bin/nvidia-smi": dlami.nvidia_smi(up).encode()}, "",
         _alias("nvidia-utils, nvidia-smi"), ""),
        (f"nvidia-headless-no-dkms-{b}-server-open", v, {}, f"{common}, nvidia-kernel-source-{b}-server-open (= {v}), "
         f"libnvidia-compute-{b}-server (= {v}), nvidia-compute-utils-{b}-server (= {v}), libnvidia-cfg1-{b}-server (= {v})",
         {}, ""),
        (f"nvidia-headless-{b}-server-open", v, {}, f"nvidia-headless-no-dkms-{b}-server-open, nvidia-dkms-{b}-server-open",
         _alias("nvidia-headless"), ""),
        (f"nvidia-fabricmanager-{b}", v,
         {"/usr/bin/nv-fabricmanager": dlami.fabricmanager(up).encode(),
          "/lib/systemd/system/nvidia-fabricmanager.service":
              dlami.SERVICE.format(description="NVIDIA fabric manager service", command="/usr/bin/nv-fabricmanager").encode()},
         f"nvidia-kernel-common-{b}-server (= {v})", {}, ""),
        (f"libnvidia-nscq-{b}", v, {f"{library}/libnvidia-nscq.so.{up}": b"\0"}, f"nvidia-kernel-common-{b}-server (= {v})",
         {}, ""),
    ]


def build_layer(layer: Path, instance_type: str, work: Path, host_name: str) -> Path:
    """The whole layer for FSDPCTL_LOCAL_NODE_LAYER (`work`: a scratch directory for its build; `host_name`:
    the node's, which mdadm writes into the array's members); returns `layer`."""
    dlami.shape_tree(layer, instance_type, ["efa"])
    # Ubuntu's kernel has the EFA driver in-tree, loaded at boot by the boot stand-in
    dlami.install_command(layer, "usr/local/sbin/fsdp-shape-boot", dlami.render("shape-boot.sh.j2", block_state=BLOCK_STATE))
    units = layer / "etc/systemd/system"
    (units / "sysinit.target.wants").mkdir(parents=True)
    (units / "fsdp-shape-boot.service").write_text(BOOT_UNIT)
    (units / "sysinit.target.wants/fsdp-shape-boot.service").symlink_to("../fsdp-shape-boot.service")
    (layer / "etc/apt").mkdir(parents=True, exist_ok=True)
    (layer / "etc/apt/sources.list").write_text(f"# the stand-in Ubuntu archive\ndeb [trusted=yes] file:{ARCHIVE} ./\n")
    image = layer / dlami.IMAGE_DEBS.lstrip("/")
    image.mkdir(parents=True)
    dlami.build_deb(image, "initramfs-tools", "0.140ubuntu13.5", {"/usr/sbin/update-initramfs": dlami.INITRAMFS.encode()})
    archive = layer / ARCHIVE.lstrip("/")
    archive.mkdir(parents=True)
    for name, version, files, depends, relations, postinst in archive_packages():
        dlami.build_deb(archive, name, version, files, depends=depends, relations=relations, postinst=postinst,
                        arch="all" if name == "dkms" else "amd64")
    upstream.build_downloads(layer, archive, work, BRANCH, UPSTREAM)
    dlami.write_repository(archive)
    # The kernel has no md driver and the instance store is no block device: the block-device tools are
    # stand-ins, first on every PATH (root's, the scratch unit's), that keep the devices' state in BLOCK_STATE
    (layer / BLOCK_STATE.lstrip("/") / "dev").mkdir(parents=True)
    for name, body in block_device_stand_ins(Path(BLOCK_STATE), Path(dlami.SHAPE), host_name).items():
        dlami.install_command(layer, f"usr/local/sbin/{name}", f"#!/bin/bash\n{body}\n")
    os.chmod(layer, 0o755)
    return layer
