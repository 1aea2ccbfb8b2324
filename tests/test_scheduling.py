"""How `make test` queues the suite for its workers (tests/scheduling.py): the files sharing the demo cluster
are one unit of work and every other file its own, the units that boot nodes or are slow come first, and a
whole `pytest --collect-only` in that mode keeps every unit together."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.local.conftest import REPO
from tests.local.demo_cluster import SHARING_MODULES
from tests.scheduling import DEMO_CLUSTER_UNIT, queue_order, work_unit


def test_the_files_sharing_the_demo_cluster_are_one_unit_and_the_others_one_each():
    assert {work_unit(f"{module}::test_x") for module in SHARING_MODULES} == {DEMO_CLUSTER_UNIT}
    assert work_unit("tests/slurm/test_slurm_nodes.py::test_a[rank-1]") == "tests/slurm/test_slurm_nodes.py"
    assert work_unit("tests/faults/test_node_faults.py::test_b") == "tests/faults/test_node_faults.py"


def test_every_sharing_module_exists():
    assert [m for m in SHARING_MODULES if not (REPO / m).is_file()] == []


def test_heavy_units_come_first_by_heavy_tests_and_every_unit_stays_together_in_its_own_order():
    lifecycle, configure = SHARING_MODULES[:2]
    tests = [
        ("tests/a_fast.py::t1", False), ("tests/a_fast.py::t2", False), ("tests/a_fast.py::t3", False),
        (f"{lifecycle}::demo", True),
        ("tests/b_mixed.py::boot", True), *((f"tests/b_mixed.py::quick{i}", False) for i in range(4)),
        ("tests/c_fast.py::t1", False),
        (f"{configure}::second_run", True), (f"{configure}::check_mode", True),
        ("tests/d_slow.py::train", True), ("tests/d_slow.py::resume", True),
    ]
    order = [tests[i][0] for i in queue_order(tests)]
    assert order == [
        # three heavy tests in the demo cluster's files, in their order, though other files came between
        f"{lifecycle}::demo", f"{configure}::second_run", f"{configure}::check_mode",
        # two heavy tests, before a file of five with one: what its quick tests cost does not count
        "tests/d_slow.py::train", "tests/d_slow.py::resume",
        "tests/b_mixed.py::boot", *(f"tests/b_mixed.py::quick{i}" for i in range(4)),
        # then the files with no heavy test, most tests first
        "tests/a_fast.py::t1", "tests/a_fast.py::t2", "tests/a_fast.py::t3",
        "tests/c_fast.py::t1",
    ]


def test_the_suite_collected_for_loadfile_keeps_each_unit_together_and_the_heavy_ones_first():
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "--dist", "loadfile",
         "tests/test_scheduling.py", "tests/slurm", "tests/local/test_configure.py",
         "tests/trainer/test_data.py", "tests/lifecycle"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    units = [work_unit(line) for line in collected.stdout.splitlines() if "::" in line]
    runs = [unit for i, unit in enumerate(units) if i == 0 or units[i - 1] != unit]
    assert len(runs) == len(set(runs)), runs  # no unit comes back after another began
    assert runs[0] == DEMO_CLUSTER_UNIT  # the most heavy tests
    assert runs.index("tests/slurm/test_slurm_nodes.py") < runs.index("tests/trainer/test_data.py")
    assert runs.index("tests/slurm/test_power_saving.py") < runs.index("tests/test_scheduling.py")


def test_an_xdist_worker_runs_the_units_in_the_queue_order(tmp_path: Path):
    """Through pytest-xdist itself (whose workers see `dist` as "no"): one worker takes the units in
    the queue's order, the file with the most heavy tests first."""
    ran = tmp_path / "ran.txt"
    files = {"test_a_fast.py": ["", "", ""], "test_b_mixed.py": ["slow", "", ""],
             "test_c_nodes.py": ["root", "root"]}
    for name, marks in files.items():
        (tmp_path / name).write_text("import os, pytest\n" + "".join(
            (f"@pytest.mark.{mark}\n" if mark else "")
            + f"def test_{i}(request):\n"
              f"    with open(os.environ['RAN'], 'a') as f:\n"
              f"        f.write(request.node.nodeid + '\\n')\n"
            for i, mark in enumerate(marks)))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.scheduling", "-p", "no:cacheprovider", "-q", "-n", "1",
         "--dist", "loadfile", "-o", "markers=root\nslow", str(tmp_path)],
        cwd=tmp_path, env={**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, "RAN": str(ran),
                           "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [line.split("::")[0] for line in ran.read_text().splitlines()] == [
        "test_c_nodes.py", "test_c_nodes.py", "test_b_mixed.py", "test_b_mixed.py", "test_b_mixed.py",
        "test_a_fast.py", "test_a_fast.py", "test_a_fast.py"]
