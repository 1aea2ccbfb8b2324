"""nccl-tests in the smoke test without nodes: all_reduce_perf's table parsed, the mpirun command built,
and the bandwidth gate decided on parsed figures."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from fsdpctl.checks.bandwidth import (
    GLOO_BUSBW_FLOOR_GBPS,
    AllReduceMeasurement,
    as_measurement,
    bandwidth_verdict,
)
from fsdpctl.checks.nccl_tests import (
    ALL_REDUCE_PERF,
    AllReducePerfRow,
    NcclTestsError,
    average_bus_bandwidth,
    mpirun_command,
    parse_all_reduce_perf,
)
from infra.catalog import lookup

P4D_GATE = lookup("p4d.24xlarge").allreduce_busbw_gate_gbps

HEADER = """\
# nThread 1 nGpus 1 minBytes 8388608 maxBytes 2147483648 step: 2(factor) warmup iters: 5 iters: 20
#
# Using devices
#  Rank  0 Group  0 Pid  40112 on ip-10-0-1-11 device  0 [0x10] NVIDIA A100-SXM4-40GB
#  Rank  8 Group  0 Pid  38311 on ip-10-0-1-12 device  0 [0x10] NVIDIA A100-SXM4-40GB
#
#                                                  out-of-place                    in-place
#       size        count    type  redop  root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)   (elements)                          (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
"""


def row(size: int, time_us: float, algbw: float, busbw: float, wrong: str = "0",
        in_place_wrong: str = "0") -> str:
    """A result row with all_reduce_perf's own field widths (float, sum, root -1; in place 0.1% slower)."""
    return (f"{size:12d} {size // 4:12d} {'float':>7s} {'sum':>6s} {-1:5d}"
            f"  {time_us:7.1f}  {algbw:6.2f}  {busbw:6.2f}  {wrong:>5s}"
            f"  {time_us * 1.001:7.1f}  {algbw * 0.999:6.2f}  {busbw * 0.999:6.2f}  {in_place_wrong:>5s}\n")


# Two p4d.24xlarge, 16 ranks over 4 EFA: ~78 GB/s bus bandwidth at large sizes; NCCL's own log lines
# interleave with the rows.
TWO_P4D = (HEADER + row(8388608, 266.9, 31.43, 58.93) + row(16777216, 462.0, 36.31, 68.09)
           + "ip-10-0-1-12:38311:38311 [0] NCCL INFO comm 0x55d0 rank 8 nranks 16 - Init COMPLETE\n"
           + row(33554432, 857.3, 39.14, 73.39) + row(1073741824, 25936, 41.40, 77.62)
           + row(2147483648, 51573, 41.64, 78.07)
           + "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 71.2793\n#\n")

# The same pair of nodes with one EFA working (or a TCP fallback): ~20 GB/s.
ONE_EFA = (HEADER + row(1073741824, 100661, 10.67, 20.00) + row(2147483648, 200800, 10.69, 20.05)
           + "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 20.02\n")


def test_parses_the_out_of_place_figures_per_size_and_skips_comments_and_messages():
    rows = parse_all_reduce_perf(TWO_P4D)
    assert [r.size_bytes for r in rows] == [8388608, 16777216, 33554432, 1073741824, 2147483648]
    assert rows[-1] == AllReducePerfRow(size_bytes=2147483648, algbw_gbps=41.64, busbw_gbps=78.07)
    assert max(r.busbw_gbps for r in rows) == 78.07
    assert average_bus_bandwidth(TWO_P4D) == pytest.approx(71.2793)


def test_one_efa_figures():
    rows = parse_all_reduce_perf(ONE_EFA)
    assert [r.busbw_gbps for r in rows] == [20.00, 20.05]
    assert average_bus_bandwidth(ONE_EFA) == pytest.approx(20.02)


def test_older_rows_without_redop_and_root_and_validation_off():
    text = ("#  size  count  type  time  algbw  busbw  error  time  algbw  busbw  error\n"
            "  1048576  262144  float  120.1  8.73  16.37  N/A  119.8  8.75  16.41  N/A\n")
    assert parse_all_reduce_perf(text) == [AllReducePerfRow(size_bytes=1048576, algbw_gbps=8.73,
                                                            busbw_gbps=16.37)]


@pytest.mark.parametrize(("wrong", "in_place_wrong"), [("3", "0"), ("0", "3"), ("3", "N/A")])
def test_wrong_results_are_an_error_naming_the_size(wrong, in_place_wrong):
    text = HEADER + row(8388608, 266.9, 31.43, 58.93) + row(1073741824, 25936, 41.40, 77.62,
                                                             wrong, in_place_wrong)
    with pytest.raises(NcclTestsError, match="1073741824 B: 3 wrong element"):
        parse_all_reduce_perf(text)


def test_output_without_result_rows_is_an_error_showing_its_end():
    text = HEADER + ("ip-10-0-1-12: Test NCCL failure common.cu:1005 'unhandled system error'\n"
                     "--------------------------------------------------------------------------\n"
                     "Primary job  terminated normally, but 1 process returned a non-zero exit code.\n")
    with pytest.raises(NcclTestsError, match=r"no result rows(.|\n)*unhandled system error"):
        parse_all_reduce_perf(text)


def test_result_has_the_shape_the_report_plots():
    data = as_measurement(parse_all_reduce_perf(TWO_P4D), 16, average_bus_bandwidth(TWO_P4D))
    assert data.backend == "nccl-tests" and data.world_size == 16
    assert data.peak_busbw_gbps == 78.07 and data.avg_busbw_gbps == pytest.approx(71.2793)
    assert data.results[0].model_dump(exclude_none=True) == {"bytes": 8388608, "algbw_gbps": 31.43,
                                                             "busbw_gbps": 58.93}


def test_the_trainer_collectives_result_reads_as_the_same_type():
    """What `python -m trainer.collectives --output` writes (tests/trainer/test_collectives.py runs it)."""
    written = {"backend": "gloo", "world_size": 2, "nnodes": 2, "device": "cpu", "iters": 10, "warmup": 3,
               "results": [{"bytes": 4096, "size": "4K", "time_us": 80.5, "algbw_gbps": 0.05,
                            "busbw_gbps": 0.05}], "peak_busbw_gbps": 0.05}
    data = AllReduceMeasurement.model_validate(written)
    assert data.results[0].time_us == 80.5 and data.model_dump(exclude_none=True) == written


def test_mpirun_command_runs_one_rank_per_gpu_on_every_host_with_the_nccl_environment():
    command = mpirun_command(["10.0.1.11", "10.0.1.12"], 8, ALL_REDUCE_PERF, "/etc/fsdp-cluster/nccl.env",
                             "1G", "2G")
    prefix, mpirun = command.split(" && set +a && ")
    assert prefix == "set -a && . /etc/fsdp-cluster/nccl.env"
    argv = shlex.split(mpirun)  # the $(sed ...) and ${...} parts stay as words of their own
    assert argv[0] == "/opt/amazon/openmpi/bin/mpirun"
    assert argv[argv.index("-np") + 1] == "16"
    assert argv[argv.index("-H") + 1] == "10.0.1.11:8,10.0.1.12:8"
    assert argv[argv.index("--bind-to") + 1] == "none"
    exported = [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]
    assert "FI_PROVIDER=efa" in exported
    library_path = next(e for e in exported if e.startswith("LD_LIBRARY_PATH="))
    assert "/opt/amazon/efa/lib" in library_path and "/opt/amazon/ofi-nccl/lib" in library_path
    assert "/etc/fsdp-cluster/nccl.env" in mpirun.split(" -x ")[-1]  # every variable of the env file
    assert argv[-9:] == [ALL_REDUCE_PERF, "-b", "1G", "-e", "2G", "-f", "2", "-g", "1"]


def test_mpirun_command_exports_each_variable_of_the_env_file(tmp_path):
    env_file = tmp_path / "nccl.env"
    env_file.write_text('# comment\nFI_EFA_USE_HUGE_PAGE="0"\nNCCL_SOCKET_IFNAME="^docker,lo,veth"\n')
    command = mpirun_command(["a"], 1, "/bin/true", str(env_file), 8, 16)
    # the command's own shell expansions, seen by printing the mpirun words instead of running them
    printed = command.replace("/opt/amazon/openmpi/bin/mpirun", "printf '%s\\n'", 1)
    shown = subprocess.run(["bash", "-c", printed], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    exported = [shown[i + 1] for i, a in enumerate(shown) if a == "-x"]
    assert exported[-2:] == ["FI_EFA_USE_HUGE_PAGE", "NCCL_SOCKET_IFNAME"]


def test_mpirun_command_without_an_env_file_and_bad_arguments():
    assert ". " not in mpirun_command(["a", "b"], 8, ALL_REDUCE_PERF, None, "1G", "2G")
    with pytest.raises(ValueError, match="at least one host"):
        mpirun_command([], 8)
    with pytest.raises(ValueError, match="gpus_per_node"):
        mpirun_command(["a"], 0)


def _verdict(text: str, nodes: int = 2):
    peak = as_measurement(parse_all_reduce_perf(text), 8 * nodes, None).peak_busbw_gbps
    return bandwidth_verdict(peak, world_size=8 * nodes, nodes=nodes, backend="nccl-tests",
                             gate_gbps=P4D_GATE, basis="p4d.24xlarge gate")


def test_two_p4d_pass_the_gate():
    passed, summary = _verdict(TWO_P4D)
    assert passed, summary
    assert summary == ("peak bus bandwidth 78.1 GB/s over 16 ranks (nccl-tests); p4d.24xlarge gate 70 GB/s")


def test_one_efa_fails_loudly_with_the_hint():
    passed, summary = _verdict(ONE_EFA)
    assert not passed
    assert "20.1 GB/s" in summary and "below the gate" in summary
    assert "fewer EFAs" in summary and "TCP sockets" in summary


def test_gloo_floor_and_single_rank():
    passed, summary = bandwidth_verdict(0.01, world_size=4, nodes=2, backend="gloo",
                                        gate_gbps=GLOO_BUSBW_FLOOR_GBPS, basis="gloo/CPU floor")
    assert not passed and "below the gate" in summary and "EFA" not in summary
    assert bandwidth_verdict(0.0, world_size=1, nodes=1, backend="gloo", gate_gbps=GLOO_BUSBW_FLOOR_GBPS,
                             basis="gloo/CPU floor")[0]
    passed, summary = bandwidth_verdict(150.0, world_size=8, nodes=1, backend="nccl-tests",
                                        gate_gbps=P4D_GATE, basis="p4d.24xlarge gate")
    assert passed and "one node: inter-node bandwidth not measured" in summary
