"""The fault-injection summary: one line per fault the tests recorded (tests/faults/conftest.py's
`fault` fixture) and the total, at the end of the run:

    faults injected 12, survived 12, data lost 0

A plugin loaded by tests/conftest.py rather than hooks in tests/faults/conftest.py: under
pytest-xdist only the controller prints the summary, and it never loads a subdirectory's conftest.
The faults travel to it in each report's user_properties.
"""

from __future__ import annotations

import pytest

_RESULTS: list[tuple[str, str, bool, int]] = []


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
