"""The decisions the hardware roles take from what a node already has (a Deep Learning AMI brings a
newer driver, GDRCopy, EFA installer and aws-ofi-nccl), rendered by Ansible's templating exactly as the
tasks write them, with the variables of a p4d/p5 node. What to do with the instance store (adopt the
image's volume or build our own) is the storage role's scratch program's decision:
tests/ansible/test_scratch.py."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import pytest
from ansible.template import trust_as_template

from tests.ansible.conftest import ROLES_DIR, render, render_template, role_tasks, task_expression
from tests.ansible.conftest import gpu_node as _gpu_node_fixture  # noqa: F401 (the fixture below wraps it)


@pytest.fixture
def gpu_node(_gpu_node_fixture):  # noqa: F811
    """The conftest's node variables, detected once per instance type; overrides are the last layer
    (as in conftest.node_variables), so calls can repeat within a test."""
    cache: dict[str, dict[str, Any]] = {}

    def make(instance_type: str, **overrides: Any) -> dict[str, Any]:
        if instance_type not in cache:
            cache[instance_type] = _gpu_node_fixture(instance_type)
        return {**cache[instance_type], **overrides}

    return make


def task(role: str, tasks_file: str, name: str) -> dict[str, Any]:
    return next(t for t in role_tasks(role, tasks_file) if t.get("name") == name)


def evaluate(role: str, tasks_file: str, name: str, key: str, variables: dict[str, Any]) -> Any:
    """The value a task's `key` (a set_fact entry, `when`, `failed_when`, ...) takes, with the task's
    own `vars` in scope as Ansible gives them."""
    t = task(role, tasks_file, name)
    scope = {
        **variables,
        **{k: trust_as_template(v) if isinstance(v, str) else v for k, v in t.get("vars", {}).items()},
    }
    value = t["ansible.builtin.set_fact"][key] if key in t.get("ansible.builtin.set_fact", {}) else t[key]
    if isinstance(value, list):  # a `when` list: all must hold
        return all(render("{{ " + v + " }}", scope) for v in value)
    if key in ("when", "failed_when") and "{{" not in value:
        return render("{{ " + value + " }}", scope)
    return render(value, scope)


# ------------------------------------------------------------------------------------------ GDRCopy
@pytest.mark.parametrize(
    ("dpkg", "pin", "builds"),
    [
        ("installed 2.5.1", "2.5.1", False),  # the release tarball's packages: plain upstream version
        ("installed 2.5.1-1", "2.5.1", False),
        ("installed 2.5.2", "2.5.1", False),  # the DLAMI's newer GDRCopy is kept, never downgraded
        ("installed 2.4.4", "2.5.1", True),
        ("", "2.5.1", True),  # not installed
        ("deinstall 2.5.1", "2.5.1", True),  # removed, config files left
    ],
)
def test_gdrcopy_installed_at_least_the_pin_is_kept(gpu_node, dpkg, pin, builds):
    variables = gpu_node(
        "p4d.24xlarge",
        cuda_gdrcopy_version=pin,
        cuda_gdrcopy_installed={"rc": 0 if dpkg else 1, "stdout": dpkg},
    )
    current = evaluate(
        "cuda", "gdrcopy.yml", "Record the installed GDRCopy version", "cuda_gdrcopy_current", variables
    )
    assert current == ("" if not dpkg.startswith("installed") else dpkg.split()[1].split("-")[0])
    when = evaluate(
        "cuda",
        "gdrcopy.yml",
        "Build and install GDRCopy {{ cuda_gdrcopy_version }}",
        "when",
        {**variables, "cuda_gdrcopy_current": current},
    )
    assert when is builds


def test_gdrcopy_packages_install_in_one_transaction(gpu_node):
    # gdrcopy depends on libgdrapi, gdrcopy-tests and gdrdrv-dkms: one file at a time, sorted, installs
    # gdrcopy first and fails on its dependencies; apt-get orders the files it is given together.
    debs = [
        f"/opt/src/gdrcopy-2.5.1/packages/{n}_2.5.1-1_amd64.deb"
        for n in ("gdrcopy", "gdrcopy-tests", "gdrdrv-dkms", "libgdrapi")
    ]
    t = task("cuda", "gdrcopy.yml", "Install the GDRCopy packages")
    assert "loop" not in t
    argv = render(
        t["ansible.builtin.command"]["argv"],
        {**gpu_node("p4d.24xlarge"), "cuda_gdrcopy_debs": {"files": [{"path": p} for p in reversed(debs)]}},
    )
    assert argv[:2] == ["apt-get", "install"] and sorted(argv[-4:]) == sorted(debs)


# ---------------------------------------------------------------------------------------- CUDA toolkit
@pytest.mark.parametrize(
    ("found", "adopted"),
    [
        ("12.9.1", True),  # the DLAMI's runfile toolkit (no package owns it) or the pinned package's
        ("12.9.2", True),  # newer patch release: kept, never downgraded
        ("12.9.0", False),  # older: the pinned package upgrades it
        (None, False),  # no /usr/local/cuda-12.9
    ],
)
def test_cuda_toolkit_is_adopted_whatever_installed_it(gpu_node, found, adopted):
    version_json = (
        {
            "content": base64.b64encode(
                json.dumps({"cuda": {"name": "CUDA SDK", "version": found}}).encode()
            ).decode()
        }
        if found
        else {"failed": True, "msg": "file not found: /usr/local/cuda-12.9/version.json"}
    )
    variables = gpu_node("p4d.24xlarge", cuda_version="12.9.1", cuda_version_json=version_json)
    decide = "Decide whether to adopt the node's CUDA toolkit"
    assert evaluate("cuda", "toolkit.yml", decide, "cuda_toolkit_adopted", variables) is adopted
    install = "Install CUDA toolkit {{ cuda_version }}"
    assert evaluate(
        "cuda", "toolkit.yml", install, "when", {**variables, "cuda_toolkit_adopted": adopted}
    ) is (not adopted)


# ------------------------------------------------------------------------------------------- holds
def test_installed_kernel_and_nvidia_packages_are_held_once(gpu_node):
    dpkg = [
        "linux-image-6.8.0-1021-aws install installed",
        "nvidia-fabricmanager hold installed",  # held by an earlier run: not held again
        "libnvidia-nscq install installed",
        "nvidia-utils-580-server deinstall config-files",  # removed: nothing to hold
        "libnccl2 hold installed",  # the nccl role's hold, not a kernel or NVIDIA package
        "curl install installed",
    ]
    variables = gpu_node("p4d.24xlarge", common_hold_query={"stdout_lines": dpkg})
    matching = evaluate(
        "common",
        "hold.yml",
        "Find the installed kernel and NVIDIA packages",
        "common_hold_matching",
        variables,
    )
    assert [m[0] for m in matching] == [
        "linux-image-6.8.0-1021-aws",
        "nvidia-fabricmanager",
        "libnvidia-nscq",
    ]
    hold = task("common", "hold.yml", "Hold the installed kernel and NVIDIA packages")
    scope = {**variables, "common_hold_matching": matching}
    assert render(hold["vars"]["common_hold_new"], scope) == ["linux-image-6.8.0-1021-aws", "libnvidia-nscq"]
    # the second run finds them held: nothing to do
    held = [[m[0], "hold", "installed"] for m in matching]
    assert (
        evaluate("common", "hold.yml", hold["name"], "when", {**variables, "common_hold_matching": held})
        is False
    )


# Tasks that change a package the common role (or their own role) holds, on purpose.
CHANGES_HELD_PACKAGES = [
    ("nvidia", "driver.yml", "Install the driver packages of the branch"),
    ("nvidia", "fabricmanager.yml", "Install Fabric Manager at the driver's version"),
    ("nccl", "nccl.yml", "Install or upgrade NCCL from NVIDIA's CUDA repository"),
]


def test_packages_held_against_drift_are_still_changed_on_purpose(gpu_node):
    variables = gpu_node(
        "p4d.24xlarge",
        nvidia_kernel_common=kernel_common(UBUNTU_580),
        nvidia_smi_running={"rc": 0, "stdout_lines": ["580.95.05"]},
        nvidia_fm_version={"rc": 1, "stdout": ""},
    )
    held = re.compile("|".join(render("{{ common_hold_patterns }}", variables)))
    fabric_manager = evaluate(
        "nvidia", "fabricmanager.yml", "Decide the Fabric Manager packages", "nvidia_fm_specs", variables
    )
    nvidia_packages = render("{{ nvidia_driver_packages }}", variables) + [
        s.split("=")[0] for s in fabric_manager
    ]
    assert all(held.match(name) for name in nvidia_packages), nvidia_packages
    assert task("nccl", "nccl.yml", "Hold NCCL at the installed version")["loop"] == [
        "libnccl2",
        "libnccl-dev",
    ]
    for role, tasks_file, name in CHANGES_HELD_PACKAGES:
        assert (
            task(role, tasks_file, name)["ansible.builtin.apt"].get("allow_change_held_packages") is True
        ), name
    # and held again after the change, with whatever the install brought
    rehold = "Hold the new driver and Fabric Manager packages"
    assert task("nvidia", "driver.yml", rehold)["ansible.builtin.include_role"] == {
        "name": "common",
        "tasks_from": "hold",
    }
    for install, fabric_manager_install, rehold_runs in [
        ({"changed": True}, None, True),
        ({"changed": False, "skipped": True}, {"changed": True}, True),
        ({"changed": False, "skipped": True}, {"changed": False}, False),
        ({"changed": False, "skipped": True}, None, False),  # no NVSwitch: no Fabric Manager task ran
    ]:
        scope = {**variables, "nvidia_install": install}
        if fabric_manager_install is not None:
            scope["nvidia_fm_install"] = fabric_manager_install
        assert evaluate("nvidia", "driver.yml", rehold, "when", scope) is rehold_runs


def test_only_fabric_manager_may_be_downgraded(gpu_node):
    # Fabric Manager must equal the driver's version, older or newer; everything else is upgrade-only
    downgrading = [
        (path.parent.parent.name, path.name, t.get("name"))
        for path in sorted(ROLES_DIR.glob("*/tasks/*.yml"))
        for t in role_tasks(path.parent.parent.name, path.name)
        if (t.get("ansible.builtin.apt") or {}).get("allow_downgrade")
    ]
    assert downgrading == [("nvidia", "fabricmanager.yml", "Install Fabric Manager at the driver's version")]


# ------------------------------------------------------------------------------------------- driver
DRIVER = "Decide whether to adopt the image's driver"


def driver_decision(gpu_node, smi: str, **overrides):
    variables = gpu_node(
        "p5.48xlarge",
        nvidia_smi_version={"rc": 0 if smi else 9, "stdout_lines": [smi] if smi else []},
        **overrides,
    )
    adopted = evaluate("nvidia", "driver.yml", DRIVER, "nvidia_driver_adopted", variables)
    image = evaluate("nvidia", "driver.yml", DRIVER, "nvidia_image_driver", variables)
    refuse = evaluate(
        "nvidia",
        "driver.yml",
        "Refuse to switch the driver branch without being asked",
        "when",
        {**variables, "nvidia_driver_adopted": adopted, "nvidia_image_driver": image},
    )
    return adopted, refuse


def test_image_driver_of_a_newer_branch_is_adopted(gpu_node):
    # the DLAMI ships 595 while the spec pins 580: keep it, install nothing
    assert driver_decision(gpu_node, "595.71.05", nvidia_driver_branch="580") == (True, False)
    assert driver_decision(gpu_node, "580.95.05", nvidia_driver_branch="580")[0] is True


def test_image_driver_of_an_older_branch_is_refused_unless_switching_is_asked_for(gpu_node):
    assert driver_decision(gpu_node, "570.172.08", nvidia_driver_branch="580") == (False, True)
    assert (
        driver_decision(
            gpu_node, "570.172.08", nvidia_driver_branch="580", nvidia_driver_allow_branch_switch=True
        )[1]
        is False
    )
    # exact branch asked for: a newer image driver is a switch too
    assert driver_decision(
        gpu_node, "595.71.05", nvidia_driver_branch="580", nvidia_driver_exact_branch=True
    ) == (False, True)


def test_node_without_driver_installs_the_headless_server_packages(gpu_node):
    adopted, refuse = driver_decision(gpu_node, "", nvidia_driver_branch="580")
    assert adopted is False and refuse is False
    packages = render("{{ nvidia_driver_packages }}", gpu_node("p5.48xlarge", nvidia_driver_branch="580"))
    assert packages == ["nvidia-headless-580-server-open", "nvidia-utils-580-server"]


def test_a_driver_installed_without_a_reboot_is_loaded_and_the_hardware_read_again(gpu_node):
    # a reboot loads the new module where it may run; elsewhere (not allowed, a container) modprobe does
    variables = gpu_node("p4d.24xlarge")
    load = "Load the new driver where the node was not rebooted"
    assert task("nvidia", "driver.yml", load)["ansible.builtin.command"]["argv"] == ["modprobe", "nvidia"]
    for install, reboot, loads in [
        ({"changed": True}, {"changed": False, "skipped": True}, True),
        ({"changed": True}, {"changed": True, "rebooted": True}, False),
        ({"changed": False, "skipped": True}, {"changed": False, "skipped": True}, False),  # adopted driver
    ]:
        scope = {**variables, "nvidia_install": install, "nvidia_reboot": reboot}
        assert evaluate("nvidia", "driver.yml", load, "when", scope) is loads
    # the hardware facts were read before the driver existed: read again by the hardware role's own tasks,
    # after the reboot or the load and before anything reads the driver, only where a driver was installed
    names = [t.get("name") for t in role_tasks("nvidia", "driver.yml")]
    refresh = "Read the hardware again with the new driver loaded"
    assert task("nvidia", "driver.yml", refresh)["ansible.builtin.include_role"] == {"name": "hardware"}
    assert names.index("Reboot to load the new driver") < names.index(load) < names.index(refresh)
    assert names.index(refresh) < names.index("Read the running driver version")
    for install, refreshes in [({"changed": True}, True), ({"changed": False, "skipped": True}, False)]:
        scope = {**variables, "nvidia_install": install}
        assert evaluate("nvidia", "driver.yml", refresh, "when", scope) is refreshes


def test_a_driver_install_reboots_a_machine_and_a_container_only_where_the_target_boots_it_again(gpu_node):
    reboot = "Reboot to load the new driver"
    machine = gpu_node("p4d.24xlarge")  # an EC2 instance, from the AWS inventory
    container = {**machine["fsdp_hardware"], "container": "systemd-nspawn"}
    for overrides, reboots in [
        ({}, True),
        ({"nvidia_reboot_allowed": False}, False),
        ({"nvidia_install": {"changed": False}}, False),  # an adopted driver: nothing new to load
        ({"fsdp_hardware": container}, False),  # nothing would boot it again: the reboot would end it
        ({"fsdp_hardware": container, "fsdp_container_reboots": True}, True),  # the local target's keeper
    ]:
        scope = {**machine, "nvidia_install": {"changed": True}, **overrides}
        assert evaluate("nvidia", "driver.yml", reboot, "when", scope) is reboots, overrides


# `dpkg-query --show` of nvidia-kernel-common-*: package|version|provides|status
UBUNTU_535 = "nvidia-kernel-common-535-server|535.183.01-0ubuntu0.22.04.1|nvidia-kernel-common|installed"
UBUNTU_580 = (
    "nvidia-kernel-common-580-server|580.95.05-0ubuntu0.22.04.3|"
    "nvidia-kernel-common, nvidia-kernel-common-580-server-580.95.05|installed"
)


def kernel_common(*lines: str) -> dict[str, Any]:
    return {"rc": 0 if lines else 1, "stdout_lines": list(lines)}


@pytest.mark.parametrize(
    ("driver", "dpkg", "source", "specs"),
    [
        # Ubuntu's packages, installed by this run on a fresh node: Fabric Manager and NSCQ depend on exactly
        # the kernel-common version and share it
        (
            "535.183.01",
            [UBUNTU_535],
            "ubuntu",
            [
                "nvidia-fabricmanager-535=535.183.01-0ubuntu0.22.04.1",
                "libnvidia-nscq-535=535.183.01-0ubuntu0.22.04.1",
            ],
        ),
        # Ubuntu's since 580.95.05-0ubuntu0.22.04.3 (LP #2129682): they depend on the release's virtual
        # package, so any Ubuntu revision of the release fits
        (
            "580.95.05",
            [UBUNTU_580],
            "ubuntu",
            ["nvidia-fabricmanager-580=580.95.05-*", "libnvidia-nscq-580=580.95.05-*"],
        ),
        # a runfile driver (no package) and NVIDIA's repository's packages: 580.95.05-1ubuntu1
        ("580.95.05", [], "nvidia", ["nvidia-fabricmanager=580.95.05-*", "libnvidia-nscq=580.95.05-*"]),
        (
            "580.95.05",
            ["nvidia-kernel-common-580|580.95.05-1ubuntu1|nvidia-kernel-common|installed"],
            "nvidia",
            ["nvidia-fabricmanager=580.95.05-*", "libnvidia-nscq=580.95.05-*"],
        ),
        # Ubuntu's packages of an older release removed (config files left) under the image's runfile driver
        (
            "595.71.05",
            [UBUNTU_535.replace("|installed", "|config-files")],
            "nvidia",
            ["nvidia-fabricmanager=595.71.05-*", "libnvidia-nscq=595.71.05-*"],
        ),
    ],
)
def test_fabric_manager_at_the_drivers_exact_version_from_its_repository(
    gpu_node, driver, dpkg, source, specs
):
    variables = gpu_node(
        "p4d.24xlarge",
        nvidia_kernel_common=kernel_common(*dpkg),
        nvidia_smi_running={"rc": 0, "stdout_lines": [driver]},
        nvidia_fm_version={"rc": 0, "stdout": "Fabric Manager version is : 575.57.08"},
    )
    name = "Decide the Fabric Manager packages"
    assert evaluate("nvidia", "fabricmanager.yml", name, "nvidia_driver_source", variables) == source
    assert evaluate("nvidia", "fabricmanager.yml", name, "nvidia_fm_specs", variables) == specs
    assert evaluate("nvidia", "fabricmanager.yml", name, "nvidia_fm_installed", variables) == "575.57.08"
    install = "Install Fabric Manager at the driver's version"
    assert evaluate(
        "nvidia", "fabricmanager.yml", install, "when", {**variables, "nvidia_fm_installed": "575.57.08"}
    )
    # the image's Fabric Manager already matches: nothing to install
    assert not evaluate(
        "nvidia", "fabricmanager.yml", install, "when", {**variables, "nvidia_fm_installed": driver}
    )


# ------------------------------------------------------------------------------------ EFA and NCCL
@pytest.mark.parametrize(
    ("installed", "runs"), [("1.50.0", False), ("1.47.0", False), ("1.40.0", True), ("", True)]
)
def test_efa_installer_never_downgrades(gpu_node, installed, runs):
    variables = gpu_node("p4d.24xlarge", efa_installer_version="1.47.0")
    record = (
        "# EFA installer version: " + installed + "\n# Debug packages installed: no\n" if installed else None
    )
    packages = (
        {"content": __import__("base64").b64encode(record.encode()).decode()} if record else {"failed": True}
    )
    version = evaluate(
        "efa",
        "install.yml",
        "Record the installed EFA installer version",
        "efa_installed_version",
        {**variables, "efa_installed_packages": packages},
    )
    assert version == installed
    when = evaluate(
        "efa",
        "install.yml",
        "Install EFA installer {{ efa_installer_version }}",
        "when",
        {**variables, "efa_installed_version": version},
    )
    assert when is runs


def test_aws_ofi_nccl_version_is_read_from_the_installed_plugin(gpu_node):
    variables = gpu_node(
        "p5.48xlarge", efa_ofi_nccl_package_version={"rc": 0, "stdout": "installed 1.18.0-1"}
    )
    version = evaluate(
        "efa",
        "installed.yml",
        "Record the installed aws-ofi-nccl version (the nccl role's environment depends on it)",
        "efa_aws_ofi_nccl_version",
        variables,
    )
    assert version == "1.18.0"
    nccl = gpu_node("p5.48xlarge", efa_aws_ofi_nccl_version=version, efa_libfabric_version="2.4.0")
    assert render("{{ nccl_aws_ofi_nccl_version }}", nccl) == "1.18.0"
    text = render_template("nccl", "nccl.env.j2", nccl)
    assert "aws-ofi-nccl 1.18.0" in text and "libfabric 2.4.0" in text


def test_every_process_finds_aws_ofi_nccl(gpu_node):
    variables = gpu_node(
        "p5.48xlarge",
        efa_ofi_nccl_lib_dirs=["/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu"],
        efa_ofi_nccl_plugin_name="ofi",
    )
    conf = render_template("nccl", "ld.so.conf.j2", variables).splitlines()
    assert [line for line in conf if not line.startswith("#")] == [
        "/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu",
        "/opt/amazon/efa/lib",
    ]
    assert 'NCCL_NET_PLUGIN="ofi"' in render_template("nccl", "nccl.env.j2", variables).splitlines()
    # an older plugin named libnccl-net.so is NCCL's default: no NCCL_NET_PLUGIN
    plain = gpu_node("p5.48xlarge", efa_ofi_nccl_plugin_name="")
    assert "NCCL_NET_PLUGIN" not in render_template("nccl", "nccl.env.j2", plain)


@pytest.mark.parametrize(
    ("dpkg", "action", "installs"),
    [
        ("", "install", "pin"),
        ("config-files 2.27.7-1+cuda12.9", "install", "pin"),  # removed, configuration left
        ("installed 2.27.7-1+cuda12.9", "upgrade", "pin"),  # older: upgraded to the pin (over its hold)
        ("installed 2.29.3-1+cuda12.9", "keep", "2.29.3-1+cuda12.9"),
        ("installed 2.29.3-1+cuda12.8", "keep", "2.29.3-1+cuda12.8"),  # the pinned NCCL for another CUDA
        ("installed 2.30.1-1+cuda12.9", "keep", "2.30.1-1+cuda12.9"),  # newer: never downgraded
    ],
)
def test_nccl_is_upgraded_to_the_pin_and_never_downgraded(gpu_node, dpkg, action, installs):
    variables = gpu_node(
        "p4d.24xlarge", nccl_installed={"rc": 0 if dpkg else 1, "stdout": dpkg}, fsdp_nccl_version="2.29.3-1"
    )
    pin = render("{{ nccl_package_version }}", variables)
    assert pin == "2.29.3-1+cuda12.9"
    name = "Decide whether to install, upgrade or keep NCCL"
    assert evaluate("nccl", "nccl.yml", name, "nccl_action", variables) == action
    assert evaluate("nccl", "nccl.yml", name, "nccl_install_version", variables) == (
        pin if installs == "pin" else installs
    )
    install = task("nccl", "nccl.yml", "Install or upgrade NCCL from NVIDIA's CUDA repository")
    names = [
        render(n, {**variables, "nccl_install_version": "V"}) for n in install["ansible.builtin.apt"]["name"]
    ]
    assert names == ["libnccl2=V", "libnccl-dev=V"]


MISSING_PLUGIN = "Fail without aws-ofi-nccl on an EFA node"


def test_an_efa_node_without_aws_ofi_nccl_fails_instead_of_guessing_its_version(gpu_node):
    # the efa role read what the node has: libnccl-ofi not installed, libfabric 2.4.0
    variables = gpu_node(
        "p4d.24xlarge", efa_aws_ofi_nccl_version="", efa_libfabric_version="2.4.0", ansible_check_mode=False
    )
    assert render("{{ nccl_aws_ofi_nccl_version | trim }}", variables) == ""  # not the installer pin's 1.14.0
    assert evaluate("nccl", "environment.yml", MISSING_PLUGIN, "when", variables) is True
    message = " ".join(
        render(
            task("nccl", "environment.yml", MISSING_PLUGIN)["ansible.builtin.fail"]["msg"], variables
        ).split()
    )
    assert "the aws-ofi-nccl package libnccl-ofi is not installed and libfabric is 2.4.0" in message
    assert "Install them with the EFA installer, which ships the libnccl-ofi package" in message
    assert "--tags efa,nccl" in message
    installed = {**variables, "efa_aws_ofi_nccl_version": "1.18.0"}
    assert evaluate("nccl", "environment.yml", MISSING_PLUGIN, "when", installed) is False
    # a check run on a fresh node previews the environment for the installer pin's versions
    check = {**variables, "ansible_check_mode": True}
    assert render("{{ nccl_aws_ofi_nccl_version | trim }}", check) == "1.14.0"
    assert evaluate("nccl", "environment.yml", MISSING_PLUGIN, "when", check) is False
    # a GPU node without EFA reads nothing: its environment follows the installer pin
    no_efa = {
        **{k: v for k, v in variables.items() if not k.startswith("efa_")},
        "fsdp_hardware": {**variables["fsdp_hardware"], "efa_count": 0},
    }
    assert render("{{ nccl_aws_ofi_nccl_version | trim }}", no_efa) == "1.14.0"
    assert evaluate("nccl", "environment.yml", MISSING_PLUGIN, "when", no_efa) is False


def test_the_nccl_role_reads_the_efa_software_itself_when_run_alone(gpu_node):
    # --tags nccl: the efa role did not run in this play, so its facts are not there yet
    read = "Read the EFA software the node has (the environment is written for its versions)"
    assert task("nccl", "environment.yml", read)["ansible.builtin.include_role"] == {
        "name": "efa",
        "tasks_from": "installed",
    }
    variables = gpu_node("p4d.24xlarge")
    assert evaluate("nccl", "environment.yml", read, "when", variables) is True
    assert (
        evaluate("nccl", "environment.yml", read, "when", {**variables, "efa_aws_ofi_nccl_version": ""})
        is False
    )


LDD_OK = """\tlinux-vdso.so.1 (0x00007ffc1a3f2000)
\tlibmpi.so.40 => /opt/amazon/openmpi/lib/libmpi.so.40 (0x00007f2c1c000000)
\tlibnccl.so.2 => /lib/x86_64-linux-gnu/libnccl.so.2 (0x00007f2b00000000)
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f2c1bc00000)
"""


@pytest.mark.parametrize(
    ("stdout", "failed"),
    [
        (LDD_OK, False),
        # Open MPI 5 of the installer in /opt/amazon/openmpi5: no /opt/amazon/openmpi/lib path, still resolved
        (LDD_OK.replace("/opt/amazon/openmpi/lib", "/opt/amazon/openmpi5/lib"), False),
        (LDD_OK.replace("/opt/amazon/openmpi/lib/libmpi.so.40 (0x00007f2c1c000000)", "not found"), True),
        (
            LDD_OK.replace("\tlibnccl.so.2 => /lib/x86_64-linux-gnu/libnccl.so.2 (0x00007f2b00000000)\n", ""),
            True,
        ),
    ],
)
def test_nccl_tests_link_check_resolves_like_the_smoke_run(gpu_node, stdout, failed):
    name = "Check all_reduce_perf finds NCCL and Open MPI at run time"
    t = task("nccl", "nccl_tests.yml", name)
    assert t["environment"]["LD_LIBRARY_PATH"]
    assert (
        evaluate(
            "nccl",
            "nccl_tests.yml",
            name,
            "failed_when",
            gpu_node("p4d.24xlarge", nccl_tests_ldd={"rc": 0, "stdout": stdout}),
        )
        is failed
    )


# --------------------------------------------------------------------------------------- GPUDirect
@pytest.mark.parametrize(
    ("loaded", "available", "kernel_module", "module", "dmabuf"),
    [
        (["efa_nv_peermem"], [], "open", "efa_nv_peermem", True),
        ([], ["nvidia_peermem"], "proprietary", "nvidia_peermem", False),
        ([], [], "open", "", True),  # dma-buf: no peer-memory module needed
        ([], [], "proprietary", "", False),
    ],
)
def test_gpudirect_accepts_a_peer_memory_module_or_dma_buf(
    gpu_node, loaded, available, kernel_module, module, dmabuf
):
    hardware = {
        **gpu_node("p5.48xlarge")["fsdp_hardware"],
        "peermem_modules": loaded,
        "nvidia_kernel_module": kernel_module,
    }
    modinfo = {
        "results": [
            {"item": m, "rc": 0 if m in available else 1} for m in ("efa_nv_peermem", "nvidia_peermem")
        ]
    }
    variables = gpu_node("p5.48xlarge", fsdp_hardware=hardware, gpudirect_modinfo=modinfo)
    name = "Choose how EFA reaches GPU memory"
    chosen = evaluate("gpudirect", "main.yml", name, "gpudirect_module", variables)
    assert chosen == module
    assert evaluate("gpudirect", "main.yml", name, "gpudirect_dmabuf", variables) is dmabuf
    refused = evaluate(
        "gpudirect",
        "main.yml",
        "Fail without a peer-memory module or dma-buf",
        "when",
        {**variables, "gpudirect_module": chosen, "gpudirect_dmabuf": dmabuf},
    )
    assert refused is (not module and not dmabuf)


def test_the_first_configure_holds_only_the_idle_dynamic_nodes_of_its_play():
    """Which nodes the slurm role holds with a job for the rest of the play (power saving turned on
    half-way through it): those up and idle, once each, and only of this play (`--limit`)."""
    expression = task_expression("slurm", "services.yml", "Hold them with a job until the play ends",
                                 "vars", "slurm_idle_hosts")
    sinfo = ["c-node1 idle", "c-node1 idle", "c-node2 idle~", "c-node3 allocated", "c-node4 idle",
             "c-node5 idle#"]
    held = render(expression, {"slurm_dynamic_states": {"stdout_lines": sinfo},
                               "ansible_play_hosts": ["c-node0", "c-node1", "c-node2", "c-node3", "c-node5"]})
    assert held == ["c-node1"]
    assert render(expression, {"slurm_dynamic_states": {"skipped": True}, "ansible_play_hosts": []}) == []
