"""The install paths for real on a local node shaped like a plain Ubuntu 22.04 p4d (tests/shaped/ubuntu.py):
nothing NVIDIA installed, Ubuntu's archive the only package source, the upstream downloads stand-ins in
the layer (tests/shaped/upstream.py). `fsdpctl configure --tags nvidia,cuda,efa,nccl,storage` installs the
driver branch's `-server-open` packages, reboots the node (its keeper boots the container again; the boot
stand-in loads the module DKMS built, as udev does on a real node), reads the hardware again, and installs
Ubuntu's Fabric Manager at exactly the installed `nvidia-kernel-common-<branch>-server` version; then
NVIDIA's cuda-keyring and CUDA toolkit, GDRCopy built from its source release into packages (whose init
script loads gdrdrv and makes /dev/gdrdrv), the EFA installer, NCCL from NVIDIA's repository (held) with
nccl-tests built against the installer's Open MPI, and the blank instance store built into a RAID0 array
mounted at /scratch. The second run changes nothing, NVIDIA's repository listed by then (its own build of
the branch's Fabric Manager sorts above Ubuntu's and is not taken). What the play left for the roles after
it (the hardware fact) is read from the facts ansible-runner cached for the run. Before any of it, check
mode on the fresh node previews the install paths and leaves the node as it was."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from fsdpctl import remote
from fsdpctl.state import ClusterState
from tests.local.conftest import fsdpctl, reboot, spec_file
from tests.shaped import dlami, ubuntu, upstream
from tests.shaped.conftest import cached_facts, shaped_cluster
from tests.shaped.test_shaped_cluster import INSTALL_NCCL, RECAP, check_mode_run, results

pytestmark = [pytest.mark.root, pytest.mark.slow]

NAME = "hw-ubuntu"
SUBNET = "198.18.41.0/24"
NODE = f"{NAME}-node0"
EXTRA_VARS = {
    "fsdp_sysfs_root": dlami.SHAPE,  # hardware_facts reads the shaped tree
    "fsdp_offline": False,  # the stand-in archive is the node's package source
    "hardware_required": True,  # absent hardware fails, as on AWS
    # the upstream downloads, from the layer's stand-ins (upstream.py)
    "cuda_keyring_url": upstream.CUDA_KEYRING,
    "cuda_gdrcopy_url": upstream.GDRCOPY_TARBALL,
    "efa_installer_url": f"file://{upstream.EFA_TARBALL}",
    "nccl_tests_url": dlami.NCCL_TESTS_TARBALL,
}
TAGS = ("nvidia", "cuda", "efa", "nccl", "storage")
EXTRA_ARGS = [a for k, v in EXTRA_VARS.items() for a in ("-e", f"{k}={json.dumps(v)}")]
PACKAGES = "dpkg-query -W -f '${Package}=${Version} ${db:Status-Want}\\n' "
# ansible-playbook's own output: a task's header, then a line per host result
TASK_HEADER = re.compile(r"^TASK \[(?:(\S+) : )?(.+?)\] \*+$")
HOST_RESULT = re.compile(r"^(ok|changed|skipping|fatal|failed): \[([^\]]+)\]")


@dataclass(frozen=True)
class NodeSnapshot:
    """What a configure run changes on a fresh node: its packages (with their selection: hold or install),
    and its systemd units."""

    packages: tuple[str, ...]
    holds: tuple[str, ...]
    units: tuple[str, ...]
    files: tuple[str, ...]  # what the installers and the scratch program write, where they write it
    block_writes: tuple[str, ...]  # the stand-in block-device tools' writing calls (mdadm, mkfs.xfs, mount)


def snapshot(state: ClusterState) -> NodeSnapshot:
    def lines(command: str) -> tuple[str, ...]:
        return tuple(remote.run(state, 0, command, check=False).stdout.splitlines())

    return NodeSnapshot(
        packages=lines("dpkg-query -W -f '${Package}=${Version} ${db:Status-Abbrev}\\n'"),
        holds=lines("apt-mark showhold"),
        units=lines("systemctl list-unit-files --no-legend --no-pager --plain | cut -d' ' -f1"),
        files=lines("ls -d /etc/apt/sources.list.d/* /usr/local/cuda* /opt/fsdp-cluster/src/* /opt/amazon/* "
                    "/dev/gdrdrv /scratch 2>/dev/null"),
        block_writes=lines(f"grep -E '^(mdadm|mkfs.xfs|mount) ' {ubuntu.BLOCK_STATE}/calls 2>/dev/null"),
    )


def playbook_results(stdout: str) -> dict[tuple[str, str, str], set[str]]:
    """(host, role, task) -> its statuses in ansible-playbook's own output, as `results` reads fsdpctl's:
    ok, changed, skipped, failed, or ignored (a failure the task's ignore_errors let the play go past)."""
    found: dict[tuple[str, str, str], set[str]] = {}
    role = task = ""
    last: tuple[tuple[str, str, str], str] | None = None
    for line in stdout.splitlines():
        if header := TASK_HEADER.match(line):
            role, task = header.group(1) or "", header.group(2)
        elif result := HOST_RESULT.match(line):
            status = {"skipping": "skipped", "fatal": "failed"}.get(result.group(1), result.group(1))
            last = ((result.group(2), role, task), status)
            found.setdefault(last[0], set()).add(status)
        elif line.strip() == "...ignoring" and last is not None:
            found[last[0]].discard(last[1])
            found[last[0]].add("ignored")
    return found


@dataclass(frozen=True)
class CheckRun:
    """A check-mode run and the node as it was before and after it."""

    before: NodeSnapshot
    run: subprocess.CompletedProcess
    after: NodeSnapshot


@pytest.fixture(scope="module")
def cluster(prerequisites, tmp_path_factory):
    work = tmp_path_factory.mktemp("shape")
    layer = ubuntu.build_layer(work / "layer", "p4d.24xlarge", work, NODE)
    home = tmp_path_factory.mktemp("home")
    spec = spec_file(
        tmp_path_factory.mktemp("spec"),
        NAME,
        node_count=1,
        local={"subnet_cidr": SUBNET},
        software={"nvidia_driver_branch": ubuntu.BRANCH},
    )
    with shaped_cluster(home, NAME, spec, layer, ubuntu.BAKE) as home_and_state:
        yield home_and_state


def configure(home: Path):
    return fsdpctl(home, "configure", "--tags", ",".join(TAGS), *EXTRA_ARGS, check=False)


def run_facts(home: Path, run: int) -> dict:
    """The facts configure run `run` (0: the first) left for the node."""
    runs = sorted((home / "reports" / NAME).glob("*-configure"))
    return cached_facts(runs[run], NODE)


@pytest.fixture(scope="module")
def check_mode(cluster) -> CheckRun:
    """`--check --tags nvidia` on the fresh node, with what the node had before and after it."""
    home, state = cluster
    before = snapshot(state)
    run = check_mode_run(home, state, TAGS, EXTRA_VARS)
    return CheckRun(before=before, run=run, after=snapshot(state))


@pytest.fixture(scope="module")
def first_run(cluster, check_mode):
    home, _ = cluster
    return configure(home)


@pytest.fixture(scope="module")
def second_run(cluster, first_run):
    home, _ = cluster
    return configure(home)


@dataclass(frozen=True)
class Reboot:
    """The configured node rebooted: systemd's state once it had started, and the block-device stand-ins'
    writing calls made during the boot."""

    system_state: str
    block_writes: tuple[str, ...]


@pytest.fixture(scope="module")
def rebooted(cluster, second_run) -> Reboot:
    _, state = cluster
    calls_before = len(snapshot(state).block_writes)
    system_state = reboot(state, 0)
    return Reboot(system_state=system_state, block_writes=snapshot(state).block_writes[calls_before:])


def test_check_mode_on_the_fresh_node_previews_the_install_and_changes_nothing(check_mode):
    # no nvidia-smi, no module, no packages, no units yet: what the skipped writes would have made is not
    # there to read, and the preview must neither fail on that nor change the node
    out = check_mode.run.stdout
    assert check_mode.run.returncode == 0, out[-6000:] + check_mode.run.stderr[-2000:]
    recap = re.findall(
        r"^(\S+)\s+: ok=\d+\s+changed=\d+\s+unreachable=(\d+)\s+failed=(\d+)", out, re.MULTILINE
    )
    assert recap == [(NODE, "0", "0")], out[-3000:]
    found = playbook_results(out)
    for task, statuses in {
        "Blacklist nouveau": {"changed"},
        "Install the driver packages of the branch": {"changed"},
        "Run the persistence daemon with persistence mode on": {"changed"},
        "Reboot to load the new driver": {"changed"},  # reported, not done
        "Install Fabric Manager at the driver's version": {"skipped"},  # no driver to match yet, and why:
        "Skip installing Fabric Manager in check mode (no driver installed yet)": {"skipped"},
    }.items():
        assert found.get((NODE, "nvidia", task)) == statuses, (task, found.get((NODE, "nvidia", task)))
    assert "check mode installs no driver, so it cannot say which packages" in " ".join(out.split())
    # the other install paths: previewed up to what needs the download or the unpacked tree, nothing run
    for (role, task), statuses in {
        ("cuda", "Install NVIDIA's repository key (cuda-keyring)"): {"changed"},
        ("cuda", "Install the GDRCopy build dependencies"): {"changed"},
        ("cuda", "Build the GDRCopy Debian packages"): {"skipped"},
        # no source directory to download or unpack into (its creation is a write): reported and gone past
        ("cuda", f"Download and unpack GDRCopy {upstream.GDRCOPY}"): {"ignored"},
        ("efa", "Download the installer and verify its checksum"): {"ignored"},
        ("efa", "Run the EFA installer"): {"skipped"},
        ("storage", "Ask the scratch program what it would do"): {"ok"},
        ("storage", "Build or mount the scratch file system"): {"skipped"},
    }.items():
        assert found.get((NODE, role, task)) == statuses, (role, task, found.get((NODE, role, task)))
    assert check_mode.after == check_mode.before
    assert not [p for p in check_mode.after.packages if "nvidia" in p], check_mode.after.packages
    assert check_mode.after.holds == ()
    assert "nvidia-persistenced.service" not in check_mode.after.units
    assert check_mode.after.block_writes == ()  # nothing written to the instance store


def boots(state: ClusterState) -> list[tuple[str, list[str]]]:
    """The node's boots, as the boot stand-in marks them in the stand-in modprobe's log: (boot id, the modules
    loaded from that boot on, in order)."""
    found: list[tuple[str, list[str]]] = []
    for line in remote.run(state, 0, f"cat {dlami.SHAPE}/modprobe.log").stdout.splitlines():
        if line.startswith("# boot "):
            found.append((line.removeprefix("# boot "), []))
        else:
            found[-1][1].append(line)
    return found


def test_first_run_installs_the_driver_and_reboots_into_it(cluster, first_run):
    run = first_run
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    found = results(run.stdout)
    for task, statuses in {
        "Install the driver packages of the branch": {"changed"},
        "Reboot to load the new driver": {"changed"},
        "Load the new driver where the node was not rebooted": {"skipped"},
        "Check the driver version and persistence mode on every GPU": {"ok"},
    }.items():
        assert found.get((NODE, "nvidia", task)) == statuses, (task, found.get((NODE, "nvidia", task)))
    # a second boot, and only its coldplug loaded the nvidia module: nothing loaded it by hand
    _, state = cluster
    (first_id, first_boot), (second_id, second_boot) = boots(state)
    assert first_id != second_id
    assert first_boot == ["efa"]  # no nvidia module built yet
    assert second_boot[:2] == ["nvidia", "efa"] and second_boot.count("nvidia") == 1, second_boot


def test_fabric_manager_comes_from_ubuntus_archive_at_the_drivers_exact_version(cluster, first_run):
    run = first_run
    assert run.returncode == 0, run.stdout[-6000:]
    found = results(run.stdout)
    assert found[(NODE, "nvidia", "Install Fabric Manager at the driver's version")] == {"changed"}
    assert found[(NODE, "nvidia", "Check Fabric Manager matches the driver")] == {"ok"}
    _, state = cluster
    b, v = ubuntu.BRANCH, ubuntu.VERSION
    names = f"nvidia-kernel-common-{b}-server nvidia-fabricmanager-{b} libnvidia-nscq-{b}"
    installed = remote.run(state, 0, PACKAGES + names).stdout.splitlines()
    assert sorted(installed) == sorted(
        f"{name}={v} hold" for name in names.split()  # and held after the change, with the driver
    )
    # NVIDIA's naming (its CUDA repository, not configured on a plain image) was never asked for
    nvidias = remote.run(state, 0, "dpkg-query -W nvidia-fabricmanager libnvidia-nscq", check=False)
    assert nvidias.returncode == 1, nvidias.stdout
    assert remote.run(state, 0, "systemctl is-active nvidia-fabricmanager").stdout.strip() == "active"


def test_the_roles_after_the_driver_see_its_loaded_module(cluster, first_run):
    # the hardware fact gathered before the install said no module; the play refreshed it once the module was
    # loaded, so gpudirect's dma-buf fall-back (open kernel module) is open to the roles that follow
    assert first_run.returncode == 0, first_run.stdout[-6000:]
    home, state = cluster
    assert run_facts(home, 0)["fsdp_hardware"]["nvidia_kernel_module"] == "open"
    banner = remote.run(state, 0, f"cat {dlami.SHAPE}/proc/driver/nvidia/version").stdout
    assert banner == dlami.nvrm_banner(ubuntu.UPSTREAM)


def test_second_run_changes_nothing(cluster, second_run):
    out = second_run.stdout
    assert second_run.returncode == 0, out[-6000:]
    recap = {m[0]: tuple(map(int, m[1:])) for m in RECAP.findall(out)}
    assert set(recap) == {NODE}
    changed = [line for line in out.splitlines() if line.lstrip().startswith("changed ")]
    assert all(c == 0 for _, c, _, _ in recap.values()), changed
    assert len(boots(cluster[1])) == 2  # not rebooted again


def test_first_run_installs_cuda_gdrcopy_efa_and_nccl_and_builds_the_scratch_array(first_run):
    run = first_run
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    found = results(run.stdout)
    for (role, task), statuses in {
        ("cuda", "Install NVIDIA's repository key (cuda-keyring)"): {"changed"},
        ("cuda", f"Install CUDA toolkit {upstream.CUDA}"): {"changed"},
        ("cuda", "Check the toolkit is the pinned version"): {"ok"},
        ("cuda", "Install the GDRCopy build dependencies"): {"changed"},
        ("cuda", f"Download and unpack GDRCopy {upstream.GDRCOPY}"): {"changed"},
        ("cuda", "Build the GDRCopy Debian packages"): {"changed"},
        ("cuda", "Install the GDRCopy packages"): {"changed"},
        # gdrdrv-dkms's postinst started its init script, which loaded the module and made the device
        ("cuda", "Start GDRCopy's service (loads gdrdrv, makes /dev/gdrdrv)"): {"skipped"},
        ("cuda", "Check the GDRCopy device exists"): {"ok"},
        ("efa", "Download the installer and verify its checksum"): {"changed"},
        ("efa", "Run the EFA installer"): {"changed"},
        ("efa", "Check libfabric sees every EFA device"): {"ok"},
        ("efa", "Check the aws-ofi-nccl plugin and Open MPI are installed"): {"ok"},
        ("nccl", INSTALL_NCCL): {"changed"},
        ("nccl", "Hold NCCL at the installed version"): {"changed"},
        ("nccl", "Let every process find aws-ofi-nccl and libfabric"): {"changed"},
        ("nccl", "Build nccl-tests against the EFA installer's Open MPI"): {"changed"},
        ("nccl", "Check all_reduce_perf finds NCCL and Open MPI at run time"): {"ok"},
        ("storage", "Ask the scratch program what it would do"): {"ok"},
        ("storage", "Build or mount the scratch file system"): {"changed"},
        ("storage", "Enable the scratch unit at boot"): {"changed"},
    }.items():
        assert found.get((NODE, role, task)) == statuses, (role, task, found.get((NODE, role, task)))


def test_the_installs_left_what_the_real_ones_leave(cluster, first_run):
    assert first_run.returncode == 0, first_run.stdout[-6000:]
    _, state = cluster
    packages = remote.run(state, 0, PACKAGES + " ".join(
        ["cuda-keyring", "cuda-toolkit-12-9", "cuda-nvcc-12-9", "libgdrapi", "gdrdrv-dkms", "gdrcopy-tests",
         "gdrcopy", "libfabric1-aws", "libnccl-ofi", "openmpi40-aws", "libnccl2", "libnccl-dev"]
    )).stdout.split()
    assert sorted(p for p in packages if p not in ("install", "hold")) == sorted([
        "cuda-keyring=1.1-1", "cuda-toolkit-12-9=12.9.1-1", "cuda-nvcc-12-9=12.9.86-1",
        "libgdrapi=2.5.1", "gdrdrv-dkms=2.5.1", "gdrcopy-tests=2.5.1", "gdrcopy=2.5.1",
        f"libfabric1-aws={upstream.EFA.libfabric}", f"libnccl-ofi={upstream.EFA.ofi_nccl}",
        f"openmpi40-aws={upstream.EFA.openmpi40}", f"libnccl2={dlami.NCCL}", f"libnccl-dev={dlami.NCCL}"])
    script = (
        f"cat {upstream.CUDA_SOURCES}; /usr/local/cuda-12.9/bin/nvcc --version | tail -1; "
        f"test -d {dlami.SHAPE}/sys/module/gdrdrv && test -e /dev/gdrdrv && echo gdrdrv; "
        "systemctl is-active gdrdrv; head -1 /opt/amazon/efa_installed_packages; "
        "cat /etc/ld.so.conf.d/100_ofinccl.conf; ldconfig -p | grep -o '/opt/amazon/.*libnccl-net-ofi.so'; "
        f"cat {ubuntu.BLOCK_STATE}/mounts; stat -c %a /scratch"
    )
    assert remote.run(state, 0, script).stdout.splitlines() == [
        f"deb [signed-by={upstream.CUDA_KEYRING_FILE} trusted=yes] file:{upstream.NVIDIA_REPO} ./",
        "Cuda compilation tools, release 12.9, V12.9.86",
        "gdrdrv",
        "active",
        "# EFA installer version: 1.47.0",
        "/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu",
        "/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu/libnccl-net-ofi.so",
        "/dev/md127 /scratch",
        "1777",
    ]
    # the instance store built into one RAID0 array, as the scratch program asks mdadm
    writes = remote.run(state, 0, f"grep -E '^(mdadm|mkfs.xfs|mount) ' {ubuntu.BLOCK_STATE}/calls").stdout
    devices = " ".join(f"/dev/nvme{n}n1" for n in range(1, 9))
    assert writes.splitlines() == [
        f"mdadm --create /dev/md/fsdp-scratch --level=0 --name=fsdp-scratch --raid-devices=8 {devices}",
        "mkfs.xfs -q -L fsdp-scratch /dev/md127",
        "mount -t xfs -o defaults,noatime /dev/md127 /scratch",
    ]


def test_nvidias_repository_does_not_replace_ubuntus_fabric_manager(cluster, second_run):
    # the second run has NVIDIA's repository listed, whose nvidia-fabricmanager-535 535.183.01-1 sorts above
    # Ubuntu's 535.183.01-0ubuntu0.22.04.1: the driver's exact version is kept
    assert second_run.returncode == 0, second_run.stdout[-6000:]
    _, state = cluster
    b, v = ubuntu.BRANCH, ubuntu.VERSION
    madison = f"apt-cache madison nvidia-fabricmanager-{b} | awk '{{print $3}}'"
    policy = remote.run(state, 0, madison).stdout.split()
    assert sorted(policy) == sorted([v, f"{ubuntu.UPSTREAM}-1"])
    names = f"nvidia-fabricmanager-{b} libnvidia-nscq-{b}"
    installed = remote.run(state, 0, PACKAGES + names).stdout.splitlines()
    assert sorted(installed) == [f"libnvidia-nscq-{b}={v} hold", f"nvidia-fabricmanager-{b}={v} hold"]


def test_the_configured_node_boots_again_as_configured(cluster, second_run, rebooted):
    # what a reboot (or the nvidia role's, on a node configured before) must bring back by itself: the
    # driver (udev), the persistence daemon with persistence mode on, Fabric Manager, gdrdrv and its device
    # (its init script), the scratch array assembled from its members and mounted, nothing created
    assert second_run.returncode == 0, second_run.stdout[-6000:]
    _, state = cluster
    assert rebooted.system_state == "running"  # no unit failed
    *_, (_, modules) = boots(state)
    assert modules[:2] == ["nvidia", "efa"] and "gdrdrv" in modules and modules.count("nvidia") == 1, modules
    units = "nvidia-persistenced nvidia-fabricmanager gdrdrv fsdp-scratch"
    assert remote.run(state, 0, f"systemctl is-active {units}").stdout.split() == ["active"] * 4
    query = "nvidia-smi --query-gpu=index,driver_version,persistence_mode --format=csv,noheader"
    persistence = remote.run(state, 0, query).stdout.splitlines()
    assert persistence == [f"{i}, {ubuntu.UPSTREAM}, Enabled" for i in range(8)]
    assert rebooted.block_writes[0].startswith("mdadm --assemble "), rebooted.block_writes
    assert not [w for w in rebooted.block_writes if "--create" in w or w.startswith("mkfs")]
    assert rebooted.block_writes[-1] == "mount -t xfs -o defaults,noatime /dev/md127 /scratch"
    after = f"cat {ubuntu.BLOCK_STATE}/mounts; stat -c %a /scratch; test -e /dev/gdrdrv && echo gdrdrv"
    assert remote.run(state, 0, after).stdout.splitlines() == ["/dev/md127 /scratch", "1777", "gdrdrv"]


def test_a_fabric_manager_of_another_release_fails_the_run_naming_both_versions_and_the_packages(
        cluster, rebooted):
    # the packages are right but the binary is not (a manual install of an earlier release over them): the
    # role reads the version Fabric Manager itself reports, not the package database, and stops
    home, state = cluster
    stray = shlex.quote(dlami.fabricmanager("535.161.07"))
    binary = "/usr/bin/nv-fabricmanager"
    remote.run(state, 0, f"cp -p {binary} /root/nv-fabricmanager.packaged && printf %s {stray} > {binary}")
    try:
        run = fsdpctl(home, "configure", "--tags", "nvidia", *EXTRA_ARGS, check=False)
    finally:
        remote.run(state, 0, f"cp -p /root/nv-fabricmanager.packaged {binary}")
    assert run.returncode == 1, run.stdout[-4000:]
    b, v = ubuntu.BRANCH, ubuntu.VERSION
    expected = (f'NVIDIA Fabric Manager on {NODE} reports "Fabric Manager version is : 535.161.07" but the '
                f"driver is {ubuntu.UPSTREAM}: they must be the same version. Install "
                f"nvidia-fabricmanager-{b}={v}, libnvidia-nscq-{b}={v} from the repository the driver came "
                "from (ubuntu)")
    assert expected in " ".join(run.stdout.split()), run.stdout[-4000:]
