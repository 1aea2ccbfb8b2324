"""The records of the metrics JSONL (`--metrics-file`): one definition that the trainer writes
(trainer/metrics.py) and every reader parses (fsdpctl's checks, tests).

Three kinds of line, one JSON object each:

- `StepRecord`, one per optimizer step (no `event` key);
- `EvalRecord`, `{"event": "eval", ...}`, one per validation run;
- `SummaryRecord`, `{"event": "summary", ...}`, the last line of a run (a resumed run appends its own).

The fields and what they mean are listed in docs/trainer.md ("Metrics"). This module imports only
pydantic and the standard library: the operator machine reads the records without torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    SerializerFunctionWrapHandler,
    Tag,
    TypeAdapter,
    ValidationError,
    model_serializer,
)


class _Record(BaseModel):
    # NaN and infinity written as Python's json module writes them (a skipped fp16 step's gradient
    # norm is inf), so a line reads back to the same value.
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")

    def json_line(self) -> str:
        """The record as one line of the metrics file (without the newline)."""
        return self.model_dump_json()


class RunFacts(_Record):
    """What every step record and the summary repeat about the run."""

    world_size: int
    nodes: int
    ranks_per_node: int
    device: str
    """The device type: `cuda` or `cpu`."""
    strategy: str
    """The FSDP sharding strategy (parallel.strategy)."""
    params: int
    """The model's parameter count."""


CommBytes = dict[str, int]
"""Bytes by collective kind: `all_gather`, `reduce_scatter`, `all_reduce` (trainer/commbytes.py)."""

_ABSENT_UNLESS_MEASURED = ("router_aux_loss", "tokens_per_expert", "expert_load_max_over_mean",
                           "host_rss_bytes_per_rank", "device_mem_bytes_per_rank")


class StepRecord(RunFacts):
    """One optimizer step. The figures of one log interval's steps come from one flush (throughput,
    memory); the communication figures only from profiled steps (null on the others)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    samples_per_s: float
    step_time_s: float
    grad_sync_s: float | None
    grad_sync_share: float | None
    comm_s: float | None
    comm_exposed_s: float | None
    comm_exposed_share: float | None
    profiled_step_time_s: float | None
    comm_bytes: CommBytes | None
    mfu: float | None
    max_mem_bytes: int
    mem_bytes_per_rank: list[int]
    mem_max_min_ratio: float
    skipped: bool
    # Mixture-of-experts models only (absent from the line otherwise).
    router_aux_loss: float | None = None
    tokens_per_expert: list[list[int]] | None = None
    expert_load_max_over_mean: list[float] | None = None
    # Memory now, on the last step of each flush only (absent from the other lines); device memory on
    # CUDA only. The monitoring check fits its leak slopes to these.
    host_rss_bytes_per_rank: list[int] | None = None
    device_mem_bytes_per_rank: list[int] | None = None

    @model_serializer(mode="wrap")
    def _leave_out_unmeasured(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """A line carries the optional figures only where they were measured, as it always has."""
        line = handler(self)
        for name in _ABSENT_UNLESS_MEASURED:
            if line.get(name) is None:
                line.pop(name, None)
        return line


class EvalRecord(_Record):
    """A validation run (eval.interval): the mean next-token loss over `eval_tokens` positions."""

    event: Literal["eval"] = "eval"
    step: int
    eval_loss: float
    eval_tokens: int


class SummaryRecord(RunFacts):
    """The run's last line: its aggregates (docs/trainer.md says how each is measured)."""

    event: Literal["summary"] = "summary"
    steps: int
    first_step: int | None
    last_step: int | None
    first_loss: float | None
    final_loss: float | None
    min_loss: float | None
    eval_loss: float | None
    tokens_per_s: float | None
    samples_per_s: float | None
    step_time_s: float | None
    measured_steps: int
    measured_wall_s: float | None
    grad_sync_s: float | None
    grad_sync_share: float | None
    comm_exposed_share: float | None
    profiled_steps: int
    comm_bytes_per_step: CommBytes | None
    mfu: float | None
    max_mem_bytes: int | None
    mem_max_min_ratio: float | None
    skipped_steps: int
    stopped: Literal["completed", "signal"]
    signal: str | None
    """The signal's name (e.g. SIGUSR1) when `stopped` is `signal`."""
    wall_time_s: float
    rank_hosts: list[str]


def _kind(line: object) -> str:
    """A line's record kind: its `event`, or `step` for the step records, which have none."""
    if isinstance(line, dict):
        return str(line.get("event", "step"))
    return getattr(line, "event", "step")


MetricsRecord = Annotated[
    Annotated[StepRecord, Tag("step")] | Annotated[EvalRecord, Tag("eval")]
    | Annotated[SummaryRecord, Tag("summary")],
    Discriminator(_kind)]
_LINE = TypeAdapter(MetricsRecord)


class MetricsFormatError(ValueError):
    """A line of a metrics file is not a record of this trainer."""


class MetricsLog(BaseModel):
    """A metrics file's records by kind, in file order."""

    model_config = ConfigDict(frozen=True)

    steps: list[StepRecord] = []
    evals: list[EvalRecord] = []
    summaries: list[SummaryRecord] = []
    """One per run that finished into the file (a resumed run appends its own)."""

    @property
    def summary(self) -> SummaryRecord | None:
        """The summary of the last run that finished, if any."""
        return self.summaries[-1] if self.summaries else None


def parse_record(line: str, *, source: str, number: int) -> StepRecord | EvalRecord | SummaryRecord:
    """One line of a metrics file; MetricsFormatError naming `source` and the line `number`."""
    try:
        return _LINE.validate_json(line)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"][1:])  # [0] is the record kind's tag
        raise MetricsFormatError(
            f"{source} line {number}: not a metrics record of this trainer "
            f"({where + ': ' if where else ''}{error['msg']}): the file was written by another trainer "
            "version or edited; deploy this checkout's trainer (`fsdpctl deploy`) and rerun") from None


def parse_metrics(text: str, *, source: str) -> MetricsLog:
    """Every record of a metrics file's text. A last line without its newline is left out: the
    trainer is still writing it (it writes each line whole, newline included). Any other line that
    is not a record raises MetricsFormatError naming `source` and the line."""
    lines = text.split("\n")
    lines.pop()  # after the last newline: empty, or a line still being written
    steps, evals, summaries = [], [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = parse_record(line, source=source, number=number)
        if isinstance(record, StepRecord):
            steps.append(record)
        elif isinstance(record, EvalRecord):
            evals.append(record)
        else:
            summaries.append(record)
    return MetricsLog(steps=steps, evals=evals, summaries=summaries)
