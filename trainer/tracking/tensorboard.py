"""The TensorBoard sink of the trackers (trainer/tracking/trackers.py): one event file per run, written
synchronously, every scalar as a double. Its own module so that only the main rank, which writes it,
imports tensorboardX."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboardX.proto.tensor_pb2 import TensorProto
from tensorboardX.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboardX.summary import text

from trainer.tracking.scalars import Scalars, Steps, scalars, summary_step

# TensorBoard's scalars plugin reads a tensor value marked as its own; a double keeps every value exactly
# as in the JSONL (the classic simple_value is float32: byte counts and learning rates would round).
_SCALAR_METADATA = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="scalars"))


def _double_scalars(values: Scalars) -> Summary:
    return Summary(value=[
        Summary.Value(tag=tag, metadata=_SCALAR_METADATA, tensor=TensorProto(
            dtype="DT_DOUBLE", double_val=[value], tensor_shape=TensorShapeProto()))
        for tag, value in values.items()])


def _json_text(obj: dict) -> str:
    return textwrap.indent(json.dumps(obj, indent=2), "    ")  # a Markdown code block in TensorBoard


class TensorBoardSink:
    """One event file per run in `logdir`; a resumed run adds a file, TensorBoard joins them by step."""

    def __init__(self, logdir: str, run_config: dict):
        Path(logdir).mkdir(parents=True, exist_ok=True)
        # Synchronous, unlike tensorboardX's FileWriter, whose flush() leaves queued events unwritten:
        # what the metrics file has, the event file has too.
        self.writer = EventsWriter(str(Path(logdir) / "events"))
        self._write(0, text("config", _json_text(run_config)))
        self.writer.flush()

    def _write(self, step: int, summary: Summary) -> None:
        self.writer.write_event(Event(wall_time=time.time(), step=step, summary=summary))

    def log(self, steps: Steps) -> None:
        for step, values in steps:
            self._write(step, _double_scalars(values))
        self.writer.flush()

    def close(self, summary: dict) -> None:
        step = summary_step(summary)
        self._write(step, _double_scalars(scalars(summary, "summary/")))
        self._write(step, text("summary", _json_text(summary)))
        self.writer.close()
