"""How `make test` spreads the whole suite over its workers in one pytest session (`-n 3 --dist loadfile`).

Each test file is one unit of work, run whole by one worker: a file that boots local nodes does so in a
module fixture its tests share, in a subnet of its own. The files that share the session's demo cluster
(tests/local/demo_cluster.py SHARING_MODULES) are one unit together, so one worker holds that cluster.

The queue starts with the units that boot nodes or are marked slow, most such tests first, and ends with
the others. The node units take minutes each and wait on their nodes part of the time; the short units after
them fill the cores until the last node unit ends. (Two sessions, the fast tests first, left a core
idle at the end of each and collected the whole suite in five worker processes instead of three.)

pytest-xdist sends the scheduler only test ids, so the workers put their collection in this order
(`pytest_collection_modifyitems`; the controller tells them the session's `--dist`, since xdist sets
their own to "no") and the scheduler keeps it. (xdist's `--dist loadgroup` cannot group
files under pytest 9: it renames a test's `_nodeid`, which pytest 9 no longer reads, so it groups
nothing; pytest-dev/pytest-xdist#1386.)
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from xdist.scheduler import LoadFileScheduling

from tests.local.demo_cluster import SHARING_MODULES

DEMO_CLUSTER_UNIT = "demo-cluster"
HEAVY_MARKERS = ("root", "slow")
"""A unit with a test marked so goes to the front of the queue."""


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or DEMO_CLUSTER_UNIT for the files sharing the
    demo cluster."""
    path = nodeid.split("::", 1)[0]
    return DEMO_CLUSTER_UNIT if path in SHARING_MODULES else path


def queue_order(tests: Iterable[tuple[str, bool]]) -> list[int]:
    """The order to run `tests`, given as (test id, heavy) in collection order: the indices of the tests,
    unit after unit. The units with heavy tests come first, most heavy tests first (a file's quick tests
    cost next to nothing beside one that boots nodes, and many files hold both); then the others, most
    tests first; ties by where the unit first appears. Within a unit the tests keep their order
    (pytest's, by fixture)."""
    units: list[str] = []
    first: dict[str, int] = {}
    size: dict[str, int] = {}
    heavy: dict[str, int] = {}
    for index, (nodeid, is_heavy) in enumerate(tests):
        unit = work_unit(nodeid)
        units.append(unit)
        first.setdefault(unit, index)
        size[unit] = size.get(unit, 0) + 1
        heavy[unit] = heavy.get(unit, 0) + is_heavy
    return sorted(range(len(units)), key=lambda i: (-heavy[units[i]], -size[units[i]], first[units[i]]))


class SuiteScheduling(LoadFileScheduling):
    """pytest-xdist's loadfile over `work_unit`s, in the order the workers collected them."""

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)

    def _reschedule(self, node) -> None:
        # xdist hands a worker its next file once two of its tests are left to run. A node test takes
        # minutes, so near the end a worker sat on a file it could not start for two tests' time while the
        # others, finding nothing left, shut down. A worker runs a test only once it knows the next one
        # (xdist's remote.run_one_test), so one test left is the latest the next file can come.
        if self.workqueue and not node.shutting_down and self._pending_of(self.assigned_work[node]) > 1:
            return
        super()._reschedule(node)


_SESSION_DIST = "fsdp_session_dist"
"""The key of the session's `--dist` mode in what xdist hands each worker (`workerinput`)."""


def _loadfile(config: pytest.Config) -> bool:
    """Whether the session distributes by file: on a worker, as the controller said (xdist sets a
    worker's own `dist` option to "no")."""
    workerinput = getattr(config, "workerinput", None)
    dist = config.getvalue("dist") if workerinput is None else workerinput.get(_SESSION_DIST)
    return dist == "loadfile"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    node.workerinput[_SESSION_DIST] = node.config.getvalue("dist")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if not _loadfile(config):
        return None
    # The queue follows the collection (ordered below), not xdist's own order by number of tests.
    config.option.loadscopereorder = False
    return SuiteScheduling(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _loadfile(config):
        return
    heavy = [any(item.get_closest_marker(m) for m in HEAVY_MARKERS) for item in items]
    order = queue_order(zip((item.nodeid for item in items), heavy, strict=True))
    items[:] = [items[i] for i in order]
