"""Faults in fsdpctl's own files and in its concurrency, with the real CLI in subprocesses (no nodes):
a truncated or garbled state.json or spec copy is a one-line error naming the file and the repair
(and `down --force` still works); commands running at once never lose each other's state fields;
a second command on a busy cluster refuses, naming the one it waits for."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdpctl import state as state_mod
from tests.fsdpctl.test_cli import local_cluster, run

# The commands that read a cluster's state: each must fail the same clean way on a broken file.
READERS = [("status",), ("inventory",), ("configure",), ("deploy",), ("smoke",), ("scale-test",),
           ("exclude", "0", "--reason", "test"), ("ssh", "0", "--", "true"), ("replace", "0", "--yes"),
           ("down", "--yes")]

GARBLE = {
    "truncated": lambda text: text[: len(text) // 3],
    "empty": lambda text: "",
    "not JSON/YAML": lambda text: "\x00\x01 {[ not a document",
}


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def brought_up(tmp_path: Path, name: str, nodes: int = 2) -> state_mod.ClusterState:
    """A local cluster's state as a finished `up` leaves it (nodes and SSH settings), nothing booted."""
    state = local_cluster(tmp_path, name=name, nodes=nodes)
    # loopback addresses: a command that got past the broken file would reach nothing but this host
    state.update(nodes=[{**n.model_dump(), "address": f"127.0.0.{2 + n.rank}"} for n in state.read().nodes])
    state.update(ssh={"user": "root", "key_file": str(state.keys_dir / "id_ed25519"),
                      "known_hosts": str(state.known_hosts)})
    return state


def assert_one_line_error(result: subprocess.CompletedProcess, path: Path, name: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert str(path) in lines[0] and f"fsdpctl down --cluster {name} --force" in lines[0], lines[0]
    assert f"{path}.good" in lines[0]  # where the last good copy is


@pytest.mark.parametrize("how", GARBLE)
@pytest.mark.parametrize("which", ["state.json", "spec.yaml"])
@pytest.mark.slow
def test_a_broken_state_file_is_one_line_for_every_command_and_down_force_repairs(
        home, tmp_path, fault, how, which):
    state = brought_up(tmp_path, "flt-state")
    path = state.root / which
    path.write_text(GARBLE[how](path.read_text()))
    fault.inject(f"{which} {how}")
    for argv in READERS:
        assert_one_line_error(run(*argv, home=home), path, state.name)
    # `list` shows the broken cluster beside the others instead of failing
    local_cluster(tmp_path, name="flt-other")
    listed = {row["name"]: row for row in json.loads(run("list", "--json", home=home).stdout)}
    assert "error" not in listed["flt-other"] and str(path) in listed["flt-state"]["error"]
    # down --force puts the last good copy back (saying so) and removes the cluster
    down = run("down", "--cluster", state.name, "--force", "--yes", home=home)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"{path} is unreadable" in down.stderr
    assert f"restored its last good copy {path}.good" in down.stderr
    assert "is down" in down.stdout and not state.root.exists()


def test_down_force_with_both_copies_broken_says_what_to_remove_by_hand(home, tmp_path, fault):
    state = local_cluster(tmp_path, name="flt-both")
    for path in (state.state_path, Path(f"{state.state_path}.good")):
        path.write_text("{")
    fault.inject("state.json and its last good copy both truncated")
    down = run("down", "--cluster", state.name, "--force", "--yes", home=home)
    assert down.returncode == 2 and len(down.stderr.strip().splitlines()) == 1
    assert "docs/reliability.md" in down.stderr and str(state.root) in down.stderr


def test_a_state_file_from_a_newer_fsdpctl_is_refused_not_misread(home, tmp_path, fault):
    state = local_cluster(tmp_path, name="flt-newer")
    data = json.loads(state.state_path.read_text())
    state.state_path.write_text(json.dumps({**data, "schema_version": state_mod.SCHEMA_VERSION + 1,
                                            "a_newer_field": 1}))
    fault.inject("state.json with a newer schema_version")
    result = run("status", home=home)
    assert_one_line_error(result, state.state_path, state.name)
    assert f"schema_version {state_mod.SCHEMA_VERSION + 1}" in result.stderr


def _exclude(home: str, rank: int) -> tuple[int, str]:
    result = run("exclude", str(rank), "--reason", f"rank {rank} test", home=Path(home))
    return result.returncode, result.stderr


def _mark_reports(home: str, name: str, count: int) -> None:
    os.environ["FSDPCTL_HOME"] = home
    state = state_mod.cluster_state(name)
    for i in range(count):
        state.update(last_report=f"/reports/{i}")


def test_commands_at_once_never_lose_each_others_fields(home, tmp_path, fault):
    """Eight `fsdpctl exclude` of different ranks at once (each a read-modify-write of the same list)
    while another process keeps updating another field: every exclusion and the last update stay."""
    state = brought_up(tmp_path, "flt-race", nodes=8)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(9) as pool:
        writer = pool.apply_async(_mark_reports, (str(home), state.name, 40))
        codes = pool.starmap(_exclude, [(str(home), rank) for rank in range(8)])
        writer.get(timeout=120)
    fault.inject("8 excludes and a state writer at once on one cluster")
    assert [code for code, _ in codes] == [0] * 8, codes
    record = state.read()
    missing = set(range(8)) - record.excluded_ranks()
    fault.lost(len(missing))
    assert not missing, f"exclusions lost: {sorted(missing)}"
    assert record.last_report == "/reports/39" and len(record.nodes) == 8


def test_a_second_command_on_a_busy_cluster_refuses_and_names_the_first(home, tmp_path, fault):
    state = local_cluster(tmp_path, name="flt-busy")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom fsdpctl import state\n"
         f"with state.cluster_state({state.name!r}).operation('deploy'):\n"
         "    print('held', flush=True)\n    time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "FSDPCTL_HOME": str(home)},
        cwd=Path(__file__).resolve().parents[2])
    try:
        assert holder.stdout.readline().strip() == "held"
        fault.inject("smoke, configure and down while a deploy holds the cluster")
        for argv in (("smoke",), ("configure",), ("down", "--yes"), ("scale-test",)):
            result = run(*argv, home=home)
            assert result.returncode == 2, result.stderr
            assert f"cluster {state.name} is busy: fsdpctl deploy (pid {holder.pid})" in result.stderr
            assert f"then run `fsdpctl {argv[0]}` again" in result.stderr
    finally:
        holder.kill()
        holder.wait()
    # the lock goes with its holder, even a SIGKILLed one
    time.sleep(0.1)
    with state.operation("smoke"):
        pass
