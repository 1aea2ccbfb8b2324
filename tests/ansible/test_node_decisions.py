"""The decisions the hardware roles take from what a node already has (a Deep Learning AMI brings a
newer driver, GDRCopy, EFA installer and aws-ofi-nccl, and mounts its instance store), rendered by
Ansible's templating exactly as the tasks write them, with the variables of a p4d/p5 node."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from ansible.template import trust_as_template

from tests.ansible.conftest import ROLES_DIR, render, render_template
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


def _tasks(role: str, tasks_file: str) -> list[dict[str, Any]]:
    flat = []
    for task in yaml.safe_load((ROLES_DIR / role / "tasks" / tasks_file).read_text()):
        flat.append(task)
        flat.extend(task.get("block", []))
    return flat


def task(role: str, tasks_file: str, name: str) -> dict[str, Any]:
    return next(t for t in _tasks(role, tasks_file) if t.get("name") == name)


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


# ------------------------------------------------------------------------------------------- driver
DRIVER = "Decide whether to adopt the image's driver"


def driver_decision(gpu_node, smi: str, owner: str = "", **overrides):
    variables = gpu_node(
        "p5.48xlarge",
        nvidia_smi_version={"rc": 0 if smi else 9, "stdout_lines": [smi] if smi else []},
        nvidia_smi_package={"rc": 0 if owner else 1, "stdout": owner},
        **overrides,
    )
    adopted = evaluate("nvidia", "driver.yml", DRIVER, "nvidia_driver_adopted", variables)
    source = evaluate("nvidia", "driver.yml", DRIVER, "nvidia_driver_source", variables)
    image = evaluate("nvidia", "driver.yml", DRIVER, "nvidia_image_driver", variables)
    refuse = evaluate(
        "nvidia",
        "driver.yml",
        "Refuse to switch the driver branch without being asked",
        "when",
        {**variables, "nvidia_driver_adopted": adopted, "nvidia_image_driver": image},
    )
    return adopted, source, refuse


def test_image_driver_of_a_newer_branch_is_adopted(gpu_node):
    # the DLAMI ships 595 while the spec pins 580: keep it, install nothing
    assert driver_decision(gpu_node, "595.71.05", nvidia_driver_branch="580") == (True, "nvidia", False)
    assert driver_decision(gpu_node, "580.95.05", nvidia_driver_branch="580")[0] is True


def test_image_driver_of_an_older_branch_is_refused_unless_switching_is_asked_for(gpu_node):
    assert driver_decision(gpu_node, "570.172.08", nvidia_driver_branch="580") == (False, "nvidia", True)
    assert (
        driver_decision(
            gpu_node, "570.172.08", nvidia_driver_branch="580", nvidia_driver_allow_branch_switch=True
        )[2]
        is False
    )
    # exact branch asked for: a newer image driver is a switch too
    assert driver_decision(
        gpu_node, "595.71.05", nvidia_driver_branch="580", nvidia_driver_exact_branch=True
    ) == (False, "nvidia", True)


def test_node_without_driver_installs_the_headless_server_packages(gpu_node):
    adopted, _, refuse = driver_decision(gpu_node, "", nvidia_driver_branch="580")
    assert adopted is False and refuse is False
    packages = render("{{ nvidia_driver_packages }}", gpu_node("p5.48xlarge", nvidia_driver_branch="580"))
    assert packages == ["nvidia-headless-580-server-open", "nvidia-utils-580-server"]


@pytest.mark.parametrize(
    ("owner", "source", "specs"),
    [
        # Ubuntu archive server packages: the branch is in the name, the version is Ubuntu's
        (
            "nvidia-utils-580-server",
            "ubuntu",
            ["nvidia-fabricmanager-580=580.95.05-*", "libnvidia-nscq-580=580.95.05-*"],
        ),
        # NVIDIA's repository, and a runfile driver (owned by no package): 580.95.05-1ubuntu1
        ("nvidia-driver-cuda", "nvidia", ["nvidia-fabricmanager=580.95.05-*", "libnvidia-nscq=580.95.05-*"]),
        ("", "nvidia", ["nvidia-fabricmanager=580.95.05-*", "libnvidia-nscq=580.95.05-*"]),
    ],
)
def test_fabric_manager_at_the_drivers_full_version_from_its_repository(gpu_node, owner, source, specs):
    assert driver_decision(gpu_node, "580.95.05", owner, nvidia_driver_branch="580")[1] == source
    variables = gpu_node(
        "p4d.24xlarge",
        nvidia_driver_source=source,
        nvidia_smi_running={"rc": 0, "stdout_lines": ["580.95.05"]},
        nvidia_fm_version={"rc": 0, "stdout": "Fabric Manager version is : 575.57.08"},
    )
    name = "Decide the Fabric Manager packages"
    assert evaluate("nvidia", "fabricmanager.yml", name, "nvidia_fm_specs", variables) == specs
    assert evaluate("nvidia", "fabricmanager.yml", name, "nvidia_fm_installed", variables) == "575.57.08"
    install = "Install Fabric Manager at the driver's version"
    assert evaluate(
        "nvidia", "fabricmanager.yml", install, "when", {**variables, "nvidia_fm_installed": "575.57.08"}
    )
    # the image's Fabric Manager already matches: nothing to install
    assert not evaluate(
        "nvidia", "fabricmanager.yml", install, "when", {**variables, "nvidia_fm_installed": "580.95.05"}
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
        "verify.yml",
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


# ----------------------------------------------------------------------------------------- storage
def scratch_action(gpu_node, *, mounts, holders=None, signed=(), raid=False):
    hardware = gpu_node("p4d.24xlarge")["fsdp_hardware"]
    devices = hardware["nvme_instance_store"]
    hardware = {**hardware, "nvme_holders": {d: (holders or {}).get(d, []) for d in devices}}
    findmnt = {"filesystems": [{"target": t, "source": "/dev/x", "fstype": "xfs"} for t in ["/", *mounts]]}
    blkid = {"results": [{"item": d, "rc": 0 if d in signed else 2} for d in devices]}
    variables = gpu_node(
        "p4d.24xlarge",
        fsdp_hardware=hardware,
        storage_raid={"stat": {"exists": raid}},
        storage_findmnt={"stdout": __import__("json").dumps(findmnt)},
        storage_blkid=blkid,
    )
    name = "Decide what to do with the instance store"
    return (
        evaluate("storage", "scratch.yml", name, "storage_scratch_action", variables).strip(),
        evaluate("storage", "scratch.yml", name, "storage_nvme_in_use", variables),
    )


def test_dlami_instance_store_mount_is_adopted(gpu_node):
    held = {f"/dev/nvme{n}n1": ["md127"] for n in range(1, 9)}
    assert scratch_action(gpu_node, mounts=["/opt/dlami/nvme"], holders=held)[0] == "adopt"
    # second run: /scratch is the bind mount now; still the same decision, nothing re-created
    assert scratch_action(gpu_node, mounts=["/opt/dlami/nvme", "/scratch"], holders=held)[0] == "adopt"


@pytest.mark.parametrize(
    ("holders", "signed"),
    [({"/dev/nvme3n1": ["dm-0"]}, ()), ({}, ("/dev/nvme1n1",))],
)
def test_instance_store_in_use_is_refused_never_overwritten(gpu_node, holders, signed):
    action, in_use = scratch_action(gpu_node, mounts=[], holders=holders, signed=signed)
    assert action == "refuse"
    assert in_use == sorted([*holders, *signed])


def test_blank_instance_store_or_our_own_array_is_built(gpu_node):
    assert scratch_action(gpu_node, mounts=[])[0] == "create"
    # our array exists (its members are held by it): keep building on it, not refuse
    assert scratch_action(gpu_node, mounts=[], holders={"/dev/nvme1n1": ["md127"]}, raid=True)[0] == "create"
    assert scratch_action(gpu_node, mounts=["/scratch"])[0] == "mounted"
