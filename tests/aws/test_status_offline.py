"""`fsdpctl status` of an aws cluster where AWS does not answer the health check: it shows what the
state file knows and says the health was not refreshed, and why, instead of a traceback."""

from __future__ import annotations

import json

from fsdpctl import cli
from fsdpctl.targets.aws import stack

from .test_stack import OUTPUTS, make_spec, new_state


def test_status_when_ec2_refuses_the_node_query(aws, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    spec = make_spec()
    state = new_state(tmp_path, spec)
    # Instance ids this account does not have: describe_instances answers InvalidInstanceID.NotFound.
    stack.state_from_outputs(spec, OUTPUTS, key_file=tmp_path / "k",
                             known_hosts=tmp_path / "kh").record(state)
    assert cli.main(["status", "--cluster", "pf"]) == 0
    out = capsys.readouterr().out
    assert "pf-node0" in out and "10.42.1.11" in out
    assert "health: not refreshed (EC2 did not say how the nodes are (InvalidInstanceID.NotFound: " in out
    assert cli.main(["status", "pf", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["health"] == "unknown" and "InvalidInstanceID.NotFound" in status["health_not_refreshed"]
