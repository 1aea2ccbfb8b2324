"""The network gate of the training check, on NCCL_DEBUG=INFO logs as NCCL and aws-ofi-nccl print them
(lines shaped after real p4d/p5 runs: aws-ofi-nccl issues, AWS's EFA guide)."""

from __future__ import annotations

from pathlib import Path

from fsdpctl.checks.nccl_network import network_problems, parse_nccl_network
from fsdpctl.checks.torchrun import TorchrunJob
from fsdpctl.slurm import SlurmJob

HOST = "ip-10-1-0-5:1929:1937 [0]"
INIT = f"""{HOST} NCCL INFO NCCL version 2.29.3+cuda12.9
{HOST} NCCL INFO NET/Plugin: Loaded net plugin Libfabric (v10)
{HOST} NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.18.0
{HOST} NCCL INFO NET/OFI Using Libfabric version 2.4
{HOST} NCCL INFO NET/OFI Using CUDA driver version 13020 with runtime 12090
{HOST} NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct (found 4 nics)
{HOST} NCCL INFO NET/OFI Support for DMA-BUF registrations: false
{HOST} NCCL INFO Using network Libfabric
"""
CHANNELS = "".join(
    f"{HOST} NCCL INFO Channel {c:02d}/0 : 0[0] -> 8[0] [send] via NET/Libfabric/{c % 4}/GDRDMA\n"
    f"{HOST} NCCL INFO Channel {c:02d}/0 : 8[0] -> 0[0] [receive] via NET/Libfabric/{c % 4}/GDRDMA\n"
    for c in range(4)
)
HEALTHY = INIT + CHANNELS


def test_efa_with_gpudirect_on_every_channel_passes():
    found = parse_nccl_network(HEALTHY)
    assert found.networks == ["Libfabric"] and found.provider == "efa" and found.nics == 4
    assert found.ofi_version == "1.18.0" and found.net_channels == found.gdr_channels == 8
    assert network_problems(found, efa_interfaces=4, multi_node=True) == []


def test_older_plugin_wording_is_understood():
    log = (f"{HOST} NCCL INFO NET/OFI Selected Provider is efa (found 16 nics)\n"
           f"{HOST} NCCL INFO Using network AWS Libfabric\n")
    found = parse_nccl_network(log)
    assert (found.provider, found.nics, found.networks) == ("efa", 16, ["AWS Libfabric"])
    assert network_problems(found, efa_interfaces=16, multi_node=False) == []


def test_socket_fallback_fails_naming_the_plugin_error():
    log = (f"{HOST} NCCL INFO NET/Plugin: Could not find: libnccl-net.so. Using internal network plugin.\n"
           f"{HOST} NCCL INFO NET/IB : No device found.\n"
           f"{HOST} NCCL INFO NET/Socket : Using [0]ens32:10.1.0.5<0>\n"
           f"{HOST} NCCL INFO Using network Socket\n"
           f"{HOST} NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/Socket/0\n")
    problems = network_problems(parse_nccl_network(log), efa_interfaces=4, multi_node=True)
    assert len(problems) == 1
    assert "NCCL used network Socket, not aws-ofi-nccl" in problems[0]
    assert "Could not find: libnccl-net.so" in problems[0]


def test_fewer_nics_than_the_instance_has_fails():
    problems = network_problems(parse_nccl_network(HEALTHY.replace("found 4 nics", "found 1 nics")),
                                efa_interfaces=4, multi_node=True)
    assert problems == ["aws-ofi-nccl found 1 EFA NIC(s), the instance has 4: NCCL runs on a fraction of "
                        "the bandwidth; replace the node"]


def test_network_channels_without_gpudirect_fail_between_nodes_only():
    log = INIT + CHANNELS.replace("/GDRDMA\n", "\n", 3)
    found = parse_nccl_network(log)
    assert (found.net_channels, found.gdr_channels) == (8, 5)
    (problem,) = network_problems(found, efa_interfaces=4, multi_node=True)
    assert problem.startswith("3 of 8 network channel(s) without GPUDirect RDMA")
    # one node: no network channel at all, NVLink carries everything
    assert network_problems(parse_nccl_network(INIT), efa_interfaces=4, multi_node=False) == []


def test_a_log_without_nccl_debug_fails_and_non_efa_instances_are_not_gated():
    assert "names no network" in network_problems(parse_nccl_network("step 1 loss 2.3\n"), efa_interfaces=4,
                                                  multi_node=True)[0]
    assert network_problems(parse_nccl_network(""), efa_interfaces=0, multi_node=True) == []


def _finished(cls, tmp_path: Path, **attrs):
    """A job object as it is once its run ended (the constructors start the run on the nodes)."""
    job = object.__new__(cls)
    vars(job).update(log_dir=tmp_path, name="fsdp", ranks=[0, 1], **attrs)
    return job


def test_a_torchrun_jobs_logs_are_every_nodes_log(tmp_path: Path):
    (tmp_path / "fsdp-node0.log").write_text(INIT)
    (tmp_path / "fsdp-node1.log").write_text(CHANNELS)
    found = parse_nccl_network(_finished(TorchrunJob, tmp_path).logs())
    assert (found.provider, found.gdr_channels) == ("efa", 8)


def test_a_slurm_jobs_logs_are_its_output_file_that_srun_gathered_from_every_node(tmp_path: Path):
    # The fsdp check runs as a Slurm job wherever Slurm is configured: the gate must read that job's
    # output, not torchrun's per-node files (which a Slurm job never writes).
    (tmp_path / "fsdp-slurm-17.out").write_text(INIT + CHANNELS)
    job = _finished(SlurmJob, tmp_path, job_id=17)
    found = parse_nccl_network(job.logs())
    assert (found.provider, found.nics, found.gdr_channels) == ("efa", 4, 8)
    assert network_problems(found, efa_interfaces=4, multi_node=True) == []
    assert job.log_tail(1) == CHANNELS.splitlines()[-1]
