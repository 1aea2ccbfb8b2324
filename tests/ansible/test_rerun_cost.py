"""What an idempotent configure costs per node: checks that read the node do it in one module call,
not one per item (each call is an SSH round trip and a Python start on every node, every run)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from ansible.template import trust_as_template

from tests.ansible.conftest import ROLES_DIR, render

MONITORING_PACKAGES = ["prometheus", "prometheus-node-exporter"]


def _monitoring_task(name: str) -> dict[str, Any]:
    tasks = yaml.safe_load((ROLES_DIR / "monitoring" / "tasks" / "packages.yml").read_text())
    return next(t for t in tasks if t["name"] == name)


def test_the_monitoring_packages_are_listed_in_one_dpkg_query():
    listing = _monitoring_task("List the installed monitoring packages")
    assert "loop" not in listing
    argv = render(listing["ansible.builtin.command"]["argv"], {"monitoring_packages": MONITORING_PACKAGES})
    assert argv == ["dpkg-query", "--show", "--showformat", "${Package} ${db:Status-Status}\n",
                    *MONITORING_PACKAGES]


@pytest.mark.parametrize(("stdout_lines", "missing"), [
    (["prometheus installed", "prometheus-node-exporter installed"], []),
    # dpkg-query prints nothing for a package it does not know (and exits 1)
    (["prometheus installed"], ["prometheus-node-exporter"]),
    # removed but its configuration kept
    (["prometheus config-files", "prometheus-node-exporter installed"], ["prometheus"]),
    ([], MONITORING_PACKAGES),
])
def test_the_missing_monitoring_packages_come_from_that_one_query(stdout_lines, missing):
    check = _monitoring_task("Check the node carries the monitoring packages")
    variables = {"monitoring_packages": MONITORING_PACKAGES,
                 "monitoring_dpkg_query": {"stdout_lines": stdout_lines, "rc": 1 if missing else 0}}
    task_vars = {k: trust_as_template(v) for k, v in check["vars"].items()}
    assert render("{{ monitoring_missing }}", {**variables, **task_vars}) == missing
