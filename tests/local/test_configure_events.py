"""Without nodes: `-e` parsing and how configure turns ansible-runner events into progress lines and
failures (events shaped like the ones ansible-runner 2.4 emits, as recorded in a run's job_events)."""

from __future__ import annotations

import pytest

from fsdpctl.configure import _EventPrinter, parse_extra_vars
from fsdpctl.errors import CommandError


def event(kind: str, task: str, role: str = "network", host: str = "n0", **extra) -> dict:
    return {"event": kind, "event_data": {"host": host, "task": task, "role": role, **extra}}


def test_extra_vars_are_typed_yaml_scalars():
    assert parse_extra_vars(["fsdp_mtu=9000", "flag=true", "name=node a", "empty="]) == {
        "fsdp_mtu": 9000, "flag": True, "name": "node a", "empty": ""}
    with pytest.raises(CommandError, match="is not KEY=VALUE"):
        parse_extra_vars(["fsdp_mtu"])


def test_one_line_per_task_result_with_failures_and_skip_reasons():
    lines: list[str] = []
    printer = _EventPrinter(lines.append)
    printer(event("playbook_on_task_start", "Set the MTU"))
    printer(event("runner_on_ok", "Set the MTU", res={"changed": True}))
    printer(event("runner_on_ok", "Read the MTU back", res={"changed": False}))
    printer(event("runner_on_failed", "Check the MTU", host="n1", res={"msg": "eth0 has MTU 1500"}))
    printer(event("runner_on_failed", "Optional probe", res={"msg": "x"}, ignore_errors=True))
    printer(event("runner_on_unreachable", "Gathering Facts", role="", host="n2",
                  res={"msg": "ssh: connect to host 198.18.1.4 port 22: No route to host"}))
    skipped = event("runner_on_skipped", "Skip the NVIDIA driver (no NVIDIA GPU)", role="nvidia")
    skipped["stdout"] = ("skipping: [n0] => \r\n    changed: false\r\n    skip_reason: 'no NVIDIA GPU on\r\n"
                         "        this node'")
    printer(skipped)
    printer(event("runner_on_skipped", "Scratch", role="storage"))
    assert [r.status for r in printer.results] == ["changed", "ok", "failed", "ignored", "unreachable",
                                                   "skipped", "skipped"]
    assert lines[0].split() == ["changed", "n0", "network", ":", "Set", "the", "MTU"]
    assert lines[2].splitlines()[0].split()[:2] == ["failed", "n1"]
    assert lines[2].splitlines()[1].strip() == "eth0 has MTU 1500"
    assert lines[-2].endswith("(no NVIDIA GPU on this node)")
    assert lines[-1].endswith("storage : Scratch")
    assert [(f.host, f.task) for f in printer.failures] == [("n1", "network : Check the MTU"),
                                                            ("n2", "Gathering Facts")]
    assert "No route to host" in printer.failures[1].message
