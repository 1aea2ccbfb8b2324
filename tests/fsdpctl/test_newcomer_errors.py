"""What a new user runs into, tried as one would (issue 23): each ends in one line naming what is
wrong, the value and the fix, with a non-zero exit, or (status) in what can be shown without the
cloud. The spec's own refusals are in tests/infra/test_spec_input.py, the trainer's in
tests/trainer/test_config_input.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from fsdpctl import state as state_mod
from fsdpctl.cli import main
from tests.fsdpctl.test_cli import local_cluster
from tests.infra.conftest import REPO, demo_data

DEMO = str(REPO / "examples" / "demo.yaml")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def no_aws(tmp_path, monkeypatch):
    """No AWS credentials anywhere: no profile, empty config files, no instance metadata."""
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                "AWS_SESSION_TOKEN", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    config = tmp_path / "aws-config"
    config.write_text("[profile dev]\nregion = us-east-1\n[profile prod]\nregion = us-west-2\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def error_lines(err: str, command: str) -> list[str]:
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith(f"fsdpctl {command}: ")]


def test_a_mistyped_aws_profile_names_the_profiles_there_is(no_aws, monkeypatch, capsys):
    monkeypatch.setenv("AWS_PROFILE", "dve")
    assert main(["preflight", DEMO]) == 2
    (line,) = error_lines(capsys.readouterr().err, "preflight")
    assert line == ("fsdpctl preflight: AWS_PROFILE='dve' names no profile in ~/.aws/config or "
                    "~/.aws/credentials (or AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE); profiles "
                    "there: dev, prod. Fix: set AWS_PROFILE to one of them, or unset it, or create it with "
                    "`aws configure --profile dve`")


def test_train_before_deploy_says_to_deploy(home, tmp_path, capsys):
    local_cluster(tmp_path, "nc-train")
    assert main(["train", "tiny", "--cluster", "nc-train"]) == 1
    assert error_lines(capsys.readouterr().err, "train") == [
        "fsdpctl train: the trainer is not deployed on cluster 'nc-train': run `fsdpctl deploy` first"]


def _without(modules: list[str], argv: list[str], home: Path) -> subprocess.CompletedProcess:
    """fsdpctl as after a plain `pip install -e .`: importing `modules` fails as for a missing package."""
    script = textwrap.dedent(f"""
        import sys
        for name in {modules!r}:
            sys.modules[name] = None
        from fsdpctl.cli import main
        sys.exit(main({argv!r}))
    """)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                          timeout=120, env={**os.environ, "FSDPCTL_HOME": str(home)})


def test_without_the_extras_each_command_says_which_to_install(home, tmp_path):
    local_cluster(tmp_path, "nc-extras")
    result = _without(["boto3", "botocore"], ["preflight", DEMO], home)
    assert result.returncode == 2, result.stderr
    assert error_lines(result.stderr, "preflight") == [
        "fsdpctl preflight: the Python package boto3 is not installed here (import botocore failed); install "
        "it with `pip install -e '.[aws]'` in the repository"]
    result = _without(["ansible_runner"], ["configure", "--cluster", "nc-extras"], home)
    assert result.returncode == 2, result.stderr
    assert error_lines(result.stderr, "configure") == [
        "fsdpctl configure: the Python package ansible-runner is not installed here (import ansible_runner "
        "failed); install it with `pip install -e '.[ansible]'` in the repository"]
    result = _without(["ansible_mitogen"], ["configure", "--cluster", "nc-extras"], home)
    assert result.returncode == 2, result.stderr
    assert error_lines(result.stderr, "configure") == [
        "fsdpctl configure: the Python package mitogen is not installed here (import ansible_mitogen "
        "failed); install it with `pip install -e '.[ansible]'` in the repository"]


def _aws_cluster(tmp_path: Path, name: str) -> state_mod.ClusterState:
    """An aws cluster as `up` records it: nodes with instance ids, SSH, an expiry and a cost."""
    state = local_cluster(tmp_path, name)
    state.update(target="aws", pulumi_stack=name, expires_at="2099-01-01T00:00:00Z", cost_per_hour=88.5,
                 nodes=[{"rank": r, "name": f"{name}-node{r}", "address": f"10.42.0.{10 + r}",
                         "instance_id": f"i-0123456789abcdef{r}"} for r in range(2)],
                 ssh={"user": "ubuntu", "key_file": str(tmp_path / "key"),
                      "known_hosts": str(tmp_path / "kh")})
    return state


def test_status_shows_the_state_file_without_aws_credentials(home, tmp_path, no_aws, capsys):
    _aws_cluster(tmp_path, "nc-offline")
    assert main(["status", "--cluster", "nc-offline"]) == 0
    out = capsys.readouterr().out
    assert "cluster nc-offline: target aws, 2 node(s)" in out
    assert "expires at 2099-01-01T00:00:00Z" in out and "cost: about 88.50 USD per hour" in out
    assert "nc-offline-node1" in out and "10.42.0.11" in out
    assert ("health: not refreshed (no AWS credentials found for region us-east-1; configure credentials: "
            in out)
    assert out.rstrip().endswith("the above is what the state file recorded")
    assert main(["status", "--cluster", "nc-offline", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["health"] == "unknown" and "no AWS credentials" in status["health_not_refreshed"]
    assert [n["instance_id"] for n in status["node_list"]] == ["i-0123456789abcdef0", "i-0123456789abcdef1"]


def test_down_takes_the_cluster_name_first_as_sky_down_does(home, tmp_path, capsys):
    first = local_cluster(tmp_path, "nc-first")
    local_cluster(tmp_path, "nc-second")  # now the current one
    assert main(["status", "nc-first", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "nc-first"
    assert main(["down", "nc-first", "--cluster", "nc-second", "--yes"]) == 2
    assert error_lines(capsys.readouterr().err, "down") == [
        "fsdpctl down: NAME 'nc-first' and --cluster 'nc-second' name different clusters; give one of them, "
        "e.g. `fsdpctl down nc-first`"]
    assert main(["down", "nc-first", "--yes"]) == 0
    assert not first.exists() and state_mod.cluster_state("nc-second").exists()


def test_a_no_is_said_once(home, tmp_path, monkeypatch, capsys):
    local_cluster(tmp_path, "nc-no")
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    assert main(["down", "nc-no"]) == 1
    assert capsys.readouterr().err == "fsdpctl down: not confirmed; nothing was done\n"
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)
    assert main(["down", "nc-no"]) == 2
    assert capsys.readouterr().err == ("fsdpctl down: this needs a yes to 'Destroy cluster nc-no?', and "
                                       "there is no terminal to ask on: run it again with --yes to go "
                                       "ahead\n")


def test_a_prices_file_with_unknown_keys_or_negative_prices_is_refused(tmp_path, capsys):
    prices = tmp_path / "prices.yaml"
    prices.write_text(yaml.safe_dump({
        "p4d.24xlarge": {"us-east-1": -100},
        "regions": {"us-east-1": {"instance_hour": {"p4d.24xlarge": -15.0, "p5.48xlarg": 50.0},
                                  "nat_gateway_hours": 0.05},
                    "us-est-1": {"nat_gateway_hour": 0.05}}}))
    assert main(["plan", DEMO, "--prices", str(prices)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "-59.85" not in err
    assert err.splitlines()[0] == f"fsdpctl plan: price table {prices} has 5 problem(s):"
    assert sorted(err.splitlines()[1:]) == sorted([
        "  - p4d.24xlarge: is not a known field (got {'us-east-1': -100}). Fix: remove it; the keys here are "
        "as_of, source, currency, hours_per_month, fallback_region, regions",
        "  - regions.us-east-1.instance_hour.p5.48xlarg: is not an instance type of the catalog (got "
        "'p5.48xlarg'). Fix: did you mean p5.48xlarge?",
        "  - regions.us-east-1.instance_hour.p4d.24xlarge: is below the minimum, 0.0 (got -15.0). Fix: use "
        "0.0 or more",
        "  - regions.us-east-1.nat_gateway_hours: is not a known field (got 0.05). Fix: did you mean "
        "`nat_gateway_hour`?",
        "  - regions.us-est-1: is not an AWS region (infra/data/regions.yaml) (got 'us-est-1'). Fix: did you "
        "mean us-west-1 or us-east-1?",
    ])


def test_an_alias_bomb_spec_is_refused_in_a_few_lines(tmp_path, capsys):
    from tests.infra.test_spec_input import BOMB

    spec = tmp_path / "bomb.yaml"
    spec.write_text(yaml.safe_dump(demo_data()) + BOMB.replace("name: *g", "tags: *g"))
    assert main(["plan", str(spec)]) == 2
    err = capsys.readouterr().err
    assert len(err) < 1000 and "expand to more than 100,000 values" in err


def test_a_state_file_with_a_bad_field_says_so_in_its_own_words(home, tmp_path, capsys):
    state = local_cluster(tmp_path, "nc-field")
    record = json.loads(state.state_path.read_text())
    record["nodes"][0]["rank"] = "first"
    state.state_path.write_text(json.dumps(record))
    assert main(["status", "--cluster", "nc-field"]) == 2
    (line,) = error_lines(capsys.readouterr().err, "status")
    assert line.startswith(f"fsdpctl status: {state.state_path} has a bad nodes.0.rank: it is not a whole "
                           "number (got 'first'); restore it from ")
    assert "Input should" not in line


def test_status_without_the_aws_extra_shows_the_state_file(home, tmp_path):
    _aws_cluster(tmp_path, "nc-noboto")
    result = _without(["boto3", "botocore"], ["status", "nc-noboto"], home)
    assert result.returncode == 0, result.stderr
    assert "cluster nc-noboto: target aws, 2 node(s)" in result.stdout
    assert ("health: not refreshed (the Python package boto3 is not installed here (import botocore failed); "
            "install it with `pip install -e '.[aws]'` in the repository); the above is what the state file "
            "recorded") in result.stdout
