"""trainer.tracking: TensorBoard event files, W&B offline runs and MLflow file stores each hold exactly the
scalars of the metrics JSONL, step by step. The records come from a real MetricsLogger (one gloo rank in
this process); W&B and MLflow run in a subprocess without a network (a new network namespace)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pydantic
import pytest
import torch
import torch.distributed as dist
from tensorboardX.proto.event_pb2 import Event

from trainer.config import MetricsConfig, TrainConfig
from trainer.distributed import Runtime
from trainer.errors import ConfigError
from trainer.metrics import MetricsLogger
from trainer.tracking import Tracker, TrackingConfig
from trainer.tracking.scalars import scalars

REPO = Path(__file__).resolve().parents[2]
STEPS = 5
# What the trackers read from the environment (trackers.py sets some): each test starts without them.
TRACKER_ENV = ("WANDB_MODE", "WANDB_ERROR_REPORTING", "WANDB_API_KEY", "MLFLOW_TRACKING_URI",
               "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_DISABLE_TELEMETRY")


@pytest.fixture(autouse=True)
def _tracker_env(monkeypatch):
    for name in TRACKER_ENV:
        monkeypatch.setenv(name, "")  # records the original value, restored after the test
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def metrics_run(tmp_path_factory) -> dict:
    """The records of each flush, the summary and the JSONL of a 5-step MetricsLogger run (step 3
    skipped, so a bool; MFU from a given peak, so a float; no profiling, so null fields)."""
    path = tmp_path_factory.mktemp("metrics") / "metrics.jsonl"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runtime = Runtime(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                          device=torch.device("cpu"), backend="gloo", hostname=socket.gethostname())
        cfg = MetricsConfig(file=str(path), log_interval=2, profile_steps=0, peak_flops=1e12)
        metrics = MetricsLogger(cfg, runtime, total_steps=STEPS, tokens_per_step=4096, samples_per_step=8,
                                flops_per_token=6_000_000, strategy="FULL_SHARD", params=123,
                                hosts=[runtime.hostname], log=lambda _message: None)
        metrics.start()
        batches = [metrics.log_step(step=step, loss=torch.tensor(3.0 / step), lr=1e-4 * step,
                                    grad_norm=torch.tensor(0.7 * step), skipped=step == 3)
                   for step in range(1, STEPS + 1)]
        summary = metrics.close()
    finally:
        dist.destroy_process_group()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {"batches": [b for b in batches if b], "summary": summary.model_dump(), "summary_record": summary,
            "jsonl": lines[:-1], "run_config": TrainConfig().model_dump(mode="json")}


def expected_scalars(record: dict) -> dict[str, float]:
    """What the brief asks of a JSONL record, written out independently of tracking.scalars."""
    out = {}
    for key, value in record.items():
        if key == "step" or value is None or isinstance(value, str | list):
            continue
        if isinstance(value, dict):
            out.update({f"{key}/{inner}": v for inner, v in value.items() if v is not None})
        else:
            out[key] = int(value) if isinstance(value, bool) else value
    return out


def jsonl_steps(records: list[dict]) -> dict[int, dict[str, float]]:
    return {record["step"]: expected_scalars(record) for record in records}


def read_events(directory: Path) -> list[Event]:
    """Every event of the TFRecord files in `directory`: u64 length, u32 CRC, data, u32 CRC."""
    events = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack_from("<Q", data, pos)
            events.append(Event.FromString(data[pos + 12:pos + 12 + length]))
            pos += 12 + length + 4
    return events


def tensorboard_scalars(events: list[Event]) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    for event in events:
        for value in event.summary.value:
            if value.metadata.plugin_data.plugin_name == "scalars":
                assert value.tensor.dtype == 2, f"{value.tag} is not a double (DT_DOUBLE)"
                steps.setdefault(event.step, {})[value.tag] = value.tensor.double_val[0]
    return steps


def tensorboard_texts(events: list[Event]) -> dict[str, str]:
    return {value.tag: value.tensor.string_val[0].decode()
            for event in events for value in event.summary.value
            if value.metadata.plugin_data.plugin_name == "text"}


def test_the_fixture_run_has_every_kind_of_field(metrics_run):
    first = metrics_run["jsonl"][0]
    assert [r["step"] for r in metrics_run["jsonl"]] == list(range(1, STEPS + 1))
    assert isinstance(first["mfu"], float) and first["grad_sync_s"] is None
    assert isinstance(first["skipped"], bool) and isinstance(first["mem_bytes_per_rank"], list)
    assert isinstance(first["device"], str)


def test_flattening_follows_the_jsonl_names():
    record = {"step": 7, "loss": 2.5, "world_size": 8, "skipped": True, "mfu": None, "device": "cuda",
              "mem_bytes_per_rank": [1, 2], "comm_bytes": {"all_gather": 10, "reduce_scatter": 5}}
    assert scalars({k: v for k, v in record.items() if k != "step"}) == {
        "loss": 2.5, "world_size": 8, "skipped": 1,
        "comm_bytes/all_gather": 10, "comm_bytes/reduce_scatter": 5}


def test_tensorboard_holds_the_jsonl_scalars_exactly(metrics_run, tmp_path):
    metrics_file = tmp_path / "run" / "metrics.jsonl"
    tracker = Tracker.create(TrackingConfig(), metrics_file=str(metrics_file),
                             run_config=metrics_run["run_config"], is_main=True)
    for batch in metrics_run["batches"]:
        tracker.log(batch)
        tracker.log([])  # between log intervals MetricsLogger returns no records
    events = read_events(tmp_path / "run" / "metrics.tensorboard")  # the default: next to the JSONL
    steps = tensorboard_scalars(events)
    expected = jsonl_steps(metrics_run["jsonl"])
    assert {"loss", "lr", "skipped", "mfu", "tokens_per_s"} <= set(expected[1])
    assert steps == expected
    # Written at each log(), not only at close: what the JSONL has, TensorBoard has.
    tracker.close(metrics_run["summary_record"])
    events = read_events(tmp_path / "run" / "metrics.tensorboard")
    steps = tensorboard_scalars(events)
    summary, last = metrics_run["summary"], metrics_run["summary"]["last_step"]
    assert steps.pop(last) == {**expected.pop(last), **{f"summary/{k}": v for k, v in
                                                        expected_scalars(summary).items()}}
    assert steps == expected
    texts = tensorboard_texts(events)
    assert json.loads(textwrap.dedent(texts["config/text_summary"])) == metrics_run["run_config"]
    assert json.loads(textwrap.dedent(texts["summary/text_summary"])) == summary


def test_nested_records_reach_tensorboard_flattened(metrics_run, tmp_path):
    tracker = Tracker.create(TrackingConfig(tensorboard_dir=str(tmp_path / "tb")), metrics_file=None,
                             run_config={}, is_main=True)
    record = metrics_run["batches"][0][0].model_copy(
        update={"step": 4, "loss": 1.5, "skipped": False, "comm_bytes": {"all_gather": 2**40 + 1}})
    tracker.log([record])
    tracker.close(metrics_run["summary_record"].model_copy(update={"last_step": 4}))
    scalars_at_4 = tensorboard_scalars(read_events(tmp_path / "tb"))[4]
    expected = {"loss": 1.5, "skipped": 0, "comm_bytes/all_gather": 2**40 + 1, "summary/last_step": 4}
    assert {k: scalars_at_4[k] for k in expected} == expected


def test_without_a_metrics_file_or_tensorboard_dir_nothing_is_written(metrics_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tracker = Tracker.create(TrackingConfig(), metrics_file=None, run_config={}, is_main=True)
    tracker.log(metrics_run["batches"][0])
    tracker.close(metrics_run["summary_record"])
    assert list(tmp_path.iterdir()) == []


def test_other_ranks_write_nothing_and_import_nothing(metrics_run, tmp_path, monkeypatch):
    # A configured library that is not even installed: a non-main rank must not need it.
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    cfg = TrackingConfig(tensorboard_dir=str(tmp_path / "tb"), wandb={"project": "p", "dir": str(tmp_path)},
                         mlflow={"experiment": "e"})
    tracker = Tracker.create(cfg, metrics_file=str(tmp_path / "metrics.jsonl"),
                             run_config=metrics_run["run_config"], is_main=False)
    for batch in metrics_run["batches"]:
        tracker.log(batch)
    tracker.close(metrics_run["summary_record"])
    assert list(tmp_path.iterdir()) == []
    # ... whereas the main rank does write, with the same config and calls.
    Tracker.create(TrackingConfig(tensorboard_dir=str(tmp_path / "tb")), metrics_file=None, run_config={},
                   is_main=True).close(metrics_run["summary_record"])
    assert list((tmp_path / "tb").iterdir())


def test_a_missing_library_is_a_config_error_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = TrackingConfig(wandb={"project": "p"})
    with pytest.raises(ConfigError) as raised:
        Tracker.create(cfg, metrics_file=str(tmp_path / "metrics.jsonl"), run_config={}, is_main=True)
    [problem] = raised.value.problems
    assert problem.key == "tracking.wandb"
    assert "wandb" in problem.message and "pip install 'fsdp-cluster[tracking]'" in problem.fix
    assert "tracking.wandb" in str(raised.value)
    assert list(tmp_path.iterdir()) == []  # not even the TensorBoard directory

    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ConfigError) as raised:
        Tracker.create(TrackingConfig(wandb={"project": "p"}, mlflow={"experiment": "e"}),
                       metrics_file=None, run_config={}, is_main=True)
    assert [p.key for p in raised.value.problems] == ["tracking.wandb", "tracking.mlflow"]


def test_config_needs_names_and_rejects_unknown_keys():
    assert TrackingConfig(wandb={"project": "p"}).wandb.mode == "offline"
    for bad in ({"wandb": {}}, {"mlflow": {"tracking_uri": "file:/x"}},
                {"wandb": {"project": "p", "mode": "x"}}, {"tensorboard": "x"}):
        with pytest.raises(pydantic.ValidationError):
            TrackingConfig.model_validate(bad)


# ---- W&B offline and MLflow file store, in a subprocess with no network ----

OFFLINE_RUN = """
import json, sys
from trainer.records import StepRecord, SummaryRecord
from trainer.tracking import Tracker, TrackingConfig
run = json.loads(open(sys.argv[1]).read())
tracker = Tracker.create(TrackingConfig.model_validate(run["tracking"]), metrics_file=run["metrics_file"],
                         run_config=run["run_config"], is_main=True)
for batch in run["batches"]:
    tracker.log([StepRecord.model_validate(record) for record in batch])
tracker.close(SummaryRecord.model_validate(run["summary"]))
"""


def no_network_prefix() -> list[str]:
    """unshare into a new network namespace (only a down loopback): any connection attempt fails."""
    probe = ["unshare", "--net", "--map-root-user", "true"]
    if shutil.which("unshare") and subprocess.run(probe, capture_output=True).returncode == 0:
        return probe[:-1]
    pytest.skip("needs `unshare --net --map-root-user` to run without a network")


@pytest.fixture(scope="module")
def offline_run(metrics_run, tmp_path_factory) -> Path:
    """W&B offline and MLflow with their default locations next to metrics.jsonl, fed the fixture run."""
    root = tmp_path_factory.mktemp("offline")
    spec = root / "run.json"
    spec.write_text(json.dumps({
        "tracking": {"wandb": {"project": "fsdp-test", "name": "offline-run"},
                     "mlflow": {"experiment": "fsdp-test", "run_name": "file-store-run"}},
        "metrics_file": str(root / "run" / "metrics.jsonl"), "run_config": metrics_run["run_config"],
        "batches": [[record.model_dump() for record in batch] for batch in metrics_run["batches"]],
        "summary": metrics_run["summary"]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(PYTHONPATH=str(REPO), HOME=str(root / "home"), WANDB_CONFIG_DIR=str(root / "wandb-config"),
               WANDB_CACHE_DIR=str(root / "wandb-cache"), WANDB_DATA_DIR=str(root / "wandb-data"))
    proc = subprocess.run([*no_network_prefix(), sys.executable, "-c", OFFLINE_RUN, str(spec)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
    return root / "run"


def wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file: a 7-byte header (":W&B", magic, version), then LevelDB log
    blocks of 32 KiB made of chunks (u32 CRC, u16 length, u8 type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def _item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_holds_the_jsonl_history_and_the_summary(metrics_run, offline_run):
    [run_dir] = (offline_run / "wandb").glob("offline-run-*")  # default dir: next to metrics.jsonl
    [wandb_file] = run_dir.glob("run-*.wandb")
    records = wandb_records(wandb_file)
    history, summary = {}, {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {_item_key(i): json.loads(i.value_json) for i in record.history.item}
            history[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "summary":
            summary.update({_item_key(i): json.loads(i.value_json) for i in record.summary.update})
        elif kind == "run":
            run = record.run
    assert run.display_name == "offline-run" and run.project == "fsdp-test"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["model"]["dim"] == metrics_run["run_config"]["model"]["dim"]
    assert history == jsonl_steps(metrics_run["jsonl"])
    expected_summary = {k: v for k, v in metrics_run["summary"].items() if k != "event"}
    # The run summary has the summary's values, not the last step's (tokens_per_s is in both).
    assert expected_summary["tokens_per_s"] != metrics_run["jsonl"][-1]["tokens_per_s"]
    assert {k: summary[k] for k in expected_summary} == expected_summary


def _mlflow_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """The file store keeps each metric in metrics/<key> (a "/" in the key is a directory), one
    `<timestamp ms> <value> <step>` line per value."""
    steps: dict[int, dict[str, float]] = {}
    for path in (run_dir / "metrics").rglob("*"):
        if path.is_file():
            for line in path.read_text().splitlines():
                _timestamp, value, step = line.split()
                key = path.relative_to(run_dir / "metrics").as_posix()
                steps.setdefault(int(step), {})[key] = float(value)
    return steps


def test_mlflow_file_store_holds_the_jsonl_history_and_the_summary(metrics_run, offline_run):
    store = offline_run / "mlruns"  # default tracking URI: next to metrics.jsonl
    [experiment] = [p.parent for p in store.glob("*/meta.yaml") if "name: fsdp-test" in p.read_text()]
    [run_dir] = [p.parent for p in experiment.glob("*/meta.yaml")]
    meta = run_dir.joinpath("meta.yaml").read_text()
    assert "run_name: file-store-run" in meta and "status: 3" in meta  # RunStatus.FINISHED
    steps = _mlflow_metrics(run_dir)
    summary, last = metrics_run["summary"], metrics_run["summary"]["last_step"]
    summary_metrics = {k: v for k, v in steps[last].items() if k.startswith("summary/")}
    steps[last] = {k: v for k, v in steps[last].items() if not k.startswith("summary/")}
    assert steps == {step: {k: float(v) for k, v in values.items()}
                     for step, values in jsonl_steps(metrics_run["jsonl"]).items()}
    assert summary_metrics == {f"summary/{k}": float(v) for k, v in expected_scalars(summary).items()}
    assert json.loads((run_dir / "artifacts" / "summary.json").read_text()) == summary
    params = run_dir / "params"
    assert (params / "model.dim").read_text() == str(metrics_run["run_config"]["model"]["dim"])
    assert (params / "checkpoint.dir").read_text() == "None"
