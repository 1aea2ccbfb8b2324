"""bench/gpu_summary.py on a recorded CPU dry run (tests/bench/data/cpu-dry-run) and on copies of it
changed the way a GPU run can go wrong."""

import json
import math
import statistics
from pathlib import Path

import pytest

from trainer.config import load_config


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
    assert {name: s["status"] for name, s in summary["steps"].items()} == dict.fromkeys(gs.STEPS, "pass")
    assert summary["ok"] and summary["counts"] == {"pass": 6, "fail": 0, "skipped": 0}
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
