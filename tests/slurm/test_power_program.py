"""The power program (Slurm's ResumeProgram/SuspendProgram, ansible/roles/slurm/files/fsdp-power) without
nodes: its local backend against a power agent answering in a thread, its aws backend against a stand-in
`aws` that answers as the AWS CLI does (an InsufficientInstanceCapacity error included), the nodes it sets
DOWN and why (a stand-in `scontrol` records its calls), shellcheck; and the local power agent's answers
to requests it must refuse. slurm.conf with power saving is rendered as for two p4d nodes."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from fsdpctl import slurm_nodes
from fsdpctl.errors import CommandError
from fsdpctl.state import ClusterState, LocalNode, LocalRecord
from fsdpctl.targets.local.power import Agent
from tests.ansible.conftest import ROLES_DIR, render_template
from tests.stand_ins import stand_in_commands

PROGRAM = ROLES_DIR / "slurm/files/fsdp-power"
NODES = ["pw-node1", "pw-node2"]
# `scontrol show hostnames LIST` prints one name a line; `scontrol update ...` is recorded.
SCONTROL = """
if [ "$1 $2" = "show hostnames" ]; then
    case "$3" in pw-node\\[1-2\\]) printf 'pw-node1\\npw-node2\\n' ;; *) echo "$3" ;; esac
    exit 0
fi
printf '%s\\n' "$*" >> "$CALLS"
"""


@pytest.fixture
def power(tmp_path):
    """Run the program by one of its two names with a conf file; returns (result, scontrol calls)."""
    bin_dir = tmp_path / "libexec"
    bin_dir.mkdir()
    shutil.copy(PROGRAM, bin_dir / "power")
    for action in ("resume", "suspend", "retry"):
        (bin_dir / f"power-{action}").symlink_to("power")
    calls = tmp_path / "scontrol-calls"
    runs = iter(range(100))

    def run(action: str, hostlist: str | None, conf: str, aws: str = "exit 99", sinfo: str = ""):
        (tmp_path / "power.conf").write_text(conf + f"\nPOWER_LOG={tmp_path}/power.log\n")
        stand_ins = tmp_path / f"run{next(runs)}"
        stand_ins.mkdir()
        (stand_ins / "sinfo.out").write_text(sinfo)
        env = {**stand_in_commands(stand_ins, scontrol=SCONTROL, aws=aws, sinfo=f"cat {stand_ins}/sinfo.out"),
               "CALLS": str(calls), "FSDP_POWER_CONF": str(tmp_path / "power.conf")}
        argv = [str(bin_dir / f"power-{action}"), *([hostlist] if hostlist else [])]
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        return result, calls.read_text().splitlines() if calls.exists() else []

    return run


def answer_requests(request_dir: Path, answers: dict[str, str], stop: threading.Event) -> list[str]:
    """A power agent's part: answer each request by node name; returns the requests seen."""
    seen: list[str] = []

    def serve():
        while not stop.is_set():
            for request in request_dir.glob("*.request"):
                text = request.read_text().strip()
                seen.append(text)
                request.with_suffix(".answer").write_text(answers[text.split()[1]] + "\n")
                request.unlink()
            time.sleep(0.05)

    threading.Thread(target=serve, daemon=True).start()
    return seen


def test_local_resume_asks_the_agent_per_node_and_sets_a_refused_node_down(tmp_path, power):
    requests = tmp_path / "requests"
    requests.mkdir()
    stop = threading.Event()
    seen = answer_requests(requests, {"pw-node1": "ok", "pw-node2": "error: mount failed: no work dir"}, stop)
    try:
        result, calls = power("resume", "pw-node[1-2]", f"POWER_BACKEND=local\nPOWER_REQUEST_DIR={requests}")
    finally:
        stop.set()
    assert sorted(seen) == ["resume pw-node1", "resume pw-node2"]
    assert result.returncode == 1
    assert calls == ["update nodename=pw-node2 state=down reason=power resume: mount failed: no work dir"]
    assert not list(requests.iterdir())  # requests and answers are cleaned up
    log = (tmp_path / "power.log").read_text()
    assert "resume pw-node1: ok" in log and "resume failed for pw-node2" in log


def test_local_suspend_without_an_agent_sets_the_node_down_after_the_timeout(tmp_path, power):
    requests = tmp_path / "requests"
    result, calls = power("suspend", "pw-node1",
                          f"POWER_BACKEND=local\nPOWER_REQUEST_DIR={requests}\nPOWER_ANSWER_TIMEOUT_S=1")
    assert result.returncode == 1
    assert len(calls) == 1
    assert calls[0].startswith("update nodename=pw-node1 state=down reason=power suspend: no answer from the "
                               "power agent within 1 s")
    assert not list(requests.iterdir())  # the unanswered request is withdrawn


AWS_RECORDER = 'printf "%s\\n" "$*" >> "$CALLS.aws"; echo "INSTANCES $*"'
ICE = ('echo "An error occurred (InsufficientInstanceCapacity) when calling the StartInstances operation '
       '(reached max retries: 2): Insufficient capacity." >&2; exit 254')


def test_aws_resume_starts_every_node_in_one_call(tmp_path, power):
    (tmp_path / "nodes.conf").write_text("pw-node1 i-0aaa\npw-node2 i-0bbb\n")
    conf = f"POWER_BACKEND=aws\nPOWER_NODES_FILE={tmp_path}/nodes.conf\nPOWER_REGION=us-east-1"
    result, calls = power("resume", "pw-node[1-2]", conf, aws=AWS_RECORDER)
    assert result.returncode == 0 and calls == []
    aws_calls = Path(f"{tmp_path}/scontrol-calls.aws").read_text().splitlines()
    assert aws_calls == ["ec2 start-instances --region us-east-1 --instance-ids i-0aaa i-0bbb --output text"]
    result, _ = power("suspend", "pw-node1", conf, aws=AWS_RECORDER)
    assert result.returncode == 0
    assert Path(f"{tmp_path}/scontrol-calls.aws").read_text().splitlines()[-1] == (
        "ec2 stop-instances --region us-east-1 --instance-ids i-0aaa --output text")


def test_aws_insufficient_capacity_sets_the_nodes_down_with_ec2s_code(tmp_path, power):
    (tmp_path / "nodes.conf").write_text("pw-node1 i-0aaa\npw-node2 i-0bbb\n")
    conf = f"POWER_BACKEND=aws\nPOWER_NODES_FILE={tmp_path}/nodes.conf\nPOWER_REGION=us-east-1"
    result, calls = power("resume", "pw-node[1-2]", conf, aws=ICE)
    assert result.returncode == 1
    assert calls == ["update nodename=pw-node1,pw-node2 state=down "
                     "reason=power resume: InsufficientInstanceCapacity"]


def test_aws_node_without_an_instance_id_is_set_down_with_the_fix(tmp_path, power):
    (tmp_path / "nodes.conf").write_text("pw-node1 i-0aaa\n")
    conf = f"POWER_BACKEND=aws\nPOWER_NODES_FILE={tmp_path}/nodes.conf\nPOWER_REGION=us-east-1"
    result, calls = power("resume", "pw-node2", conf, aws=AWS_RECORDER)
    assert result.returncode == 1
    reason = f"power resume: no instance id for it in {tmp_path}/nodes.conf (run fsdpctl configure)"
    assert calls == [f"update nodename=pw-node2 state=down reason={reason}"]


def test_retry_powers_down_only_the_nodes_that_did_not_start_long_enough_ago(tmp_path, power):
    def since(seconds_ago: int) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - seconds_ago))

    sinfo = (f"pw-node1|power resume: InsufficientInstanceCapacity|{since(700)}\n"
             f"pw-node2|power resume: InsufficientInstanceCapacity|{since(30)}\n"
             f"pw-node3|health (prolog): 7 of 8 GPUs answer nvidia-smi|{since(3600)}\n")
    result, calls = power("retry", None, "POWER_BACKEND=aws\nPOWER_RETRY_AFTER_S=600", sinfo=sinfo)
    assert result.returncode == 0, result.stderr
    # node2 waits its turn; node3 is down for a health check, which no power retry clears
    assert calls == ["update nodename=pw-node1 state=power_down_force"]
    assert "retry pw-node1: down since" in (tmp_path / "power.log").read_text()


def test_the_program_passes_shellcheck():
    subprocess.run(["shellcheck", "--severity=warning", str(PROGRAM)], check=True)


def _agent(tmp_path: Path) -> Agent:
    state = ClusterState(name="pw", root=tmp_path / "pw")
    node = LocalNode(rank=1, name="pw-node1", address="198.18.60.3", machine="fsdp-x-1", veth="fsdpxv1",
                     dir=str(tmp_path / "pw-node1"), machine_id="0" * 32)
    plan = LocalRecord(subnet="198.18.60.0/24", bridge="fsdpxbr", bridge_address="198.18.60.1",
                       gateway="198.18.60.254", rootfs=str(tmp_path / "rootfs"),
                       shared_host_dir=str(tmp_path / "shared"), nodes=[node])
    state.root.mkdir()
    state.update(name="pw", target="local", created_at=0.0, local=plan)
    return Agent(state)


@pytest.mark.parametrize(("request_text", "answer"), [
    ("resume pw-node9", "error: pw-node9 is not a node of cluster pw"),
    ("reboot pw-node1", "error: not a power request: 'reboot pw-node1'"),
    ("resume", "error: not a power request: 'resume'"),
])
def test_the_agent_refuses_what_is_not_a_request_for_its_nodes(tmp_path, request_text, answer):
    assert _agent(tmp_path).handle(request_text) == answer


def test_slurm_conf_with_power_saving_makes_the_upper_ranks_cloud_nodes(p4d_node):
    node = p4d_node()
    hosts = node["groups"]["nodes"]
    text = render_template("slurm", "slurm.conf.j2", {**node, "fsdp_static_node_count": 1,
                                                       "fsdp_suspend_after_s": 300})
    conf = [line for line in text.splitlines() if line and not line.startswith("#")]
    settings = dict(line.split("=", 1) for line in conf
                    if not line.startswith(("NodeName=", "PartitionName=")))
    assert settings["ResumeProgram"] == "/usr/local/libexec/fsdp-cluster/power-resume"
    assert settings["SuspendProgram"] == "/usr/local/libexec/fsdp-cluster/power-suspend"
    assert settings["SuspendTime"] == "300" and settings["SuspendTimeout"] == "120"
    assert settings["SuspendExcNodes"] == hosts[0]
    assert settings["ResumeRate"] == settings["SuspendRate"] == "0"
    assert settings["PrivateData"] == "cloud" and settings["TreeWidth"] == "65533"
    nodes = [line for line in conf if line.startswith("NodeName=")]
    assert nodes[0].endswith("State=UNKNOWN") and nodes[1].endswith("State=CLOUD")
    # the controller never powers down, whatever its rank: node 1 runs it here, node 0 is static
    text = render_template("slurm", "slurm.conf.j2",
                           {**node, "fsdp_static_node_count": 1, "slurm_controller_rank": 1})
    assert "State=CLOUD" not in text and "ResumeProgram" not in text
    # local nodes stop in seconds
    text = render_template("slurm", "slurm.conf.j2",
                           {**node, "fsdp_static_node_count": 1, "fsdp_target": "local"})
    assert "SuspendTimeout=10\n" in text


def test_slurm_conf_of_a_fixed_cluster_has_no_power_saving(p4d_node):
    text = render_template("slurm", "slurm.conf.j2", p4d_node())
    assert "ResumeProgram" not in text and "State=CLOUD" not in text


def test_the_agent_answers_a_failed_start_and_keeps_serving(tmp_path, monkeypatch):
    from fsdpctl.targets.local import nodes

    def no_nspawn(plan, node):
        raise FileNotFoundError(2, "No such file or directory", "systemd-nspawn")

    monkeypatch.setattr(nodes, "running_ranks", lambda plan: set())
    monkeypatch.setattr(nodes, "power_on", no_nspawn)
    agent = _agent(tmp_path)
    assert agent.handle("resume pw-node1") == "error: [Errno 2] No such file or directory: 'systemd-nspawn'"
    assert "resume pw-node1 failed: FileNotFoundError" in (agent.state.root / "power-agent.log").read_text()


def test_the_agent_boots_a_replaced_node_with_its_new_identity_and_settles_its_boot(tmp_path, monkeypatch):
    """The node boots with its new machine-id; then, beside the next requests, the agent follows its boot
    as `up` does (nodes.settle_boot: what failed while booting is started again) with the node's keeper."""
    from fsdpctl.targets.local import nodes

    booted, settled = [], []
    keeper = object()  # what power_on returns: the node's keeper process

    def power_on(plan, node):
        booted.append(node.machine_id)
        return keeper

    monkeypatch.setattr(nodes, "running_ranks", lambda plan: set())
    monkeypatch.setattr(nodes, "power_on", power_on)
    monkeypatch.setattr(nodes, "settle_boot", lambda node, proc, deadline, progress: settled.append(
        (node.name, proc)))
    agent = _agent(tmp_path)
    plan = agent.state.read().local
    # `fsdpctl replace 1` while the agent runs: the node gets a new machine-id
    replaced = plan.nodes[0].model_copy(update={"machine_id": "1" * 32})
    agent.state.update(local=plan.model_copy(update={"nodes": [replaced]}))
    assert agent.handle("resume pw-node1") == "ok"
    assert booted == ["1" * 32]
    for thread in threading.enumerate():
        if thread.name == "settle-pw-node1":
            thread.join(timeout=10)
    assert settled == [("pw-node1", keeper)]


def test_the_agent_stops_once_its_cluster_state_is_gone(tmp_path):
    """A test run killed before `down`, whose temporary FSDPCTL_HOME was then deleted, must not leave
    its agent polling forever."""
    agent = _agent(tmp_path)
    agent.requests.mkdir(parents=True)
    agent.state.state_path.unlink()
    agent.serve()  # returns at once instead of serving
    assert "is gone: no cluster left to serve" in (agent.state.root / "power-agent.log").read_text()


def test_the_agent_records_which_ranks_it_stopped_in_the_state(tmp_path):
    agent = _agent(tmp_path)
    agent._record(1, powered_down=True)
    assert agent.state.read().local.powered_down == [1]
    agent._record(1, powered_down=False)
    assert agent.state.read().local.powered_down == []


def test_the_agent_never_brings_back_nodes_a_down_took_out_of_the_record(tmp_path):
    """`down` clears the record's nodes before it stops the agent: a request meanwhile is refused, and
    the record is not given back the nodes the agent started with."""
    agent = _agent(tmp_path)
    agent.state.update(local=None)
    refused = agent.handle("resume pw-node1")
    assert refused == "error: cluster pw has no local nodes any more (`fsdpctl down` under way)"
    agent._record(1, powered_down=True)
    assert agent.state.read().local is None


class FakeSlurm:
    """What nodes_held_up asks of the cluster's Slurm: sinfo's node states (changing per call as
    given), sbatch, squeue of the hold job (RUNNING after `running_after` polls), scancel."""

    def __init__(self, states: list[dict[str, str]], running_after: int = 2):
        self.states, self.running_after, self.commands = states, running_after, []

    def run_slurm(self, record, command: str, *, check: bool = True, timeout: float = 30):
        self.commands.append(command)
        if command.startswith("squeue"):
            self.running_after -= 1
            out = "RUNNING" if self.running_after <= 0 else "CONFIGURING"
        else:
            out = "41\n" if command.startswith("sbatch") else ""
        return subprocess.CompletedProcess(command, 0, out, "")

    def node_states(self, record):
        states = self.states[0] if len(self.states) == 1 else self.states.pop(0)
        return {n: slurm_nodes.NodeState(n, *value.split("|")) for n, value in states.items()}


def _elastic(tmp_path, monkeypatch, fake: FakeSlurm, **scaling):
    from fsdpctl.state import ClusterRecord, Node
    from infra.spec import load_spec

    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump({
        "name": "pw", "region": "us-east-1", "availability_zone": "us-east-1b",
        "instance_type": "p4d.24xlarge", "node_count": 3, "ssh_cidr": "203.0.113.0/24",
        "capacity": {"all_or_nothing": False}, "scaling": scaling}))
    record = ClusterRecord(name="pw", target="local", created_at=0.0, nodes=[
        Node(rank=r, name=f"pw-node{r}", address=f"198.18.60.{2 + r}") for r in range(3)])
    for name in ("run_slurm", "node_states"):
        monkeypatch.setattr(slurm_nodes, name, getattr(fake, name))
    monkeypatch.setattr(slurm_nodes, "slurm_configured", lambda record: True)
    monkeypatch.setattr(slurm_nodes, "POLL_S", 0)
    return record, load_spec(spec_path)


def test_configure_holds_the_free_elastic_nodes_with_a_job_and_cancels_it_after(tmp_path, monkeypatch):
    fake = FakeSlurm([{"pw-node0": "idle|none", "pw-node1": "idle~|none", "pw-node2": "allocated|none"}])
    record, spec = _elastic(tmp_path, monkeypatch, fake, min_nodes=1)
    said = []
    with slurm_nodes.nodes_held_up(record, spec, said.append, what="configure"):
        assert fake.commands[-1].startswith("squeue") and "scancel" not in " ".join(fake.commands)
    # node2 runs a job and stays up by itself; node0 is static
    assert fake.commands[0] == ("sbatch --parsable --job-name=fsdpctl-hold-configure --nodelist=pw-node1 -N1 "
                                "--exclusive --no-requeue --output=/dev/null --wrap 'sleep infinity'")
    assert fake.commands[-1] == "scancel 41"
    assert said == ["configure: Slurm job 41 holds pw-node1 while it runs, powering up pw-node1 (powered "
                    "down while idle)"]


def test_a_held_node_that_cannot_start_stops_the_command_with_its_reason(tmp_path, monkeypatch):
    fake = FakeSlurm([{"pw-node0": "idle|none", "pw-node1": "idle~|none", "pw-node2": "idle|none"},
                      {"pw-node0": "idle|none", "pw-node2": "allocated|none",
                       "pw-node1": "down#|power resume: InsufficientInstanceCapacity"}], running_after=99)
    record, spec = _elastic(tmp_path, monkeypatch, fake, min_nodes=1)
    with pytest.raises(CommandError, match=r"configure: could not bring up pw-node1: down#, power resume: "
                       r"InsufficientInstanceCapacity\. .*fsdpctl exclude RANK"), \
            slurm_nodes.nodes_held_up(record, spec, print, what="configure"):
        pass
    assert "--nodelist=pw-node1,pw-node2 -N2" in fake.commands[0] and fake.commands[-1] == "scancel 41"


def test_after_the_first_configure_the_roles_hold_is_cancelled_whatever_the_play_did(tmp_path, monkeypatch):
    fake = FakeSlurm([{}])
    record, spec = _elastic(tmp_path, monkeypatch, fake, min_nodes=1)
    monkeypatch.setattr(slurm_nodes, "slurm_configured", lambda record: False)  # Slurm not up before
    with pytest.raises(CommandError), slurm_nodes.nodes_held_up(record, spec, print, what="configure"):
        raise CommandError("the playbook failed")  # a play that stopped before its last task
    assert fake.commands == [f"scancel --name={slurm_nodes.PLAY_HOLD_JOB_NAME}"]
    role_defaults = yaml.safe_load((ROLES_DIR / "slurm/defaults/main.yml").read_text())
    assert role_defaults["slurm_play_hold_job_name"] == slurm_nodes.PLAY_HOLD_JOB_NAME


def test_a_fixed_cluster_holds_nothing(tmp_path, monkeypatch):
    fake = FakeSlurm([{"pw-node0": "idle|none"}])
    record, spec = _elastic(tmp_path, monkeypatch, fake)
    with slurm_nodes.nodes_held_up(record, spec, print, what="deploy"):
        pass
    assert fake.commands == []


def test_smoke_powers_the_stopped_nodes_up_and_waits_for_them(tmp_path, monkeypatch):
    fake = FakeSlurm([{"pw-node0": "idle|none", "pw-node1": "idle~|none", "pw-node2": "idle|none"},
                      {"pw-node0": "idle|none", "pw-node1": "idle~|none", "pw-node2": "idle|none"},
                      {"pw-node0": "idle|none", "pw-node1": "idle#|none", "pw-node2": "idle|none"},
                      {"pw-node0": "idle|none", "pw-node1": "idle|none", "pw-node2": "idle|none"}])
    record, spec = _elastic(tmp_path, monkeypatch, fake, min_nodes=1)
    said = []
    slurm_nodes.power_up_all(record, spec, said.append, what="smoke")
    assert fake.commands == ["sudo -n scontrol update nodename=pw-node1 state=power_up"]
    assert said == ["smoke: powering up pw-node1 (Slurm powered them down while idle); they power down again "
                    "once idle", "smoke: pw-node1 powered up"]


def test_smoke_stops_with_the_reason_of_a_node_that_cannot_start(tmp_path, monkeypatch):
    fake = FakeSlurm([{"pw-node0": "idle|none", "pw-node1": "idle~|none"},
                      {"pw-node0": "idle|none", "pw-node1": "idle~|none"},
                      {"pw-node0": "idle|none", "pw-node1": "down#|power resume: mount failed"}])
    record, spec = _elastic(tmp_path, monkeypatch, fake, min_nodes=1)
    with pytest.raises(CommandError, match=r"^smoke: could not power up pw-node1: power resume: mount "
                       r"failed\. .*fsdpctl exclude RANK"):
        slurm_nodes.power_up_all(record, spec, print, what="smoke")
