"""The storage role's scratch program (files/fsdp-scratch), which the role runs at configure time and
fsdp-scratch.service runs at every boot: on an instance-shaped sys tree with stand-in blkid, mdadm,
mkfs.xfs, mount, findmnt and udevadm that keep each device's signatures, holders and the mount table
as the real tools would (mdadm checks only for ext2/3/4, md and partition-table signatures and goes on
over XFS or LVM; mkfs.xfs without -f refuses any signature; a device in an array is busy). A blank
instance store (the first boot after an EC2 stop/start) is built and mounted, a reboot only assembles
and mounts, a device that carries data not ours is refused and left alone; an image's own instance-store
volume (the DLAMI's /opt/dlami/nvme) is bound and opened, waited for at boot, and its absence fails in one
line without touching the devices. Then the unit and settings
the role renders, the role's glue (which plans lead to what), and the role's tasks in check mode on
this machine with the same stand-ins. Shellcheck passes the program (a warning fails)."""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra import catalog
from tests.ansible.conftest import (
    BIN,
    REPO,
    ROLES_DIR,
    ansible_env,
    detect_hardware,
    render,
    render_template,
    run_playbook,
    sysfs_tree,
)
from tests.stand_ins import block_device_stand_ins, stand_in_commands

PROGRAM = ROLES_DIR / "storage/files/fsdp-scratch"
P4D_DEVICES = [f"/dev/nvme{n}n1" for n in range(1, 9)]
HOST_NAME = "ip-10-42-1-10"
MEMBER = f"TYPE=linux_raid_member\nLABEL={HOST_NAME}:fsdp-scratch\n"
WRITES = ("mdadm", "mkfs.xfs", "mount")
IMAGE_VOLUME = "/dev/mapper/vg.01-lv_ephemeral"  # what the Deep Learning AMI's dlami-nvme.service mounts


class InstanceStore:
    """A node's instance store for the program: an instance-shaped sys tree, the stand-in tools' state
    and the settings the role gives it. run() runs the program and returns (exit status, stdout, the
    calls that write: mdadm, mkfs.xfs and mount)."""

    def __init__(self, tmp_path: Path, instance_type: str = "p4d.24xlarge",
                 extra_stand_ins: dict[str, str] | None = None, **settings: str):
        self.sysfs = sysfs_tree(tmp_path / "shape", instance_type)
        self.state = tmp_path / "state"
        (self.state / "dev").mkdir(parents=True)
        self.mount_point = tmp_path / "scratch"
        # where an image would mount the instance store itself (as the role sets it: the DLAMI's path,
        # which a plain image never mounts)
        self.image_mount = tmp_path / "opt/dlami/nvme"
        self.env = stand_in_commands(tmp_path, **block_device_stand_ins(self.state, self.sysfs, HOST_NAME),
                                     **(extra_stand_ins or {}))
        devices = len(detect_hardware(self.sysfs)["nvme_instance_store"])  # as the role renders it
        self.settings = {
            "FSDP_SCRATCH_MOUNT": str(self.mount_point),
            "FSDP_SCRATCH_MOUNT_OPTIONS": "defaults,noatime",
            "FSDP_SCRATCH_NAME": "fsdp-scratch",
            "FSDP_SCRATCH_DEVICES": str(devices),
            "FSDP_SCRATCH_SYSFS_ROOT": str(self.sysfs),
            "FSDP_SCRATCH_IMAGE_MOUNT": str(self.image_mount),
            "FSDP_SCRATCH_IMAGE_WAIT_S": "0",
            **settings,
        }

    def image_mounts_its_volume(self) -> None:
        """The image's boot service mounted its volume (the DLAMI: LVM over the devices, ext4, mode 0755
        until its script opens it)."""
        self.image_mount.mkdir(parents=True, exist_ok=True)
        with (self.state / "mounts").open("a") as mounts:
            mounts.write(f"{IMAGE_VOLUME} {self.image_mount}\n")

    def sign(self, device: str, signature: str) -> None:
        (self.state / "dev" / Path(device).name).write_text(signature)

    def signature(self, device: str) -> str:
        path = self.state / "dev" / Path(device).name
        return path.read_text() if path.exists() else ""

    def hold(self, device: str, holder: str) -> None:
        (self.sysfs / "sys/class/block" / Path(device).name / "holders" / holder).mkdir(parents=True)

    def mounted(self) -> list[str]:
        mounts = self.state / "mounts"
        return mounts.read_text().splitlines() if mounts.exists() else []

    def reboot(self, *, stopped: bool) -> None:
        """Nothing is mounted and no array runs; after an EC2 stop/start every device is blank too."""
        (self.state / "mounts").unlink(missing_ok=True)
        shutil.rmtree(self.sysfs / "sys/class/block", ignore_errors=True)
        if stopped:
            shutil.rmtree(self.state / "dev")
            (self.state / "dev").mkdir()

    def run(self, mode: str) -> tuple[int, str, list[str]]:
        calls = self.state / "calls"
        calls.unlink(missing_ok=True)
        proc = subprocess.run(["bash", str(PROGRAM), mode], capture_output=True, text=True, timeout=60,
                              env={**self.env, **self.settings})
        return proc.returncode, proc.stdout + proc.stderr, [c for c in self.calls() if c.startswith(WRITES)]

    def calls(self) -> list[str]:
        """The stand-in tools the last run called, with their arguments."""
        calls = self.state / "calls"
        return calls.read_text().splitlines() if calls.exists() else []


def test_the_program_passes_shellcheck():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail("shellcheck is not installed: run `make host-packages` (apt-get install shellcheck)")
    proc = subprocess.run([shellcheck, "--shell=bash", "--severity=warning", "--format=gcc", str(PROGRAM)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert PROGRAM.stat().st_mode & stat.S_IXUSR


def test_a_blank_instance_store_is_built_into_raid0_xfs_and_mounted(tmp_path):
    store = InstanceStore(tmp_path)
    devices = " ".join(P4D_DEVICES)
    # plan writes nothing
    assert store.run("plan") == (
        0, f"create: RAID0 array fsdp-scratch over {devices}, XFS, at {store.mount_point}\n", [])
    status, out, writes = store.run("apply")
    assert status == 0, out
    assert writes == [
        f"mdadm --create /dev/md/fsdp-scratch --level=0 --name=fsdp-scratch --raid-devices=8 {devices}",
        "mkfs.xfs -q -L fsdp-scratch /dev/md127",
        f"mount -t xfs -o defaults,noatime /dev/md127 {store.mount_point}",
    ]
    assert f"\nmounted /dev/md127 at {store.mount_point}\n" in out
    assert stat.S_IMODE(store.mount_point.stat().st_mode) == 0o1777  # open to every user, sticky
    assert all(store.signature(d) == MEMBER for d in P4D_DEVICES)
    # the next configure: nothing to do
    assert store.run("apply") == (0, f"ready: {store.mount_point} is mounted from /dev/md127\n", [])


def test_after_an_ec2_stop_start_the_blank_instance_store_is_built_again(tmp_path):
    store = InstanceStore(tmp_path)
    assert store.run("apply")[0] == 0
    store.reboot(stopped=True)
    status, out, writes = store.run("apply")
    assert status == 0, out
    assert out.startswith("create: RAID0 array fsdp-scratch over /dev/nvme1n1 ")
    assert [w.split()[0:2] for w in writes] == [["mdadm", "--create"], ["mkfs.xfs", "-q"], ["mount", "-t"]]
    assert store.mounted() == [f"/dev/md127 {store.mount_point}"]


def test_a_reboot_without_a_stop_only_assembles_and_mounts(tmp_path):
    store = InstanceStore(tmp_path)
    assert store.run("apply")[0] == 0
    store.reboot(stopped=False)
    # udev did not assemble the array (yet): the program assembles it from the devices
    status, out, writes = store.run("apply")
    assert status == 0, out
    assert writes == [
        f"mdadm --assemble /dev/md/fsdp-scratch {' '.join(P4D_DEVICES)}",
        f"mount -t xfs -o defaults,noatime /dev/md127 {store.mount_point}",
    ]
    # udev assembled it: mount only
    store.reboot(stopped=False)
    for device in P4D_DEVICES:
        store.hold(device, "md127")
    array = f"RAID0 array fsdp-scratch over {' '.join(P4D_DEVICES)} (/dev/md127)"
    assert store.run("plan") == (0, f"mount: {array} at {store.mount_point}\n", [])
    status, out, writes = store.run("apply")
    assert (status, writes) == (0, [f"mount -t xfs -o defaults,noatime /dev/md127 {store.mount_point}"]), out


def test_an_array_of_ours_without_a_file_system_gets_one(tmp_path):
    # a create interrupted between mdadm and mkfs.xfs (the node stopped, or the run was killed)
    store = InstanceStore(tmp_path)
    for device in P4D_DEVICES:
        store.sign(device, MEMBER)
        store.hold(device, "md127")
    status, out, writes = store.run("apply")
    assert status == 0, out
    assert writes == ["mkfs.xfs -q -L fsdp-scratch /dev/md127",
                      f"mount -t xfs -o defaults,noatime /dev/md127 {store.mount_point}"]


@pytest.mark.parametrize(
    ("signature", "holder", "shown"),
    [
        # someone's XFS or LVM volume: mdadm itself would not notice and would overwrite it
        ("TYPE=xfs\nLABEL=data\n", None, 'xfs "data"'),
        ("TYPE=LVM2_member\n", "dm-0", "held by dm-0"),
        ("TYPE=ext4\n", None, "ext4"),
        ("PTTYPE=gpt\n", None, "a gpt partition table"),
        # a member of another array (the Deep Learning AMI's, say)
        (f"TYPE=linux_raid_member\nLABEL={HOST_NAME}:0\n", "md0", "held by md0"),
        (f"TYPE=linux_raid_member\nLABEL={HOST_NAME}:0\n", None, f'linux_raid_member "{HOST_NAME}:0"'),
    ],
)
def test_a_device_carrying_data_not_ours_is_refused_and_left_alone(tmp_path, signature, holder, shown):
    store = InstanceStore(tmp_path)
    store.sign("/dev/nvme3n1", signature)
    if holder:
        store.hold("/dev/nvme3n1", holder)
    for mode in ("plan", "apply"):
        status, out, writes = store.run(mode)
        assert (status, writes) == (1, []), out
        refused = f"refuse: the instance-store device(s) /dev/nvme3n1 ({shown}) already carry data: never"
        assert out.startswith(refused), out
        assert "wipe the devices (wipefs -a) if their data is not needed" in out
    assert store.signature("/dev/nvme3n1") == signature
    assert all(store.signature(d) == "" for d in P4D_DEVICES if d != "/dev/nvme3n1")
    assert store.mounted() == []


def test_a_file_system_not_xfs_on_an_array_of_ours_is_refused(tmp_path):
    store = InstanceStore(tmp_path)
    for device in P4D_DEVICES:
        store.sign(device, MEMBER)
        store.hold(device, "md127")
    store.sign("/dev/md127", "TYPE=ext4\n")
    status, out, writes = store.run("apply")
    assert (status, writes) == (1, []), out
    assert out.startswith("refuse: RAID0 array fsdp-scratch (/dev/md127) carries ext4, not XFS: never "), out


def test_members_of_ours_held_by_different_arrays_are_refused(tmp_path):
    # half of them in an array udev left unfinished: assembling or creating over them would fail or worse
    store = InstanceStore(tmp_path)
    for device in P4D_DEVICES:
        store.sign(device, MEMBER)
    for device in P4D_DEVICES[:4]:
        store.hold(device, "md127")
    status, out, writes = store.run("apply")
    assert (status, writes) == (1, []), out
    members = " ".join(P4D_DEVICES)
    assert out.startswith(f"refuse: the members of RAID0 array fsdp-scratch ({members}) are held by "
                          "different arrays (md127,md127,md127,md127,none,none,none,none): stop them"), out


def test_missing_devices_are_not_built_over(tmp_path):
    # the node had 9 at configure time; 8 came back
    store = InstanceStore(tmp_path, FSDP_SCRATCH_DEVICES="9", FSDP_SCRATCH_DEVICE_WAIT_S="1")
    status, out, writes = store.run("apply")
    assert (status, writes) == (1, []), out
    assert out.startswith(f"refuse: 8 instance-store device(s) ({' '.join(P4D_DEVICES)}) where the node "
                          "had 9 after 1 s: not building scratch over part of them."), out


def test_a_mount_point_mounted_from_something_else_is_kept(tmp_path):
    store = InstanceStore(tmp_path)
    (store.state / "mounts").write_text(f"/dev/nvme0n1p2 {store.mount_point}\n")
    kept = f"{store.mount_point} is mounted from /dev/nvme0n1p2, not from the instance store's scratch"
    assert store.run("apply") == (0, f"other: {kept}; kept as it is\n", [])


def test_a_single_device_is_formatted_directly_and_known_by_its_label(tmp_path):
    store = InstanceStore(tmp_path, "p5.48xlarge")
    for ctrl in sorted((store.sysfs / "sys/class/nvme").iterdir())[2:]:  # keep the EBS root and nvme1
        shutil.rmtree(ctrl)
    store.settings["FSDP_SCRATCH_DEVICES"] = "1"
    status, out, writes = store.run("apply")
    assert status == 0, out
    assert writes == ["mkfs.xfs -q -L fsdp-scratch /dev/nvme1n1",
                      f"mount -t xfs -o defaults,noatime /dev/nvme1n1 {store.mount_point}"]
    store.reboot(stopped=False)
    assert store.run("plan") == (0, f'mount: XFS "fsdp-scratch" on /dev/nvme1n1 at {store.mount_point}\n', [])
    # an XFS of someone else's (no label, or another) on the device is not ours
    store.reboot(stopped=True)
    store.sign("/dev/nvme1n1", "TYPE=xfs\n")
    status, out, writes = store.run("apply")
    assert (status, writes) == (1, []), out
    assert out.startswith("refuse: the instance-store device(s) /dev/nvme1n1 (xfs) already carry data"), out


# ------------------------------------------------------------------- the image's instance-store volume
def test_the_images_volume_is_bound_at_the_scratch_mount_point_and_opened(tmp_path):
    store = InstanceStore(tmp_path)
    store.image_mounts_its_volume()
    image = f"the image's instance-store volume at {store.image_mount} ({IMAGE_VOLUME})"
    assert store.run("plan") == (0, f"adopt: bind {image} at {store.mount_point}, mode 1777\n", [])
    status, out, writes = store.run("apply")
    assert (status, writes) == (0, [f"mount --bind {store.image_mount} {store.mount_point}"]), out
    assert out.endswith(f"\nbound {store.image_mount} at {store.mount_point}, mode 1777\n")
    assert stat.S_IMODE(store.mount_point.stat().st_mode) == 0o1777  # open to every user, sticky
    assert store.mounted()[-1] == f"{IMAGE_VOLUME} {store.mount_point}"
    # the devices are the image's: never looked at, let alone written
    assert not any(c.startswith(("blkid", "mdadm", "mkfs.xfs", "udevadm")) for c in store.calls())
    # the next configure, and a reboot before which nothing changed: nothing to do
    adopted = f"adopted: {store.mount_point} is a bind mount of {image}, mode 1777\n"
    assert store.run("apply") == (0, adopted, [])


def test_after_a_stop_start_the_boot_unit_waits_for_the_images_volume_then_binds_and_opens_it(tmp_path):
    # the image's service (the DLAMI's dlami-nvme.service, after network-online.target) mounts its new
    # file system, mode 0755, while the unit waits: the stand-in sleep is that service finishing
    store = InstanceStore(tmp_path, extra_stand_ins={"sleep": f"""echo "sleep $*" >> {tmp_path}/state/calls
if ! grep -q " {tmp_path}/opt/dlami/nvme$" {tmp_path}/state/mounts 2>/dev/null; then
    echo "{IMAGE_VOLUME} {tmp_path}/opt/dlami/nvme" >> {tmp_path}/state/mounts
fi"""}, FSDP_SCRATCH_IMAGE_WAIT_S="300")
    store.image_mount.mkdir(parents=True)
    store.mount_point.mkdir(mode=0o755)
    status, out, writes = store.run("apply")
    assert (status, writes) == (0, [f"mount --bind {store.image_mount} {store.mount_point}"]), out
    assert "sleep 1" in store.calls()
    assert out.startswith(f"adopt: bind the image's instance-store volume at {store.image_mount} "), out
    assert stat.S_IMODE(store.mount_point.stat().st_mode) == 0o1777


def test_a_bound_mount_point_whose_mode_the_new_file_system_lost_is_opened_again(tmp_path):
    store = InstanceStore(tmp_path)
    store.image_mounts_its_volume()
    assert store.run("apply")[0] == 0
    store.mount_point.chmod(0o755)  # the image made a new file system: its root is root's 0755
    status, out, writes = store.run("apply")
    assert (status, writes) == (0, []), out  # bound already: only the mode
    assert out.startswith("adopt: ") and stat.S_IMODE(store.mount_point.stat().st_mode) == 0o1777


def test_an_images_volume_that_never_comes_fails_the_unit_in_one_line_and_builds_nothing(tmp_path):
    # at boot on a node that adopted it: never build our own over the image's devices
    store = InstanceStore(tmp_path, extra_stand_ins={"sleep": f'echo "sleep $*" >> {tmp_path}/state/calls'},
                          FSDP_SCRATCH_IMAGE_WAIT_S="3")
    status, out, writes = store.run("apply")
    assert (status, writes) == (1, []), out
    assert out == (
        f"refuse: {store.image_mount} (the image's instance-store volume, bound at {store.mount_point}) "
        "is not mounted after 3 s: the image's boot service did not mount it (Deep Learning AMI: systemctl "
        "status dlami-nvme). Mount it there and run systemctl restart fsdp-scratch, or replace the instance "
        "(fsdpctl replace)\n")
    assert store.calls().count("sleep 1") == 3
    assert not any(c.startswith(("blkid", "mdadm", "mkfs.xfs", "udevadm")) for c in store.calls())


def test_without_the_images_volume_at_configure_time_the_node_builds_its_own(tmp_path):
    # plain Ubuntu: nothing at the DLAMI's path, no wait (the role's setting before the node adopted it)
    store = InstanceStore(tmp_path)
    assert store.run("plan")[1].startswith("create: RAID0 array fsdp-scratch over /dev/nvme1n1 ")
    # adoption switched off: the image's volume is left alone, and its devices (held by its LVM) refused
    store = InstanceStore(tmp_path / "off", FSDP_SCRATCH_IMAGE_MOUNT="")
    store.image_mounts_its_volume()
    store.sign("/dev/nvme1n1", "TYPE=LVM2_member\n")
    store.hold("/dev/nvme1n1", "dm-0")
    status, out, _ = store.run("plan")
    assert status == 1, out
    assert out.startswith("refuse: the instance-store device(s) /dev/nvme1n1 (held by dm-0)"), out


def test_a_scratch_mount_point_mounted_from_elsewhere_is_kept_beside_the_images_volume(tmp_path):
    store = InstanceStore(tmp_path)
    store.image_mounts_its_volume()
    (store.state / "mounts").open("a").write(f"/dev/nvme0n1p2 {store.mount_point}\n")
    kept = (f"other: {store.mount_point} is mounted from /dev/nvme0n1p2, not from the image's instance-store "
            f"volume at {store.image_mount} ({IMAGE_VOLUME}); kept as it is\n")
    assert store.run("apply") == (0, kept, [])


# ------------------------------------------------------------------------------ what the role renders
@pytest.mark.parametrize("instance_type", ["p4d.24xlarge", "p5.48xlarge"])
def test_the_unit_runs_the_program_with_the_settings_the_role_runs_it_with(gpu_node, instance_type):
    variables = gpu_node(instance_type)
    devices = catalog.CATALOG[instance_type].nvme_devices
    # the count the role checks the node against (the spec's), and the one the program waits for
    assert render("{{ storage_expected_nvme }}", variables) == devices
    env_file = render_template("storage", "scratch.env.j2", variables)
    settings = dict(line.split("=", 1) for line in env_file.splitlines() if line and not line.startswith("#"))
    assert settings == {
        "FSDP_SCRATCH_MOUNT": "/scratch",
        "FSDP_SCRATCH_MOUNT_OPTIONS": "defaults,noatime",
        "FSDP_SCRATCH_NAME": "fsdp-scratch",
        "FSDP_SCRATCH_DEVICES": str(devices),
        "FSDP_SCRATCH_SYSFS_ROOT": "/",
        "FSDP_SCRATCH_IMAGE_MOUNT": "/opt/dlami/nvme",
        "FSDP_SCRATCH_IMAGE_WAIT_S": "0",  # no plan yet: nothing adopted, nothing to wait for
    }
    # the tasks' environment is the same dictionary
    assert render("{{ storage_scratch_settings }}", variables) == settings
    unit = render_template("storage", "fsdp-scratch.service.j2", variables).splitlines()
    for line in [
        "Before=slurmd.service",
        "Type=oneshot",
        "RemainAfterExit=yes",
        "EnvironmentFile=/etc/fsdp-cluster/scratch.env",
        "ExecStart=/usr/local/libexec/fsdp-cluster/scratch apply",
        "WantedBy=multi-user.target",
    ]:
        assert line in unit
    assert render("{{ storage_scratch_env_file }} {{ storage_scratch_unit }}", variables) == (
        "/etc/fsdp-cluster/scratch.env fsdp-scratch.service")


@pytest.mark.parametrize(
    ("plan", "wait"),
    [
        (f"adopt: bind the image's instance-store volume at /opt/dlami/nvme ({IMAGE_VOLUME})", "300"),
        ("adopted: /scratch is a bind mount of the image's instance-store volume at /opt/dlami/nvme", "300"),
        ("create: RAID0 array fsdp-scratch over /dev/nvme1n1, XFS, at /scratch", "0"),
        ("ready: /scratch is mounted from /dev/md127", "0"),
    ],
)
def test_a_node_that_adopted_the_images_volume_waits_for_it_at_boot(gpu_node, plan, wait):
    variables = {**gpu_node("p4d.24xlarge"),
                 "storage_scratch_plan": {"rc": 0, "stdout": plan + "\n", "stderr": ""}}
    env_file = render_template("storage", "scratch.env.j2", variables)
    assert f"FSDP_SCRATCH_IMAGE_WAIT_S={wait}" in env_file.splitlines()
    unit = render_template("storage", "fsdp-scratch.service.j2", variables).splitlines()
    assert "TimeoutStartSec=600" in unit  # room for the wait
    longer = {**variables, "storage_image_mount_wait_s": 900}
    assert "TimeoutStartSec=960" in render_template("storage", "fsdp-scratch.service.j2", longer).splitlines()
    # adoption switched off: no image path, so the program never adopts
    off = render_template("storage", "scratch.env.j2", {**variables, "storage_adopt_image_mount": False})
    assert "FSDP_SCRATCH_IMAGE_MOUNT=''" in off.splitlines()


def test_a_mount_point_with_a_space_is_quoted_for_systemd(gpu_node):
    variables = gpu_node("p4d.24xlarge", storage_scratch_mount="/mnt/my scratch")
    env_file = render_template("storage", "scratch.env.j2", variables)
    assert "FSDP_SCRATCH_MOUNT='/mnt/my scratch'" in env_file.splitlines()


def test_a_scratch_name_xfs_cannot_label_is_rejected_before_anything_changes(tmp_path):
    play = """
- name: Validate the storage settings
  hosts: all
  gather_facts: false
  tasks:
    - name: Check storage
      ansible.builtin.include_role:
        name: storage
        tasks_from: validate
"""
    result = run_playbook(tmp_path, play, "-e", "storage_raid_name=fsdp-scratch-0")
    assert result.returncode == 2, result.stdout[-3000:]
    assert ("storage_raid_name (fsdp-scratch-0), which names the scratch md array and labels its XFS file "
            "system, must be 1 to 12 letters, digits, '-' or '_'") in " ".join(result.stdout.split())
    assert run_playbook(tmp_path, play, "-e", "storage_raid_name=scratch_1").returncode == 0


def _scratch_block() -> dict:
    tasks = yaml.safe_load((ROLES_DIR / "storage/tasks/scratch.yml").read_text())
    return next(t for t in tasks if "block" in t)


@pytest.mark.parametrize(
    ("plan", "installed", "applied"),
    [
        ("create: RAID0 array fsdp-scratch over /dev/nvme1n1, XFS, at /scratch", True, True),
        ("mount: RAID0 array fsdp-scratch over /dev/nvme1n1 (/dev/md127) at /scratch", True, True),
        ("ready: /scratch is mounted from /dev/md127", True, False),
        ("other: /scratch is mounted from /dev/nvme0n1p2, not from the instance store's", False, False),
        # the image's volume: bound by the unit at every boot too, and now where it is not yet
        ("adopt: bind the image's instance-store volume at /opt/dlami/nvme (/dev/md0)", True, True),
        ("adopted: /scratch is a bind mount of the image's instance-store volume", True, False),
    ],
)
def test_the_role_keeps_its_scratch_at_boot_and_runs_what_is_needed(gpu_node, plan, installed, applied):
    block = _scratch_block()
    variables = {
        **gpu_node("p4d.24xlarge"),
        "storage_scratch_plan": {"rc": 0, "stdout": plan + "\n", "stderr": ""},
    }
    assert render("{{ " + block["when"] + " }}", variables) is installed
    apply = next(t for t in block["block"] if t["name"] == "Build or mount the scratch file system")
    assert render("{{ " + apply["when"] + " }}", variables) is applied


# -------------------------------------------------------------------- the role's tasks in check mode
CHECK_PLAY = """
- name: The storage role in check mode
  hosts: all
  gather_facts: false
  roles:
    - role: storage
"""


def test_the_role_in_check_mode_asks_the_program_and_changes_nothing(tmp_path):
    # the whole role on this machine, its hardware read from the instance-shaped tree and every tool the
    # program calls a stand-in: the plan runs for real (read-only), nothing is written
    store = InstanceStore(tmp_path)
    play = tmp_path / "play.yml"
    play.write_text(CHECK_PLAY)
    result = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", "--check",
         "-e", f"ansible_python_interpreter={sys.executable}", "-e", f"fsdp_sysfs_root={store.sysfs}",
         "-e", f"fsdp_scratch_mount={store.mount_point}", "-e", "fsdp_nvme_devices=8", str(play)],
        cwd=REPO, env={**ansible_env(tmp_path), "PATH": f"{BIN}:{store.env['PATH']}"},
        capture_output=True, text=True, timeout=300,
    )
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-2000:]
    planned = f"create: RAID0 array fsdp-scratch over {' '.join(P4D_DEVICES)}, XFS, at {store.mount_point}"
    assert f"msg: '{planned}'" in " ".join(out.split()), out[-3000:]  # the task's report, as YAML wraps it
    calls = [c.split()[0] for c in (store.state / "calls").read_text().splitlines()]
    assert set(calls) == {"findmnt", "udevadm", "blkid"}, calls  # read, never written
    assert not store.mount_point.exists()
