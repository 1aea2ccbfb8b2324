"""One configured cluster for every test that only needs one: `fsdpctl demo --keep` (up -> configure ->
deploy -> smoke) on 2 local nodes in 198.18.3.0/24, logged in to as AWS nodes are (as `ubuntu`, a user with
passwordless sudo: tests/local/conftest.py LOGIN_USER), made once per test session and shared by the
lifecycle, configure and monitoring tests (a fixture of the whole session, so also when one of those
modules runs alone).

Its tests run on one worker: under `make test`'s `--dist loadfile` the files in SHARING_MODULES are
one unit of work (tests/scheduling.py). A test that breaks the cluster is marked `ends_demo_cluster` and
runs after the cluster's other tests.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.local.conftest import LOGIN_USER, fsdpctl, read_state, require_local_prerequisites, spec_file

NAME = "demo-test"
SUBNET = "198.18.3.0/24"
NODES = [f"{NAME}-node0", f"{NAME}-node1"]
ADDRESSES = ["198.18.3.2", "198.18.3.3"]
SMOKE_STEPS = 40
"""The smoke run's steps: the monitoring check fits each rank's memory over the logged steps (30 of 40)."""
SHARING_MODULES = ("tests/lifecycle/test_local_lifecycle.py", "tests/local/test_configure.py",
                   "tests/monitoring/test_local_monitoring.py")
"""The test files that use the demo cluster: one unit of work under `--dist loadfile`."""


@dataclass(frozen=True)
class DemoCluster:
    home: Path
    """FSDPCTL_HOME of the cluster."""
    result: subprocess.CompletedProcess
    """`fsdpctl demo --keep`, as it ended."""
    local: dict | None
    """The state's record of the local nodes right after the demo (None if it made none)."""

    def stage_output(self, stage: str) -> str:
        """What the demo printed for one of its stages (up, configure, deploy, smoke)."""
        parts = re.split(r"^==> \[demo\] ", self.result.stdout, flags=re.MULTILINE)
        return next(part for part in parts if re.match(rf"\d+/\d+ fsdpctl {stage}\b", part))

    @property
    def smoke_run_dir(self) -> Path:
        """The run directory of the demo's smoke test (later smoke runs write others)."""
        match = re.search(r"^\s*smoke report: (\S+)/report\.html", self.result.stdout, re.MULTILINE)
        assert match, self.result.stdout[-3000:]
        return Path(match[1])

    @property
    def smoke_report(self) -> dict:
        """The demo's smoke report (report.json of its run directory)."""
        return json.loads((self.smoke_run_dir / "report.json").read_text())


@pytest.fixture(scope="session")
def demo_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoCluster]:
    """The demo's cluster, kept up for the session and torn down after it whatever happens."""
    require_local_prerequisites()
    home = tmp_path_factory.mktemp("demo-home")
    spec = spec_file(home.parent, NAME,
                     local={"subnet_cidr": SUBNET, "nproc_per_node": 1, "login_user": LOGIN_USER})
    try:
        result = fsdpctl(home, "demo", str(spec), "--nodes", "2", "--keep", "--smoke-steps", str(SMOKE_STEPS),
                         timeout=1500, check=False)
        local = read_state(home, NAME).get("local") if (home / "clusters" / NAME).exists() else None
        yield DemoCluster(home, result, local)
    finally:
        fsdpctl(home, "down", "--yes", "--cluster", NAME, timeout=300, check=False)


@pytest.fixture(scope="session")
def demo(demo_cluster: DemoCluster) -> DemoCluster:
    """The demo's cluster; an error naming what the demo said for every test using it if it did not get
    through."""
    result = demo_cluster.result
    assert result.returncode == 0, f"demo failed:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    return demo_cluster


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unlisted = sorted({item.nodeid.split("::")[0] for item in items if "demo_cluster" in item.fixturenames}
                      - set(SHARING_MODULES))
    if unlisted:
        raise pytest.UsageError(f"{', '.join(unlisted)} use the demo cluster: add them to SHARING_MODULES in "
                                "tests/local/demo_cluster.py, so that they run on the worker that holds it")
    # After pytest's own reordering by fixture: the tests that break the cluster last.
    items.sort(key=lambda item: item.get_closest_marker("ends_demo_cluster") is not None)
