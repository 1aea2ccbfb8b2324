"""`fsdpctl jobs --all` without nodes: the job-completion log's lines (the format of Slurm 22.05's
jobcomp/filetxt, JOB_FORMAT in src/plugins/jobcomp/filetxt/jobcomp_filetxt.c) and squeue's rows merged
into one row per job."""

from __future__ import annotations

from fsdpctl.slurm_history import HistoryRow, parse_completion_line, parse_history


def _line(job_id: int, name: str, state: str, nodes: str, start: str, end: str, exit_code: str,
          work_dir: str = "/shared/fsdp-cluster/jobs/x") -> str:
    return (f"JobId={job_id} UserId=root(0) GroupId=root(0) Name={name} JobState={state} Partition=train "
            f"TimeLimit=UNLIMITED StartTime={start} EndTime={end} NodeList={nodes} NodeCnt=2 ProcCnt=4 "
            f"WorkDir={work_dir} ReservationName= Tres=cpu=4,mem=7000M,node=2,billing=4 Account= QOS= "
            f"WcKey= Cluster=slurm-test SubmitTime=2026-12-05T13:40:01 EligibleTime=2026-12-05T13:40:01 "
            f"DerivedExitCode=0:0 ExitCode={exit_code} ")


def test_a_completion_line_keeps_values_with_spaces_and_empty_ones():
    fields = parse_completion_line(_line(7, "my run", "COMPLETED", "n[0-1]", "2026-12-05T13:40:02",
                                         "2026-12-05T13:41:00", "0:0", work_dir="/shared/a b"))
    assert fields["Name"] == "my run" and fields["WorkDir"] == "/shared/a b"
    assert fields["ReservationName"] == "" and fields["Tres"] == "cpu=4,mem=7000M,node=2,billing=4"
    assert (fields["JobId"], fields["JobState"], fields["ExitCode"]) == ("7", "COMPLETED", "0:0")


def test_the_queue_and_the_log_merge_into_one_row_per_job_with_its_runs():
    text = "\n".join([
        "# queue",
        "9|tiny-2n|root|RUNNING|n[0-1]|2|2026-12-05T13:45:00|N/A|/shared/fsdp-cluster/jobs/tiny-2n",
        "8|wrap|root|COMPLETED|n0|1|2026-12-05T13:44:00|2026-12-05T13:44:01|/root",
        "# completed",
        # job 7 requeued once (a spot notice), then completed; job 8 still in the queue too
        _line(7, "tiny-usr1", "REQUEUED", "n[0-1]", "2026-12-05T13:40:02", "2026-12-05T13:41:00", "75:0"),
        _line(7, "tiny-usr1", "COMPLETED", "n[0-1]", "2026-12-05T13:41:40", "2026-12-05T13:42:30", "0:0"),
        _line(8, "wrap", "COMPLETED", "n0", "2026-12-05T13:44:00", "2026-12-05T13:44:01", "0:0", "/root"),
        _line(5, "held", "CANCELLED", "(null)", "Unknown", "2026-12-05T13:30:00", "0:15"),
    ]) + "\n"
    rows = parse_history(text)
    assert [r.job_id for r in rows] == [5, 7, 8, 9]
    assert rows[0] == HistoryRow(job_id=5, name="held", user="root", state="CANCELLED", nodes="",
                                 node_count=2, start=None, end="2026-12-05T13:30:00", exit_code="0:15",
                                 runs=1, work_dir="/shared/fsdp-cluster/jobs/x")
    assert (rows[1].state, rows[1].runs, rows[1].start, rows[1].exit_code) == (
        "COMPLETED", 2, "2026-12-05T13:41:40", "0:0")
    assert (rows[2].state, rows[2].runs, rows[2].work_dir) == ("COMPLETED", 1, "/root")
    assert rows[3] == HistoryRow(job_id=9, name="tiny-2n", user="root", state="RUNNING", nodes="n[0-1]",
                                 node_count=2, start="2026-12-05T13:45:00", end=None, exit_code=None, runs=0,
                                 work_dir="/shared/fsdp-cluster/jobs/tiny-2n")


def test_an_empty_cluster_has_no_rows():
    assert parse_history("# queue\n# completed\n") == []
