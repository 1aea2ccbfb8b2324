"""nccl-tests' all_reduce_perf across the nodes through the EFA installer's Open MPI: the command that
runs it from node 0, and its result table parsed.

The `nccl` Ansible role builds nccl-tests against `/opt/amazon/openmpi` and links the pinned build at
`/opt/nccl-tests/build`; it writes the NCCL/libfabric environment to `/etc/fsdp-cluster/nccl.env`. mpirun
starts the remote ranks over SSH, which the `cluster_ssh` role makes passwordless between the nodes.

all_reduce_perf prints one row per message size after `#` header lines (spacing shortened here):

    #       size       count   type  redop  root    time  algbw   busbw #wrong    time  algbw   busbw #wrong
    #        (B)  (elements)                        (us) (GB/s)  (GB/s)           (us) (GB/s)  (GB/s)
      1073741824   268435456  float    sum    -1   13729  78.21  146.64      0   13731  78.20  146.62      0

the out-of-place time/algbw/busbw/#wrong, then the in-place ones (`#wrong` is `N/A` when validation is
off); older releases print fewer leading columns, so the figures are read from the end of the row.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from fsdpctl.errors import CommandError

OPENMPI_DIR = "/opt/amazon/openmpi"
ALL_REDUCE_PERF = "/opt/nccl-tests/build/all_reduce_perf"
NCCL_ENVIRONMENT_FILE = "/etc/fsdp-cluster/nccl.env"
# libfabric with the EFA provider, the aws-ofi-nccl plugin NCCL loads to use it, and Open MPI's own.
EFA_LIBRARY_PATH = ("/opt/amazon/efa/lib", "/opt/amazon/ofi-nccl/lib", f"{OPENMPI_DIR}/lib")

_AVERAGE = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([0-9.]+)", re.MULTILINE)
# out-of-place time, algbw, busbw, #wrong, then the same in place
_TRAILING_FIGURES = 8


class NcclTestsError(CommandError):
    """all_reduce_perf ran but its output shows no usable or wrong results."""


@dataclass(frozen=True)
class AllReducePerfRow:
    """all_reduce_perf's out-of-place figures for one message size."""

    size_bytes: int
    algbw_gbps: float
    busbw_gbps: float


def parse_all_reduce_perf(text: str) -> list[AllReducePerfRow]:
    """The out-of-place figures per message size (GB/s).

    Raises NcclTestsError when no result row is found or any row reports wrong values (#wrong > 0).
    """
    rows, wrong = [], []
    for line in text.splitlines():
        fields = line.split()
        if not fields or line.lstrip().startswith("#") or len(fields) < 2 + _TRAILING_FIGURES:
            continue
        if not (fields[0].isdigit() and fields[1].isdigit()):
            continue  # MPI/NCCL messages between the rows
        _time, algbw, busbw, errors = fields[-_TRAILING_FIGURES:-_TRAILING_FIGURES + 4]
        try:
            row = AllReducePerfRow(size_bytes=int(fields[0]), algbw_gbps=float(algbw),
                                   busbw_gbps=float(busbw))
        except ValueError:
            continue
        in_place_errors = fields[-1]
        bad = [int(e) for e in (errors, in_place_errors) if e.isdigit() and int(e) > 0]
        if bad:
            wrong.append(f"{row.size_bytes} B: {max(bad)} wrong element(s)")
        rows.append(row)
    if not rows:
        tail = "\n".join(text.strip().splitlines()[-15:])
        raise NcclTestsError(f"all_reduce_perf printed no result rows; its output ends:\n{tail}")
    if wrong:
        raise NcclTestsError("all_reduce_perf found wrong results (data corruption on the fabric or a "
                             "faulty GPU): " + "; ".join(wrong))
    return rows


def average_bus_bandwidth(text: str) -> float | None:
    """The `# Avg bus bandwidth` figure (GB/s) all_reduce_perf prints at the end, if present."""
    match = _AVERAGE.search(text)
    return float(match.group(1)) if match else None


def mpirun_command(hosts: list[str], gpus_per_node: int, binary: str = ALL_REDUCE_PERF,
                   env_file: str | None = NCCL_ENVIRONMENT_FILE, min_bytes: int | str = "8M",
                   max_bytes: int | str = "2G") -> str:
    """The shell command, run on the first host, that runs `binary` with one process per GPU on every host.

    The variables of `env_file` (KEY="value" lines, as the nccl role writes it) are loaded into the shell
    and exported to every rank with `-x`, along with the EFA provider and library path.
    """
    if not hosts:
        raise ValueError("mpirun needs at least one host")
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    library_path = ":".join(EFA_LIBRARY_PATH)
    argv = [f"{OPENMPI_DIR}/bin/mpirun", "-np", str(len(hosts) * gpus_per_node),
            "-H", ",".join(f"{host}:{gpus_per_node}" for host in hosts),
            # each rank picks its GPU by local rank; binding to cores would starve the proxy threads
            "--bind-to", "none",
            # MPI itself only bootstraps over TCP; NCCL carries the data over EFA through aws-ofi-nccl
            "--mca", "pml", "^cm", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_exclude", "lo,docker0",
            "-x", "FI_PROVIDER=efa"]
    command = " ".join(shlex.quote(a) for a in argv)
    command += f' -x "LD_LIBRARY_PATH={library_path}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"'
    prefix = ""
    if env_file:
        quoted = shlex.quote(env_file)
        prefix = f"set -a && . {quoted} && set +a && "
        # one `-x NAME` per variable the file sets (values come from the shell that sourced it)
        command += f" $(sed -n 's/^\\([A-Za-z_][A-Za-z0-9_]*\\)=.*/-x \\1/p' {quoted})"
    command += " " + " ".join(shlex.quote(str(a)) for a in
                              [binary, "-b", min_bytes, "-e", max_bytes, "-f", 2, "-g", 1])
    return prefix + command

