"""How `run_smoke` runs its checks, without nodes: each check's line in the report, a check that
could not run, one skipped on request, and those an earlier failure blocks."""

from __future__ import annotations

from fsdpctl.checks.context import CheckError
from fsdpctl.checks.nodes import InventoryDetails, InventoryResult, NodeInventory
from fsdpctl.checks.smoke import _Checks


def _inventory() -> InventoryResult:
    return InventoryResult(summary="2 node(s) answer", details=InventoryDetails(
        expected_mtu=9000, hardware_checks="skipped", nodes={0: NodeInventory(answers=True, interface="eth0"),
                                                             1: NodeInventory(answers=True, interface=None)}))


def test_a_checks_result_becomes_its_line_and_is_handed_back():
    printed: list[str] = []
    checks = _Checks(record=None, work_dir="/w", skip=[], out=printed.append)
    result = checks.run("inventory", _inventory)
    assert result == _inventory() and result.interfaces == {0: "eth0"}
    [line] = checks.entries
    assert (line.name, line.status, line.summary, line.details) == ("inventory", "pass", "2 node(s) answer",
                                                                   _inventory().details)
    assert printed[-1].startswith("inventory: pass (")


def test_a_check_that_cannot_run_fails_its_line_and_hands_back_nothing():
    def unreachable() -> InventoryResult:
        raise CheckError("node 1 (10.0.0.2) does not answer")

    checks = _Checks(record=None, work_dir="/w", skip=[], out=lambda _line: None)
    assert checks.run("inventory", unreachable) is None
    assert checks.status("inventory") == "fail"
    [line] = checks.entries
    assert line.summary == "node 1 (10.0.0.2) does not answer" and line.details is None


def test_skipped_and_blocked_checks_do_not_run():
    def must_not_run() -> InventoryResult:
        raise AssertionError("ran")

    checks = _Checks(record=None, work_dir="/w", skip=["bandwidth"], out=lambda _line: None)
    assert checks.run("bandwidth", must_not_run) is None
    checks.block("the inventory check failed (every node must answer first)")
    assert checks.run("fsdp", must_not_run) is None
    assert [(e.name, e.status, e.summary) for e in checks.entries] == [
        ("bandwidth", "skip", "skipped on request (--skip)"),
        ("fsdp", "skip", "not run: the inventory check failed (every node must answer first)")]
