"""bench/gpu_summary.py on a recorded CPU dry run (tests/bench/data/cpu-dry-run) and on copies of it
changed the way a GPU run can go wrong."""

import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest

from trainer.config import load_config

DATA = Path(__file__).parent / "data"
TITAN_CHECK = Path(__file__).resolve().parents[2] / "bench" / "gpu_check" / "titan_check.py"


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if '"event"' not in line]


def rewrite_metrics(path: Path, change) -> None:
    """Apply change(record) to every step record of a metrics JSONL file (summary lines kept)."""
    lines = []
    for line in path.read_text().splitlines():
        obj = json.loads(line)
        if obj.get("event") != "summary":
            change(obj)
        lines.append(json.dumps(obj))
    path.write_text("\n".join(lines) + "\n")


def args_of(work: Path, step: str) -> list[str]:
    return (work / step / "run.args").read_text().splitlines()


def overrides(argv: list[str]) -> tuple[str, list[str]]:
    config = argv[argv.index("--config") + 1]
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    return config, sets


def test_recorded_dry_run_passes_with_medians_from_its_metrics(gs, work):
    summary = gs.summarise(work)
    assert {name: s["status"] for name, s in summary["steps"].items()} == {
        **dict.fromkeys(gs.STEPS, "pass"), "torchtitan_llama1b": "skipped"}
    assert summary["ok"] and summary["counts"] == {"pass": 8, "fail": 0, "skipped": 1}
    bf16 = summary["steps"]["bf16"]
    recs = records(work / "bf16" / "metrics.jsonl")
    expected = statistics.median(r["step_time_s"] for r in recs[gs.WARMUP_STEPS:])
    assert bf16["median_step_time_s"] == pytest.approx(expected)
    config, sets = overrides(args_of(work, "bf16"))
    cfg = load_config(config, sets)
    tokens_per_step = cfg.training.global_batch_size * cfg.data.seq_len
    assert bf16["median_tokens_per_s"] == pytest.approx(tokens_per_step / expected)
    assert bf16["peak_mem_bytes"] == max(r["max_mem_bytes"] for r in recs)
    # No peak FLOP/s for a CPU: no MFU, and the H200 target does not apply.
    assert bf16["mfu"] is None and summary["peak_flops"] is None
    mfu_target = summary["targets"][0]
    assert mfu_target["status"] == "not applicable" and "CPU" in mfu_target["reason"]


def test_mfu_is_palm_flops_times_tokens_over_peak(gs, work):
    summary = gs.summarise(work, peak_override=1e12)
    bf16 = summary["steps"]["bf16"]
    config, sets = overrides(args_of(work, "bf16"))
    m = load_config(config, sets).model
    seq = load_config(config, sets).data.seq_len
    non_embedding = m.num_params - m.vocab_size * m.dim
    flops = 6 * non_embedding + 6 * m.n_layers * m.n_heads * 2 * m.head_size * seq
    assert bf16["mfu"] == pytest.approx(flops * bf16["median_tokens_per_s"] / 1e12)


def test_compile_time_and_gain_are_reported_apart(gs, work):
    summary = gs.summarise(work)
    compiled, eager = summary["steps"]["compile"], summary["steps"]["bf16"]
    assert compiled["config"]["compile"] is True and eager["config"]["compile"] is False
    recs = records(work / "compile" / "metrics.jsonl")
    warm = recs[:gs.WARMUP_STEPS]
    excess = sum(r["step_time_s"] for r in warm) - len(warm) * compiled["median_step_time_s"]
    assert compiled["compile_time_s"] == pytest.approx(excess - eager["warmup_excess_s"])
    assert compiled["compile_time_s"] > 1  # the recorded CPU compile took tens of seconds
    assert compiled["compile_gain"] == pytest.approx(
        compiled["median_tokens_per_s"] / eager["median_tokens_per_s"] - 1)


def _as_h200_gpt1b(work: Path, step_time_s: float | None = None) -> None:
    env = json.loads((work / "env.json").read_text())
    env.update(mode="gpu", gpu_names=["NVIDIA H200"], gpu_count=1)
    (work / "env.json").write_text(json.dumps(env))
    argv = args_of(work, "compile")
    argv[argv.index("--config") + 1] = "gpt-1b"
    (work / "compile" / "run.args").write_text("\n".join(argv) + "\n")
    if step_time_s is not None:
        rewrite_metrics(work / "compile" / "metrics.jsonl", lambda r: r.update(step_time_s=step_time_s))


def _gpt1b_step_time(work: Path, mfu: float) -> float:
    """The compile step's step time at which gpt-1b on its batch runs at `mfu` of an H200."""
    flops = load_config("gpt-1b").model.flops_per_token(2048)
    config, sets = overrides(args_of(work, "compile"))
    tokens_per_step = load_config(config, sets).training.global_batch_size * 2048
    return tokens_per_step * flops / (mfu * 989e12)


def test_mfu_target_not_met_for_slow_gpt1b_steps(gs, work):
    _as_h200_gpt1b(work, step_time_s=_gpt1b_step_time(work, 0.35))
    summary = gs.summarise(work)
    assert summary["peak_flops"] == 989e12
    target = summary["targets"][0]
    assert target["status"] == "not met" and target["value"] == pytest.approx(0.35)
    # The RNG check found no CUDA generator on this (CPU) recording: on a GPU that is a failure.
    assert summary["steps"]["resume"]["status"] == "fail"
    assert "CUDA RNG" in summary["steps"]["resume"]["reason"]


def test_mfu_target_met_when_a_step_takes_what_40_percent_needs(gs, work):
    _as_h200_gpt1b(work, step_time_s=_gpt1b_step_time(work, 0.45))
    target = gs.summarise(work)["targets"][0]
    assert target["status"] == "met" and target["value"] == pytest.approx(0.45)


def test_resumed_losses_that_differ_fail(gs, work):
    path = work / "resume" / "resumed.jsonl"
    lines = path.read_text().splitlines()
    last = json.loads(lines[-2])  # the last step record; the summary line follows it
    last["loss"] *= 1.01
    lines[-2] = json.dumps(last)
    path.write_text("\n".join(lines) + "\n")
    resume = gs.summarise(work)["steps"]["resume"]
    assert resume["status"] == "fail" and "differ" in resume["reason"]
    assert resume["max_rel_diff"] == pytest.approx(0.01, rel=1e-6)
    assert resume["noise_floor_rel"] == 0.0 and not resume["bitwise_equal"]


def test_a_second_run_that_started_over_fails(gs, work):
    path = work / "resume" / "resumed.jsonl"
    runs = path.read_text().splitlines()
    # Keep the first run; replace the second by the uninterrupted run: steps from 1, as if no resume.
    first = runs[:next(i for i, line in enumerate(runs) if '"event"' in line) + 1]
    uninterrupted = (work / "resume" / "uninterrupted.jsonl").read_text().splitlines()
    path.write_text("\n".join(first + uninterrupted) + "\n")
    resume = gs.summarise(work)["steps"]["resume"]
    assert resume["status"] == "fail" and "started at step 1" in resume["reason"]


def test_rng_not_restored_fails(gs, work):
    rng = json.loads((work / "resume" / "rng.json").read_text())
    rng["cpu_restored"] = False
    (work / "resume" / "rng.json").write_text(json.dumps(rng))
    resume = gs.summarise(work)["steps"]["resume"]
    assert resume["status"] == "fail" and "CPU RNG" in resume["reason"]


def test_fp16_counts_skipped_steps_and_passes(gs, work):
    rewrite_metrics(work / "fp16" / "metrics.jsonl", lambda r: r.update(skipped=r["step"] <= 2))
    fp16 = gs.summarise(work)["steps"]["fp16"]
    assert fp16["status"] == "pass" and fp16["skipped_steps"] == 2 and fp16["skipped_at"] == [1, 2]
    assert fp16["losses_finite"] and fp16["losses_falling"]


def test_fp16_nan_loss_on_an_applied_step_fails(gs, work):
    rewrite_metrics(work / "fp16" / "metrics.jsonl",
                    lambda r: r.update(loss=math.nan) if r["step"] == 4 else None)
    fp16 = gs.summarise(work)["steps"]["fp16"]
    assert fp16["status"] == "fail" and "non-finite loss" in fp16["reason"] and not fp16["losses_finite"]


def test_fp16_rising_loss_fails(gs, work):
    rewrite_metrics(work / "fp16" / "metrics.jsonl", lambda r: r.update(loss=1.0 + r["step"]))
    fp16 = gs.summarise(work)["steps"]["fp16"]
    assert fp16["status"] == "fail" and "not falling" in fp16["reason"]


def test_fp16_mostly_skipped_fails(gs, work):
    rewrite_metrics(work / "fp16" / "metrics.jsonl", lambda r: r.update(skipped=r["step"] > 2))
    fp16 = gs.summarise(work)["steps"]["fp16"]
    assert fp16["status"] == "fail" and "skipped (inf/nan gradients)" in fp16["reason"]


def test_a_failed_step_names_its_error_and_the_others_stand(gs, work):
    (work / "bf16" / "run.rc").write_text("2\n")
    (work / "bf16" / "run.log").write_text("model: ...\n"
                                           "error: model.dim: is not divisible (got 7). Fix: ...\n")
    summary = gs.summarise(work)
    assert summary["steps"]["bf16"]["status"] == "fail"
    assert "run: exit 2 (error: model.dim: is not divisible" in summary["steps"]["bf16"]["reason"]
    assert summary["steps"]["fp16"]["status"] == "pass" and not summary["ok"]


def test_timed_out_and_cut_off_metrics(gs, work):
    (work / "bf16" / "run.rc").write_text("124\n")
    step = json.loads((work / "bf16" / "step.json").read_text())
    step.update(rc=124, timed_out=True)
    (work / "bf16" / "step.json").write_text(json.dumps(step))
    path = work / "bf16" / "metrics.jsonl"
    lines = [line for line in path.read_text().splitlines() if '"event"' not in line][:3]
    path.write_text("\n".join(lines) + '\n{"step": 4, "loss": 4.')  # killed mid-line
    bf16 = gs.summarise(work)["steps"]["bf16"]
    assert bf16["status"] == "fail" and "run: timed out" in bf16["reason"]
    assert bf16["steps"] == 3 and "3 of 5 steps recorded" in bf16["reason"]


def test_single_rank_throughput_ratio_is_not_meaningful(gs, work):
    result = json.loads((work / "throughput" / "result.json").read_text())
    result["nproc"] = 1
    (work / "throughput" / "result.json").write_text(json.dumps(result))
    summary = gs.summarise(work)
    thr = summary["steps"]["throughput"]
    assert thr["status"] == "pass" and thr["ratio_meaningful"] is False and "not meaningful" in thr["note"]
    assert summary["targets"][1]["status"] == "not applicable"
    assert "ratio not meaningful" in gs.markdown(summary)


def test_skipped_and_missing_steps(gs, work):
    (work / "collectives" / "step.json").write_text(json.dumps({"step": "collectives",
                                                                 "skipped": "one GPU (1 visible)"}))
    for f in (work / "compile").iterdir():
        f.unlink()
    summary = gs.summarise(work)
    assert summary["steps"]["collectives"] == {"status": "skipped", "reason": "one GPU (1 visible)"}
    assert summary["steps"]["compile"]["status"] == "skipped"
    assert "not run" in summary["steps"]["compile"]["reason"] and summary["ok"]


def test_cli_writes_both_files_and_exit_status(gs, work, tmp_path):
    out = tmp_path / "out"
    assert gs.main(["--work", str(work), "--out", str(out)]) == 0
    saved = json.loads((out / "summary.json").read_text())
    assert saved["steps"]["resume"]["bitwise_equal"] is True
    md = (out / "summary.md").read_text()
    assert "| resume | pass |" in md and "| bf16 | pass |" in md
    (work / "fp16" / "run.rc").write_text("1\n")
    assert gs.main(["--work", str(work), "--out", str(out)]) == 1


def test_cli_bad_inputs(gs, tmp_path, capsys):
    assert gs.main(["--work", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    assert "--work" in capsys.readouterr().err
    assert gs.main(["--work", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "no env.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gs.main(["--work", str(tmp_path), "--out", str(tmp_path), "--peak-flops", "-1"])
    assert e.value.code == 2 and "--peak-flops -1.0 must be a positive" in capsys.readouterr().err


# --- the Llama-3.2-1B steps ------------------------------------------------------------------------

def test_recorded_hf_llama1b_loaded_its_weights_and_has_the_figures_of_its_architecture(gs, work):
    # The model directory is not kept with the logs: the figures come from the config.json kept beside
    # them, read as the architecture the run loaded.
    args = work / "hf_llama1b" / "run.args"
    gone = f"model.hf_dir={work / 'no-such-model'}"
    args.write_text("".join(f"{gone}\n" if a.startswith("model.hf_dir=") else f"{a}\n" for a in args_of(
        work, "hf_llama1b")))
    summary = gs.summarise(work, peak_override=1e12)
    hf = summary["steps"]["hf_llama1b"]
    assert hf["status"] == "pass" and hf["tensors_loaded"] == 20 and hf["model_dir_made"]
    arch = load_config("finetune", [f"model.hf_config={work / 'hf_llama1b' / 'model-config.json'}",
                                    "data.seq_len=64", "data.source=synthetic"]).model
    assert hf["config"]["params"] == arch.num_params == 155968
    recs = records(work / "hf_llama1b" / "metrics.jsonl")
    step_time = statistics.median(r["step_time_s"] for r in recs[gs.WARMUP_STEPS:])
    assert hf["median_tokens_per_s"] == pytest.approx(4 * 64 / step_time)
    assert hf["mfu"] == pytest.approx(arch.flops_per_token(64) * hf["median_tokens_per_s"] / 1e12)
    torchtitan = summary["steps"]["torchtitan_llama1b"]
    assert torchtitan["reason"].startswith("torchtitan is not installed and no wheels are in .whl/torchtitan")
    assert summary["llama1b_ours_over_torchtitan"] is None
    assert summary["targets"][2]["status"] == "not applicable"


def test_hf_llama1b_that_did_not_load_from_the_directory_fails(gs, work):
    log = work / "hf_llama1b" / "run.log"
    log.write_text("\n".join(line for line in log.read_text().splitlines() if "model: loaded" not in line))
    hf = gs.summarise(work)["steps"]["hf_llama1b"]
    assert hf["status"] == "fail" and "did not go through model.hf_dir" in hf["reason"]


def titan_line(step: int, tps: float, loss: float = 8.1, mfu: str = "40.00%") -> str:
    """A log line as torchtitan/components/metrics.py writes it (colour codes included)."""
    return (f"[titan] 2026-12-04 20:46:38,442 - root - INFO - \x1b[31mstep: {step:2}  "
            f"\x1b[32mloss: {loss:8.5f}  \x1b[33mgrad_norm:  0.7267  \x1b[36mmemory: 61.20GiB(43.80%)  "
            f"\x1b[34mtps: {round(tps):,}  \x1b[36mtflops: 123.45  \x1b[35mmfu: {mfu}\x1b[39m")


def titan_ran(work: Path, tps: list[float], **change) -> None:
    """Act out a torchtitan_llama1b run on the recorded hf_llama1b step's shape, batch and sequence."""
    arch = json.loads((work / "hf_llama1b" / "model-config.json").read_text())
    config = {"flavor": "1B", "dim": arch["hidden_size"], "n_layers": arch["num_hidden_layers"],
              "n_heads": arch["num_attention_heads"], "n_kv_heads": arch["num_key_value_heads"],
              "ffn_dim": arch["intermediate_size"], "vocab_size": arch["vocab_size"],
              "tied_embeddings": arch["tie_word_embeddings"], "local_batch_size": 4, "seq_len": 64,
              "steps": len(tps), **change}
    step = work / "torchtitan_llama1b"
    for f in step.iterdir():
        f.unlink()
    (step / "check.json").write_text(json.dumps({"torch_version": "2.13.0", "torchtitan_version": "0.3.0",
                                                 "importable": True, "config": config}))
    (step / "run.log").write_text("\n".join(
        ["Peak FLOPS used for computing MFU: 9.890e+14"] + [titan_line(i + 1, t) for i, t in enumerate(tps)]))
    for name in ("check", "run"):
        (step / f"{name}.rc").write_text("0\n")
    (step / "step.json").write_text(json.dumps({"step": "torchtitan_llama1b", "rc": 0, "seconds": 60,
                                                "limit_s": 300, "timed_out": False, "device": "cuda"}))


def test_torchtitan_log_lines_as_torchtitan_writes_them(gs):
    recs = gs.torchtitan_records(DATA / "torchtitan-cpu.log")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert [r["tokens_per_s"] for r in recs] == [77, 2778, 2893, 2978, 823, 194]
    assert recs[0]["loss"] == 8.05962 and recs[1]["mfu"] == pytest.approx(0.0003)
    assert recs[0]["reserved_gib"] == -0.0


def test_ratio_of_the_trainer_over_torchtitan_when_both_ran(gs, work):
    titan_ran(work, [100.0, 900.0, 1000.0, 2000.0, 2000.0])
    summary = gs.summarise(work, peak_override=1e12)
    titan, ours = summary["steps"]["torchtitan_llama1b"], summary["steps"]["hf_llama1b"]
    assert titan["status"] == "pass" and titan["warmup_steps_excluded"] == 3
    assert titan["median_tokens_per_s"] == pytest.approx(2000.0)
    assert titan["config"]["params"] == ours["config"]["params"]
    assert titan["mfu"] == pytest.approx(titan["config"]["flops_per_token"] * 2000.0 / 1e12)
    assert titan["mfu_torchtitan_reported"] == pytest.approx(0.40) and titan["peak_reserved_gib"] == 61.2
    assert titan["peak_flops_torchtitan"] == 989e12
    compared = summary["llama1b_ours_over_torchtitan"]
    assert compared["same_shape_and_batch"] and compared["differences"] == []
    assert compared["tokens_per_s_ratio"] == pytest.approx(ours["median_tokens_per_s"] / 2000.0)
    # The same FLOPs per token and peak for both: the MFU ratio is the tokens/s ratio.
    assert compared["mfu_ratio"] == pytest.approx(compared["tokens_per_s_ratio"])
    md = gs.markdown(summary)
    assert f"= {compared['tokens_per_s_ratio']:.2f}x, MFU" in md and "torchtitan 0.3.0 on torch 2.13.0" in md
    assert summary["targets"][2]["status"] == "not applicable"
    assert summary["targets"][2]["reason"] == "CPU dry run"


@pytest.mark.parametrize(("titan_tps", "status"), [(0.5, "met"), (2.0, "not met")])
def test_goal_ours_at_least_torchtitan_on_a_gpu(gs, work, titan_tps, status):
    ours = gs.summarise(work)["steps"]["hf_llama1b"]["median_tokens_per_s"]
    titan_ran(work, [ours * titan_tps] * 5)
    env = json.loads((work / "env.json").read_text())
    env.update(mode="gpu", gpu_names=["NVIDIA H200"], gpu_count=1)
    (work / "env.json").write_text(json.dumps(env))
    target = gs.summarise(work)["targets"][2]
    assert target["status"] == status and target["value"] == pytest.approx(1 / titan_tps, rel=1e-3)


def test_different_shapes_are_not_compared(gs, work):
    titan_ran(work, [1000.0] * 5, local_batch_size=8)
    summary = gs.summarise(work)
    compared = summary["llama1b_ours_over_torchtitan"]
    assert not compared["same_shape_and_batch"] and "tokens_per_step 256 vs 512" in compared["differences"]
    assert summary["targets"][2]["status"] == "not applicable"
    assert "not comparable" in gs.markdown(summary)


def test_torchtitan_run_with_missing_or_bad_steps_fails(gs, work):
    titan_ran(work, [1000.0] * 5)
    log = work / "torchtitan_llama1b" / "run.log"
    log.write_text("\n".join([*log.read_text().splitlines()[:-1], titan_line(5, 1000.0, loss=math.nan)]))
    titan = gs.summarise(work)["steps"]["torchtitan_llama1b"]
    assert titan["status"] == "fail" and "non-finite loss at steps [5]" in titan["reason"]
    log.write_text("\n".join(log.read_text().splitlines()[:3]))
    titan = gs.summarise(work)["steps"]["torchtitan_llama1b"]
    assert titan["status"] == "fail" and "2 of 5 steps logged" in titan["reason"]
    log.write_text("Traceback (most recent call last):\nRuntimeError: CUDA out of memory\n")
    (work / "torchtitan_llama1b" / "run.rc").write_text("1\n")
    titan = gs.summarise(work)["steps"]["torchtitan_llama1b"]
    assert titan["status"] == "fail" and "run: exit 1 (RuntimeError: CUDA out of memory)" in titan["reason"]


@pytest.mark.parametrize(("error", "reason"), [
    # What torchtitan 0.3.0 meets on torch 2.11 (torchtitan/distributed/fsdp.py).
    (ImportError("cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'",
                 name="torch.distributed.fsdp"),
     "torchtitan needs a newer torch than 2.11.0: ImportError: cannot import name 'DataParallelMeshDims'"),
    (ModuleNotFoundError("No module named 'torchtitan'", name="torchtitan"), "torchtitan is not installed"),
    (ModuleNotFoundError("No module named 'tyro'", name="tyro"),
     "torchtitan does not import with torch 2.11.0: ModuleNotFoundError: No module named 'tyro' (carry"),
    (AttributeError("module 'torch' has no attribute 'x'"),
     "torchtitan does not import with torch 2.11.0: AttributeError: module 'torch' has no attribute"),
])
def test_why_torchtitan_does_not_import(error, reason):
    spec = importlib.util.spec_from_file_location("titan_check", TITAN_CHECK)
    titan_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(titan_check)  # standard library only until torchtitan is imported
    assert titan_check.import_failure(error, "2.11.0").startswith(reason)


# --- the gpt-oss step ------------------------------------------------------------------------------

def _gpt_oss_model(work: Path):
    """The recorded gpt_oss_layers run's model, read by the trainer from the config.json the step wrote."""
    return load_config("finetune", [f"model.hf_config={work / 'gpt_oss_layers' / 'model-config.json'}",
                                    "data.seq_len=64", "data.source=synthetic"]).model


def test_recorded_gpt_oss_layers_has_mfu_from_the_active_parameters(gs, work):
    # The run wrote its config.json in a step directory that is gone: the one kept beside the logs is read.
    args = work / "gpt_oss_layers" / "run.args"
    args.write_text("".join(f"model.hf_config={work / 'no-such-dir' / 'model-config.json'}\n"
                            if a.startswith("model.hf_config=") else f"{a}\n"
                            for a in args_of(work, "gpt_oss_layers")))
    step = gs.summarise(work, peak_override=1e12)["steps"]["gpt_oss_layers"]
    assert step["status"] == "pass" and step["steps"] == 5
    m = _gpt_oss_model(work)
    assert (m.family, m.n_layers, m.n_experts, m.n_active_experts) == ("gpt_oss", 4, 8, 2)
    assert m.expert_kind == "gpt_oss"
    assert m.attention_sinks and m.sliding_layers == [0, 2] and m.rope_scaling.type == "yarn"
    # Active: 2 of the 8 experts per block (each expert 3 x 64 x 64 weights plus its 2 x 64 + 64 biases).
    expert = 3 * 64 * 64 + 2 * 64 + 64
    assert step["config"]["params"] == m.num_params
    assert step["config"]["params"] - step["config"]["active_params"] == 4 * (8 - 2) * expert
    flops = 6 * (step["config"]["active_params"] - 512 * 64) + 6 * 4 * 4 * (2 * 16) * 64
    assert step["config"]["flops_per_token"] == flops
    recs = records(work / "gpt_oss_layers" / "metrics.jsonl")
    step_time = statistics.median(r["step_time_s"] for r in recs[gs.WARMUP_STEPS:])
    assert step["median_tokens_per_s"] == pytest.approx(4 * 64 / step_time)
    assert step["mfu"] == pytest.approx(flops * step["median_tokens_per_s"] / 1e12)
    assert step["peak_mem_bytes"] == max(r["max_mem_bytes"] for r in recs)
    # On CPU the experts run as a loop: a forward and its recomputation (activation checkpointing) per
    # block and step.
    assert (step["experts_path"], step["grouped_calls"], step["looped_calls"]) == ("loop", 0, 5 * 4 * 2)
    assert step["architecture"]["num_hidden_layers"] == 4 and step["architecture"]["layer_types"] == [
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert step["expert_load_max_over_mean"] == recs[-1]["expert_load_max_over_mean"]
    estimated = json.loads((work / "gpt_oss_layers" / "estimate.log").read_text())
    assert step["estimate_gib"] == estimated["total"] / 2**30
    assert "estimate_over_peak" not in step  # a CPU run's memory is the process's resident size


def _as_h200(work: Path) -> None:
    env = json.loads((work / "env.json").read_text())
    env.update(mode="gpu", gpu_names=["NVIDIA H200"], gpu_count=1)
    (work / "env.json").write_text(json.dumps(env))


def test_gpt_oss_layers_on_a_gpu_must_run_its_experts_by_grouped_gemm(gs, work):
    _as_h200(work)
    paths = work / "gpt_oss_layers" / "moe_paths.json"
    step = gs.summarise(work)["steps"]["gpt_oss_layers"]
    assert step["status"] == "fail"
    assert step["reason"] == ("the experts ran as a loop (40 calls) on CUDA in bf16, where trainer/moe.py "
                              "takes torch._grouped_mm")
    paths.write_text(json.dumps({"grouped_calls": 40, "looped_calls": 0}))
    summary = gs.summarise(work)
    step = summary["steps"]["gpt_oss_layers"]
    assert step["status"] == "pass" and step["experts_path"] == "grouped GEMM"
    tokens_per_s = step["median_tokens_per_s"]
    assert step["mfu"] == pytest.approx(step["config"]["flops_per_token"] * tokens_per_s / 989e12)
    assert step["estimate_over_peak"] == pytest.approx(step["estimate_gib"] / step["peak_mem_gib"])
    assert "experts by grouped GEMM (40 grouped, 0 loop calls)" in gs.markdown(summary)


def test_gpt_oss_layers_without_its_expert_counts_fails(gs, work):
    (work / "gpt_oss_layers" / "moe_paths.json").unlink()
    step = gs.summarise(work)["steps"]["gpt_oss_layers"]
    assert step["status"] == "fail" and "no moe_paths.json" in step["reason"]


def test_estimate_after_a_warning_in_its_log(gs, tmp_path):
    log = tmp_path / "estimate.log"
    log.write_text('UserWarning: something\n{"total": 1073741824, "fits": null}\n')
    assert gs.estimate_of(log) == {"total": 1073741824, "fits": None}
    log.write_text("error: model.hf_config: ...\n")
    assert gs.estimate_of(log) is None
    assert gs.estimate_of(tmp_path / "none.log") is None


# --- grouped GEMM against the per-expert loop (bench/gpu_check/grouped_check.py) -------------------

def test_recorded_grouped_check_passes_forward_only_on_cpu(gs, work):
    recorded = json.loads((work / "gpt_oss_layers" / "grouped_check.json").read_text())
    summary = gs.summarise(work)
    step = summary["steps"]["gpt_oss_layers"]
    assert step["status"] == "pass"
    check = step["grouped_equals_loop"]
    assert (check["passed"], check["device"], check["backward"]) == (True, "cpu", "not on cpu")
    assert check["modules"] == ["GptOssExperts", "SwiGLUExperts"] and check["failures"] == []
    # The worst of every comparison, whole tensors and each expert's part.
    ratios = [c["ratio"] for m in recorded["modules"] for t in m["tensors"]
              for c in [t["whole"], *t["experts"]]]
    assert check["worst_ratio"] == max(ratios) < 1
    assert check["run_lengths"] == recorded["run_lengths"] and 0 in check["run_lengths"]
    assert ("grouped vs loop on cpu: equal (backward not on cpu); worst: GptOssExperts output"
            in gs.markdown(summary))


def _grouped_check_fails(work: Path, device: str) -> dict:
    """The recorded check as if SwiGLUExperts' output were wrong on its first expert with rows: the part,
    the tensor, the module and the verdict failed, the finding recorded, the command's exit status 1."""
    path = work / "gpt_oss_layers" / "grouped_check.json"
    check = json.loads(path.read_text())
    check.update(device=device, backward="checked" if device == "cuda" else "not on cpu", passed=False)
    module = check["modules"][1]
    tensor = module["tensors"][0]
    part = tensor["experts"][0]
    part.update(grouped_rel=0.25, ratio=0.25 / part["allowed"], passed=False)
    tensor["passed"] = module["passed"] = False
    finding = {"module": module["module"], "tensor": tensor["tensor"], "expert": part["expert"],
               **{key: part[key] for key in ("grouped_rel", "looped_rel", "allowed", "ratio")}}
    check.update(worst=finding, failures=[finding])
    path.write_text(json.dumps(check))
    (work / "gpt_oss_layers" / "grouped-check.rc").write_text("1\n")
    return part


def test_grouped_check_that_fails_on_cuda_fails_the_step_naming_the_tensor(gs, work):
    _as_h200(work)
    paths = {"grouped_calls": 40, "looped_calls": 0}
    (work / "gpt_oss_layers" / "moe_paths.json").write_text(json.dumps(paths))
    part = _grouped_check_fails(work, "cuda")
    summary = gs.summarise(work)
    step = summary["steps"]["gpt_oss_layers"]
    assert step["status"] == "fail" and not summary["ok"]
    # The verdict, not the command's exit status 1, is the reason.
    assert step["reason"] == (
        f"grouped GEMM differs from the per-expert loop: SwiGLUExperts output expert {part['expert']}: "
        f"grouped 0.25 vs loop {part['looped_rel']:.3g} (allowed {part['allowed']:.3g}, "
        f"ratio {part['ratio']:.3g})")
    check = step["grouped_equals_loop"]
    assert check["passed"] is False and check["backward"] == "checked" and check["worst_ratio"] > 1
    assert "grouped vs loop on cuda: DIFFERENT (backward checked)" in gs.markdown(summary)


def test_grouped_check_that_fails_on_cpu_is_recorded_without_failing_the_step(gs, work):
    _grouped_check_fails(work, "cpu")
    step = gs.summarise(work)["steps"]["gpt_oss_layers"]
    assert step["status"] == "pass"
    check = step["grouped_equals_loop"]
    assert check["passed"] is False and check["failures"][0].startswith("SwiGLUExperts output expert")
    assert check["note"].startswith("differs on cpu (SwiGLUExperts output expert")
    assert "not failing the step" in check["note"]


def test_grouped_check_missing_unreadable_or_crashed_fails_the_step(gs, work):
    step_dir = work / "gpt_oss_layers"
    (step_dir / "grouped_check.json").write_text(json.dumps({"device": "cuda"}))
    step = gs.summarise(work)["steps"]["gpt_oss_layers"]
    assert step["status"] == "fail"
    assert step["reason"].startswith("grouped_check.json is not bench/gpu_check/grouped_check.py's result: ")
    (step_dir / "grouped_check.json").unlink()
    step = gs.summarise(work)["steps"]["gpt_oss_layers"]
    assert step["status"] == "fail" and "grouped_equals_loop" not in step
    assert step["reason"] == ("no grouped_check.json from bench/gpu_check/grouped_check.py: grouped GEMM was "
                              "not compared with the per-expert loop")
    # Exit status 1 without its verdict file is a failed command like any other.
    (step_dir / "grouped-check.rc").write_text("1\n")
    (step_dir / "grouped-check.log").write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
    step = gs.summarise(work)["steps"]["gpt_oss_layers"]
    assert step["reason"].startswith("grouped-check: exit 1 (RuntimeError: boom); no grouped_check.json")
