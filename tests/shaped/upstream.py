# ruff: noqa: E501 (package tables read better unwrapped)
"""Stand-ins of what the roles fetch from upstream on a plain Ubuntu node, for the plain-Ubuntu layer (ubuntu.py):

- NVIDIA's cuda-keyring_1.1-1_all.deb: it lists NVIDIA's CUDA repository in sources.list.d and installs the
  repository's keyring, as the real one does, but the repository is a flat one in the layer. It carries
  cuda-toolkit-12-9 12.9.1-1 with its dependency chain down to cuda-nvcc-12-9 (version.json and nvcc), and,
  as the real repository does, its own builds of branch-named driver packages (nvidia-fabricmanager-535
  535.183.01-1, libnvidia-nscq-535), whose version sorts above Ubuntu's -0ubuntu0 one: the roles must not
  pick them;
- GDRCopy's v2.5.1 source release (what GitHub serves as .../archive/refs/tags/v2.5.1.tar.gz): its
  packages/build-deb-packages.sh is a stand-in that checks its inputs as the real one does and builds the real
  packages with dpkg-deb; gdrdrv-dkms's postinst builds the module for the running kernel and starts the
  package's init script, which loads it and creates /dev/gdrdrv;
- aws-efa-installer-1.47.0.tar.gz and its .sha256 next to it: a stand-in efa_installer.sh that installs the
  packages dlami.efa_packages lays out (as the DLAMI's installer left them) and writes its record;
- the build dependencies the cuda role installs for GDRCopy, in Ubuntu's archive: build-essential and what
  it depends on, debhelper, devscripts, fakeroot, pkg-config and the headers of the running kernel (the
  container shares this machine's); make is the stand-in that builds nccl-tests' tree;
- NCCL (libnccl2, libnccl-dev at the pin) in NVIDIA's repository and the nccl-tests source tarball, as the
  DLAMI layer has them (real ELF stand-ins, so ldd resolves for real).

Every script is a jinja2 template under templates/."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

from tests.shaped import dlami

DOWNLOADS = f"{dlami.SHAPE}/downloads"  # what the tests pass as the roles' download URLs
NVIDIA_REPO = f"{dlami.SHAPE}/nvidia-repo"  # the stand-in of NVIDIA's CUDA repository (flat)
CUDA_KEYRING = f"{DOWNLOADS}/cuda-keyring_1.1-1_all.deb"
CUDA_SOURCES = "/etc/apt/sources.list.d/cuda-ubuntu2204-x86_64.list"
CUDA_KEYRING_FILE = "/usr/share/keyrings/cuda-archive-keyring.gpg"
CUDA = "12.9.1"
NVCC = "12.9.86"
GDRCOPY = "2.5.1"
GDRCOPY_TARBALL = f"{DOWNLOADS}/v{GDRCOPY}.tar.gz"
EFA = dlami.EfaRelease(installer="1.47.0", libfabric="2.3.1amzn1.0", openmpi40="4.1.7-2", ofi_nccl="1.17.1-1",
                       peermem="1.2.2-1.amzn1", profile="1.7-1")
EFA_DRIVER = "2.17.2-1.amzn1"  # the installer's efa kernel driver (DKMS)
EFA_TARBALL = f"{DOWNLOADS}/aws-efa-installer-{EFA.installer}.tar.gz"
# The cuda role's GDRCopy build dependencies (cuda_gdrcopy_build_packages) that debuild checks
GDRCOPY_BUILD_DEPENDS = ("build-essential", "debhelper", "devscripts", "dkms", "fakeroot", "pkg-config")


def build_nvidia_repository(layer: Path, branch: str, upstream: str, elves: dict[str, Path]) -> None:
    """NVIDIA's CUDA repository (its packages for this test, NCCL's from the ELF stand-ins `elves`) and the
    cuda-keyring package that lists it."""
    repo = layer / NVIDIA_REPO.lstrip("/")
    repo.mkdir(parents=True)
    release = CUDA.rsplit(".", 1)[0]
    toolkit = f"/usr/local/cuda-{release}"
    flavour = release.replace(".", "-")
    nvidia = f"{upstream}-1"  # NVIDIA's revision of the driver branch
    for name, version, files, depends in [
        (f"cuda-toolkit-{flavour}", f"{CUDA}-1", {f"{toolkit}/version.json": dlami.VERSION_JSON.format(version=CUDA).encode()},
         f"cuda-compiler-{flavour} (>= {CUDA})"),
        (f"cuda-compiler-{flavour}", f"{CUDA}-1", {f"/usr/share/doc/cuda-compiler-{flavour}/copyright": b"stand-in\n"},
         f"cuda-nvcc-{flavour} (>= {NVCC})"),
        (f"cuda-nvcc-{flavour}", f"{NVCC}-1", {f"{toolkit}/bin/nvcc": dlami.NVCC.format(release=release, build=NVCC).encode()}, ""),
        (f"nvidia-fabricmanager-{branch}", nvidia, {"/usr/bin/nv-fabricmanager": dlami.fabricmanager(upstream).encode()},
         f"libnvidia-nscq-{branch} (= {nvidia})"),
        (f"libnvidia-nscq-{branch}", nvidia, {f"/usr/lib/x86_64-linux-gnu/libnvidia-nscq.so.{upstream}": b"\0"}, ""),
    ]:
        dlami.build_deb(repo, name, version, files, depends=depends)
    dlami.build_nccl(repo, dlami.NCCL, elves)
    dlami.write_repository(repo)
    downloads = layer / DOWNLOADS.lstrip("/")
    downloads.mkdir(parents=True, exist_ok=True)
    deb = dlami.build_deb(downloads, "cuda-keyring", "1.1-1", {
        CUDA_SOURCES: f"deb [signed-by={CUDA_KEYRING_FILE} trusted=yes] file:{NVIDIA_REPO} ./\n".encode(),
        CUDA_KEYRING_FILE: b"stand-in of NVIDIA's repository signing key\n",
    }, arch="all")
    assert deb.name == Path(CUDA_KEYRING).name


def build_dependencies(kernel: str) -> list[tuple[str, str, dict[str, bytes], str, dict[str, str]]]:
    """(name, version, files, Depends, links) of Ubuntu 22.04's packages GDRCopy's build needs. libc6-dev does
    not pin libc6: the node's libc6 is Debian's (the node image is Debian's, the archive Ubuntu's)."""
    def doc(name: str) -> dict[str, bytes]:
        return {f"/usr/share/doc/{name}/copyright": b"stand-in\n"}

    headers = f"/usr/src/linux-headers-{kernel}"
    return [
        ("build-essential", "12.9ubuntu3", doc("build-essential"),
         "libc6-dev | libc-dev, gcc (>= 4:10.2), g++ (>= 4:10.2), make, dpkg-dev (>= 1.17.11)", {}),
        ("libc6-dev", "2.35-0ubuntu3.8", doc("libc6-dev"), "", {}),
        ("gcc", "4:11.2.0-1ubuntu1", doc("gcc"), "", {}),
        ("g++", "4:11.2.0-1ubuntu1", doc("g++"), "gcc (>= 4:11.2.0-1ubuntu1)", {}),
        # nccl-tests' build runs it: the stand-in builds that tree (dlami.MAKE)
        ("make", "4.3-4.1build1", {"/usr/bin/make": dlami.MAKE.encode()}, "", {}),
        ("dpkg-dev", "1.21.1ubuntu2.3", doc("dpkg-dev"), "make", {}),
        ("debhelper", "13.6ubuntu1", doc("debhelper"), "dpkg-dev (>= 1.18.0~)", {}),
        ("devscripts", "2.22.1ubuntu1", doc("devscripts"), "dpkg-dev", {}),
        ("fakeroot", "1.28-1ubuntu1", doc("fakeroot"), "", {}),
        ("pkg-config", "0.29.2-1ubuntu3", doc("pkg-config"), "", {}),
        (f"linux-headers-{kernel}", kernel if kernel[0].isdigit() else f"0-{kernel}", {f"{headers}/Makefile": b"# stand-in\n"}, "",
         {f"/lib/modules/{kernel}/build": headers}),
    ]


def _tarball(path: Path, members: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755 if data[:2] == b"#!" else 0o644
            tar.addfile(info, io.BytesIO(data))


def build_gdrcopy_release(layer: Path) -> None:
    top = f"gdrcopy-{GDRCOPY}"
    _tarball(layer / GDRCOPY_TARBALL.lstrip("/"), {
        f"{top}/README.md": b"GDRCopy (stand-in of the source release)\n",
        f"{top}/packages/build-deb-packages.sh": dlami.render("gdrcopy-build-deb-packages.sh.j2", version=GDRCOPY,
                                                              build_depends=GDRCOPY_BUILD_DEPENDS).encode(),
        f"{top}/packages/dkms.conf": f'PACKAGE_NAME="gdrdrv-dkms"\nPACKAGE_VERSION="{GDRCOPY}"\nBUILT_MODULE_NAME[0]="gdrdrv"\n'.encode(),
        f"{top}/packages/dkms/gdrdrv.init": dlami.render("gdrdrv.init.j2").encode(),
        f"{top}/packages/dkms/postinst": dlami.render("gdrdrv-dkms.postinst.j2", version=GDRCOPY).encode(),
    })


def build_efa_installer(layer: Path, work: Path, elves: dict[str, Path]) -> None:
    """The installer tarball (top directory aws-efa-installer, as AWS's) and its .sha256."""
    debs = work / "efa-debs"
    debs.mkdir(parents=True)
    for name, version, files, depends in dlami.efa_packages(EFA, elves):
        dlami.build_deb(debs, name, version, files, depends=depends)
    dlami.build_deb(debs, "efa", EFA_DRIVER, {f"/usr/src/efa-{EFA_DRIVER.split('-')[0]}/dkms.conf": b"PACKAGE_NAME=efa\n"})
    members = {f"aws-efa-installer/DEBS/UBUNTU2204/x86_64/{deb.name}": deb.read_bytes() for deb in sorted(debs.glob("*.deb"))}
    members["aws-efa-installer/efa_installer.sh"] = dlami.render("efa_installer.sh.j2", version=EFA.installer).encode()
    members["aws-efa-installer/efa_installed_packages"] = dlami.efa_record(EFA).encode()
    tarball = layer / EFA_TARBALL.lstrip("/")
    _tarball(tarball, members)
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    tarball.with_name(tarball.name + ".sha256").write_text(f"{digest}  {tarball.name}\n")


def build_downloads(layer: Path, archive: Path, work: Path, branch: str, upstream: str) -> None:
    """Everything above into the layer; the build dependencies into Ubuntu's archive (`archive`, whose
    repository index the caller writes)."""
    elves = dlami.build_elves(work / "elves")
    build_nvidia_repository(layer, branch, upstream, elves)
    kernel = os.uname().release
    for name, version, files, depends, links in build_dependencies(kernel):
        dlami.build_deb(archive, name, version, files, depends=depends, links=links,
                        arch="all" if name in ("build-essential", "debhelper", "devscripts", "dpkg-dev") else "amd64")
    build_gdrcopy_release(layer)
    build_efa_installer(layer, work, elves)
    dlami.nccl_tests_tarball(layer / dlami.NCCL_TESTS_TARBALL.lstrip("/"), elves["all_reduce_perf"])
