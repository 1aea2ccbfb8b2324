"""`fsdpctl heal`: which nodes a pass replaces, and the watch loop. The node test (a spot notice on a
local Slurm node, the job checkpointing, heal putting a fresh node in its place and the job finishing
there) is in tests/slurm/test_slurm_nodes.py."""

from __future__ import annotations

import pytest

from fsdpctl import heal as heal_mod
from fsdpctl import slurm_nodes
from fsdpctl.cli import main
from fsdpctl.errors import CommandError, Interrupted
from fsdpctl.heal import plan_heal
from fsdpctl.slurm_nodes import NodeState
from fsdpctl.state import Node
from tests.fsdpctl.test_cli import local_cluster

SPOT = 'spot interruption notice: {"action": "terminate", "time": "2026-12-03T08:00:00Z"}'
REBALANCE = 'rebalance recommendation notice: {"noticeTime": "2026-12-03T07:50:00Z"}'


def nodes(count: int) -> list[Node]:
    return [Node(rank=r, name=f"heal-node{r}", address=f"198.18.9.{2 + r}") for r in range(count)]


def states(*seen: tuple[str, str | None]) -> dict[str, NodeState]:
    """Slurm's view of nodes heal-node0, heal-node1, ... as (state, reason)."""
    return {f"heal-node{r}": NodeState(name=f"heal-node{r}", state=state, reason=why)
            for r, (state, why) in enumerate(seen)}


@pytest.mark.parametrize(("seen", "ready", "waiting"), [
    # no notice anywhere: nothing to do
    ([("idle", None), ("allocated", None)], [], []),
    # drained by a notice, no job left: replaced now; its jobs still checkpointing: a later pass
    ([("idle", None), ("drained", SPOT)], [1], []),
    ([("idle", None), ("draining", SPOT)], [], [1]),
    ([("drained", REBALANCE), ("draining", REBALANCE)], [0], [1]),
    # EC2 took the instance back: its slurmd does not answer, the notice is still the reason
    ([("drained*", SPOT), ("down*", SPOT)], [0, 1], []),
    # drained for anything else: the operator's call
    ([("drained", "health (prolog): GPU 0 has 2 uncorrected ECC errors"),
      ("drained", "fsdpctl exclude: ECC errors")], [], []),
    ([("down*", "Not responding"), ("idle~", None)], [], []),
])
def test_a_pass_replaces_the_nodes_a_notice_drained_once_their_jobs_have_left(seen, ready, waiting):
    plan = plan_heal(nodes(len(seen)), states(*seen), controller=None)
    assert [n.rank for n in plan.ready] == ready
    assert [n.rank for n in plan.waiting] == waiting
    assert plan.controller is None


def test_a_node_slurm_does_not_list_is_left_alone():
    plan = plan_heal(nodes(3), states(("idle", None), ("drained", SPOT)), controller="heal-node0")
    assert [n.rank for n in plan.ready] == [1] and plan.waiting == ()


@pytest.mark.parametrize("state", ["drained", "draining", "down*"])
def test_the_controller_is_never_replaced(state):
    plan = plan_heal(nodes(2), states((state, SPOT), ("drained", SPOT)), controller="heal-node0")
    assert [n.rank for n in plan.ready] == [1] and plan.waiting == ()
    assert plan.controller is not None and plan.controller.rank == 0


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A three-node local cluster's state (nothing booted; node 0 runs Slurm's controller), Slurm's view
    of it, and the ranks replaced."""
    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    state = local_cluster(tmp_path, name="heal", nodes=3)
    seen: list[dict[str, NodeState] | Exception] = []
    replaced: list[tuple[int, bool]] = []

    def node_states(record):
        now = seen.pop(0)
        if isinstance(now, Exception):
            raise now
        return now

    monkeypatch.setattr(slurm_nodes, "node_states", node_states)
    monkeypatch.setattr(slurm_nodes, "controller_name", lambda record: "heal-node0")
    monkeypatch.setattr("fsdpctl.lifecycle.replace", lambda state, rank, *, yes: replaced.append((rank, yes)))
    return state, seen, replaced


def test_one_pass_replaces_what_is_ready_and_says_what_waits(cluster, capsys):
    _, seen, replaced = cluster
    seen.append(states(("idle", None), ("draining", SPOT), ("drained", SPOT)))
    assert main(["heal", "--cluster", "heal", "--yes"]) == 0
    assert replaced == [(2, True)]
    out = capsys.readouterr().out
    assert f"heal-node2: {SPOT}; replacing it" in out
    assert f"heal-node1: {SPOT}; its jobs are still checkpointing, replaced once they have left" in out


def test_a_drained_controller_is_left_to_the_operator_with_what_to_run(cluster, capsys):
    _, seen, replaced = cluster
    seen.append(states(("drained", SPOT), ("drained", SPOT)))
    assert main(["heal", "--cluster", "heal", "--yes"]) == 0
    assert replaced == [(1, True)]
    assert (f"heal-node0: {SPOT}; it runs Slurm's controller, which heal leaves alone (a new one starts "
            "with an empty queue): when no job needs the cluster, `fsdpctl replace 0`, then `fsdpctl "
            "configure --tags slurm`") in capsys.readouterr().out


def test_an_excluded_node_is_not_replaced(cluster, capsys):
    state, seen, replaced = cluster
    state.update(excluded=[{"rank": 1, "reason": "bad GPU", "time": "2026-12-01T00:00:00+00:00"}])
    seen.append(states(("idle", None), ("drained", SPOT)))
    assert main(["heal", "heal", "--yes"]) == 0
    assert replaced == [] and "cluster heal: no node drained by a spot notice" in capsys.readouterr().out


def test_a_cluster_without_slurm_is_a_one_line_error(cluster, capsys):
    _, seen, _ = cluster
    seen.append(None)
    assert main(["heal", "--cluster", "heal", "--yes"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "fsdpctl heal: Slurm is not installed on cluster heal, so no spot watcher drains its nodes: run "
        "`fsdpctl configure` first (docs/slurm.md)"]


def test_watch_goes_on_after_a_failed_pass_until_interrupted(cluster, monkeypatch, capsys):
    _, seen, replaced = cluster
    seen.extend([CommandError("`sinfo` exited 1: slurm_load_node: Unable to contact slurm controller"),
                 states(("idle", None), ("down*", SPOT))])
    sleeps: list[float] = []

    def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(heal_mod.time, "sleep", sleep)
    assert main(["heal", "--cluster", "heal", "--watch", "30", "--yes"]) == 130
    assert replaced == [(1, True)] and sleeps == [30, 30]
    err = capsys.readouterr().err
    assert ("this pass did not finish: `sinfo` exited 1: slurm_load_node: Unable to contact slurm "
            "controller; trying again in 30 s") in err


def test_watch_ends_when_a_replace_is_interrupted(cluster, monkeypatch, capsys):
    _, seen, _ = cluster
    seen.append(Interrupted("configure canceled; the nodes may be partly configured"))
    monkeypatch.setattr(heal_mod.time, "sleep", lambda seconds: pytest.fail("the watch went on"))
    assert main(["heal", "--cluster", "heal", "--watch", "30", "--yes"]) == 130
    assert "configure canceled" in capsys.readouterr().err


def test_watch_ends_when_the_cluster_is_taken_down(cluster, monkeypatch, capsys):
    state, seen, _ = cluster
    seen.append(states(("idle", None), ("idle", None), ("idle", None)))
    monkeypatch.setattr(heal_mod.time, "sleep", lambda seconds: state.state_path.unlink())
    assert main(["heal", "--cluster", "heal", "--watch", "30", "--yes"]) == 2
    assert "cluster heal has no state file" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--watch", "60"], "--watch replaces nodes with nobody there to answer: add --yes"),
    (["--watch", "5", "--yes"], "--watch 5: give the seconds between passes, at least 10 (e.g. --watch 60)"),
])
def test_bad_watch_arguments_are_refused_before_anything_runs(cluster, argv, message, capsys):
    assert main(["heal", "--cluster", "heal", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"fsdpctl heal: {message}"
