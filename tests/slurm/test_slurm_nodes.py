"""Slurm on real local nodes (2 systemd-nspawn nodes in 198.18.20.0/24, one cluster for the module),
logged in to as AWS's are: as `ubuntu`, a user with passwordless sudo (`local.login_user`), whose jobs
run as it and who makes their directories in the shared directory (the storage role's);
after `configure --tags storage,slurm` every node is idle in sinfo (a second configure of the whole playbook,
the slurm role included, changes nothing: tests/local/test_configure.py);
a 2-node `fsdpctl train` of the tiny config completes with a falling loss; a cancelled job is not
requeued, and its ranks' Prometheus files (each rank exports its metrics where node exporter's textfile
directory exists) are gone after it, the one a killed rank left removed by the epilog; a plain torchrun
script that is not ours runs as a job with `fsdpctl train --command`, as a command line and as a script
file; a node whose health check fails (a stand-in nvidia-smi reporting ECC errors) is drained with the
reason by the prolog, the job waits for healthy nodes instead of running there, `fsdpctl status` shows
the reason, and the periodic check drains the same way; a 2-node fine-tuning job loads a Hugging Face
model from the shared file system and exports one transformers loads; a node's
workers killed mid-job make the batch script retry the step at once in its allocation, which finishes
from its checkpoint, repeating the lost steps with the same losses; a frozen worker (SIGSTOP) is found
by the job watcher, which ends the step, and the job resumes the same way; the spot watcher drains
its node on a rebalance recommendation and on an interruption notice from an IMDS stand-in on the
node's loopback, the job running there checkpoints at once, and `fsdpctl heal` puts a fresh node in
the drained one's place, where the requeued job resumes from that checkpoint;
`fsdpctl jobs --all` lists a plain sbatch job next to fsdpctl's, with each job's runs from the
completion log; `fsdpctl exclude` drains the node.

The tests run in file order (the last ones drain nodes)."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

import pytest
import yaml

from fsdpctl import slurm
from tests.local.conftest import LOGIN_USER, as_root, fsdpctl, read_state
from tests.slurm.conftest import cluster_state, on_node, slurm_cluster, slurm_node_states, wait_for

pytestmark = [pytest.mark.root, pytest.mark.slow]

NAME = "slurm-test"
SUBNET = "198.18.20.0/24"  # the slurm area's subnet
NODES = [f"{NAME}-node0", f"{NAME}-node1"]
STANDIN = Path(__file__).with_name("imds_standin.py")
PLAIN_SCRIPT = Path(__file__).parents[2] / "examples/plain_torchrun.py"
HEALTH_CONF = "/etc/slurm/node-health.conf"
# A GPU for the health check on a node that has none: a stand-in nvidia-smi answering the check's
# query with one GPU that has uncorrected ECC errors.
FAULTY_NVIDIA_SMI = "#!/bin/sh\necho '0, 00000000:10:1C.0, 2, No, No'\n"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Up, `configure --tags storage,slurm`, deploy; torn down after the module whatever happens."""
    # A short stall limit for the frozen-rank test (the default, 300 s, would keep it waiting).
    spec = {"trainer": {"config": "tiny"}, "recovery": {"stall_min_s": 15},
            "local": {"login_user": LOGIN_USER}}
    with slurm_cluster(tmp_path_factory, NAME, SUBNET, spec=spec, tags="storage,slurm",
                       deploy=True) as home_and_env:
        yield home_and_env


def ssh(cluster, rank: int, command: str, check: bool = True):
    home, env = cluster
    return fsdpctl(home, "ssh", str(rank), "--", command, env=env, check=check, timeout=120)


def ssh_as_root(cluster, rank: int, command: str, check: bool = True):
    """`command` run as root on the node (the login user has passwordless sudo, as on AWS)."""
    return ssh(cluster, rank, as_root(command), check=check)


def node_states(cluster) -> dict[str, tuple[str, str]]:
    home, _ = cluster
    return slurm_node_states(home, NAME)


def shared(cluster) -> Path:
    home, _ = cluster
    return Path(read_state(home, NAME)["local"]["shared_host_dir"])


def train(cluster, *args: str) -> int:
    home, env = cluster
    out = fsdpctl(home, "train", "tiny", "--nodes", "2", *args, env=env).stdout
    return int(out.split("submitted job ")[1].split()[0])


def job(cluster, job_id: int) -> dict:
    """The job's row of `fsdpctl jobs --json` (asked from this process: tests/slurm/conftest.py)."""
    home, _ = cluster
    rows = slurm.list_jobs(cluster_state(home, NAME).read())
    return dataclasses.asdict(next(r for r in rows if r.job_id == job_id))


def steps(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in rows if "step" in r and "event" not in r]


def test_every_node_is_idle_in_sinfo(cluster):
    assert ssh(cluster, 0, "id -un").stdout.strip() == LOGIN_USER  # not root: as on AWS
    assert node_states(cluster) == {n: ("idle", "none") for n in NODES}
    conf = ssh(cluster, 1, "cat /etc/slurm/slurm.conf").stdout
    assert f"SlurmctldHost={NODES[0]}(" in conf and "ProctrackType=proctrack/linuxproc" in conf
    # one munge key for the cluster, not the node image's
    keys = {ssh_as_root(cluster, r, "sha256sum /etc/munge/munge.key").stdout.split()[0] for r in (0, 1)}
    image_key = ssh_as_root(cluster, 0, "sha256sum /etc/fsdp-cluster/munge.key").stdout.split()[0]
    assert keys == {image_key}


# The killed-workers job runs as this one does; this one, uninterrupted, is its reference.
KILL_RUN = ("--steps", "60", "--checkpoint-interval", "5", "--set", "metrics.log_interval=1")


def test_two_node_training_job_completes_and_loss_falls(cluster):
    job_id = train(cluster, *KILL_RUN, "--name", "tiny-2n")
    row = wait_for(lambda: (r := job(cluster, job_id))["state"] == "COMPLETED" and r, "job completion")
    assert row["last_step"] == 60 and row["status"] == "completed 0"
    assert row["nodes"] == f"{NAME}-node[0-1]"
    lines = steps(shared(cluster) / "fsdp-cluster/jobs/tiny-2n/metrics.jsonl")
    assert [r["step"] for r in lines] == list(range(1, 61))
    assert sum(r["loss"] for r in lines[-5:]) < sum(r["loss"] for r in lines[:5])
    script = (shared(cluster) / "fsdp-cluster/jobs/tiny-2n/job.sbatch").read_text()
    assert "#SBATCH --requeue" in script
    home, env = cluster
    assert next(r for r in json.loads(fsdpctl(home, "jobs", "--json", env=env).stdout)
                if r["job_id"] == job_id) == row
    log = fsdpctl(home, "logs", str(job_id), env=env).stdout
    assert f"job {job_id} run 0 on {NAME}-node[0-1]" in log and log.rstrip().endswith("completed")
    # The controller's job-completion log keeps the finished job (no accounting database).
    completions = ssh(cluster, 0, "cat /var/log/slurm/jobcomp.log").stdout
    assert any(f"JobId={job_id} " in line and "JobState=COMPLETED" in line
               for line in completions.splitlines())


def wait_for_job_end(cluster, job_id: int) -> dict:
    ended = ("COMPLETED", "FAILED", "CANCELLED")
    try:
        return wait_for(lambda: (r := job(cluster, job_id))["state"] in ended and r, f"job {job_id}'s end")
    except AssertionError as e:
        home, env = cluster
        log = fsdpctl(home, "logs", str(job_id), env=env, check=False).stdout
        raise AssertionError(f"{e}; its log ends:\n{log[-3000:]}") from None


def test_a_plain_torchrun_command_runs_as_a_job_with_the_cluster_environment(cluster):
    """`fsdpctl train --command`: someone else's torchrun script (examples/plain_torchrun.py, plain
    DDP on gloo), launched by the user's own torchrun line from the environment the job gives it."""
    home, env = cluster
    (shared(cluster) / "plain").mkdir(exist_ok=True)
    (shared(cluster) / "plain/plain_torchrun.py").write_text(PLAIN_SCRIPT.read_text())
    command = ('echo "node $NODE_RANK of $NNODES: rendezvous $MASTER_ADDR:$MASTER_PORT, $NPROC_PER_NODE '
               'per node, checkpoints in $CHECKPOINT_DIR"; torchrun --nnodes "$NNODES" --nproc-per-node '
               '"$NPROC_PER_NODE" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" '
               '/shared/plain/plain_torchrun.py --steps 20')
    out = fsdpctl(home, "train", "--nodes", "2", "--name", "plain-cmd", "--command", command, env=env).stdout
    job_id = int(out.split("submitted job ")[1].split()[0])
    row = wait_for_job_end(cluster, job_id)
    log = fsdpctl(home, "logs", str(job_id), env=env).stdout
    assert row["state"] == "COMPLETED" and row["status"] == "completed 0", log[-3000:]
    assert (row["last_step"], row["loss"], row["tokens_per_s"]) == (None, None, None)  # no trainer metrics
    job_dir = "/shared/fsdp-cluster/jobs/plain-cmd"
    address = read_state(home, NAME)["nodes"][0]["address"]
    for rank in (0, 1):
        assert (f"node {rank} of 2: rendezvous {address}:29500, 1 per node, checkpoints in "
                f"{job_dir}/checkpoints") in log
    assert "plain_torchrun: step 20 loss" in log and "(2 processes)" in log and "done at step 20" in log
    assert (shared(cluster) / "fsdp-cluster/jobs/plain-cmd/checkpoints/plain_torchrun.pt").exists()
    listed = fsdpctl(home, "jobs", env=env).stdout
    row_text = rf"^\s*{job_id} plain-cmd\s+COMPLETED\s+{NAME}-node\[0-1\]\s+- +- +-$"
    assert re.search(row_text, listed, re.MULTILINE), listed


def test_a_local_python_script_given_as_the_command_is_copied_and_run_under_torchrun(cluster):
    home, env = cluster
    out = fsdpctl(home, "train", "--nodes", "2", "--name", "plain-py", "--command", str(PLAIN_SCRIPT),
                  env=env).stdout
    job_id = int(out.split("submitted job ")[1].split()[0])
    row = wait_for_job_end(cluster, job_id)
    job_dir = shared(cluster) / "fsdp-cluster/jobs/plain-py"
    log = (job_dir / f"slurm-{job_id}.out").read_text()
    assert row["state"] == "COMPLETED", log[-3000:]
    assert (job_dir / "plain_torchrun.py").read_text() == PLAIN_SCRIPT.read_text()
    assert "plain_torchrun: done at step 20" in log and "(2 processes)" in log


def test_fine_tuning_job_from_hf_weights_exports_a_model_transformers_loads(cluster, tmp_path):
    """The deployed wheel alone (no transformers on the nodes) loads a Hugging Face model from the
    shared file system, trains on chats with its tokenizer and chat template, and exports."""
    from tests.trainer.hf_fixtures import chat_examples, make_model, reference_chat_eval

    root = shared(cluster) / "hf-test"
    model = make_model("qwen3", root / "model")
    chats = chat_examples(16)
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    ssh_as_root(cluster, 0, f"chown -R {LOGIN_USER}: /shared/hf-test")  # the user's, as if they had copied it
    home, env = cluster
    out = fsdpctl(home, "train", "finetune", "--nodes", "2", "--steps", "8", "--name", "sft-2n",
                  "--set", "model.hf_dir=/shared/hf-test/model",
                  "--set", "data.path=/shared/hf-test/chats.jsonl",
                  "--set", "data.messages_field=messages", "--set", "data.seq_len=64",
                  "--set", "parallel.param_dtype=fp32", "--set", "training.global_batch_size=4",
                  "--set", "optim.lr=2e-3", "--set", "optim.warmup_steps=1",
                  "--set", "checkpoint.hf_export_dir=/shared/hf-test/export", env=env).stdout
    job_id = int(out.split("submitted job ")[1].split()[0])
    row = wait_for(lambda: (r := job(cluster, job_id))["state"] in ("COMPLETED", "FAILED") and r,
                   "fine-tuning job end")
    assert row["state"] == "COMPLETED", fsdpctl(home, "logs", str(job_id), env=env).stdout[-3000:]
    from transformers import AutoModelForCausalLM

    export = root / "export"
    _, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    before, _ = reference_chat_eval(model, chats, 64)
    after, _ = reference_chat_eval(export, chats, 64)
    assert after < before


def trainer_textfiles(cluster, rank: int, job_id: int) -> list[str]:
    """The trainer's Prometheus files of job `job_id` in node exporter's textfile directory on a node (asked
    while waiting: from this process, as the other polls)."""
    home, _ = cluster
    listing = on_node(home, NAME, rank, f"ls {slurm.PROMETHEUS_TEXTFILE_DIR}").split()
    return sorted(name for name in listing if name.startswith(f"fsdp-trainer-{job_id}-"))


def test_cancelled_job_ends_without_a_requeue_and_leaves_no_metrics_exported(cluster):
    """With node exporter's textfile directory on the nodes (the monitoring role makes it; this module
    configures the slurm role alone), each rank exports its metrics there while the job runs; after the
    cancel none is left, not even the file of a rank killed mid-step (one planted on node 1 as such a
    rank leaves it): the epilog removes the job's files."""
    home, env = cluster
    for rank in (0, 1):  # as the monitoring role makes it: the login user's
        ssh_as_root(cluster, rank, f"install -d -o {LOGIN_USER} {slurm.PROMETHEUS_TEXTFILE_DIR}")
    try:
        job_id = train(cluster, "--steps", "100000", "--name", "tiny-cancel")
        job_dir = shared(cluster) / "fsdp-cluster/jobs/tiny-cancel"
        exported = [[f"fsdp-trainer-{job_id}-rank0.prom"], [f"fsdp-trainer-{job_id}-rank1.prom"]]
        wait_for(lambda: [trainer_textfiles(cluster, rank, job_id) for rank in (0, 1)] == exported,
                 "each rank's metrics file on its node")
        assert steps(job_dir / "metrics.jsonl")
        killed = f"{slurm.PROMETHEUS_TEXTFILE_DIR}/fsdp-trainer-{job_id}-rank7.prom"
        ssh(cluster, 1, f"echo 'fsdp_trainer_step 3' > {killed}")
        fsdpctl(home, "cancel", str(job_id), env=env)
        # Slurm marks the job CANCELLED at once; the batch script writes its status when its step ended.
        row = wait_for(lambda: (r := job(cluster, job_id))["state"] == "CANCELLED"
                       and (r["status"] or "").startswith("cancelled") and r, "the cancel", timeout=180)
        assert row["last_step"] < 100000
        assert "requeued" not in (job_dir / f"slurm-{job_id}.out").read_text()
        wait_for(lambda: [trainer_textfiles(cluster, rank, job_id) for rank in (0, 1)] == [[], []],
                 "the job's metrics files gone", timeout=60)
        assert f"removed fsdp-trainer-{job_id}-rank7.prom (left by a killed rank)" in health_log(cluster, 1)
    finally:
        for rank in (0, 1):
            ssh_as_root(cluster, rank, f"rm -rf {slurm.PROMETHEUS_TEXTFILE_DIR}")


RESUMED_FROM = re.compile(r"checkpoint: resumed from \S+ \(step (\d+)\)")


def _assert_resumed_with_the_uninterrupted_losses(cluster, job_dir: Path, log: str) -> int:
    """The job resumed from a committed checkpoint of before the fault, redid the steps after it, and
    every step has the loss of the uninterrupted run of the same job (the first training test's): the
    resumed run is that run (data order, optimizer state, learning rate). Returns the resumed step."""
    assert "checkpoint: resumed from" in log
    resumed = int(RESUMED_FROM.search(log).group(1))
    assert resumed % 5 == 0 and resumed >= 5  # a committed checkpoint from before the fault
    records = steps(job_dir / "metrics.jsonl")
    again = records[len(records) - (60 - resumed):]
    assert [r["step"] for r in again] == list(range(resumed + 1, 61))
    uninterrupted = steps(shared(cluster) / "fsdp-cluster/jobs/tiny-2n/metrics.jsonl")
    reference = {r["step"]: r["loss"] for r in uninterrupted}
    assert len(reference) == 60
    differing = {r["step"]: (r["loss"], reference[r["step"]]) for r in records
                 if r["loss"] != pytest.approx(reference[r["step"]], rel=1e-5)}
    assert differing == {}
    return resumed


def _seconds_to_the_resumed_run(job_dir: Path, job_id: int, faulted_at: float, records_before: int) -> float:
    """From the fault to the first step of the resumed run: the log says "checkpoint: resumed from ...
    (step R)" and step R + 1 is recorded after the records of before the fault. (R can be the last step
    before the fault, when a checkpoint was committed just before it: then no step is done twice.) On a
    timeout the error carries the job's batch log and its last step records, to show where it stopped."""
    metrics, log = job_dir / "metrics.jsonl", job_dir / f"slurm-{job_id}.out"

    def resumed_run_stepped() -> bool:
        resumed = RESUMED_FROM.search(log.read_text(errors="replace")) if log.exists() else None
        first = int(resumed.group(1)) + 1 if resumed else None
        return any(r["step"] == first for r in steps(metrics)[records_before:])

    try:
        wait_for(resumed_run_stepped, "the resumed run's first step", timeout=300, interval=0.2)
    except AssertionError as timeout:
        logs = "\n".join(f"== {log.name}\n{log.read_text(errors='replace')[-4000:]}"
                         for log in sorted(job_dir.glob("slurm-*.out")))
        raise AssertionError(f"{timeout} ({records_before} step records before the fault; steps now "
                             f"{[r['step'] for r in steps(metrics)][-20:]})\n{logs}") from None
    return time.monotonic() - faulted_at


def _fault_after_step_12(cluster, name: str, fault: str, what: str) -> tuple[int, Path, str]:
    """Run the 60-step job `name` (a record per step: the default log interval of 10 would leave the
    steps after the last flush unlogged), run `fault` on node 1 after step 12 ($AGENT is the pid of the
    job's torchrun there), print the seconds from the fault to the resumed run's first step, and wait for
    the job to complete; (its id, its directory, its log)."""
    job_id = train(cluster, *KILL_RUN, "--name", name)
    job_dir = shared(cluster) / f"fsdp-cluster/jobs/{name}"
    wait_for(lambda: len(steps(job_dir / "metrics.jsonl")) >= 12, "step 12")
    assert ssh(cluster, 1, f"AGENT=$(cat /tmp/fsdp-job-{job_id}.agent) && {fault}").stdout.split()
    faulted_at = time.monotonic()
    records_before = len(steps(job_dir / "metrics.jsonl"))
    recovery_s = _seconds_to_the_resumed_run(job_dir, job_id, faulted_at, records_before)
    print(f"{what}: {recovery_s:.1f} s from the fault to a resumed step")
    row = wait_for(lambda: (r := job(cluster, job_id))["state"] == "COMPLETED" and r, f"{name}'s completion")
    assert row["last_step"] == 60 and row["status"] == "completed 0"
    return job_id, job_dir, (job_dir / f"slurm-{job_id}.out").read_text()


def test_killed_workers_are_retried_in_the_allocation_and_finish_from_the_checkpoint(cluster):
    """Node 1's workers killed: the step fails, both nodes pass their health check, and the batch
    script starts the step again at once in the same allocation (no requeue, so no wait of Slurm's
    requeue delay); it resumes from the last checkpoint with the uninterrupted run's losses."""
    job_id, job_dir, log = _fault_after_step_12(
        cluster, "tiny-kill", "pids=$(pgrep -P $AGENT) && kill -KILL $pids && echo $pids",
        "recovery in the allocation")
    retried = "retried in this allocation (run 0 attempt 1, failed step 1 of at most 3 retried)"
    assert retried in log, log[-3000:]
    assert "requeued" not in log and f"job {job_id} run 1 on" not in log
    assert (job_dir / "failures").read_text() == "1\n"
    _assert_resumed_with_the_uninterrupted_losses(cluster, job_dir, log)


def test_a_frozen_rank_is_ended_by_the_job_watcher_and_the_job_resumes_with_the_same_losses(cluster):
    """A worker on node 1 stopped (SIGSTOP): every rank waits for it and no metrics come. The job
    watcher on the controller (recovery.stall_min_s 15 in this module's spec) ends the step with the
    reason, and the job resumes from its last checkpoint with the uninterrupted run's losses."""
    job_id, job_dir, log = _fault_after_step_12(
        cluster, "tiny-frozen", "pid=$(pgrep -P $AGENT | head -n 1) && kill -STOP $pid && echo $pid",
        "frozen rank (stall limit 15 s)")
    ended = re.search(r"step ended by the job watcher: no metrics for (\d+) s \(limit (\d+) s: 10 x the "
                      r"usual [\d.]+ s between writes, at least 15 s\): a rank stopped making progress", log)
    assert ended, log[-3000:]
    assert int(ended.group(1)) >= int(ended.group(2)) >= 15
    assert "retried in this allocation (run 0 attempt 1" in log
    watcher_log = ssh_as_root(cluster, 0, "journalctl --no-pager -o cat -u fsdp-job-watcher").stdout
    assert re.search(rf"step {job_id}\.\d+: no metrics for \d+ s .*: ending it", watcher_log), watcher_log
    _assert_resumed_with_the_uninterrupted_losses(cluster, job_dir, log)


def test_sigusr1_checkpoints_at_the_next_step_and_the_requeued_job_goes_on_from_there(cluster):
    """The warning a time limit or the spot watcher gives (SIGUSR1 to the batch script): the workers
    save at the step they are in and exit, the job is requeued and resumes right after that step."""
    job_id = train(cluster, "--steps", "40", "--checkpoint-interval", "1000", "--name", "tiny-usr1")
    job_dir = shared(cluster) / "fsdp-cluster/jobs/tiny-usr1"
    wait_for(lambda: steps(job_dir / "metrics.jsonl"), "the first step")
    ssh(cluster, 0, f"scancel --batch --signal=USR1 {job_id}")  # what the spot watcher sends
    row = wait_for(lambda: (r := job(cluster, job_id))["state"] == "COMPLETED" and r, "the requeued job")
    assert row["last_step"] == 40 and row["status"] == "completed 0"
    log = (job_dir / f"slurm-{job_id}.out").read_text()
    assert "SIGUSR1: asking the workers to checkpoint" in log, log[-3000:]
    assert "after SIGUSR1: requeued" in log, log[-3000:]
    stop = int(re.search(r"stop: checkpoint of step (\d+) saved and verified", log).group(1))
    assert f"/checkpoints/step_{stop:08d} (step {stop})" in log.split("after SIGUSR1: requeued")[1]
    # every step once: nothing done before the signal is redone or lost
    assert [r["step"] for r in steps(job_dir / "metrics.jsonl")] == list(range(1, 41))


def test_jobs_all_lists_every_slurm_job_with_its_runs_from_the_completion_log(cluster):
    """`fsdpctl jobs --all`: a plain sbatch job next to fsdpctl's; the job requeued after SIGUSR1 ran
    twice, the one whose killed step was retried in its allocation once."""
    home, env = cluster
    plain = int(ssh(cluster, 0, "sbatch --parsable --job-name plain-wrap --output /dev/null --wrap true")
                .stdout)

    def history() -> dict[str, dict]:
        rows = json.loads(fsdpctl(home, "jobs", "--all", "--json", env=env).stdout)
        return {row["name"]: row for row in rows}

    rows = wait_for(lambda: (h := history()).get("plain-wrap", {}).get("state") == "COMPLETED" and h,
                    "the plain job in the history", timeout=120)
    assert (rows["plain-wrap"]["job_id"], rows["plain-wrap"]["exit_code"], rows["plain-wrap"]["runs"]) == (
        plain, "0:0", 1)
    assert (rows["tiny-usr1"]["state"], rows["tiny-usr1"]["runs"]) == ("COMPLETED", 2)
    assert (rows["tiny-kill"]["state"], rows["tiny-kill"]["runs"]) == ("COMPLETED", 1)
    assert rows["tiny-2n"]["work_dir"] == str(Path("/shared/fsdp-cluster/jobs/tiny-2n"))
    table = fsdpctl(home, "jobs", "--all", env=env).stdout
    assert table.splitlines()[0].split() == ["JOB", "NAME", "USER", "STATE", "NODES", "START", "END", "EXIT",
                                             "RUNS"]
    assert any(line.split()[:4] == [str(plain), "plain-wrap", LOGIN_USER, "COMPLETED"]
               for line in table.splitlines())


def test_spot_watcher_drains_its_node_and_checkpoints_the_running_job_on_a_notice(cluster):
    home, env = cluster
    ssh(cluster, 1, f"cat > /tmp/imds_standin.py <<'EOF'\n{STANDIN.read_text()}\nEOF\n"
        "rm -f /tmp/spot-notice.json /tmp/rebalance.json; (setsid nohup python3 /tmp/imds_standin.py "
        "--port 18080 --notice /tmp/spot-notice.json --rebalance /tmp/rebalance.json > /tmp/imds.log 2>&1 &)")
    fsdpctl(home, "configure", "--tags", "slurm", "--limit", NODES[1],
            "-e", "slurm_spot_watcher_enabled=true", "-e", "slurm_spot_watcher_endpoint=http://127.0.0.1:18080",
            "-e", "slurm_spot_watcher_interval=1", env=env, timeout=600)
    assert ssh(cluster, 1, "systemctl is-active fsdp-spot-watcher").stdout.strip() == "active"
    time.sleep(3)
    assert node_states(cluster)[NODES[1]] == ("idle", "none")  # no notice yet: nothing happens

    # A rebalance recommendation (EC2's earlier, softer warning) drains the node too.
    ssh(cluster, 1, "echo '{\"noticeTime\": \"2026-12-03T07:50:00Z\"}' > /tmp/rebalance.json")
    _, reason = wait_for(lambda: (s := node_states(cluster)[NODES[1]])[0] == "drained" and s,
                         "the drain on a rebalance recommendation", timeout=60)
    assert reason.startswith('rebalance recommendation notice: {"noticeTime"')
    ssh_as_root(cluster, 0, f"scontrol update nodename={NODES[1]} state=RESUME")

    # The interruption notice with a job running there: drain, and the job checkpoints at once.
    job_id = train(cluster, "--steps", "400", "--checkpoint-interval", "1000", "--name", "tiny-spot")
    job_dir = shared(cluster) / "fsdp-cluster/jobs/tiny-spot"
    wait_for(lambda: steps(job_dir / "metrics.jsonl"), "the first step")
    notice = '{"action": "terminate", "time": "2026-12-03T08:00:00Z"}'
    ssh(cluster, 1, f"echo '{notice}' > /tmp/spot-notice.json")
    _, reason = wait_for(lambda: (s := node_states(cluster)[NODES[1]])[0] in ("drained", "draining") and s,
                         "the drain", timeout=60)
    assert reason.startswith('spot interruption notice: {"action": "terminate"')
    log = job_dir / f"slurm-{job_id}.out"
    wait_for(lambda: "saved and verified" in log.read_text(), "the checkpoint the notice asked for",
             timeout=120)
    text = log.read_text()
    assert "SIGUSR1: asking the workers to checkpoint" in text, text[-3000:]
    stop = int(re.search(r"stop: checkpoint of step (\d+) saved and verified", text).group(1))
    assert stop < 400  # saved where the notice found it, not at the end

    # Requeued, the job cannot start while node 1 is drained (it needs both). EC2 would take the
    # instance back: `fsdpctl heal` puts a fresh node in its place once the job has left it, and the job
    # resumes on it from the checkpoint.
    wait_for(lambda: node_states(cluster)[NODES[1]][0] == "drained", "the job off node 1", timeout=60)
    old_machine = ssh(cluster, 1, "cat /etc/machine-id").stdout
    healed = fsdpctl(home, "heal", "--yes", env=env, timeout=1200).stdout
    assert f"{NODES[1]}: spot interruption notice" in healed
    assert f"{NODES[1]} replaced and configured, and the trainer deployed" in healed
    print(next(line for line in healed.splitlines() if line.startswith(f"{NODES[1]} replaced")))
    assert ssh(cluster, 1, "cat /etc/machine-id").stdout != old_machine
    resumed = wait_for(lambda: RESUMED_FROM.search(log.read_text(errors="replace")), "the resumed run",
                       timeout=300)
    assert int(resumed.group(1)) == stop
    assert job(cluster, job_id)["nodes"] == f"{NAME}-node[0-1]"
    ssh(cluster, 0, f"scancel {job_id}")  # its resumption is what this test is about
    wait_for(lambda: node_states(cluster)[NODES[1]][0] == "idle", "node 1 idle after the cancel", timeout=120)
    assert "no node drained by a spot notice" in fsdpctl(home, "heal", "--yes", env=env).stdout


def health_log(cluster, rank: int) -> str:
    return ssh_as_root(cluster, rank, "journalctl --no-pager -o cat -t fsdp-node-health").stdout


def clear_of_the_periodic_check(cluster, rank: int, margin_s: float = 30) -> None:
    """Wait, if need be, until the node's next periodic health check (slurmctld asks for one every
    HealthCheckInterval) is more than margin_s away, so that a fault made now meets the prolog first."""
    defaults = Path(__file__).parents[2] / "ansible/roles/slurm/defaults/main.yml"
    interval = yaml.safe_load(defaults.read_text())["slurm_health_check_interval"]
    out = ssh_as_root(cluster, rank, "date +%s; journalctl --no-pager -o short-unix -t fsdp-node-health "
              "| grep ': periodic on ' | tail -n 1").stdout.split()
    now, last = float(out[0]), float(out[1]) if len(out) > 1 else None
    if last is not None and (last - now) % interval < margin_s:
        time.sleep((last - now) % interval + 5)


def test_a_failing_health_check_drains_its_node_and_the_job_waits_for_healthy_nodes(cluster):
    """The prolog on node 1 finds a GPU (a stand-in nvidia-smi, with the node's expectation raised to
    one GPU) with uncorrected ECC errors: node 1 is drained with that reason, the job is requeued and
    waits instead of running there, `fsdpctl status` shows why; back in service, the job runs. Then
    the periodic check (slurmd runs it at start) drains a node the same way."""
    home, env = cluster
    clear_of_the_periodic_check(cluster, 1)
    ssh_as_root(cluster, 1, f"cp {HEALTH_CONF} /tmp/node-health.conf.orig && "
        f"sed -i 's/^EXPECTED_GPUS=.*/EXPECTED_GPUS=1/' {HEALTH_CONF} && "
        f"cat > /usr/local/bin/nvidia-smi <<'EOF'\n{FAULTY_NVIDIA_SMI}EOF\n"
        "chmod 755 /usr/local/bin/nvidia-smi")
    job_id = train(cluster, "--steps", "10", "--name", "tiny-health")
    expected = "health (prolog): GPU 0 (00000000:10:1C.0) has 2 uncorrected ECC errors"
    _, reason = wait_for(lambda: (s := node_states(cluster)[NODES[1]])[0] == "drained" and s,
                         "node 1 drained by its prolog", timeout=120)
    assert reason == expected
    wait_for(lambda: node_states(cluster)[NODES[0]] == ("idle", "none"), "node 0 idle again", timeout=60)
    row = wait_for(lambda: (r := job(cluster, job_id))["state"] == "PENDING" and r, "the requeue", timeout=60)
    assert row["nodes"] == "" and row["reason"] != "JobHeldAdmin", row  # requeued, not held, not running
    job_dir = shared(cluster) / "fsdp-cluster/jobs/tiny-health"
    # its batch script started no step (where Slurm launched it before the requeue): no status, and
    # no failed step counted against MAX_REQUEUES
    assert not (job_dir / "status").exists() and not (job_dir / "failures").exists()
    assert f"prolog job {job_id} on {NODES[1]}: FAILED in " in health_log(cluster, 1)
    status = fsdpctl(home, "status", env=env).stdout
    assert f"slurm: 1 of 2 node(s) in service\n  {NODES[1]} drained: {expected}\n" in status
    listed = json.loads(fsdpctl(home, "status", "--json", env=env).stdout)["node_list"]
    assert [(n["slurm_state"], n["slurm_reason"]) for n in listed] == [("idle", None), ("drained", expected)]

    # Fixed and resumed, the node takes the job, which runs on both nodes.
    ssh_as_root(cluster, 1, f"rm /usr/local/bin/nvidia-smi && mv /tmp/node-health.conf.orig {HEALTH_CONF}")
    ssh_as_root(cluster, 0, f"scontrol update nodename={NODES[1]} state=RESUME")
    row = wait_for_job_end(cluster, job_id)
    assert row["state"] == "COMPLETED" and row["nodes"] == f"{NAME}-node[0-1]", row
    prologs = [int(m) for m in re.findall(rf"prolog job {job_id} on \S+: ok in (\d+) ms",
                                          health_log(cluster, 0) + health_log(cluster, 1))]
    print(f"prolog of job {job_id} on healthy nodes: {prologs} ms")
    assert len(prologs) == 3  # node 0 at both allocations, node 1 at the second

    # The periodic check: slurmd runs it when it starts, before it registers.
    ssh_as_root(cluster, 1, f"cp {HEALTH_CONF} /tmp/node-health.conf.orig && "
        f"sed -i 's/^EXPECTED_GPUS=.*/EXPECTED_GPUS=1/' {HEALTH_CONF} && systemctl restart slurmd")
    _, reason = wait_for(lambda: (s := node_states(cluster)[NODES[1]])[0] == "drained" and s,
                         "node 1 drained by its periodic check", timeout=120)
    assert reason == "health (periodic): nvidia-smi not found (1 GPUs expected)"
    ssh_as_root(cluster, 1, f"mv /tmp/node-health.conf.orig {HEALTH_CONF}")
    ssh_as_root(cluster, 0, f"scontrol update nodename={NODES[1]} state=RESUME")
    wait_for(lambda: node_states(cluster)[NODES[1]][0] == "idle", "node 1 back in service", timeout=60)


def test_exclude_drains_the_node_with_the_reason(cluster):
    home, env = cluster
    result = fsdpctl(home, "exclude", "1", "--reason", "ECC errors", env=env)
    assert f"drained {NODES[1]} in Slurm" in result.stdout
    assert node_states(cluster)[NODES[1]] == ("drained", "fsdpctl exclude: ECC errors")
