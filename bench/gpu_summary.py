"""Summarise a GPU check (bench/gpu_check.sh): read each step's logs, metrics and results, compute the
figures and verdicts, check the targets, and write summary.json and summary.md.

    python bench/gpu_summary.py --work GPU_CHECK_WORK --out DIR [--peak-flops F] [--resume-rtol R]

Input, under --work (what gpu_check.sh writes): env.json (bench/gpu_check/probe.py), setup.json, and one
directory per step holding step.json ({"rc", "seconds", "timed_out"} or {"skipped": reason}), and for
each command NAME.args (its argv, one per line), NAME.log and NAME.rc, plus the trainer's metrics JSONL
and the benchmarks' result JSON. Figures come from the metrics files: medians over the steady steps
(the first WARMUP_STEPS are left out: allocation, lazy initialisation, compilation), MFU by the PaLM
formula (trainer.config's flops_per_token) against the device's dense bf16 peak. torchtitan's figures
come from its log lines (`step: N  loss: ...  tps: ...  mfu: ...%`), its MFU recomputed the same way
for the shape its config resolved to (bench/gpu_check/titan_check.py), so the two trainers' Llama-3.2-1B
figures compare one to one. The gpt-oss step's MFU counts the parameters a token uses (k of n experts),
beside which path the experts ran by (bench/gpu_check/moe_paths.py), the estimator's memory figure and
whether grouped GEMM equals the per-expert loop (bench/gpu_check/grouped_check.py: a failure fails the step
on CUDA only, where its backward is compared too).

Exit status: 0 when no step failed (passed or skipped), 1 when one failed, 2 when --work is unusable.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = ("bf16", "compile", "fp16", "resume", "throughput", "collectives", "hf_llama1b", "torchtitan_llama1b",
         "gpt_oss_layers")
WARMUP_STEPS = 3
MFU_TARGET = 0.40  # gpt-1b, seq 2048, compile, one H200
THROUGHPUT_RATIO_TARGET = 0.9  # FSDP2 / DDP tokens/s (bench/trainer_throughput.py)
RESUME_RTOL = 1e-3  # relative loss difference a resume may show on a GPU (non-deterministic kernels)
LLAMA_RATIO_TARGET = 1.0  # hf_llama1b / torchtitan_llama1b tokens/s: the goal is ours >= torchtitan
# Metric keys, newest name first: the trainer's metrics may be renamed; the first present is used.
KEYS = {"step_time": ("step_time_s",), "tokens": ("tokens_per_s",),
        "mem": ("max_mem_bytes", "peak_mem_bytes"), "loss": ("loss",), "skipped": ("skipped",),
        "mfu": ("mfu",)}


# Commands whose exit status 1 is a verdict they wrote to a file: the step's analyser judges the file.
VERDICT_FILES = {"grouped-check": "grouped_check.json"}


class WorkError(Exception):
    """--work cannot be summarised (missing or not a GPU check's directory)."""


# --- reading -------------------------------------------------------------------------------------

def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_metrics(path: Path) -> list[list[dict]]:
    """The metrics JSONL as runs: each run's step records up to its summary line (a resumed run
    appends to the same file, so the file holds one list per run)."""
    runs: list[list[dict]] = [[]]
    if not path.is_file():
        return []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue  # a line cut off by a killed run
        if obj.get("event") == "summary":
            runs.append([])
        elif "step" in obj:
            runs[-1].append(obj)
    return [run for run in runs if run]


def value(record: dict, kind: str):
    for key in KEYS[kind]:
        if key in record:
            return record[key]
    return None


def read_args(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value after the last `flag` of a command's argv."""
    at = [i for i, a in enumerate(argv[:-1]) if a == flag]
    return argv[at[-1] + 1] if at else None


def error_line(log: Path) -> str | None:
    """The line of a log that best says why it failed."""
    if not log.is_file():
        return None
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for marker in ("error:", "Error", "FAILED", "Traceback"):
        found = [line for line in lines if marker in line and not line.startswith("File ")]
        if found:
            return found[-1][:300]
    return lines[-1][:300] if lines else None


ARCHITECTURE_KEYS = ("model.hf_dir=", "model.hf_config=")


def run_config(argv: list[str], architecture: Path | None = None) -> dict:
    """Model figures of a trainer command (its --config, --set and flags) through the trainer's own
    config: FLOPs per token, tokens per step, sequence length. {} when the trainer cannot load. With
    `architecture` (a config.json), a model.hf_dir or model.hf_config setting is read as that architecture
    instead: the figures need only the shape, and the model directory (or the step directory the run
    wrote its config.json in) may not be where the logs are read."""
    if "-m" not in argv or "trainer" not in argv:
        return {}
    args = argv[argv.index("trainer") + 1:]
    config, overrides, flags = None, [], {}
    for flag, nxt in zip(args, [*args[1:], None], strict=True):
        if flag == "--config":
            config = nxt
        elif flag == "--set" and nxt and architecture and nxt.startswith(ARCHITECTURE_KEYS):
            overrides.append(f"model.hf_config={architecture}")
        elif flag == "--set" and nxt:
            overrides.append(nxt)
        elif flag == "--steps" and nxt:
            flags["training.steps"] = int(nxt)
    if config is None:
        return {}
    sys.path.insert(0, str(REPO))
    try:
        from trainer.config import load_config

        cfg = load_config(config, overrides, flags)
    except Exception as e:
        return {"config": config, "config_error": f"{type(e).__name__}: {e}"}
    return {"config": config, "seq_len": cfg.data.seq_len, "steps": cfg.training.steps,
            "tokens_per_step": cfg.training.global_batch_size * cfg.data.seq_len,
            "flops_per_token": cfg.flops_per_token(), "params": cfg.model.num_params,
            "active_params": cfg.model.active_params,
            "compile": cfg.parallel.compile, "param_dtype": cfg.parallel.param_dtype,
            "peak_flops_override": cfg.metrics.peak_flops}


def step_config(step_dir: Path) -> dict:
    """run_config of a step's `run` command; a run that loaded model.hf_dir or model.hf_config is read
    with the config.json the step kept beside its logs (model-config.json)."""
    architecture = step_dir / "model-config.json"
    return run_config(read_args(step_dir / "run.args"), architecture if architecture.is_file() else None)


def device_peak(env: dict, override: float | None) -> tuple[float | None, str]:
    if override:
        return override, "given"
    if env.get("mode") != "gpu" and not env.get("gpu_names"):
        return None, "no peak for a CPU run: MFU is not computed"
    name = (env.get("gpu_names") or [""])[0]
    # The trainer's table of dense bf16 peaks by device name (the H200's practical matmul peak is
    # about 790 of its 989 TFLOP/s).
    sys.path.insert(0, str(REPO))
    try:
        from trainer.metrics import peak_flops_for_name
    except ImportError as e:  # a refused setup: the trainer's modules may be what is missing
        return None, f"no peak table ({e}): MFU is not computed"
    peak = peak_flops_for_name(name)
    if peak:
        return peak, f"{name} dense bf16"
    return None, f"unknown GPU {name!r}: set GPU_CHECK_PEAK_FLOPS (or --peak-flops) for MFU"


# --- figures -------------------------------------------------------------------------------------

def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def throughput_figures(records: list[dict], cfg: dict, peak: float | None, world: int) -> dict:
    """Median step time and tokens/s over the steady steps, MFU, peak memory, and the warm-up's excess
    over the steady step time (seconds spent on allocation, lazy init and compilation)."""
    warm = min(WARMUP_STEPS, max(0, len(records) - 1))
    steady = records[warm:]
    step_time = median([value(r, "step_time") for r in steady])
    tokens = None
    if step_time and cfg.get("tokens_per_step"):
        tokens = cfg["tokens_per_step"] / step_time
    elif steady:
        tokens = median([value(r, "tokens") for r in steady])
    mfu = None
    if tokens and peak and cfg.get("flops_per_token"):
        mfu = cfg["flops_per_token"] * tokens / world / peak
    elif steady:
        mfu = median([value(r, "mfu") for r in steady])  # the trainer's own, where it knew the peak
    mems = [value(r, "mem") for r in records if value(r, "mem") is not None]
    warm_times = [value(r, "step_time") for r in records[:warm]]
    excess = sum(t - step_time for t in warm_times if t is not None) if step_time is not None else None
    return {"steps": len(records), "warmup_steps_excluded": warm, "median_step_time_s": step_time,
            "median_tokens_per_s": tokens, "mfu": mfu, "peak_mem_bytes": max(mems) if mems else None,
            "peak_mem_gib": max(mems) / 2**30 if mems else None,
            "first_step_time_s": value(records[0], "step_time") if records else None,
            "warmup_excess_s": excess,
            "first_loss": value(records[0], "loss") if records else None,
            "final_loss": value(records[-1], "loss") if records else None}


def finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


# --- steps ---------------------------------------------------------------------------------------

def step_outcome(step_dir: Path) -> dict:
    """pass/fail/skipped from how the step's commands ended; the analysers refine a run's result."""
    info = read_json(step_dir / "step.json")
    if info is None:
        return {"status": "skipped", "reason": "not run (no step.json: the check stopped before it)"}
    if "skipped" in info:
        return {"status": "skipped", "reason": info["skipped"]}
    out = {"status": "pass", "seconds": info.get("seconds"), "limit_s": info.get("limit_s")}
    failed = []
    for rc_file in sorted(step_dir.glob("*.rc")):
        rc, name = rc_file.read_text().strip(), rc_file.stem
        if rc == "1" and name in VERDICT_FILES and (step_dir / VERDICT_FILES[name]).is_file():
            continue
        if rc != "0":
            why = "timed out" if rc in ("124", "137") else f"exit {rc}"
            line = error_line(step_dir / f"{name}.log")
            failed.append(f"{name}: {why}" + (f" ({line})" if line else ""))
    if info.get("timed_out") and not failed:
        failed.append(f"timed out after {info.get('limit_s')}s")
    if failed:
        out.update(status="fail", reason="; ".join(failed))
    return out


def fail(out: dict, why: str) -> None:
    out["status"] = "fail"
    out["reason"] = f"{out['reason']}; {why}" if out.get("reason") else why


def analyse_training(step_dir: Path, out: dict, peak: float | None) -> tuple[dict, list[dict]]:
    cfg = step_config(step_dir)
    runs = read_metrics(step_dir / "metrics.jsonl")
    records = runs[-1] if runs else []
    world = records[-1].get("world_size", 1) if records else 1
    out["config"] = {k: v for k, v in cfg.items() if k != "peak_flops_override"}
    if out["status"] == "skipped":
        return cfg, records
    if not records:
        fail(out, "no metrics records")
        return cfg, records
    out.update(throughput_figures(records, cfg, peak, world))
    if cfg.get("steps") and len(records) != cfg["steps"]:
        fail(out, f"{len(records)} of {cfg['steps']} steps recorded")
    return cfg, records


def analyse_bf16(step_dir: Path, out: dict, peak: float | None, _ctx: dict) -> list[dict]:
    _, records = analyse_training(step_dir, out, peak)
    bad = [r["step"] for r in records if not finite(value(r, "loss"))]
    if bad:
        fail(out, f"non-finite loss at steps {bad[:5]}")
    return records


def analyse_compile(step_dir: Path, out: dict, peak: float | None, ctx: dict) -> None:
    analyse_bf16(step_dir, out, peak, ctx)
    eager = ctx.get("bf16", {})
    if out.get("median_tokens_per_s") and eager.get("median_tokens_per_s"):
        out["compile_gain"] = out["median_tokens_per_s"] / eager["median_tokens_per_s"] - 1
    if out.get("warmup_excess_s") is not None:
        # Compilation happens in the first steps: their excess over the steady step time, less the
        # eager run's (allocation and lazy init both runs pay).
        out["compile_time_s"] = out["warmup_excess_s"] - (eager.get("warmup_excess_s") or 0.0)


def analyse_fp16(step_dir: Path, out: dict, peak: float | None, _ctx: dict) -> None:
    _, records = analyse_training(step_dir, out, peak)
    if not records:
        return
    skipped = [r["step"] for r in records if value(r, "skipped")]
    used = [value(r, "loss") for r in records if not value(r, "skipped")]
    out["skipped_steps"] = len(skipped)
    out["skipped_at"] = skipped
    bad = [r["step"] for r in records if not value(r, "skipped") and not finite(value(r, "loss"))]
    out["losses_finite"] = not bad
    if bad:
        fail(out, f"non-finite loss at applied steps {bad[:5]} (GradScaler should have skipped them)")
    third = max(1, len(used) // 3)
    if len(used) >= 2 and all(finite(v) for v in used):
        head, tail = statistics.fmean(used[:third]), statistics.fmean(used[-third:])
        out["loss_first_third"], out["loss_last_third"] = head, tail
        out["losses_falling"] = tail < head
        if tail >= head:
            fail(out, f"loss not falling: mean {head:.4f} over the first third, {tail:.4f} over the last")
    else:
        out["losses_falling"] = False
        if not bad:
            fail(out, "fewer than 2 applied (not skipped) steps")
    if len(skipped) > len(records) // 2:
        fail(out, f"{len(skipped)} of {len(records)} steps skipped (inf/nan gradients)")


def analyse_resume(step_dir: Path, out: dict, _peak: float | None, ctx: dict) -> None:
    """The resumed run (first half, checkpoint, --resume auto) against the uninterrupted one."""
    base = read_metrics(step_dir / "uninterrupted.jsonl")
    halves = read_metrics(step_dir / "resumed.jsonl")
    rng = read_json(step_dir / "rng.json")
    out["rng"] = rng
    if out["status"] == "skipped":
        return
    if not base or len(halves) < 2:
        fail(out, f"metrics missing: {len(base)} uninterrupted run(s), {len(halves)} of 2 resumed halves")
        return
    reference = {r["step"]: value(r, "loss") for r in base[-1]}
    first, second = halves[0], halves[-1]
    # The checkpoint the second half was told to resume from (--resume .../step_N), else the first
    # half's last step (--resume auto).
    resume_arg = flag_value(read_args(step_dir / "second-half.args"), "--resume") or ""
    chosen = re.search(r"step_(\d+)/?$", resume_arg)
    out["checkpoint_step"] = int(chosen.group(1)) if chosen else first[-1]["step"]
    out["resumed_at_step"] = second[0]["step"]
    if second[0]["step"] != out["checkpoint_step"] + 1:
        fail(out, f"the second run started at step {second[0]['step']}, not after the checkpoint at step "
                  f"{out['checkpoint_step']} (did --resume find it?)")

    def diffs(records: list[dict]) -> tuple[float, float, bool]:
        pairs = [(value(r, "loss"), reference.get(r["step"])) for r in records]
        pairs = [(a, b) for a, b in pairs if b is not None]
        if not pairs or not all(finite(a) and finite(b) for a, b in pairs):
            return math.inf, math.inf, False
        absd = max(abs(a - b) for a, b in pairs)
        rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)
        return absd, rel, all(a == b for a, b in pairs)

    noise_abs, noise_rel, _ = diffs(first)
    resume_abs, resume_rel, bitwise = diffs(second)
    rtol = ctx["resume_rtol"]
    out.update(compared_steps=len(second), max_abs_diff=resume_abs, max_rel_diff=resume_rel,
               bitwise_equal=bitwise, rtol=rtol,
               # The same two runs before the checkpoint: how far identical runs drift on this device.
               noise_floor_abs=noise_abs, noise_floor_rel=noise_rel)
    if not resume_rel <= rtol:
        fail(out, f"resumed losses differ from the uninterrupted run's by up to {resume_rel:.2e} (relative), "
                  f"over the tolerance {rtol:.0e} (identical runs before the checkpoint: {noise_rel:.2e})")
    if rng is None:
        fail(out, "no rng.json: the RNG check did not run")
    else:
        if not rng.get("cpu_restored"):
            fail(out, "the CPU RNG state was not restored by the resume")
        if rng.get("cuda_restored") is False or (ctx["mode"] == "gpu" and rng.get("cuda_restored") is None):
            fail(out, "the CUDA RNG state was not restored by the resume")


def _step_result(step_dir: Path, out: dict, producer: str) -> dict | None:
    """The step's result.json; None (after recording the failure) when a step that ran left none."""
    if out["status"] == "skipped":
        return None
    result = read_json(step_dir / "result.json")
    if result is None:
        fail(out, f"no result.json from {producer}")
    return result


def analyse_throughput(step_dir: Path, out: dict, _peak: float | None, _ctx: dict) -> None:
    result = _step_result(step_dir, out, "bench/trainer_throughput.py")
    if result is None:
        return
    nproc = result.get("nproc", 1)
    out.update(nproc=nproc, config=result.get("config"), runs=result.get("runs"),
               fsdp2_over_ddp=result.get("fsdp2_over_ddp"), ratio_meaningful=nproc >= 2)
    if nproc < 2:
        out["note"] = ("one rank: FSDP2 has nothing to shard and DDP nothing to all-reduce, so the ratio is "
                       "not meaningful; the figures are single-GPU throughput")


def analyse_collectives(step_dir: Path, out: dict, _peak: float | None, _ctx: dict) -> None:
    result = _step_result(step_dir, out, "trainer.collectives")
    if result is None:
        return
    out.update(backend=result.get("backend"), world_size=result.get("world_size"),
               peak_busbw_gbps=result.get("peak_busbw_gbps"),
               by_size=[{"size": r["size"], "time_us": r["time_us"], "busbw_gbps": r["busbw_gbps"]}
                        for r in result.get("results", [])])


def analyse_hf_llama1b(step_dir: Path, out: dict, peak: float | None, ctx: dict) -> None:
    """The bf16 step's figures for the Llama-3.2-1B shape, and proof that the weights came from the Hugging
    Face directory (trainer/hf/weights.py logs every load)."""
    analyse_bf16(step_dir, out, peak, ctx)
    made = step_dir / "make-model.log"
    export = re.search(r"export: wrote (\S+) \(.*?, ([\d.]+) MB\) in ([\d.]+)s",
                       made.read_text(errors="replace")) if made.is_file() else None
    out["model_dir_made"] = made.is_file()  # False: made by an earlier run in the same GPU_CHECK_WORK
    if export:
        out.update(model_dir=export[1], export_mb=float(export[2]), export_s=float(export[3]))
    if out["status"] == "skipped":
        return
    log = step_dir / "run.log"
    loaded = re.search(r"model: loaded (\d+) tensors from (\S+) in ([\d.]+)s",
                       log.read_text(errors="replace")) if log.is_file() else None
    if loaded:
        out.update(tensors_loaded=int(loaded[1]), model_dir=loaded[2], load_s=float(loaded[3]))
    else:
        fail(out, "run.log does not say the weights were loaded ('model: loaded N tensors from DIR'): "
                  "the run did not go through model.hf_dir")


# The gpt-oss shape of gpt_oss_layers' config.json, as the summary reports it.
GPT_OSS_KEYS = ("num_hidden_layers", "layer_types", "hidden_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok",
                "intermediate_size", "vocab_size", "sliding_window")


def estimate_of(log: Path) -> dict | None:
    """The `fsdp-train --estimate ... --json` object in a command's log (a warning may precede it)."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    start = re.search(r"^\{", text, re.MULTILINE)
    try:
        return json.JSONDecoder().raw_decode(text, start.start())[0] if start else None
    except ValueError:
        return None


def analyse_gpt_oss_layers(step_dir: Path, out: dict, peak: float | None, ctx: dict) -> None:
    """The bf16 step's figures for a few blocks of gpt-oss at its real widths (MFU from the parameters a
    token uses: trainer.config's flops_per_token counts k of the n experts), which path the experts ran by
    (bench/gpu_check/moe_paths.py), their load, and the estimator's memory beside the measured peak."""
    records = analyse_bf16(step_dir, out, peak, ctx)
    arch = read_json(step_dir / "model-config.json") or {}
    out["architecture"] = {key: arch.get(key) for key in GPT_OSS_KEYS}
    estimated = estimate_of(step_dir / "estimate.log")
    out["estimate_gib"] = estimated["total"] / 2**30 if estimated else None
    # On CPU the trainer's memory figure is the process's resident size, not what the estimator counts.
    if ctx["mode"] == "gpu" and out["estimate_gib"] and out.get("peak_mem_gib"):
        out["estimate_over_peak"] = out["estimate_gib"] / out["peak_mem_gib"]
    if out["status"] == "skipped":
        return
    if records:
        out["expert_load_max_over_mean"] = records[-1].get("expert_load_max_over_mean")
        out["router_aux_loss"] = records[-1].get("router_aux_loss")
    paths = read_json(step_dir / "moe_paths.json")
    if paths is None:
        fail(out, "no moe_paths.json from bench/gpu_check/moe_paths.py: the experts' path is unknown")
    else:
        grouped, looped = paths.get("grouped_calls", 0), paths.get("looped_calls", 0)
        experts_path = {(True, False): "grouped GEMM", (False, True): "loop", (True, True): "both"}.get(
            (grouped > 0, looped > 0), "none")
        out.update(grouped_calls=grouped, looped_calls=looped, experts_path=experts_path)
        # trainer/moe.py takes torch._grouped_mm for CUDA tensors in bf16: the path this step is to measure.
        if ctx["mode"] == "gpu" and out["config"].get("param_dtype") == "bf16" and looped:
            fail(out, f"the experts ran as a loop ({looped} calls) on CUDA in bf16, where trainer/moe.py "
                      "takes torch._grouped_mm")
    analyse_grouped_check(step_dir, out)


def analyse_grouped_check(step_dir: Path, out: dict) -> None:
    """bench/gpu_check/grouped_check.py's comparison of grouped GEMM with the per-expert loop, as
    `grouped_equals_loop`. A failure fails the step where the check ran on CUDA (forward and backward, the
    path training takes there); on CPU it is recorded only: CPU torch runs grouped GEMM's forward alone, and
    tests/trainer/test_moe.py already compares it there."""
    path = step_dir / "grouped_check.json"
    if not path.is_file():
        fail(out, "no grouped_check.json from bench/gpu_check/grouped_check.py: grouped GEMM was not "
                  "compared with the per-expert loop")
        return
    sys.path.insert(0, str(REPO / "bench" / "gpu_check"))
    from grouped_check import GroupedCheck

    try:
        result = GroupedCheck.read(path)
    except ValueError as e:
        fail(out, "grouped_check.json is not bench/gpu_check/grouped_check.py's result: "
                  f"{str(e).splitlines()[0]}")
        return
    errors = [f"{m.module}: grouped GEMM raised {m.error}" for m in result.modules if m.error]
    failures = errors + [f.describe() for f in result.failures]
    out["grouped_equals_loop"] = {
        "passed": result.passed, "device": result.device, "backward": result.backward,
        "worst_ratio": result.worst.ratio if result.worst else None,
        "worst": result.worst.describe() if result.worst else None, "failures": failures,
        "modules": [m.module for m in result.modules], "run_lengths": result.run_lengths, "rule": result.rule}
    if result.passed:
        return
    shown = "; ".join(failures[:3]) + (f"; and {len(failures) - 3} more" if len(failures) > 3 else "")
    if result.device == "cuda":
        fail(out, f"grouped GEMM differs from the per-expert loop: {shown}")
    else:
        out["grouped_equals_loop"]["note"] = (f"differs on {result.device} ({shown}); recorded, not failing "
                                              "the step: only a CUDA run compares the path training takes")


# torchtitan/components/metrics.py, MetricsProcessor.log: one line per logged step (log_freq 1 here).
# `memory` is the peak reserved memory, `tps` tokens per second per device, `mfu` against torchtitan's
# own peak table (N/A when quantised).
TITAN_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:\s*\S+\s+memory:\s*(-?[\d.]+)GiB.*?"
                        r"tps:\s*([\d,]+)\s+tflops:\s*[\d.,]+\s+mfu:\s*(N/A|-?[\d.]+)%?")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def torchtitan_records(log: Path) -> list[dict]:
    """torchtitan's step lines as records with the trainer's metric names (tokens_per_s, mfu as a
    fraction), plus its peak reserved memory."""
    if not log.is_file():
        return []
    records = []
    for line in log.read_text(errors="replace").splitlines():
        found = TITAN_STEP.search(ANSI.sub("", line))
        if found:
            tps = float(found[4].replace(",", ""))
            records.append({"step": int(found[1]), "loss": float(found[2]), "tokens_per_s": tps,
                            "reserved_gib": float(found[3]),
                            "mfu": None if found[5] == "N/A" else float(found[5]) / 100})
    return records


def titan_figures(config: dict) -> dict:
    """FLOPs per token and parameters of the shape torchtitan resolved, by the trainer's own formula
    (trainer.config, the same PaLM count torchtitan uses: torchtitan/models/utils.py)."""
    sys.path.insert(0, str(REPO))
    from trainer.config import ModelConfig

    seq = config["seq_len"]
    model = ModelConfig(vocab_size=config["vocab_size"], dim=config["dim"], n_layers=config["n_layers"],
                        n_heads=config["n_heads"], n_kv_heads=config["n_kv_heads"], ffn_dim=config["ffn_dim"],
                        tie_embeddings=config["tied_embeddings"], max_seq_len=seq)
    return {"seq_len": seq, "steps": config["steps"], "tokens_per_step": config["local_batch_size"] * seq,
            "flops_per_token": model.flops_per_token(seq), "params": model.num_params}


def analyse_torchtitan_llama1b(step_dir: Path, out: dict, peak: float | None, _ctx: dict) -> None:
    check = read_json(step_dir / "check.json") or {}
    out.update({k: check.get(k) for k in ("torch_version", "torchtitan_version", "datasets")},
               config=check.get("config"))
    if out["status"] == "skipped":
        return
    if not check.get("config"):
        fail(out, "no resolved torchtitan config (check.json from bench/gpu_check/titan_check.py)")
        return
    figures = titan_figures(check["config"])
    out["config"] = {**check["config"], **figures}
    titan = torchtitan_records(step_dir / "run.log")
    if not titan:
        fail(out, "no torchtitan step lines ('step: N  loss: ...  tps: ...') in run.log")
        return
    # Step time from tokens/s, so the medians and the warm-up excess follow the trainer's definitions.
    per_step = figures["tokens_per_step"]
    records = [{**r, "step_time_s": per_step / r["tokens_per_s"] if r["tokens_per_s"] else None}
               for r in titan]
    out.update(throughput_figures(records, figures, peak, 1))
    reported = [r["mfu"] for r in records[out["warmup_steps_excluded"]:]]
    out["mfu_torchtitan_reported"] = median(reported)
    out["peak_reserved_gib"] = max(r["reserved_gib"] for r in records)
    peak_line = re.search(r"Peak FLOPS used for computing MFU: ([\d.e+]+)",
                          (step_dir / "run.log").read_text(errors="replace"))
    out["peak_flops_torchtitan"] = float(peak_line[1]) if peak_line else None
    if len(records) != figures["steps"]:
        fail(out, f"{len(records)} of {figures['steps']} steps logged")
    bad = [r["step"] for r in records if not finite(r["loss"])]
    if bad:
        fail(out, f"non-finite loss at steps {bad[:5]}")


ANALYSERS = {"bf16": analyse_bf16, "compile": analyse_compile, "fp16": analyse_fp16,
             "resume": analyse_resume, "throughput": analyse_throughput, "collectives": analyse_collectives,
             "hf_llama1b": analyse_hf_llama1b, "torchtitan_llama1b": analyse_torchtitan_llama1b,
             "gpt_oss_layers": analyse_gpt_oss_layers}


def compare_llama1b(ours: dict, titan: dict) -> dict | None:
    """The trainer over torchtitan on the Llama-3.2-1B shape, when both ran: tokens/s and MFU (the same
    FLOPs per token and peak for both, so the two ratios agree when the shapes do)."""
    if ours["status"] != "pass" or titan["status"] != "pass":
        return None
    mine, theirs = ours.get("config") or {}, titan.get("config") or {}
    differences = [f"{key} {mine.get(key)} vs {theirs.get(key)}"
                   for key in ("params", "flops_per_token", "seq_len", "tokens_per_step")
                   if mine.get(key) != theirs.get(key)]

    def ratio(key: str) -> float | None:
        a, b = ours.get(key), titan.get(key)
        return a / b if a and b else None

    return {"ours_tokens_per_s": ours.get("median_tokens_per_s"),
            "torchtitan_tokens_per_s": titan.get("median_tokens_per_s"), "tokens_per_s_ratio": ratio(
                "median_tokens_per_s"), "ours_mfu": ours.get("mfu"), "torchtitan_mfu": titan.get("mfu"),
            "mfu_ratio": ratio("mfu"), "torchtitan_mfu_reported": titan.get("mfu_torchtitan_reported"),
            "same_shape_and_batch": not differences, "differences": differences}


# --- targets -------------------------------------------------------------------------------------

def targets(env: dict, steps: dict) -> list[dict]:
    out = []
    compiled = steps["compile"]
    cfg = compiled.get("config") or {}
    gpus = env.get("gpu_names") or []
    mfu_target = {"name": f"MFU >= {MFU_TARGET:.0%} (gpt-1b, seq 2048, compile, one H200)",
                  "target": MFU_TARGET, "value": compiled.get("mfu")}
    if env.get("mode") != "gpu":
        mfu_target.update(status="not applicable", reason="CPU dry run")
    elif not gpus or "H200" not in gpus[0]:
        mfu_target.update(status="not applicable",
                          reason=f"the target is set for an H200, this is {gpus[:1]}")
    elif cfg.get("config") != "gpt-1b" or cfg.get("seq_len") != 2048:
        mfu_target.update(status="not applicable",
                          reason=f"config {cfg.get('config')} seq {cfg.get('seq_len')}")
    elif compiled["status"] != "pass" or compiled.get("mfu") is None:
        mfu_target.update(status="not met",
                          reason=f"the compile step did not give an MFU ({compiled['status']})")
    else:
        met = compiled["mfu"] >= MFU_TARGET
        mfu_target.update(status="met" if met else "not met",
                          reason=f"{compiled['mfu']:.1%} {'>=' if met else '<'} {MFU_TARGET:.0%}")
    out.append(mfu_target)
    thr = steps["throughput"]
    ratio = {"name": f"FSDP2 / DDP tokens/s >= {THROUGHPUT_RATIO_TARGET}x (2+ ranks)",
             "target": THROUGHPUT_RATIO_TARGET, "value": thr.get("fsdp2_over_ddp")}
    if thr["status"] != "pass":
        ratio.update(status="not applicable", reason=f"throughput step {thr['status']}")
    elif not thr.get("ratio_meaningful"):
        ratio.update(status="not applicable", reason="one rank: the ratio is not meaningful")
    else:
        met = (thr.get("fsdp2_over_ddp") or 0) >= THROUGHPUT_RATIO_TARGET
        ratio.update(status="met" if met else "not met", reason=f"{thr.get('fsdp2_over_ddp') or 0:.2f}x")
    out.append(ratio)
    out.append(llama_target(env, steps))
    return out


def llama_target(env: dict, steps: dict) -> dict:
    ours, titan = steps["hf_llama1b"], steps["torchtitan_llama1b"]
    compared = compare_llama1b(ours, titan)
    target = {"name": f"hf_llama1b / torchtitan_llama1b tokens/s >= {LLAMA_RATIO_TARGET}x "
                      "(Llama-3.2-1B shape, same batch and sequence)", "target": LLAMA_RATIO_TARGET,
              "value": compared and compared["tokens_per_s_ratio"]}
    if compared is None:
        target.update(status="not applicable", reason=f"hf_llama1b {ours['status']}, torchtitan_llama1b "
                                                      f"{titan['status']}")
    elif not compared["same_shape_and_batch"]:
        target.update(status="not applicable", reason="different runs: " + "; ".join(compared["differences"]))
    elif env.get("mode") != "gpu":
        target.update(status="not applicable", reason="CPU dry run")
    else:
        value = compared["tokens_per_s_ratio"] or 0
        target.update(status="met" if value >= LLAMA_RATIO_TARGET else "not met", reason=f"{value:.2f}x")
    return target


# --- the summary ---------------------------------------------------------------------------------

def summarise(work: Path, *, peak_override: float | None = None, resume_rtol: float = RESUME_RTOL) -> dict:
    if not work.is_dir():
        raise WorkError(f"--work {work} is not a directory; give the GPU check's step directory "
                        "(GPU_CHECK_WORK, default OUT/steps)")
    env = read_json(work / "env.json")
    if env is None:
        raise WorkError(f"--work {work} has no env.json: not a GPU check's directory (bench/gpu_check.sh "
                        "writes it first)")
    setup = read_json(work / "setup.json") or {}
    steps: dict[str, dict] = {}
    ctx: dict = {"mode": env.get("mode"), "resume_rtol": resume_rtol}
    peak, peak_source = device_peak(env, peak_override)
    for name in STEPS:
        out = step_outcome(work / name)
        step_peak = peak
        args_peak = step_config(work / name).get("peak_flops_override")
        if args_peak and not peak_override:
            step_peak = args_peak
        ANALYSERS[name](work / name, out, step_peak, ctx)
        steps[name] = out
        ctx[name] = out
    counts = {s: sum(1 for o in steps.values() if o["status"] == s) for s in ("pass", "fail", "skipped")}
    return {"env": env, "setup": setup, "peak_flops": peak, "peak_flops_source": peak_source,
            "steps": steps, "targets": targets(env, steps), "counts": counts,
            "llama1b_ours_over_torchtitan": compare_llama1b(steps["hf_llama1b"], steps["torchtitan_llama1b"]),
            "ok": counts["fail"] == 0 and "refused" not in setup}


def _fmt(x, spec: str = ".3g", unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:{spec}}{unit}"


def markdown(summary: dict) -> str:
    env, steps = summary["env"], summary["steps"]
    gpus = env.get("gpu_names") or []
    lines = ["# GPU check summary", "",
             f"- date (UTC): {env.get('date_utc', '-')}, host {env.get('hostname', '-')}, mode "
             f"{env.get('mode', '-')}",
             f"- GPUs: {len(gpus)} x {gpus[0] if gpus else 'none'}; torch {env.get('torch_version')}, CUDA "
             f"{env.get('cuda_version') or 'none'}, Python {env.get('python')}",
             f"- MFU peak: {_fmt(summary['peak_flops'], '.4g')} FLOP/s ({summary['peak_flops_source']})",
             f"- steps: {summary['counts']['pass']} passed, {summary['counts']['fail']} failed, "
             f"{summary['counts']['skipped']} skipped"]
    if summary["setup"].get("refused"):
        lines.append(f"- **setup refused**: {summary['setup']['refused']}")
    lines += ["", "| step | status | figures | reason |", "|---|---|---|---|"]
    for name, o in steps.items():
        figures = []
        if o.get("median_tokens_per_s") is not None:
            figures.append(f"{o['median_tokens_per_s']:,.0f} tok/s, "
                           f"step {_fmt(o['median_step_time_s'], '.3f')} s, MFU {_fmt(o.get('mfu'), '.1%')}, "
                           f"peak mem {_fmt(o.get('peak_mem_gib'), '.2f')} GiB")
        if name == "compile" and o.get("compile_time_s") is not None:
            figures.append(f"compile {o['compile_time_s']:.1f} s, gain {_fmt(o.get('compile_gain'), '+.1%')}")
        if name == "fp16" and "skipped_steps" in o:
            figures.append(f"skipped {o['skipped_steps']}, loss {_fmt(o.get('loss_first_third'), '.4f')} -> "
                           f"{_fmt(o.get('loss_last_third'), '.4f')}")
        if name == "resume" and "max_rel_diff" in o:
            rng = o.get("rng") or {}
            figures.append(f"resumed at step {o.get('resumed_at_step')}, "
                           f"max rel diff {_fmt(o['max_rel_diff'], '.2e')} (bitwise {o['bitwise_equal']}, "
                           f"noise floor {_fmt(o['noise_floor_rel'], '.2e')}), "
                           f"RNG cpu {rng.get('cpu_restored')} cuda {rng.get('cuda_restored')}")
        if name == "throughput" and o.get("runs"):
            figures.append(", ".join(f"{k} {v['tokens_per_s']:,.0f} tok/s" for k, v in o["runs"].items()))
            if o.get("ratio_meaningful"):
                figures.append(f"FSDP2/DDP {_fmt(o.get('fsdp2_over_ddp'), '.2f')}x")
            else:
                figures.append("1 rank: FSDP2/DDP ratio not meaningful")
        if name == "hf_llama1b" and o.get("tensors_loaded"):
            figures.append(f"{o['tensors_loaded']} tensors loaded from the HF directory in "
                           f"{o['load_s']:.1f} s")
        if name == "torchtitan_llama1b" and o.get("torchtitan_version"):
            figures.append(f"torchtitan {o['torchtitan_version']} on torch {o['torch_version']}"
                           + (f", its own MFU {o['mfu_torchtitan_reported']:.1%}"
                              if o.get("mfu_torchtitan_reported") is not None else ""))
        if name == "gpt_oss_layers" and o.get("experts_path"):
            arch, cfg = o["architecture"], o.get("config") or {}
            figures.append(f"{arch['num_hidden_layers']} blocks x {arch['num_local_experts']} experts (top-"
                           f"{arch['num_experts_per_tok']}), {_fmt(cfg.get('active_params'), ',')} of "
                           f"{_fmt(cfg.get('params'), ',')} parameters active; experts by "
                           f"{o['experts_path']} ({o['grouped_calls']} grouped, {o['looped_calls']} loop "
                           f"calls); estimate {_fmt(o.get('estimate_gib'), '.2f')} GiB")
        if name == "gpt_oss_layers" and o.get("grouped_equals_loop"):
            check = o["grouped_equals_loop"]
            verdict = "equal" if check["passed"] else "DIFFERENT"
            figures.append(f"grouped vs loop on {check['device']}: {verdict} (backward {check['backward']}); "
                           f"worst: {check['worst']}")
        if name == "collectives" and o.get("by_size"):
            figures.append(f"{o['backend']} x{o['world_size']}: " + ", ".join(
                f"{r['size']} {r['busbw_gbps']:.1f} GB/s" for r in o["by_size"]))
        reason = (o.get("reason") or "").replace("|", "/")
        if reason.startswith("setup refused"):
            reason = "setup refused (above)"
        lines.append(f"| {name} | {o['status']} | {'; '.join(figures) or '-'} | {reason or '-'} |")
    c = summary.get("llama1b_ours_over_torchtitan")
    if c:
        caveat = "" if c["same_shape_and_batch"] else f" (not comparable: {'; '.join(c['differences'])})"
        lines += ["", "Llama-3.2-1B shape, trainer / torchtitan: tokens/s "
                      f"{_fmt(c['ours_tokens_per_s'], ',.0f')} / "
                      f"{_fmt(c['torchtitan_tokens_per_s'], ',.0f')} "
                      f"= {_fmt(c['tokens_per_s_ratio'], '.2f')}x, MFU {_fmt(c['ours_mfu'], '.1%')} / "
                      f"{_fmt(c['torchtitan_mfu'], '.1%')} = {_fmt(c['mfu_ratio'], '.2f')}x{caveat}"]
    lines += ["", "| target | status | value | why |", "|---|---|---|---|"]
    for t in summary["targets"]:
        lines.append(f"| {t['name']} | {t['status']} | {_fmt(t['value'], '.3g')} | {t.get('reason', '')} |")
    return "\n".join(lines) + "\n"


def json_safe(obj):
    """Non-finite floats as null: JSON has no inf or nan."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--work", type=Path, required=True, help="the step directories (GPU_CHECK_WORK)")
    parser.add_argument("--out", type=Path, required=True, help="where summary.json and summary.md go")
    parser.add_argument("--peak-flops", type=float, help="dense bf16 peak FLOP/s per device for MFU "
                        "(default: by GPU name: H200/H100 989e12, A100 312e12)")
    parser.add_argument("--resume-rtol", type=float, default=RESUME_RTOL,
                        help=f"relative loss difference a resume may show (default {RESUME_RTOL})")
    args = parser.parse_args(argv)
    if args.peak_flops is not None and not args.peak_flops > 0:
        parser.error(f"--peak-flops {args.peak_flops} must be a positive FLOP/s figure, e.g. 989e12")
    if not args.resume_rtol >= 0:
        parser.error(f"--resume-rtol {args.resume_rtol} must be >= 0, e.g. 1e-3")
    try:
        summary = summarise(args.work, peak_override=args.peak_flops, resume_rtol=args.resume_rtol)
    except WorkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(json_safe(summary), indent=1, default=str) + "\n")
    text = markdown(summary)
    (args.out / "summary.md").write_text(text)
    print(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
