# ruff: noqa: E501 (stand-in scripts and package tables read better unwrapped)
"""A node layer shaped like a Deep Learning AMI (Ubuntu, Base OSS Nvidia Driver) on a p4d/p5 instance, for
the local target's FSDPCTL_LOCAL_NODE_LAYER hook. Everything here is a stand-in and lives under tests/:

- /opt/fsdp-shape: a sys/proc/run tree with the type's GPUs, NVSwitches, EFA devices and NVMe instance
  store (held by the DLAMI's md array), read by hardware_facts through fsdp_sysfs_root, and the loaded
  driver's entry for each GPU (/proc/driver/nvidia/gpus/ADDRESS/information: the type's GPU model as the
  driver names it, its device minor); p4d.24xlarge (8 A100, 6 NVSwitches, 4 EFA) and p5.48xlarge (8 H100,
  4 NVSwitches, 32 EFA) alike, every count from the instance catalog;
- stand-in modprobe/modinfo answering like kmod for the type's modules (loading one makes it appear in
  /opt/fsdp-shape/sys/module, gdrdrv makes /dev/gdrdrv, and an nvidia module a driver package's DKMS built
  makes /proc/driver/nvidia/version); shared with the plain Ubuntu layer (ubuntu.py), as are the stand-in
  nvidia-smi and nv-fabricmanager, which report the version of the package that ships them (nvidia-smi
  names each GPU by the model the driver's entry for it gives);
- a stand-in nvidia-persistenced that forks like the real daemon, packaged with the unit Ubuntu and NVIDIA
  ship (static, StopWhenUnneeded, --no-persistence-mode); the stand-in nvidia-smi reports persistence
  mode from the running daemon's own flag, as the driver would, not from the unit being active;
- Debian packages built here with dpkg-deb, with the real names, versions and dependencies: those the
  DLAMI ships (driver 595, Fabric Manager, GDRCopy 2.5.2, EFA installer 1.50.0's libfabric, Open MPI,
  aws-ofi-nccl 1.18.0, efa-nv-peermem) are installed at "image bake" time; those the roles install
  (CUDA toolkit, NCCL 2.29.3 and an older 2.27.7) sit in a local apt repository that the stand-in
  cuda-keyring points apt at;
- CUDA toolkits 12.8, 12.9 and 13.0 side by side under /usr/local/cuda-X.Y, installed by the image's
  runfiles (no package owns them), each with its version.json and nvcc;
- real ELF libraries and an all_reduce_perf binary built with the host's gcc (linked like nccl-tests:
  libnccl and libmpi, no rpath), so ldd on the node resolves them for real;
- the nccl-tests source tarball the nccl role unpacks, whose "build" copies that binary.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import jinja2

from infra import catalog
from tests.ansible.conftest import sysfs_tree

SHAPE = "/opt/fsdp-shape"  # the sysfs root on the node (fsdp_sysfs_root)
# Stand-in scripts kept as files (tests/shaped/templates). bash's ${#array[@]} would open a jinja2 comment:
# the templates have none.
TEMPLATES = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                               undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                               comment_start_string="{##", comment_end_string="##}")
REPO = f"{SHAPE}/repo"
IMAGE_DEBS = f"{SHAPE}/image-debs"
DRIVER = "595.71.05"
NCCL_TESTS_VERSION = "2.17.9"
NCCL_TESTS_TARBALL = f"{SHAPE}/src/nccl-tests-{NCCL_TESTS_VERSION}.tar.gz"
DLAMI_MOUNT = "/opt/dlami/nvme"
PERSISTENCED_RUN = "/run/nvidia-persistenced"  # where the real daemon writes its pid file
PERSISTENCED_PIDFILE = f"{PERSISTENCED_RUN}/nvidia-persistenced.pid"
# The nvidia module DKMS built for the running kernel (its version banner), where a driver package installed
# one: loading it makes /proc/driver/nvidia/version. The DLAMI's runfile driver is loaded at boot instead.
BUILT_NVIDIA = f"{SHAPE}/built/nvidia.version"
NCCL = "2.29.3-1+cuda12.9"  # the pin, as NVIDIA's repository versions it
OLDER_NCCL = "2.27.7-1+cuda12.9"  # what an earlier configure with an older pin would have left
# The GPU model as the NVIDIA driver names it (/proc/driver/nvidia/gpus/*/information, nvidia-smi's name),
# per catalog type: not the catalog's gpu_model, which is AWS's name for the part.
DRIVER_GPU_MODEL = {
    "p4d.24xlarge": "NVIDIA A100-SXM4-40GB",
    "p4de.24xlarge": "NVIDIA A100-SXM4-80GB",
    "p5.48xlarge": "NVIDIA H100 80GB HBM3",
    "p5e.48xlarge": "NVIDIA H200",
    "p5en.48xlarge": "NVIDIA H200",
}
# The image's CUDA toolkits (runfile installs under /usr/local/cuda-X.Y): version.json's version, nvcc's build.
IMAGE_CUDA = {"12.8": ("12.8.1", "12.8.93"), "12.9": ("12.9.1", "12.9.86"), "13.0": ("13.0.2", "13.0.88")}
# What the DLAMI's boot does before anyone configures the node: its packages are installed (the
# image), services enabled, the instance store mounted at /opt/dlami/nvme. The packaged persistenced
# unit is static (the driver's device pulls it in on a real node): started once, and systemd may stop it
# again, as StopWhenUnneeded makes it do on a real node. Its package index is minutes old, as on an image
# baked just before the launch: younger than the common role's cache_valid_time, so the roles that install
# from the image's NVIDIA repository must read it afresh (the plain-Ubuntu layer's is 30 days old).
BAKE = (f"set -e; dpkg -i {IMAGE_DEBS}/*.deb >/dev/null; systemctl daemon-reload; "
        "systemctl enable --now nvidia-fabricmanager >/dev/null 2>&1; systemctl start nvidia-persistenced; "
        f"mkdir -p {DLAMI_MOUNT}; mountpoint -q {DLAMI_MOUNT} || mount -t tmpfs -o size=64m dlami-nvme {DLAMI_MOUNT}; "
        "touch /var/lib/apt/lists")

# Stand-in commands -------------------------------------------------------------------------------
MODPROBE = f"""#!/bin/sh
# stand-in kmod modprobe: the shaped node's kernel has the modules listed in {SHAPE}/modules.available
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
name=$(echo "$1" | tr - _)
if ! grep -qx "$name" {SHAPE}/modules.available; then
  echo "modprobe: FATAL: Module $1 not found in directory /lib/modules/$(uname -r)" >&2; exit 1
fi
mkdir -p {SHAPE}/sys/module/"$name"
# a loaded nvidia module shows its version banner in /proc/driver/nvidia/version
if [ "$name" = nvidia ] && [ -f {BUILT_NVIDIA} ]; then
  mkdir -p {SHAPE}/proc/driver/nvidia && cp {BUILT_NVIDIA} {SHAPE}/proc/driver/nvidia/version
fi
echo "$name" >> {SHAPE}/modprobe.log
exit 0
"""
MODINFO = f"""#!/bin/sh
# stand-in kmod modinfo --field filename NAME
for name; do :; done
name=$(echo "$name" | tr - _)
if grep -qx "$name" {SHAPE}/modules.available; then
  echo "/lib/modules/$(uname -r)/updates/dkms/$name.ko"; exit 0
fi
echo "modinfo: ERROR: Module $name not found." >&2; exit 1
"""
NVIDIA_SMI_TEMPLATE = f"""#!/bin/sh
# stand-in nvidia-smi {{version}}: one GPU per NVIDIA display controller on the shaped PCI bus
# A module DKMS built that nothing loaded yet (no reboot since the install): the driver cannot be reached.
if [ -f {BUILT_NVIDIA} ] && [ ! -d {SHAPE}/sys/module/nvidia ]; then
  echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running."
  exit 9
fi
gpus=$(grep -l 0x0302 {SHAPE}/sys/bus/pci/devices/*/class 2>/dev/null | wc -l)
# persistence mode is what the running nvidia-persistenced was told: on unless --no-persistence-mode
pm=Disabled
pid=$(cat {PERSISTENCED_PIDFILE} 2>/dev/null)
if [ -n "$pid" ] && [ -r /proc/"$pid"/cmdline ]; then
  case " $(tr '\\0' ' ' < /proc/"$pid"/cmdline) " in *" --no-persistence-mode "*) ;; *) pm=Enabled ;; esac
fi
case "$*" in
  *--query-gpu=name*) for c in $(grep -l 0x0302 {SHAPE}/sys/bus/pci/devices/*/class 2>/dev/null); do
    sed -n 's/^Model:[[:space:]]*//p' {SHAPE}/proc/driver/nvidia/gpus/"$(basename "$(dirname "$c")")"/information; done ;;
  *--query-gpu=driver_version*) i=0; while [ $i -lt $gpus ]; do echo {{version}}; i=$((i+1)); done ;;
  *--query-gpu=index,driver_version,persistence_mode*)
    i=0; while [ $i -lt $gpus ]; do echo "$i, {{version}}, $pm"; i=$((i+1)); done ;;
  *--query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total,remapped_rows.pending,remapped_rows.failure*) i=0; for c in $(grep -l 0x0302 {SHAPE}/sys/bus/pci/devices/*/class 2>/dev/null); do echo "$i, $(basename "$(dirname "$c")"), 0, No, No"; i=$((i+1)); done ;;
  *) echo "NVIDIA-SMI {{version}}    Driver Version: {{version}}    CUDA Version: 13.2" ;;
esac
"""
PERSISTENCED = f"""#!/bin/sh
# stand-in nvidia-persistenced: forks and writes its pid file as the real daemon does (Type=forking); the
# process left running keeps the daemon's arguments on its command line, where nvidia-smi reads the flag
mkdir -p {PERSISTENCED_RUN}
sh -c 'while :; do sleep 3600; done' nvidia-persistenced "$@" </dev/null >/dev/null 2>&1 &
echo $! > {PERSISTENCED_PIDFILE}
"""
# Ubuntu's unit (nvidia-compute-utils) and NVIDIA's: static, stopped when nothing needs it, persistence off.
PERSISTENCED_UNIT = """[Unit]
Description=NVIDIA Persistence Daemon
Wants=syslog.target
StopWhenUnneeded=true

[Service]
Type=forking
ExecStart=/usr/bin/nvidia-persistenced --user nvidia-persistenced --no-persistence-mode --verbose
ExecStopPost=/bin/rm -rf /var/run/nvidia-persistenced
"""
FABRICMANAGER_TEMPLATE = """#!/bin/sh
case "$1" in --version|-v) echo "Fabric Manager version is : {version}"; exit 0 ;; esac
exec sleep infinity
"""


def nvidia_smi(version: str) -> str:
    """The stand-in nvidia-smi of a driver package of that version."""
    return NVIDIA_SMI_TEMPLATE.format(version=version)


def fabricmanager(version: str) -> str:
    """The stand-in nv-fabricmanager of a Fabric Manager package of that version (it reports its own)."""
    return FABRICMANAGER_TEMPLATE.format(version=version)


def fi_info(version: str) -> str:
    """The stand-in fi_info of a libfabric-aws-bin package of that version (e.g. 2.4.0amzn1.0)."""
    return FI_INFO_TEMPLATE.format(version=version, api=".".join(version.split(".")[:2]), shape=SHAPE)


@dataclass(frozen=True)
class EfaRelease:
    """An EFA installer release and the versions of the packages it installs (as its record names them)."""

    installer: str
    libfabric: str  # libfabric1-aws and libfabric-aws-bin, e.g. 2.4.0amzn1.0
    openmpi40: str
    ofi_nccl: str  # libnccl-ofi (aws-ofi-nccl)
    peermem: str  # efa-nv-peermem
    profile: str  # efa-profile


def efa_packages(release: EfaRelease, elves: dict[str, Path]) -> list[tuple[str, str, dict[str, bytes | Path], str]]:
    """(name, version, files, Depends) of what the EFA installer installs, laid out as its packages install it:
    libfabric and fi_info under /opt/amazon/efa (efa-profile's /etc/ld.so.conf.d/000_efa.conf lists its
    lib), Open MPI under /opt/amazon/openmpi, aws-ofi-nccl under /opt/amazon/ofi-nccl with its own
    /etc/ld.so.conf.d/100_ofinccl.conf."""
    ofi_lib = "/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu"
    libfabric_upstream = release.libfabric.split("amzn")[0]
    return [
        ("libfabric1-aws", release.libfabric, {"/opt/amazon/efa/lib/libfabric.so.1": elves["libfabric.so.1"]}, ""),
        ("libfabric-aws-bin", release.libfabric, {"/opt/amazon/efa/bin/fi_info": fi_info(release.libfabric).encode()},
         f"libfabric1-aws (= {release.libfabric})"),
        ("efa-profile", release.profile, {"/etc/ld.so.conf.d/000_efa.conf": b"/opt/amazon/efa/lib\n",
                                          "/etc/profile.d/zippy_efa.sh": b"PATH=$PATH:/opt/amazon/efa/bin\n"}, ""),
        ("openmpi40-aws", release.openmpi40, {"/opt/amazon/openmpi/bin/mpirun": b"#!/bin/sh\n",
                                              "/opt/amazon/openmpi/bin/mpicc": b"#!/bin/sh\n",
                                              "/opt/amazon/openmpi/lib/libmpi.so.40": elves["libmpi.so.40"]}, ""),
        ("libnccl-ofi", release.ofi_nccl, {f"{ofi_lib}/libnccl-net-ofi.so": elves["libnccl-net-ofi.so"],
                                           "/etc/ld.so.conf.d/100_ofinccl.conf": f"{ofi_lib}\n".encode()},
         f"libfabric1-aws (>= {libfabric_upstream})"),
        ("efa-nv-peermem", release.peermem,
         {f"/usr/src/efa_nv_peermem-{release.peermem.split('-')[0]}/dkms.conf": b"PACKAGE_NAME=efa_nv_peermem\n"}, ""),
    ]


def efa_record(release: EfaRelease) -> str:
    """/opt/amazon/efa_installed_packages as the installer writes it."""
    return (f"# EFA installer version: {release.installer}\n# Debug packages installed: no\n# Packages installed:\n"
            f"efa-nv-peermem_{release.peermem} libfabric1-aws_{release.libfabric} libfabric-aws-bin_{release.libfabric} "
            f"efa-profile_{release.profile} openmpi40-aws_{release.openmpi40} libnccl-ofi_{release.ofi_nccl}\n")


def nvrm_banner(version: str) -> str:
    """/proc/driver/nvidia/version of a loaded open kernel module of that version."""
    return f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build\n"


def driver_information(model: str, address: str, minor: int) -> str:
    """/proc/driver/nvidia/gpus/ADDRESS/information of a GPU the loaded driver numbered `minor`."""
    return (f"Model: \t\t {model}\nBus Type: \t PCIe\nBus Location: \t {address}\n"
            f"Device Minor: \t {minor}\nGPU Excluded:\t No\n")


NVIDIA_SMI = nvidia_smi(DRIVER)  # the DLAMI's
# What the DLAMI's EFA installer left (its record and packages)
DLAMI_EFA = EfaRelease(installer="1.50.0", libfabric="2.4.0amzn1.0", openmpi40="4.1.7-1", ofi_nccl="1.18.0-1",
                       peermem="1.2.3-1.amzn1", profile="1.7-1")
FI_INFO_TEMPLATE = """#!/bin/sh
# stand-in libfabric {version} fi_info: the efa provider, loaded only where the efa kernel module is, exposes
# one RDM and one datagram domain per EFA device; -p/-t select among them; with -c FI_HMEM only when GPU
# memory can be registered (a peer-memory module loaded, or the open NVIDIA module: dma-buf)
nodata() {{ echo "fi_getinfo: -61 (No data available)" >&2; exit 1; }}
provider=efa type=""
while [ $# -gt 0 ]; do
  case "$1" in
    --version) printf 'fi_info: {version}\\nlibfabric: {version}\\nlibfabric api: {api}\\n'; exit 0 ;;
    -p|--provider) provider=$2; shift ;;
    -t|--ep_type) type=$2; shift ;;
    -c|--caps) [ "$2" = FI_HMEM ] || nodata
      ls {shape}/sys/module | grep -q peermem || grep -q "Open Kernel" {shape}/proc/driver/nvidia/version 2>/dev/null || nodata
      shift ;;
  esac
  shift
done
[ "$provider" = efa ] && [ -d {shape}/sys/module/efa ] || nodata
case "$type" in ""|FI_EP_RDM|FI_EP_DGRAM) ;; *) nodata ;; esac
for dev in $(ls {shape}/sys/class/infiniband); do
  for ep in FI_EP_RDM:rdm FI_EP_DGRAM:dgrm; do
    [ -z "$type" ] || [ "$type" = "${{ep%:*}}" ] || continue
    printf 'provider: efa\\n    fabric: efa\\n    domain: %s-%s\\n    version: 201.0\\n    type: %s\\n    protocol: FI_PROTO_EFA\\n' "$dev" "${{ep#*:}}" "${{ep%:*}}"
  done
done
"""
MAKE = """#!/bin/sh
# stand-in make for the nccl-tests tree: records its arguments and "builds" the prebuilt binary
echo "$@" > make-args.txt
exec sh ./fsdp-shape-build.sh
"""
SERVICE = """[Unit]
Description={description}

[Service]
ExecStart={command}

[Install]
WantedBy=multi-user.target
"""
INITRAMFS = "#!/bin/sh\necho \"update-initramfs $*\" >> /var/log/fsdp-shape-initramfs.log\n"
NVCC = """#!/bin/sh
echo "nvcc: NVIDIA (R) Cuda compiler driver"
echo "Cuda compilation tools, release {release}, V{build}"
"""
VERSION_JSON = """{{
   "cuda" : {{
      "name" : "CUDA SDK",
      "version" : "{version}"
   }}
}}
"""

# Stand-in libraries (real ELF objects) --------------------------------------------------------------
C_SOURCES = {
    "nccl.c": "int ncclGetVersion(int *v) { *v = 22903; return 0; }\n",
    "mpi.c": "int MPI_Init(int *c, char ***v) { (void)c; (void)v; return 0; }\n",
    "ofi.c": "const char *ncclNetPlugin_v9 = \"Libfabric\";\n",
    "fabric.c": "int fi_version(void) { return 0x20004; }\n",
    "all_reduce_perf.c": ("int ncclGetVersion(int *); int MPI_Init(int *, char ***);\n"
                          "int main(int c, char **v) { int n; MPI_Init(&c, &v); return ncclGetVersion(&n); }\n"),
}


def _cc(work: Path, *args: str) -> None:
    subprocess.run(["gcc", *args], cwd=work, check=True, capture_output=True)


def build_elves(work: Path) -> dict[str, Path]:
    """libnccl.so.2, libmpi.so.40, libnccl-net-ofi.so, libfabric.so.1 and all_reduce_perf (NEEDED
    libnccl.so.2 and libmpi.so.40, no rpath: nccl-tests' Makefile links with -L only)."""
    work.mkdir(parents=True, exist_ok=True)
    for name, text in C_SOURCES.items():
        (work / name).write_text(text)
    _cc(work, "-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", "-o", "libnccl.so.2", "nccl.c")
    _cc(work, "-shared", "-fPIC", "-Wl,-soname,libmpi.so.40", "-o", "libmpi.so.40", "mpi.c")
    _cc(work, "-shared", "-fPIC", "-o", "libnccl-net-ofi.so", "ofi.c")
    _cc(work, "-shared", "-fPIC", "-Wl,-soname,libfabric.so.1", "-o", "libfabric.so.1", "fabric.c")
    (work / "libmpi.so").symlink_to("libmpi.so.40")
    (work / "libnccl.so").symlink_to("libnccl.so.2")
    _cc(work, "-o", "all_reduce_perf", "all_reduce_perf.c", "-L.", "-lnccl", "-lmpi")
    return {p.name: p for p in work.iterdir()}


# Packages --------------------------------------------------------------------------------------------
def build_deb(out: Path, name: str, version: str, files: dict[str, bytes | Path], *, depends: str = "",
              arch: str = "amd64", modes: dict[str, int] | None = None, relations: dict[str, str] | None = None,
              postinst: str = "", links: dict[str, str] | None = None) -> Path:
    """A Debian package built with dpkg-deb: control with the real name, version and dependencies, and the
    other relations (Provides, Conflicts, Replaces) the real one declares; `postinst` stands in for what the
    real package's maintainer script does; `links` are the symbolic links it ships (path -> target)."""
    root = out / f"build-{name}"
    shutil.rmtree(root, ignore_errors=True)
    (root / "DEBIAN").mkdir(parents=True)
    control = (f"Package: {name}\nVersion: {version}\nArchitecture: {arch}\nMaintainer: fsdp-cluster tests "
               f"<tests@example.invalid>\n" + (f"Depends: {depends}\n" if depends else "")
               + "".join(f"{field}: {value}\n" for field, value in (relations or {}).items())
               + f"Description: stand-in {name} for a hardware-shaped test node\n")
    (root / "DEBIAN/control").write_text(control)
    if postinst:
        (root / "DEBIAN/postinst").write_text(postinst)
        (root / "DEBIAN/postinst").chmod(0o755)
    if any(".so" in path for path in files):  # as real library packages do: refresh the linker cache
        (root / "DEBIAN/triggers").write_text("activate-noawait ldconfig\n")
    for path, content in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            shutil.copy2(content, target)
        else:
            target.write_bytes(content)
        executable = "/bin/" in path or "/sbin/" in path or target.read_bytes()[:2] == b"#!"
        target.chmod((modes or {}).get(path, 0o755 if executable else 0o644))
    for path, link_target in (links or {}).items():
        link = root / path.lstrip("/")
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(link_target)
    deb = out / f"{name}_{version.split(':')[-1]}_{arch}.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(deb)], check=True,
                   capture_output=True)
    shutil.rmtree(root)
    return deb


def write_repository(repo: Path) -> None:
    """A flat apt repository (`deb [trusted=yes] file:DIR ./`): Packages from each .deb's control."""
    stanzas = []
    for deb in sorted(repo.glob("*.deb")):
        control = subprocess.run(["dpkg-deb", "-f", str(deb)], check=True, capture_output=True,
                                 text=True).stdout.strip()
        data = deb.read_bytes()
        stanzas.append(f"{control}\nFilename: ./{deb.name}\nSize: {len(data)}\n"
                       f"MD5sum: {hashlib.md5(data).hexdigest()}\nSHA256: {hashlib.sha256(data).hexdigest()}\n")
    (repo / "Packages").write_text("\n".join(stanzas))


def render(template: str, **values: str | tuple[str, ...]) -> str:
    """A stand-in script of tests/shaped/templates, for the node's SHAPE."""
    return TEMPLATES.get_template(template).render(shape=SHAPE, **values)


def _script(text: str) -> bytes:
    return text.encode()


def _unit(description: str, command: str) -> bytes:
    return SERVICE.format(description=description, command=command).encode()


def nccl_tests_tarball(path: Path, binary: Path) -> None:
    """The nccl-tests source tarball the nccl role unpacks (nccl_tests_url), whose make copies `binary`."""
    top = f"nccl-tests-{NCCL_TESTS_VERSION}"
    build = ("#!/bin/sh\nset -e\nmkdir -p build\ncp prebuilt/all_reduce_perf build/all_reduce_perf\n")
    members = {f"{top}/Makefile": b"# stand-in: see fsdp-shape-build.sh\nall:\n",
               f"{top}/fsdp-shape-build.sh": build.encode(),
               f"{top}/prebuilt/all_reduce_perf": binary.read_bytes()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))


def build_nccl(repo: Path, version: str, elves: dict[str, Path]) -> None:
    """NVIDIA's libnccl2 and libnccl-dev of `version` into the repository directory `repo`."""
    build_deb(repo, "libnccl2", version, {"/usr/lib/x86_64-linux-gnu/libnccl.so.2": elves["libnccl.so.2"]})
    build_deb(repo, "libnccl-dev", version, {"/usr/include/nccl.h": b"#define NCCL_MAJOR 2\n"},
              depends=f"libnccl2 (= {version})")


def shape_tree(layer: Path, instance_type: str, modules: list[str]) -> Path:
    """The instance type's sys/proc/run tree under SHAPE in `layer`, with the stand-in modprobe and modinfo
    for a kernel that has `modules`; returns the tree."""
    shape = layer / SHAPE.lstrip("/")
    sysfs_tree(shape, instance_type)
    for link in [p for p in shape.rglob("*") if p.is_symlink()]:  # relative, so they resolve on the node
        target = Path(os.readlink(link))
        if target.is_absolute():
            link.unlink()
            link.symlink_to(os.path.relpath(target, link.parent))
    (shape / "run/systemd").mkdir(parents=True)
    (shape / "run/systemd/container").write_text("systemd-nspawn\n")  # honest: still a container
    (shape / "proc/self/status").write_text("Name:\tpython3\nCapEff:\t00000000fcecbfff\n")
    (shape / "modules.available").write_text("".join(f"{m}\n" for m in modules))
    for path, text in {"usr/sbin/modprobe": MODPROBE, "usr/sbin/modinfo": MODINFO}.items():
        install_command(layer, path, text)
    return shape


def install_command(layer: Path, path: str, text: str) -> None:
    target = layer / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    target.chmod(0o755)


def build_layer(layer: Path, instance_type: str, work: Path) -> Path:
    """The whole layer for FSDPCTL_LOCAL_NODE_LAYER; returns `layer`."""
    shape = shape_tree(layer, instance_type, ["nvidia", "nvidia_uvm", "efa", "efa_nv_peermem", "gdrdrv"])
    install_command(layer, "usr/bin/make", MAKE)
    facts = catalog.CATALOG[instance_type]
    for n in range(1, facts.nvme_devices + 1):  # the DLAMI's array over the instance store
        (shape / f"sys/class/block/nvme{n}n1/holders/md127").mkdir(parents=True)
    for module in ("nvidia", "nvidia_uvm", "efa", "efa_nv_peermem"):  # loaded at boot on a DLAMI
        (shape / f"sys/module/{module}").mkdir(parents=True)
    (shape / "proc/driver/nvidia").mkdir(parents=True)
    (shape / "proc/driver/nvidia/version").write_text(nvrm_banner(DRIVER))
    gpus = sorted(c.parent.name for c in (shape / "sys/bus/pci/devices").glob("*/class")
                  if c.read_text().startswith("0x0302"))
    for minor, address in enumerate(gpus):  # the loaded driver's entry for each GPU, numbered in PCI order
        information = shape / "proc/driver/nvidia/gpus" / address / "information"
        information.parent.mkdir(parents=True)
        information.write_text(driver_information(DRIVER_GPU_MODEL[instance_type], address, minor))
    # The DLAMI's repositories are unreachable from a test node: apt reads only the local one.
    (layer / "etc/apt").mkdir(parents=True, exist_ok=True)
    (layer / "etc/apt/sources.list").write_text("# shaped test node: no Debian mirror\n")
    for release, (version, build) in IMAGE_CUDA.items():  # the image's runfile toolkits: no package owns them
        toolkit = layer / f"usr/local/cuda-{release}"
        (toolkit / "bin").mkdir(parents=True)
        (toolkit / "bin/nvcc").write_text(NVCC.format(release=release, build=build))
        (toolkit / "bin/nvcc").chmod(0o755)
        (toolkit / "version.json").write_text(VERSION_JSON.format(version=version))
    (layer / "opt/amazon").mkdir(parents=True, exist_ok=True)
    (layer / "opt/amazon/efa_installed_packages").write_text(efa_record(DLAMI_EFA))

    elves = build_elves(work / "elves")
    nccl_tests_tarball(layer / NCCL_TESTS_TARBALL.lstrip("/"), elves["all_reduce_perf"])
    image = layer / IMAGE_DEBS.lstrip("/")
    repo = layer / REPO.lstrip("/")
    image.mkdir(parents=True)
    repo.mkdir(parents=True)
    fm = f"{DRIVER}-1ubuntu1"
    for name, version, files, depends in [
        ("nvidia-driver-cuda", fm, {"/usr/bin/nvidia-smi": _script(NVIDIA_SMI),
                                    "/usr/bin/nvidia-persistenced": _script(PERSISTENCED),
                                    "/lib/systemd/system/nvidia-persistenced.service": PERSISTENCED_UNIT.encode()},
         ""),
        ("nvidia-fabricmanager", fm, {"/usr/bin/nv-fabricmanager": _script(fabricmanager(DRIVER)),
                                      "/lib/systemd/system/nvidia-fabricmanager.service":
                                          _unit("NVIDIA fabric manager service", "/usr/bin/nv-fabricmanager")},
         f"libnvidia-nscq (= {fm})"),
        ("libnvidia-nscq", fm, {"/usr/lib/x86_64-linux-gnu/libnvidia-nscq.so.2": b"\0"}, ""),
        ("libgdrapi", "2.5.2", {"/usr/lib/x86_64-linux-gnu/libgdrapi.so.2": b"\0"}, ""),
        ("gdrdrv-dkms", "2.5.2", {"/usr/src/gdrdrv-2.5.2/dkms.conf": b"PACKAGE_NAME=gdrdrv\n",
                                  "/etc/init.d/gdrdrv": _script(render("gdrdrv.init.j2"))}, ""),
        ("gdrcopy-tests", "2.5.2", {"/usr/bin/gdrcopy_copybw": _script("#!/bin/sh\n")}, "libgdrapi (>= 2.5.2)"),
        ("gdrcopy", "2.5.2", {"/usr/share/doc/gdrcopy/README": b"stand-in\n"},
         "libgdrapi (= 2.5.2), gdrcopy-tests (= 2.5.2), gdrdrv-dkms (= 2.5.2)"),
        ("initramfs-tools", "0.140ubuntu13.5", {"/usr/sbin/update-initramfs": _script(INITRAMFS)}, ""),
        ("cuda-keyring", "1.1-1", {"/etc/apt/sources.list.d/cuda-ubuntu2204-x86_64.list":
                                   f"deb [trusted=yes] file:{REPO} ./\n".encode()}, ""),
        *efa_packages(DLAMI_EFA, elves),
    ]:
        build_deb(image, name, version, files, depends=depends,
                  arch="all" if name == "cuda-keyring" else "amd64")
    version, build = IMAGE_CUDA["12.9"]
    build_deb(repo, "cuda-toolkit-12-9", f"{version}-1",
              {"/usr/local/cuda-12.9/bin/nvcc": _script(NVCC.format(release="12.9", build=build)),
               "/usr/local/cuda-12.9/version.json": VERSION_JSON.format(version=version).encode()})
    for nccl in (NCCL, OLDER_NCCL):
        build_nccl(repo, nccl, elves)
    write_repository(repo)
    os.chmod(layer, 0o755)
    return layer
