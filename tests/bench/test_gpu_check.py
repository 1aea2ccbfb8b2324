"""bench/gpu_check.sh: its arguments, its refusal on CPU torch, and the whole CPU dry run end to end."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from trainer import moe
from trainer.moe import SwiGLUExperts

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.sh"
STEPS = ["bf16", "compile", "fp16", "resume", "throughput", "collectives", "hf_llama1b", "torchtitan_llama1b",
         "gpt_oss_layers"]


def run(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    # This interpreter has torch and the trainer's modules (the project's venv).
    environ = {k: v for k, v in os.environ.items() if k != "OUT" and not k.startswith("GPU_CHECK_")}
    environ.update({"PYTHON": sys.executable, **env})
    return subprocess.run([str(SCRIPT), *args], cwd=REPO, env=environ, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--only", "bf16,nccl"], {}, "--only: unknown step 'nccl'; the steps are: bf16,compile,fp16"),
    (["--skip", "resume,,fp16"], {}, "--skip 'resume,,fp16' has an empty step name"),
    (["--out"], {}, "--out needs a value"),
    (["--out", "--dry-run"], {}, "--out needs a value"),
    (["--fast"], {}, "unknown option '--fast'"),
    (["--budget", "ten"], {}, "--budget 'ten' must be a whole number of seconds >= 60"),
    ([], {"GPU_CHECK_DEVICE": "tpu"}, "GPU_CHECK_DEVICE='tpu' is not a device; use cuda"),
    (["--dry-run"], {"GPU_CHECK_MICRO_BATCH": "0"}, "GPU_CHECK_MICRO_BATCH='0' must be a positive"),
    (["--dry-run"], {"GPU_CHECK_SET": "optim.fused=true compile"},
     "GPU_CHECK_SET: 'compile' is not KEY=VALUE"),
    (["--dry-run"], {"GPU_CHECK_LLAMA1B_COMPILE": "yes"}, "GPU_CHECK_LLAMA1B_COMPILE='yes' must be 0"),
    (["--plan"], {"GPU_CHECK_GPT_OSS_ARCH": "llama3-8b"},
     "GPU_CHECK_GPT_OSS_ARCH='llama3-8b' is not a bundled gpt-oss architecture; use gpt-oss-20b"),
    (["--plan"], {"GPU_CHECK_GPT_OSS_LAYERS": "0"},
     "GPU_CHECK_GPT_OSS_LAYERS='0' must be a positive whole number"),
    (["--plan"], {"GPU_CHECK_GPT_OSS_MICRO_BATCH": "four"},
     "GPU_CHECK_GPT_OSS_MICRO_BATCH='four' must be a positive whole number"),
])
def test_bad_arguments_are_refused_with_the_fix(args, env, message):
    result = run(*args, **env)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "--help" in result.stderr


def test_out_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    result = run("--dry-run", "--out", str(target))
    assert result.returncode == 2
    assert f"--out {target} exists and is not a directory" in result.stderr
    assert not (tmp_path / "file" / "summary.json").exists() and target.read_text() == "x"


def test_list_and_help():
    listed = run("--list")
    assert listed.returncode == 0
    assert [line.split()[0] for line in listed.stdout.splitlines()] == STEPS
    helped = run("--help")
    assert helped.returncode == 0 and "--dry-run" in helped.stdout and "--fetch-wheels" in helped.stdout


def test_plan_selects_the_compile_step_alone(tmp_path):
    result = run("--plan", "--dry-run", "--only", "compile", "--out", str(tmp_path / "o"))
    assert result.returncode == 0, result.stderr
    compile_lines = [line for line in result.stdout.splitlines() if "-m  trainer" in line.replace("'", "")]
    assert len(compile_lines) == 1
    assert "parallel.compile=true" in compile_lines[0] and "distributed.device=cpu" in compile_lines[0]
    for other in set(STEPS) - {"compile"}:
        assert f"{other}: not selected" in result.stdout
    assert not (tmp_path / "o").exists()  # a plan runs and writes nothing


def test_extra_settings_reach_every_trainer_command(tmp_path):
    result = run("--plan", "--dry-run", "--out", str(tmp_path / "o"), GPU_CHECK_SET="optim.fused=true")
    assert result.returncode == 0, result.stderr
    trainer_lines = [line for line in result.stdout.splitlines() if "-m  trainer " in line]
    # bf16, compile, fp16, the resume step's three runs, hf_llama1b's run and the one-step run that makes
    # its model directory (that one measures nothing and keeps the plain settings), and gpt_oss_layers'
    # estimate and run.
    assert len(trainer_lines) == 10
    measured = [line for line in trainer_lines if "checkpoint.hf_export_dir" not in line]
    assert len(measured) == 9 and all("--set  optim.fused=true" in line for line in measured)


def test_gpu_plan_uses_the_1b_preset_in_bf16():
    result = run("--plan", "--only", "bf16")
    line = next(line for line in result.stdout.splitlines() if "metrics-file" in line)
    for part in ("--config  gpt-1b", "distributed.device=cuda", "parallel.param_dtype=bf16",
                 "parallel.reduce_dtype=fp32", "training.global_batch_size=8", "--steps  50"):
        assert part in line


def test_gpu_plan_runs_both_llama1b_steps_on_the_same_shape_batch_and_sequence():
    result = run("--plan", "--only", "hf_llama1b,torchtitan_llama1b", GPU_CHECK_MICRO_BATCH="16")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    make, ours = (line for line in lines if "-m  trainer " in line)
    check, titan = (line for line in lines if "titan_check.py" in line or "torchtitan.train" in line)
    assert "model.hf_config=llama3.2-1b" in make and "checkpoint.hf_export_dir=" in make
    hf_dir = make.split("checkpoint.hf_export_dir=")[1].split()[0]
    for part in ("--config  finetune", f"model.hf_dir={hf_dir}", "data.source=synthetic", "data.seq_len=2048",
                 "training.global_batch_size=16", "parallel.param_dtype=bf16", "parallel.compile=false",
                 "parallel.activation_checkpointing=false", "--steps  30"):
        assert part in ours
    for line in (check, titan):
        for part in ("--training.steps  30", "--training.local_batch_size  16", "--training.seq_len  2048"):
            assert part in line
        assert "--compile.enable" not in line
    assert "--module  titan_llama1b  --config  llama3_2_1b" in titan and "--nproc-per-node=1" in titan
    compiled = run("--plan", "--only", "hf_llama1b,torchtitan_llama1b", GPU_CHECK_LLAMA1B_COMPILE="1").stdout
    assert "parallel.compile=true" in compiled and compiled.count("--compile.enable") == 2


def _sets(line: str) -> list[str]:
    parts = line.split()
    return [parts[i + 1] for i, part in enumerate(parts) if part == "--set"]


@pytest.mark.parametrize(("env", "arch", "layers", "batch"), [
    ({}, "gpt-oss-20b", "4", "4"),
    ({"GPU_CHECK_GPT_OSS_ARCH": "gpt-oss-120b", "GPU_CHECK_GPT_OSS_LAYERS": "1",
      "GPU_CHECK_GPT_OSS_MICRO_BATCH": "8"}, "gpt-oss-120b", "1", "8"),
])
def test_gpu_plan_trains_gpt_oss_blocks_from_the_config_it_writes(tmp_path, env, arch, layers, batch):
    result = run("--plan", "--only", "gpt_oss_layers", "--out", str(tmp_path / "o"), **env)
    assert result.returncode == 0, result.stderr
    make, estimate, train, compare = result.stdout.splitlines()[-4:]
    config = tmp_path / "o" / "steps" / "gpt_oss_layers" / "model-config.json"
    assert make.split()[1:] == ["bench/gpu_check/gpt_oss_arch.py", "--arch", arch, "--layers", layers,
                                "--output", str(config)]  # the real widths: no --tiny
    assert "-m  trainer  --estimate  finetune" in estimate and "--world-size  1  --json" in estimate
    assert "bench/gpu_check/moe_paths.py  --output" in train and "-m  trainer  --config  finetune" in train
    # The estimate is of exactly the settings the run trains with.
    assert _sets(estimate) == _sets(train)
    for part in (f"model.hf_config={config}", "data.source=synthetic", "data.seq_len=2048",
                 f"training.global_batch_size={batch}", "training.gradient_accumulation=1",
                 "distributed.device=cuda", "parallel.param_dtype=bf16", "parallel.reduce_dtype=fp32"):
        assert part in _sets(train)
    assert "--steps  20" in train
    # Then grouped GEMM against the loop, forward and backward, at the widths of the same config.json.
    assert compare.split()[1:] == ["bench/gpu_check/grouped_check.py", "--config", str(config), "--device",
                                   "cuda", "--output", str(config.parent / "grouped_check.json")]


@pytest.mark.skipif(bool(__import__("torch").version.cuda), reason="needs a CPU build of torch")
def test_gpu_mode_on_cpu_torch_refuses_and_says_why(tmp_path):
    out = tmp_path / "out"
    result = run("--out", str(out), "--wheels", str(tmp_path / "no-wheels"))
    assert result.returncode == 3, result.stderr
    assert "is a CPU build (torch.version.cuda is None)" in result.stderr
    assert "no CUDA torch wheel" in result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert "CPU build" in summary["setup"]["refused"]
    assert {s["status"] for s in summary["steps"].values()} == {"skipped"}
    assert "setup refused" in (out / "summary.md").read_text()
    # Nothing was installed: the refusal comes before any pip call.
    assert not (out / "steps" / "setup.log").exists()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, Path, dict]:
    """The whole check on CPU but the compile step (its CPU compile alone takes ~100 s on 2 cores;
    test_plan_selects_the_compile_step_alone covers its command), run once for the tests below: the out
    directory, the step directories (GPU_CHECK_WORK) and summary.json."""
    root = tmp_path_factory.mktemp("dry-run")
    out, work = root / "out", root / "work"
    # Its own site: the torchtitan it installs from the checkout's .whl must not reach other tests' runs.
    result = run("--dry-run", "--skip", "compile", "--out", str(out), timeout=400,
                 GPU_CHECK_WORK=str(work), GPU_CHECK_SITE=str(root / "site"))
    assert result.returncode == 0, result.stdout + result.stderr
    return out, work, json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_dry_run_runs_every_step_on_cpu(dry_run):
    out, work, summary = dry_run
    status = {name: s["status"] for name, s in summary["steps"].items()}
    assert status == {**dict.fromkeys(STEPS, "pass"), "compile": "skipped", "torchtitan_llama1b": "skipped"}
    assert summary["steps"]["compile"]["reason"] == "not selected (--only/--skip)"
    # torchtitan trains on CUDA only: on CPU it is skipped, saying why (no wheel, or options checked only).
    assert summary["steps"]["torchtitan_llama1b"]["reason"]
    hf = summary["steps"]["hf_llama1b"]
    assert hf["tensors_loaded"] > 0 and hf["median_tokens_per_s"] > 0 and hf["model_dir_made"]
    assert summary["llama1b_ours_over_torchtitan"] is None
    assert summary["steps"]["resume"]["bitwise_equal"] is True  # CPU: resume is bitwise exact
    assert summary["steps"]["resume"]["rng"]["cpu_restored"] is True
    assert summary["steps"]["collectives"]["backend"] == "gloo"
    assert summary["steps"]["bf16"]["median_tokens_per_s"] > 0
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "summary.json", "summary.md"]
    # Checkpoints are removed after the resume step; logs and metrics stay; the model directory stays out
    # of the logs.
    assert not list((work / "resume").glob("ckpt*"))
    assert (work / "bf16" / "metrics.jsonl").is_file()
    with tarfile.open(out / "logs.tar.gz") as logs:
        names = logs.getnames()
    assert "./hf_llama1b/run.log" in names and not [n for n in names if n.startswith("./models")]
    assert "./gpt_oss_layers/model-config.json" in names


@pytest.mark.slow
def test_gpt_oss_layers_dry_run_trains_the_cut_architecture_on_cpu(dry_run):
    """The step's command path on CPU: the bundled gpt-oss-20b architecture cut to 4 blocks at tiny widths,
    its estimate, and 5 steps through bench/gpu_check/moe_paths.py, summarised."""
    _, work, summary = dry_run
    step = summary["steps"]["gpt_oss_layers"]
    assert step["status"] == "pass" and step["steps"] == 5 and step["median_tokens_per_s"] > 0
    assert step["architecture"]["num_hidden_layers"] == 4 and step["architecture"]["num_local_experts"] == 8
    # The loop on CPU: 5 steps x 4 blocks x (forward + its recomputation under activation checkpointing).
    assert (step["experts_path"], step["looped_calls"]) == ("loop", 40)
    # Grouped GEMM against the loop at the tiny widths: the forward only on CPU.
    check = step["grouped_equals_loop"]
    assert (check["passed"], check["device"], check["backward"]) == (True, "cpu", "not on cpu")
    assert step["config"]["active_params"] < step["config"]["params"] and step["estimate_gib"] > 0
    written = json.loads((work / "gpt_oss_layers" / "model-config.json").read_text())
    assert written["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert written["rope_scaling"]["rope_type"] == "yarn" and written["model_type"] == "gpt_oss"


@pytest.mark.slow
def test_gpt_oss_layers_beyond_the_model_fail_the_step_with_the_fix(tmp_path):
    out = tmp_path / "out"
    result = run("--dry-run", "--only", "gpt_oss_layers", "--out", str(out), GPU_CHECK_GPT_OSS_LAYERS="25")
    assert result.returncode == 1, result.stdout + result.stderr
    step = json.loads((out / "summary.json").read_text())["steps"]["gpt_oss_layers"]
    assert step["status"] == "fail"
    assert ("make-config: exit 2 (error: --layers 25 is not 1..24, the blocks of this architecture)"
            in step["reason"])
    assert not (out / "steps" / "gpt_oss_layers" / "run.args").exists()  # nothing trained


@pytest.mark.slow
def test_hf_llama1b_makes_its_model_directory_once(dry_run, tmp_path):
    """The dry run made the model directory in its GPU_CHECK_WORK; a second run there reuses it."""
    _, work, summary = dry_run
    made = summary["steps"]["hf_llama1b"]
    assert made["status"] == "pass" and made["model_dir_made"] and made["export_mb"] > 0
    second = run("--dry-run", "--only", "hf_llama1b", "--out", str(tmp_path / "b"), timeout=120,
                 GPU_CHECK_WORK=str(work))
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"hf_llama1b: reusing {work}/models/tiny-llama3" in second.stderr
    reused = json.loads((tmp_path / "b" / "summary.json").read_text())["steps"]["hf_llama1b"]
    assert reused["status"] == "pass" and not reused["model_dir_made"]
    assert reused["model_dir"] == str(work / "models" / "tiny-llama3") and reused["tensors_loaded"] == 20


def test_torchtitan_wheels_that_do_not_install_skip_the_step_with_the_reason(tmp_path):
    wheels = tmp_path / "wheels"
    (wheels / "torchtitan").mkdir(parents=True)
    (wheels / "torchtitan" / "torchtitan-0.3.0-py3-none-any.whl").write_text("not a wheel")
    out = tmp_path / "out"
    result = run("--dry-run", "--only", "torchtitan_llama1b", "--out", str(out), "--wheels", str(wheels),
                 GPU_CHECK_SITE=str(tmp_path / "site"))
    assert result.returncode == 0, result.stdout + result.stderr
    step = json.loads((out / "summary.json").read_text())["steps"]["torchtitan_llama1b"]
    assert step["status"] == "skipped"
    assert step["reason"].startswith(f"installing the 1 wheel(s) in {wheels}/torchtitan failed")
    log = (out / "steps" / "torchtitan_llama1b" / "install.log").read_text()
    assert "torchtitan-0.3.0-py3-none-any.whl" in log  # pip was given the carried wheel, offline


def test_torchtitan_missing_skips_the_step_and_names_the_fix(tmp_path):
    out = tmp_path / "out"
    result = run("--dry-run", "--only", "torchtitan_llama1b", "--out", str(out), "--wheels", str(tmp_path),
                 GPU_CHECK_SITE=str(tmp_path / "site"))
    assert result.returncode == 0, result.stdout + result.stderr
    step = json.loads((out / "summary.json").read_text())["steps"]["torchtitan_llama1b"]
    assert step["status"] == "skipped"
    assert step["reason"] == (f"torchtitan is not installed and no wheels are in {tmp_path}/torchtitan "
                              "(bench/gpu_check.sh --fetch-wheels DIR puts them in DIR/torchtitan)")
    assert step["torch_version"] and step["torchtitan_version"] is None


def _python_without_pydantic(tmp_path: Path) -> Path:
    """A venv that sees this one's packages (torch, numpy, PyYAML, pip) but not pydantic: what the H200
    machine's Python looks like to the trainer."""
    import sysconfig
    import venv

    venv.create(tmp_path / "venv", with_pip=False)
    farm = tmp_path / "site"
    farm.mkdir()
    hidden = ("pydantic", "annotated_types", "typing_inspection")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(hidden):
            (farm / entry.name).symlink_to(entry)
    purelib = next((tmp_path / "venv" / "lib").glob("python3*")) / "site-packages"
    (purelib / "farm.pth").write_text(f"{farm}\n")
    python = tmp_path / "venv" / "bin" / "python"
    probe = subprocess.run([python, "-c", "import torch, yaml, pip; import pydantic"], capture_output=True,
                           text=True)
    assert "No module named 'pydantic'" in probe.stderr
    return python


@pytest.mark.slow
def test_missing_module_installs_from_wheels_only_and_refuses_when_it_cannot(tmp_path):
    python = _python_without_pydantic(tmp_path)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "pydantic-0.0.0-py3-none-any.whl").write_text("not a wheel")
    site = tmp_path / "gpu-site"
    result = run("--dry-run", "--out", str(tmp_path / "out"), "--wheels", str(wheels), PYTHON=str(python),
                 GPU_CHECK_SITE=str(site))
    assert result.returncode == 3, result.stderr
    assert "missing modules: pydantic; installing 1 wheel(s) from" in result.stderr
    assert "the trainer needs Python modules pydantic and they could not be installed" in result.stderr
    assert "--fetch-wheels" in result.stderr
    log = (tmp_path / "out" / "steps" / "setup.log").read_text()
    assert "pydantic-0.0.0-py3-none-any.whl" in log  # pip was given the carried wheel, offline
    assert not list(site.glob("torch*"))


# What `import trainer.__main__` (what `python -m trainer` runs first) imports from outside the standard
# library in the trainer's own modules, as top-level names; torch's own imports are not counted.
_TRAINER_START_IMPORTS = """
import builtins, json, sys
real_import, seen = builtins.__import__, set()
def spy(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and (globals or {}).get("__name__", "").split(".")[0] == "trainer":
        seen.add(name.split(".")[0])
    return real_import(name, globals, locals, fromlist, level)
builtins.__import__ = spy
import trainer.__main__
import trainer.tracking.tensorboard  # the main rank's, imported as its tracker is made
print(json.dumps(sorted(seen - set(sys.stdlib_module_names) - {"trainer", "torch"})))
"""


def _canonical(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def test_the_carried_wheels_cover_every_module_the_trainer_imports_at_start():
    """The GPU machine has torch, numpy and PyYAML; everything else `python -m trainer` imports at start
    (and its main rank's TensorBoard sink before the first step) must be probed (probe.py's
    TRAINER_MODULES) and come from `--fetch-wheels` (HELPER_WHEELS). The GPU run of 2026-12-05 stopped
    at tensorboardX, which the trainer had begun to import after the lists were made."""
    from importlib.metadata import packages_distributions

    sys.path.insert(0, str(REPO / "bench" / "gpu_check"))
    try:
        from probe import TRAINER_MODULES
    finally:
        sys.path.remove(str(REPO / "bench" / "gpu_check"))
    imported = json.loads(subprocess.run([sys.executable, "-c", _TRAINER_START_IMPORTS], cwd=REPO, check=True,
                                         capture_output=True, text=True).stdout)
    assert {"pydantic", "yaml", "tensorboardX"} <= set(imported)  # the spy sees the trainer's imports
    assert sorted(set(imported) - set(TRAINER_MODULES)) == []
    wheels = re.search(r"^HELPER_WHEELS=\((.*?)\)", SCRIPT.read_text(), re.S | re.M).group(1)
    carried = {_canonical(re.split(r"[<>=!~]", w.strip('"'))[0]) for w in wheels.split()}
    on_the_machine = {"numpy", "pyyaml"}
    providers = packages_distributions()
    missing = {m: providers[m] for m in imported
               if not {_canonical(d) for d in providers[m]} & (carried | on_the_machine)}
    assert missing == {}


# --- bench/gpu_check/grouped_check.py: grouped GEMM against the per-expert loop --------------------

TINY_GPT_OSS = REPO / "tests" / "bench" / "data" / "cpu-dry-run" / "gpt_oss_layers" / "model-config.json"


@pytest.fixture(scope="module")
def grouped_check():
    """The script as a module (registered: its dataclasses are read back through their annotations)."""
    path = SCRIPT.parent / "gpu_check" / "grouped_check.py"
    spec = importlib.util.spec_from_file_location("grouped_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["grouped_check"] = module
    spec.loader.exec_module(module)
    return module


def test_run_lengths_are_the_ones_grouped_gemm_is_never_padded_for(grouped_check):
    lengths = grouped_check.run_lengths(32, 4099, seed=0)
    assert len(lengths) == 32 and sum(lengths) == 4099
    assert lengths[0] == lengths[-1] == 0  # offsets that start and end on a repeat
    assert {1, 7, 24, 33} <= set(lengths[1:-1])
    assert [n for n in lengths if n % 8] and [n for n in lengths if n % 2]
    assert grouped_check.run_lengths(32, 4099, seed=0) == lengths  # seeded
    assert grouped_check.run_lengths(32, 4099, seed=1) != lengths


def _expert_outputs(counts: list[int]):
    """The fp32 reference and the bf16 loop of SwiGLU experts at small widths on CPU."""

    torch.manual_seed(0)
    experts = SwiGLUExperts(32, 48, len(counts))
    torch.nn.init.normal_(experts.gate_up_proj, std=32 ** -0.5)
    torch.nn.init.normal_(experts.down_proj, std=48 ** -0.5)
    rows = torch.randn(sum(counts), 32).bfloat16()
    reference = experts.looped(rows.float(), torch.tensor(counts)).detach()
    looped = experts.bfloat16().looped(rows, torch.tensor(counts)).detach()
    return reference, looped


def test_the_rule_passes_grouped_gemm_within_the_loops_error_and_catches_one_wrong_run(grouped_check):
    counts = [0, 40, 1, 300, 7, 0]
    reference, looped = _expert_outputs(counts)
    same = grouped_check.compare("output", reference, looped, looped.clone(), counts)
    assert same.passed and same.whole.grouped_rel == same.whole.looped_rel > 0
    assert [p.expert for p in same.experts] == [1, 2, 3, 4]  # the parts with rows
    # The 1-row run of expert 2 5% off: 1 of 348 rows, too little to move the whole tensor's error past the
    # rule, caught in the expert's part.
    wrong = looped.clone()
    wrong[40] = 1.05 * wrong[40]
    caught = grouped_check.compare("output", reference, looped, wrong, counts)
    assert caught.whole.passed and not caught.passed
    part = next(p for p in caught.experts if not p.passed)
    assert (part.expert, part.rows) == (2, 1) and part.grouped_rel == pytest.approx(0.05, abs=0.01)
    # A little noise over every row: beyond twice the loop's error plus 1e-3 on the whole tensor.
    noise = torch.randn(looped.shape, generator=torch.Generator().manual_seed(1))
    noisy = looped + 0.02 * looped.abs().mean() * noise
    assert not grouped_check.compare("output", reference, looped, noisy.bfloat16(), counts).whole.passed


def test_the_rule_wants_an_empty_experts_gradient_zero(grouped_check):
    reference = torch.randn(3, 4, 5)
    reference[0] = 0  # expert 0 got no rows: its gradient is exactly zero
    looped = reference.bfloat16()
    garbage = looped.clone()
    garbage[0] = 0.01
    check = grouped_check.compare("grad_down_proj", reference, looped, garbage, [0, 2, 9])
    failed = [p for p in check.experts if not p.passed]
    # Where the reference is zero the error is absolute: the norm of 20 entries of 0.01.
    assert [(p.expert, p.rows) for p in failed] == [(0, 0)]
    assert failed[0].grouped_rel == pytest.approx(0.01 * 20 ** 0.5, rel=1e-2)
    assert grouped_check.compare("grad_down_proj", reference, looped, looped, [0, 2, 9]).passed


def grouped_check_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/gpu_check/grouped_check.py", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cli_on_cpu_compares_the_forward_only_and_writes_every_number(tmp_path):
    out = tmp_path / "grouped_check.json"
    result = grouped_check_cli("--config", str(TINY_GPT_OSS), "--device", "cpu", "--output", str(out),
                               "--rows", "999")
    assert result.returncode == 0, result.stdout + result.stderr
    check = json.loads(out.read_text())
    assert (check["device"], check["backward"], check["passed"]) == ("cpu", "not on cpu", True)
    assert (check["dim"], check["ffn_dim"], check["n_experts"], check["rows"]) == (64, 64, 8, 999)
    assert [m["module"] for m in check["modules"]] == ["GptOssExperts", "SwiGLUExperts"]
    assert [t["tensor"] for m in check["modules"] for t in m["tensors"]] == ["output", "output"]
    parts = check["modules"][0]["tensors"][0]["experts"]
    assert [p["rows"] for p in parts] == [n for n in check["run_lengths"] if n]
    assert result.stdout.splitlines()[-1].startswith("grouped equals loop: passed; worst: ")


def _wrong_backward(grouped_check, monkeypatch):
    """`grouped` as the loop, whose backward adds 0.01 to the gradient of expert 0's weights (which got no
    rows): what an unwritten gradient of an empty run looks like."""

    class Garbage(torch.autograd.Function):
        @staticmethod
        def forward(ctx, weight):
            return weight.view_as(weight)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            grad[0] += 0.01
            return grad

    class GarbageRuns(moe.ExpertRuns):
        def matmul(self, rows, weight, bias=None):
            return super().matmul(rows, Garbage.apply(weight), bias)

    monkeypatch.setattr(moe.StackedExperts, "grouped",
                        lambda self, routed, counts: self.compute(routed, GarbageRuns(counts, grouped=False)))


def test_backward_comparison_on_cpu_with_the_loop_standing_in_for_grouped_gemm(grouped_check, monkeypatch):
    """CPU torch has no grouped GEMM backward: with the loop in its place the backward comparison runs here,
    passes for the loop itself and fails a gradient an empty run left wrong."""
    widths = grouped_check.Widths.of(TINY_GPT_OSS)
    counts = grouped_check.run_lengths(widths.n_experts, 500, seed=0)

    def run():
        return grouped_check.check_module("GptOssExperts", widths, torch.device("cpu"), counts, seed=0,
                                          backward=True)

    monkeypatch.setattr(moe.StackedExperts, "grouped", moe.StackedExperts.looped)
    check, _ = run()
    assert check.passed and [t.tensor for t in check.tensors] == [
        "output", "grad_input", "grad_gate_up_proj", "grad_gate_up_proj_bias", "grad_down_proj",
        "grad_down_proj_bias"]
    _wrong_backward(grouped_check, monkeypatch)
    check, found = run()
    assert not check.passed
    failed = [(f.tensor, f.expert) for f in found if not f.ratio <= 1]
    assert failed == [("grad_gate_up_proj", 0), ("grad_down_proj", 0)]


def test_a_wrong_grouped_gemm_fails_the_check_and_the_exit_status(grouped_check, monkeypatch, tmp_path):
    """Grouped GEMM computing each run with the next expert's weights, through the script's main()."""
    monkeypatch.setattr(moe.StackedExperts, "grouped",
                        lambda self, routed, counts: self.looped(routed, counts.roll(1)))
    out = tmp_path / "grouped_check.json"
    assert grouped_check.main(["--config", str(TINY_GPT_OSS), "--device", "cpu", "--output", str(out)]) == 1
    check = grouped_check.GroupedCheck.read(out)
    assert not check.passed and check.failures and check.worst.ratio > 1
    assert {f.module for f in check.failures} == {"GptOssExperts", "SwiGLUExperts"}


@pytest.mark.parametrize(("args", "message"), [
    (["--device", "tpu"], "error: argument --device: invalid choice: 'tpu'"),
    (["--rows", "10"], "error: --rows 10 is too few: give at least 67"),
    (["--config", "trainer/configs/hf/llama3-8b.json"],
     "error: --config trainer/configs/hf/llama3-8b.json: num_local_experts is 0, the check needs at least 8"),
    (["--config", "no-such.json"], "error: --config: is neither a directory, a config.json nor a bundled"),
])
def test_grouped_check_bad_arguments_are_one_line_naming_the_flag(tmp_path, args, message):
    argv = {"--config": str(TINY_GPT_OSS), "--device": "cpu", "--output": str(tmp_path / "g.json")}
    argv.update(zip(args[::2], args[1::2], strict=True))
    result = grouped_check_cli(*[x for flag_value in argv.items() for x in flag_value])
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(message) and "--help" in result.stderr
    assert not (tmp_path / "g.json").exists()
