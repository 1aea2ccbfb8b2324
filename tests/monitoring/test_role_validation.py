"""The monitoring role's settings are checked before any role changes anything (site.yml's validate
loop): a wildcard listen address or an oversized retention is refused, naming the value and the fix."""

from __future__ import annotations

import pytest

from tests.ansible.conftest import run_playbook
from tests.ansible.test_playbook import RECAP, VALIDATE

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("extra_vars", "message"), [
    (["monitoring_listen_address=0.0.0.0"],
     'monitoring_listen_address "0.0.0.0" must be the node\'s cluster address'),
    (["monitoring_retention_fraction=0.95"], "monitoring_retention_fraction 0.95 between 0.01 and 0.8"),
    (["monitoring_scrape_interval=often"], 'monitoring_scrape_interval "often" a duration such as 2s'),
])
def test_bad_monitoring_settings_are_refused(tmp_path, extra_vars, message):
    args = [a for v in [*extra_vars, "ansible_host=198.18.30.2", "node_rank=0"] for a in ("-e", v)]
    result = run_playbook(tmp_path, VALIDATE.format(role="monitoring"), *args)
    assert result.returncode == 2, result.stdout[-3000:]
    assert message in " ".join(result.stdout.split()), result.stdout[-3000:]
    assert RECAP.search(result.stdout)[4] == "1"


def test_good_monitoring_settings_pass(tmp_path):
    result = run_playbook(tmp_path, VALIDATE.format(role="monitoring"), "-e", "ansible_host=198.18.30.2")
    assert result.returncode == 0, result.stdout[-3000:]
