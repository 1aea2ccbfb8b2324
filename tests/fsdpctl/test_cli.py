"""The conventions operators expect of the CLI: --version, help on every argument, a "did you mean",
completion, documented exit codes, a yes before anything that costs or destroys, no tracebacks for
ordinary mistakes, JSON output, and `list`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fsdpctl import console
from fsdpctl import state as state_mod
from fsdpctl.cli import build_parser, main
from fsdpctl.errors import EXIT_CODES, CommandError, UsageError
from tests.infra.conftest import REPO, demo_data

FSDPCTL = str(Path(sys.executable).parent / "fsdpctl")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def run(*args: str, home: Path | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"FSDPCTL_HOME": str(home)} if home else {})}
    return subprocess.run([FSDPCTL, *args], capture_output=True, text=True, cwd=REPO, env=env,
                          input=stdin, timeout=120)


def local_cluster(tmp_path: Path, name: str = "cli-local", nodes: int = 2) -> state_mod.ClusterState:
    """A local cluster's state as `up` records it, without booting anything."""
    spec_path = tmp_path / f"{name}.yaml"
    spec_path.write_text(yaml.safe_dump(demo_data(name=name)))
    state = state_mod.create(spec_path, state_mod.load_spec(spec_path), "local", node_count=nodes)
    state.update(nodes=[{"rank": r, "name": f"{name}-node{r}", "address": f"198.18.9.{2 + r}"}
                        for r in range(nodes)])
    return state


def test_version_and_exit_codes_in_help(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("fsdpctl ")
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    assert "exit status:" in help_text
    for code, meaning in EXIT_CODES.items():
        assert f"{code:<4} {meaning}" in help_text


def test_every_argument_of_every_command_has_help():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if not isinstance(action, argparse._HelpAction) and not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []
    assert all(choice.help for choice in subparsers._choices_actions)


def test_a_mistyped_command_or_choice_gets_a_suggestion():
    typo = run("stauts")
    assert typo.returncode == 2 and "did you mean 'status'?" in typo.stderr
    target = run("up", "examples/local.yaml", "--target", "locl")
    assert target.returncode == 2 and "did you mean 'local'?" in target.stderr


def test_shell_completion_scripts(capsys):
    for shell, marker in (("bash", "complete"), ("zsh", "#compdef fsdpctl")):
        assert main(["completion", shell]) == 0
        script = capsys.readouterr().out
        assert marker in script and "preflight" in script and "scale-test" in script


def test_down_of_an_unknown_cluster_is_an_error_with_a_suggestion(home, tmp_path, capsys):
    local_cluster(tmp_path, "cli-local")
    assert main(["down", "--cluster", "cli-locl", "--yes"]) == 2
    err = capsys.readouterr().err
    assert "no cluster named 'cli-locl'" in err and "did you mean cli-local?" in err


def test_down_without_a_terminal_and_without_yes_destroys_nothing(home, tmp_path):
    state = local_cluster(tmp_path)
    result = run("down", home=home, stdin="")
    assert result.returncode == 2
    assert "no terminal to ask on: run it again with --yes" in result.stderr
    assert "2 local node(s)" in result.stdout or "the cluster's state directory" in result.stdout
    assert state.exists()


def test_confirm_asks_on_a_terminal_and_a_no_stops(monkeypatch):
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    console.confirm("Destroy?", yes=False)
    monkeypatch.setattr("builtins.input", lambda prompt: "")
    with pytest.raises(CommandError, match="not confirmed; nothing was done"):
        console.confirm("Destroy?", yes=False)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)
    with pytest.raises(UsageError, match="--yes"):
        console.confirm("Destroy?", yes=False)
    console.confirm("Destroy?", yes=True)  # --yes: no question at all


def test_a_directory_or_bad_yaml_as_spec_is_a_one_line_error(tmp_path):
    directory = run("plan", str(tmp_path))
    assert directory.returncode == 2 and "is a directory, not a spec file" in directory.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: demo\nregion: us-east-1\n  instance_type: p4d.24xlarge\n")
    broken = run("plan", str(bad))
    assert broken.returncode == 2
    assert f"{bad} has 1 problem(s)" in broken.stderr and "line 3, column" in broken.stderr
    assert "<unicode string>" not in broken.stderr
    for result in (directory, broken):
        assert "Traceback" not in result.stderr


def test_output_piped_into_head_ends_quietly(tmp_path):
    shell = f"{FSDPCTL} plan --json {REPO / 'examples/demo.yaml'} | head -c 20"
    result = subprocess.run(["bash", "-o", "pipefail", "-c", shell], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert result.stdout.startswith("{")
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr


def test_status_and_list_as_json(home, tmp_path, capsys, monkeypatch):
    state = local_cluster(tmp_path, "cli-a")
    state.update(created_at=time.time() - 3 * 3600, excluded=[
        {"rank": 1, "reason": "ECC errors", "time": "2026-12-01T00:00:00+00:00"}])
    aws = local_cluster(tmp_path, "cli-b", nodes=0)
    aws.update(target="aws", expires_at="2099-12-03T13:00:00Z", cost_per_hour=87.99)
    from fsdpctl.targets.local import nodes

    monkeypatch.setattr(nodes, "health", lambda s: ["cli-a-node1: not running"])
    assert main(["status", "--cluster", "cli-a", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["name"] == "cli-a" and status["target"] == "local" and status["nodes"] == 2
    assert status["excluded"] == [1] and status["health"] == ["cli-a-node1: not running"]
    assert status["age"] == "3h00m" and status["cost_per_hour"] == 0.0
    assert [n["excluded"] for n in status["node_list"]] == [False, True]

    assert main(["list", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"cli-a", "cli-b"}
    assert rows["cli-b"]["current"] and not rows["cli-a"]["current"]  # the last one created
    assert rows["cli-b"]["expires_at"] == "2099-12-03T13:00:00Z" and rows["cli-b"]["cost_per_hour"] == 87.99
    assert main(["list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "TARGET", "NODES", "AGE", "EXPIRES", "(UTC)", "USD/HOUR"]
    assert table[2].split() == ["*", "cli-b", "aws", "0", "0m", "2099-12-03T13:00:00Z", "87.99"]


def test_list_and_status_show_a_spot_cap_or_an_unknown_cost_not_the_priced_rest(home, tmp_path, capsys):
    """`up` records the hourly total, or for a cluster without a fixed price (spot, a Capacity
    Block) its cap or nothing: `list` and `status` say so rather than showing the NAT gateway and
    disks as the cluster's cost."""
    spot = local_cluster(tmp_path, "cli-spot", nodes=0)
    spot.update(target="aws", pulumi_stack="cli-spot", cost_per_hour=None, cost_per_hour_max=220.31)
    block = local_cluster(tmp_path, "cli-block", nodes=0)
    block.update(target="aws", pulumi_stack="cli-block", cost_per_hour=None, cost_per_hour_max=None)
    assert main(["list"]) == 0
    rows = {line.split()[1 if line.startswith("*") else 0]: line.split()[-1]
            for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows == {"cli-spot": "<=220.31", "cli-block": "unknown"}
    assert main(["list", "--json"]) == 0
    listed = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert (listed["cli-spot"]["cost_per_hour"], listed["cli-spot"]["cost_per_hour_max"]) == (None, 220.31)
    for name, said in (("cli-spot", "cost: at most 220.31 USD per hour"),
                       ("cli-block", "cost: an unknown amount per hour")):
        assert main(["status", "--cluster", name]) == 0
        assert said in capsys.readouterr().out


def test_list_without_clusters_says_how_to_make_one(home, capsys):
    assert main(["list"]) == 0
    assert "fsdpctl up SPEC.yaml" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["tiny", "--command", "torchrun x.py"], "CONFIG 'tiny' and --command both given"),
    ([], "give a trainer CONFIG (tiny, smoke, gpt-1b, ... or a YAML file) or your own program"),
    (["--command", ""], "--command is empty"),
    (["--command", "torchrun x.py", "--steps", "5"], "--steps is a setting of the trainer's CONFIG"),
    (["--command", "torchrun x.py", "--set", "optim.lr=1"], "--set is a setting of the trainer's CONFIG"),
])
def test_train_runs_a_config_or_a_command_and_says_so_before_submitting(home, tmp_path, capsys, argv,
                                                                         message):
    """Bad `train` input is one line naming the flag and the fix, before anything reaches the cluster
    (whose nodes do not exist: any SSH would fail differently)."""
    local_cluster(tmp_path, "cli-train")
    assert main(["train", *argv, "--cluster", "cli-train"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fsdpctl train: {message}") and err.count("\n") == 1


def test_a_corrupt_state_file_is_a_one_line_error(home, tmp_path):
    state = local_cluster(tmp_path)
    state.state_path.write_text(state.state_path.read_text()[:40])
    result = run("status", home=home)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{state.state_path} is not valid JSON" in result.stderr
    assert "fsdpctl down --cluster cli-local --force" in result.stderr


def test_ssh_takes_cluster_after_the_rank_too(home, tmp_path):
    local_cluster(tmp_path)
    for argv in (("ssh", "0", "--cluster", "no-such", "--", "true"),
                 ("ssh", "0", "--cluster=no-such", "--", "true")):
        result = run(*argv, home=home)
        assert result.returncode == 2 and "no cluster named 'no-such'" in result.stderr, result.stderr
    result = run("ssh", "0", "--bogus", "--", "true", home=home)
    assert result.returncode == 2 and "unknown option '--bogus' before `--`" in result.stderr


def test_up_of_an_existing_aws_cluster_keeps_the_new_spec_and_its_last_good_copy(home, tmp_path, monkeypatch):
    # `up` with a changed spec updates an aws cluster in place; `down --force` restores a garbled spec
    # from its `.good` copy, so that copy must be the spec the stack now runs, not the first one.
    state = local_cluster(tmp_path, "cli-up")
    state.update(target="aws", ssh={"user": "ubuntu", "key_file": str(tmp_path / "key"),
                                    "known_hosts": str(tmp_path / "known_hosts")})
    from fsdpctl.targets import aws

    monkeypatch.setattr(aws, "check_prerequisites", lambda action: None)
    # The stack update itself (tests/aws) asks before it changes anything; the spec copy follows the yes.
    monkeypatch.setattr(aws, "up", lambda *a, approve, **kw: approve("Apply these changes?"))
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(demo_data(name="cli-up", node_count=2, ssh_cidr="198.51.100.0/24")))
    assert main(["up", str(changed), "--target", "aws", "--yes"]) == 0
    assert state.spec_path.read_text() == changed.read_text()
    assert state.spec_path.with_name("spec.yaml.good").read_text() == changed.read_text()
    assert str(state.spec().ssh_cidr) == "198.51.100.0/24"


def test_down_force_repairs_nothing_while_another_command_holds_the_cluster(home, tmp_path, capsys):
    state = local_cluster(tmp_path, "cli-busy")
    garbled = state.state_path.read_text()[:30]
    state.state_path.write_text(garbled)
    with state.operation("deploy"):  # as a running `fsdpctl deploy` holds it
        assert main(["down", "--force", "--yes", "--cluster", "cli-busy"]) == 2
    assert "cluster cli-busy is busy: fsdpctl deploy" in capsys.readouterr().err
    assert state.state_path.read_text() == garbled  # not restored under the other command's feet


def test_a_killed_configures_playbook_is_stopped_and_other_clusters_are_left_alone(home, tmp_path):
    from fsdpctl.configure import orphaned_playbooks, stop_orphaned_playbooks

    state = local_cluster(tmp_path, "cli-orphan")
    other = local_cluster(tmp_path, "cli-other")
    # Started as ansible-runner starts it: python, the ansible-playbook script, `-i INVENTORY`.
    script = tmp_path / "bin" / "ansible-playbook"
    script.parent.mkdir()
    script.write_text("import time\ntime.sleep(120)\n")
    orphan, unrelated = (subprocess.Popen([sys.executable, str(script), "-i", str(s.inventory_path),
                                           "site.yml"]) for s in (state, other))
    try:
        time.sleep(0.5)
        assert orphaned_playbooks(state) == [orphan.pid]
        said = []
        stop_orphaned_playbooks(state, said.append)
        assert orphan.wait(timeout=15) != 0 and unrelated.poll() is None
        assert said == ["stopping ansible-playbook left running by an interrupted configure "
                        f"(pid {orphan.pid})"]
        assert orphaned_playbooks(state) == []
    finally:
        for proc in (orphan, unrelated):
            proc.kill()
            proc.wait()
