"""The fault-injection suite: each test injects one fault on purpose (a SIGKILL, a full disk, a cut
link, a garbled file) and checks what must survive it (docs/reliability.md).

A test calls `fault.inject(what)` (the `fault` fixture) when the fault is in, so a test that fails
before it got there does not count as an injected fault, and `fault.lost(n)` for any data it found
lost (checkpoint steps, state fields). At the end of the run pytest prints one line per fault and the
total:

    faults injected 12, survived 12, data lost 0
"""

from __future__ import annotations

import pytest

_RESULTS: list[tuple[str, str, bool, int]] = []


class Fault:
    def __init__(self, request: pytest.FixtureRequest):
        self._properties = request.node.user_properties

    def inject(self, what: str) -> None:
        """Record that the test has injected its fault, described as `what`."""
        print(f"injecting: {what}")
        self._properties.append(("fault", what))

    def lost(self, amount: int) -> None:
        """Record data the fault destroyed that should have survived it."""
        self._properties.append(("data_lost", amount))


@pytest.fixture
def fault(request: pytest.FixtureRequest) -> Fault:
    return Fault(request)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call" and not (report.when == "setup" and report.failed):
        return
    faults = [value for key, value in report.user_properties if key == "fault"]
    data_lost = sum(value for key, value in report.user_properties if key == "data_lost")
    for what in faults:
        _RESULTS.append((report.nodeid.split("::")[-1], what, report.passed, data_lost))


def pytest_terminal_summary(terminalreporter) -> None:
    if not _RESULTS:
        return
    terminalreporter.section("fault injection")
    for test, what, survived, data_lost in _RESULTS:
        outcome = "survived" if survived else "NOT SURVIVED"
        extra = f", data lost {data_lost}" if data_lost else ""
        terminalreporter.write_line(f"{outcome:<13} {what}  [{test}]{extra}")
    survived = sum(1 for r in _RESULTS if r[2])
    terminalreporter.write_line(f"faults injected {len(_RESULTS)}, survived {survived}, "
                                f"data lost {sum(r[3] for r in _RESULTS)}")
