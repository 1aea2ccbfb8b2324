"""What a role's failure says, rendered by Ansible's templating exactly as the task writes it."""

from __future__ import annotations

from tests.ansible.conftest import render, task_expression

CONTROLLER_LOG = [
    "[2026-12-06T00:48:01.100] sched: Allocate JobId=7 NodeList=c-node0",
    "[2026-12-06T00:48:02.200] error: Munge decode failed: Invalid credential",
    "[2026-12-06T00:48:02.201] auth_g_verify: REQUEST_PARTITION_INFO has authentication error",
    "[2026-12-06T00:48:03.000] Node c-node1 now responding",
    "[2026-12-06T00:48:04.000] _slurm_rpc_submit_batch_job: JobId=8 InitPrio=1",
]


def registration_failure(**registered) -> str:
    msg = task_expression("slurm", "services.yml", "Fail naming what sinfo and the daemons said",
                          "ansible.builtin.fail", "msg")
    return render(msg, {"inventory_hostname": "c-node1", "slurm_controller_host": "c-node0", **registered})


def test_a_node_slurmctld_refuses_names_what_sinfo_and_the_controller_said():
    msg = registration_failure(
        slurm_node_state={"rc": 1, "stdout": "",
                          "stderr": "slurm_load_partitions: Zero Bytes were transmitted"},
        slurm_controller_log={"stdout_lines": CONTROLLER_LOG},
        slurm_node_log={"stdout_lines": ["[..] slurmd version 23.11.4 started", "[..] error: Unable to "
                                         "register: Zero Bytes were transmitted or received"]})
    assert "\n" not in msg.strip()
    assert msg.startswith("c-node1 is not up in slurmctld on c-node0 after 60 s;")
    assert "sinfo said: slurm_load_partitions: Zero Bytes were transmitted." in msg
    # the controller's lines about the node, munge or authentication: the last three, nothing else
    assert ("Munge decode failed: Invalid credential / [2026-12-06T00:48:02.201] auth_g_verify" in msg
            and "Node c-node1 now responding" in msg)
    assert "JobId" not in msg
    assert "slurmd's last errors: [..] error: Unable to register" in msg
    assert msg.rstrip().endswith("then run `fsdpctl configure --limit c-node1 --tags slurm`.")


def test_a_node_whose_logs_cannot_be_read_still_fails_with_what_sinfo_said():
    msg = registration_failure(slurm_node_state={"rc": 0, "stdout": "down*", "stderr": ""},
                               slurm_controller_log={"rc": 1, "stdout_lines": []},
                               slurm_node_log={"rc": 1, "stdout_lines": []})
    assert "sinfo said: down*." in msg
    assert "slurmctld's last lines about it: none." in msg and "slurmd's last errors: none." in msg
