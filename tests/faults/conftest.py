"""The fault-injection suite: each test injects one fault on purpose (a SIGKILL, a full disk, a cut
link, a garbled file) and checks what must survive it (docs/reliability.md).

A test calls `fault.inject(what)` (the `fault` fixture) when the fault is in, so a test that fails
before it got there does not count as an injected fault, and `fault.lost(n)` for any data it found
lost (checkpoint steps, state fields). The summary at the end of the run is `tests/faults/summary.py`.
"""

from __future__ import annotations

import pytest


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
