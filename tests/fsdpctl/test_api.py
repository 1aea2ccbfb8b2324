"""fsdpctl's Python API (fsdpctl/api.py): the verbs as functions with typed arguments, which the CLI
and the demo call. What boots nodes is exercised through the demo (tests/lifecycle)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from fsdpctl import api
from fsdpctl.cli import main
from fsdpctl.errors import StateError
from fsdpctl.plan import ClusterPlan
from infra.spec import SpecError
from tests.infra.conftest import REPO, demo_data

DEMO = REPO / "examples" / "demo.yaml"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_importing_the_api_loads_no_cloud_ansible_or_trainer_package():
    # A program that only plans, or only drives local nodes, must not need every extra installed.
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, fsdpctl.api; print(' '.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True, cwd=REPO).stdout.split()
    heavy = {"pulumi", "pulumi_aws", "boto3", "ansible_runner", "ansible", "torch", "matplotlib"}
    assert heavy.isdisjoint(loaded)


def test_plan_returns_what_the_cli_prints(capsys):
    result = api.plan(DEMO)
    assert isinstance(result, ClusterPlan)
    assert main(["plan", str(DEMO), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["memory_fit"] == result.memory_fit.as_json()
    assert printed["cost"]["per_hour"] == pytest.approx(result.cost.per_hour)
    assert result.misfit is None and result.training is None


def test_plan_with_tokens_prices_the_training_run():
    result = api.plan(DEMO, tokens="1e6", mfu=0.4)
    assert result.training is not None and result.training.tokens == 1_000_000


def test_a_bad_spec_raises_before_anything_is_created(home, tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text(yaml.safe_dump({**demo_data(name="api-bad"), "node_count": 0}))
    with pytest.raises(SpecError, match="node_count"):
        api.up(spec, target="local", nodes=2)
    assert not (home / "clusters").exists()


@pytest.mark.parametrize("verb", [api.configure, api.deploy, api.down])
def test_a_verb_on_a_cluster_that_is_not_there_names_the_ones_there_are(home, verb):
    with pytest.raises(StateError, match="no cluster named 'nowhere'"):
        verb("nowhere")


def test_the_demo_stops_at_the_first_failed_stage_and_still_tears_down(home, monkeypatch, capsys):
    # The stages are the API's functions; here they are replaced, so no node boots: `configure`
    # fails as a playbook failure would, and the cluster `up` recorded must still go down.
    from fsdpctl import demo
    from fsdpctl import state as state_mod
    from fsdpctl.errors import CommandError

    spec = REPO / "examples" / "local.yaml"
    name = state_mod.load_spec(spec).name
    called: list[str] = []

    def up(spec_file, *, target, nodes):
        called.append(f"up {target} {nodes}")
        state_mod.create(spec_file, state_mod.load_spec(spec_file), target, node_count=nodes)

    def configure(cluster):
        called.append(f"configure {cluster}")
        raise CommandError("the playbook failed; fix the cause and run `fsdpctl configure` again")

    def down(cluster, *, yes):
        called.append(f"down {cluster} yes={yes}")
        state_mod.cluster_state(cluster).remove()

    for verb, fake in (("up", up), ("configure", configure), ("down", down)):
        monkeypatch.setattr(api, verb, fake)
    with pytest.raises(CommandError, match=r"demo failed at `configure`.*Nothing is left up"):
        demo.run_demo(spec, nodes=2)
    assert called == ["up local 2", f"configure {name}", f"down {name} yes=True"]
    captured = capsys.readouterr()
    assert "fsdpctl configure: the playbook failed" in captured.err
    assert "configure  FAILED (exit 1)" in captured.out and "down       ok" in captured.out


def test_a_kept_demo_whose_up_failed_says_nothing_is_left_up(home, monkeypatch, capsys):
    # A failed `up` removes what it made; with --keep the demo must not then point at a cluster.
    from fsdpctl import demo
    from fsdpctl.errors import CommandError

    def up(spec_file, *, target, nodes):
        raise CommandError("demo-node1: boot ended in state 'maintenance'; everything `up` made was removed")

    monkeypatch.setattr(api, "up", up)
    with pytest.raises(CommandError, match=r"demo failed at `up`.*Nothing is left up"):
        demo.run_demo(REPO / "examples" / "local.yaml", nodes=2, keep=True)
    out = capsys.readouterr().out
    assert "up         FAILED (exit 1)" in out and "still up" not in out


def test_status_and_list_return_what_the_cli_prints(home, tmp_path, capsys):
    from tests.fsdpctl.test_cli import local_cluster

    state = local_cluster(tmp_path, name="api-status")
    result = api.status("api-status")
    assert [n.name for n in result.node_list] == ["api-status-node0", "api-status-node1"]
    assert main(["status", "api-status", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {**result.model_dump(mode="json"), "age": printed["age"]}
    (row,) = api.list_clusters()
    assert row.name == state.name and row.current
    assert main(["list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{**row.model_dump(mode="json"), "age": row.age}]


def test_the_api_covers_the_commands_that_make_use_and_remove_a_cluster():
    from fsdpctl.cli import HANDLERS

    command_line_only = {"preflight", "inventory", "ssh", "monitor", "scale-test", "exclude", "replace",
                         "heal", "extend", "demo", "completion"}
    verbs = {"list": "list_clusters"}
    second_functions = {"job_history"}  # `jobs --all`
    assert {verbs.get(name, name) for name in set(HANDLERS) - command_line_only} == \
        set(api.__all__) - second_functions
