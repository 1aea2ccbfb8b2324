"""One command, one read of the cluster's state (issue 23): `fsdpctl smoke`, `deploy`, `train` and the
other commands that run on the nodes read state.json once at their entry and pass the record down;
what they write goes through `update`, whose read-modify-write under the state lock is the only other
read.

The cluster is a state file as `up` and `deploy` leave it, fabricated; its nodes are an
`ssh` on PATH that answers each command as a node would, just enough for the command to run to its
end: no node boots. `deploy`'s bundle is a stand-in too (building it downloads wheels)."""

from __future__ import annotations

import json
import time

import pytest

from fsdpctl import deploy as deploy_mod
from fsdpctl.cli import main
from fsdpctl.state import ClusterState, cluster_state
from tests.fsdpctl.test_cli import local_cluster
from tests.stand_ins import stand_in_commands

NAME = "reads"
PROBE = {"python": "3.11", "machine": "x86_64", "glibc": "2.36", "torch": None, "gpus": 0,
         "home": "/root", "venv_module": True}
JOBS = [{"job_id": 42, "name": "tiny-1", "job_dir": "/shared/fsdp-cluster/jobs/tiny-1", "nodes": 2,
         "steps": 50, "status": ["running", "0"], "last": {"step": 7, "loss": 2.5, "tokens_per_s": 1000.0},
         "slurm": {"state": "RUNNING", "node_list": "reads-node[0-1]"}}]


def _nodes(mtu: int) -> str:
    """An ssh whose nodes answer the inventory and deploy probes, list one Slurm job (`fsdpctl train`'s
    probe) whose log is still empty, accept sbatch, have no slurmctld (`scontrol ping`) and no other file
    to `cat`, and do the rest (mkdir, rm, tar, torchrun, scancel) without a word."""
    return f"""
command="${{@: -1}}"
case "$command" in
  *"scontrol ping"*) echo "bash: line 1: scontrol: command not found" >&2; exit 127 ;;
  *"sbatch --parsable"*) echo 42 ;;
  *'iface=$(ip'*) printf 'iface=eth0\\nmtu={mtu}\\ngpus=\\nefa=\\n' ;;
  *"platform.machine()"*) echo '{json.dumps(PROBE)}' ;;
  *'glob.glob(os.path.join(root'*) echo '{json.dumps(JOBS)}' ;;
  *"|| echo '(no output yet)'") echo "(no output yet)" ;;
  "cat "*|"test -e "*) exit 1 ;;
  *) cat >/dev/null ;;
esac"""


@pytest.fixture
def reads(tmp_path, monkeypatch) -> dict[str, int]:
    """A 2-node local cluster with a shared directory and the trainer deployed, its nodes the stand-in
    ssh; returns the counts of `ClusterState.read` calls from here on: by the command itself, and by
    `change` (the read-modify-write of `update`, under the state lock)."""
    monkeypatch.setenv("FSDPCTL_HOME", str(tmp_path / "home"))
    state = local_cluster(tmp_path, NAME)
    keys = state.keys_dir
    keys.mkdir(parents=True)
    state.update(ssh={"user": "root", "key_file": str(keys / "id_ed25519"),
                      "known_hosts": str(state.known_hosts)},
                 shared_dir="/shared",
                 deploy={"bundle": "b", "venv": "/root/.fsdp-cluster/venv", "wheelhouse_dir": "/w",
                         "trainer_dir": "/t", "ranks": [0, 1], "torch": "2.13.0", "includes_torch": False,
                         "python": "3.11", "deployed_at": time.time()})
    monkeypatch.setenv("PATH", stand_in_commands(tmp_path, ssh=_nodes(state.spec().network.mtu))["PATH"])

    counts = {"command": 0, "update": 0}
    in_change = False
    read, change = ClusterState.read, ClusterState.change

    def counted_read(self):
        counts["update" if in_change else "command"] += 1
        return read(self)

    def counted_change(self, fields_of):
        nonlocal in_change
        in_change = True
        try:
            return change(self, fields_of)
        finally:
            in_change = False

    monkeypatch.setattr(ClusterState, "read", counted_read)
    monkeypatch.setattr(ClusterState, "change", counted_change)
    return counts


def test_smoke_reads_the_state_once_and_records_its_report_through_update(reads, capsys):
    assert main(["smoke", "--cluster", NAME]) == 1  # the stand-in nodes train nothing: the checks fail
    out = capsys.readouterr().out
    assert "inventory: pass" in out and "fsdp: fail" in out  # it ran the checks on the nodes
    assert reads == {"command": 1, "update": 1}


def test_deploy_reads_the_state_once_and_records_the_deploy_through_update(reads, tmp_path, monkeypatch):
    def bundle(platform, torch_pin):
        return deploy_mod.Bundle(wheelhouse_key="w1", wheelhouse=tmp_path / "wheelhouse", trainer_key="t1",
                                 trainer_dir=tmp_path / "trainer", trainer_wheel="trainer.whl",
                                 includes_torch=torch_pin is not None)

    monkeypatch.setattr(deploy_mod, "build_bundle", bundle)
    assert main(["deploy", "--cluster", NAME]) == 0
    assert reads == {"command": 1, "update": 1}
    assert cluster_state(NAME).read().deploy.bundle == "w1-t1"  # the deploy record was written


def test_train_reads_the_state_once(reads, capsys):
    assert main(["train", "tiny", "--cluster", NAME]) == 0
    assert "submitted job 42" in capsys.readouterr().out
    assert reads == {"command": 1, "update": 0}


@pytest.mark.parametrize("argv", [
    ["jobs", "--cluster", NAME], ["logs", "42", "--cluster", NAME], ["cancel", "42", "--cluster", NAME],
    ["ssh", "0", "--cluster", NAME, "--", "true"], ["inventory", "--cluster", NAME],
], ids=lambda argv: argv[0])
def test_the_commands_that_only_read_read_the_state_once(reads, argv):
    assert main(argv) == 0
    assert reads == {"command": 1, "update": 0}
