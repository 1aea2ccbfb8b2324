"""`fsdpctl jobs --all`: every Slurm job the cluster runs or ran, not only the ones `fsdpctl train`
submitted (plain `sbatch`, the smoke checks', `configure`'s hold jobs): what slurmctld still lists
(squeue keeps a finished job for MinJobAge, 10 minutes) merged with the controller's job-completion
log (jobcomp/filetxt, slurm.conf JobCompLoc), which keeps one line per finished run of every job.
There is no accounting database (slurmdbd); this log is the cluster's job history."""

from __future__ import annotations

import re
from dataclasses import dataclass

from fsdpctl.scripts import render_script
from fsdpctl.slurm_nodes import run_slurm
from fsdpctl.state import ClusterRecord

HISTORY_LINES = 5000
"""Lines of the completion log read: the last runs of about as many jobs."""
QUEUE_FIELDS = ("job_id", "name", "user", "state", "nodes", "node_count", "start", "end", "work_dir")
QUEUE_FORMAT = "%i|%j|%u|%T|%N|%D|%S|%e|%Z"
"""squeue's fields in QUEUE_FIELDS' order (%S and %e: start and end, N/A or the time)."""
_KEY = re.compile(r" (?=[A-Z][A-Za-z]*=)")
"""Where a completion-log field starts: a space before `Key=` (values such as a job name may hold
spaces, but not a capitalised word followed by '=')."""


@dataclass(frozen=True)
class HistoryRow:
    """One Slurm job, as `fsdpctl jobs --all` shows it (`--json`: these fields)."""

    job_id: int
    name: str
    user: str
    state: str
    """Slurm's state now (from the queue), else the state its last run ended in (the log)."""
    nodes: str
    """The node list of its current or last run ("" before it had nodes)."""
    node_count: int | None
    start: str | None
    """Its current or last run's start, in the controller's local time (ISO 8601); None if none yet."""
    end: str | None
    """When that run ended; None while it runs or waits."""
    exit_code: str | None
    """`status:signal` of the last finished run, as the log has it; None for a job never finished."""
    runs: int
    """Finished runs in the log: more than one for a requeued job."""
    work_dir: str


def _time(value: str) -> str | None:
    return None if value in ("", "N/A", "Unknown", "None", "(null)") else value


def _count(value: str) -> int | None:
    return int(value) if value.isdigit() else None


def parse_completion_line(line: str) -> dict[str, str]:
    """One line of the job-completion log as its `Key=value` fields."""
    fields = {}
    for part in _KEY.split(line.strip()):
        key, sep, value = part.partition("=")
        if sep:
            fields[key] = value
    return fields


def parse_history(text: str) -> list[HistoryRow]:
    """The probe's output (its `# queue` and `# completed` sections) as one row per job, by id."""
    section, queue, finished, runs = "", {}, {}, {}
    for line in text.splitlines():
        if line.startswith("# "):
            section = line[2:].strip()
            continue
        if section == "queue":
            values = line.strip().split("|", len(QUEUE_FIELDS) - 1)
            if len(values) == len(QUEUE_FIELDS) and values[0].isdigit():
                queue[int(values[0])] = dict(zip(QUEUE_FIELDS, values, strict=True))
        elif section == "completed":
            fields = parse_completion_line(line)
            if fields.get("JobId", "").isdigit():
                job_id = int(fields["JobId"])
                finished[job_id] = fields  # the log is in time order: the last line is the last run
                runs[job_id] = runs.get(job_id, 0) + 1
    rows = []
    for job_id in sorted(queue.keys() | finished.keys()):
        log, now = finished.get(job_id, {}), queue.get(job_id)
        exit_code = log.get("ExitCode")
        if now is not None:
            rows.append(HistoryRow(
                job_id=job_id, name=now["name"], user=now["user"], state=now["state"], nodes=now["nodes"],
                node_count=_count(now["node_count"]), start=_time(now["start"]), end=_time(now["end"]),
                exit_code=exit_code, runs=runs.get(job_id, 0), work_dir=now["work_dir"]))
        else:
            rows.append(HistoryRow(
                job_id=job_id, name=log.get("Name", ""), user=log.get("UserId", "").split("(")[0],
                state=log.get("JobState", "UNKNOWN"), nodes=_time(log.get("NodeList", "")) or "",
                node_count=_count(log.get("NodeCnt", "")), start=_time(log.get("StartTime", "")),
                end=_time(log.get("EndTime", "")), exit_code=exit_code, runs=runs[job_id],
                work_dir=log.get("WorkDir", "")))
    return rows


def job_history(record: ClusterRecord) -> list[HistoryRow]:
    """Every job of the cluster's Slurm that the queue or the completion log knows, oldest first."""
    probe = render_script("templates/slurm_history_probe.sh.j2", limit=HISTORY_LINES,
                          queue_format=QUEUE_FORMAT)
    return parse_history(run_slurm(record, probe, timeout=60).stdout)
