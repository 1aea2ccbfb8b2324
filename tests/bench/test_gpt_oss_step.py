"""The gpt_oss_layers step's pieces: the architecture it cuts (bench/gpu_check/gpt_oss_arch.py), the memory
figures docs/gpu-check.md gives for it (the trainer's estimator on the script's own settings), and the
command split of bench/gpu_check/moe_paths.py."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.estimate import GIB, estimate

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "trainer" / "configs" / "hf"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / "gpu_check" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def arch():
    return _module("gpt_oss_arch")


def bundled(name: str) -> dict:
    return json.loads((BUNDLED / f"{name}.json").read_text())


def test_cut_keeps_every_width_and_the_first_blocks_kinds(arch, tmp_path):
    written = tmp_path / "config.json"
    written.write_text(json.dumps(arch.cut(bundled("gpt-oss-120b"), 2)))
    m = load_config("finetune", [f"model.hf_config={written}", "data.source=synthetic"]).model
    assert (m.family, m.n_layers, m.dim) == ("gpt_oss", 2, 2880)
    assert (m.n_heads, m.kv_heads, m.head_size) == (64, 8, 64)
    assert (m.n_experts, m.n_active_experts, m.expert_ffn_dim, m.vocab_size) == (128, 4, 2880, 201088)
    assert m.attention_sinks and m.router_bias and m.expert_kind == "gpt_oss"
    assert m.sliding_window == 128 and m.sliding_layers == [0]  # sliding, then full attention
    assert (m.rope_scaling.type, m.rope_scaling.factor, m.rope_theta) == ("yarn", 32.0, 150000.0)


def test_tiny_shrinks_the_widths_and_keeps_the_rest(arch):
    raw = bundled("gpt-oss-20b")
    tiny = arch.cut(raw, 4, tiny=True)
    assert tiny["hidden_size"] == 64 and tiny["num_local_experts"] == 8 and tiny["num_experts_per_tok"] == 2
    unchanged = set(raw) - set(arch.TINY) - {"num_hidden_layers", "layer_types"}
    assert {k: tiny[k] for k in unchanged} == {k: raw[k] for k in unchanged}
    assert raw["num_hidden_layers"] == 24  # the bundled dict is not changed


@pytest.mark.parametrize(("name", "layers", "message"), [
    ("gpt-oss-20b", 0, "--layers 0 is not 1..24, the blocks of this architecture"),
    ("gpt-oss-120b", 37, "--layers 37 is not 1..36"),
    ("llama3-8b", 2, "model_type is 'llama', not gpt_oss: this step trains gpt-oss"),
])
def test_what_cannot_be_cut_is_refused(arch, name, layers, message):
    with pytest.raises(arch.ArchError, match=message.replace(".", r"\.").replace("(", r"\(")):
        arch.cut(bundled(name), layers)


def test_cli_writes_the_file_or_says_why_not(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "bench/gpu_check/gpt_oss_arch.py", *args], cwd=REPO,
                              capture_output=True, text=True)

    out = tmp_path / "a" / "config.json"
    done = cli("--arch", "gpt-oss-20b", "--layers", "3", "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["layer_types"] == ["sliding_attention", "full_attention",
                                                           "sliding_attention"]
    refused = cli("--arch", "gpt-oss-7b", "--layers", "3", "--output", str(tmp_path / "b.json"))
    assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1
    assert refused.stderr.startswith("error: --arch: is neither a directory, a config.json nor a bundled "
                                     "architecture (got 'gpt-oss-7b'). Fix: use a model directory or one of:")
    assert not (tmp_path / "b.json").exists()


def _step_estimate(arch, tmp_path: Path, name: str, layers: int, batch: int) -> float:
    """The estimate command of the step's GPU plan (bench/gpu_check.sh --plan), on the architecture cut as the
    step cuts it: GiB per rank."""
    environ = {k: v for k, v in os.environ.items() if k != "OUT" and not k.startswith("GPU_CHECK_")}
    environ.update(PYTHON=sys.executable, GPU_CHECK_GPT_OSS_ARCH=name, GPU_CHECK_GPT_OSS_LAYERS=str(layers),
                   GPU_CHECK_GPT_OSS_MICRO_BATCH=str(batch))
    script = REPO / "bench" / "gpu_check.sh"
    plan = subprocess.run([str(script), "--plan", "--only", "gpt_oss_layers", "--out", str(tmp_path)],
                          cwd=REPO, env=environ, capture_output=True, text=True, check=True).stdout
    line = next(line.split() for line in plan.splitlines() if "--estimate" in line)
    assert line[line.index("--world-size") + 1] == "1"
    sets = [line[i + 1] for i, part in enumerate(line) if part == "--set"]
    config = Path(next(s for s in sets if s.startswith("model.hf_config=")).split("=", 1)[1])
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(arch.cut(bundled(name), layers)))
    return estimate(load_config(line[line.index("--estimate") + 1], sets), 1, "h200").total / GIB


def test_the_documented_memory_figures(arch, tmp_path):
    """docs/gpu-check.md, "gpt-oss on one GPU": what fits one H200 (126 GiB usable by the estimator)."""
    assert round(_step_estimate(arch, tmp_path, "gpt-oss-20b", 4, 4), 1) == 96.9  # the default
    assert round(_step_estimate(arch, tmp_path, "gpt-oss-20b", 4, 8), 1) == 100.4
    assert round(_step_estimate(arch, tmp_path, "gpt-oss-120b", 1, 4), 1) == 117.9
    assert round(_step_estimate(arch, tmp_path, "gpt-oss-120b", 2, 1), 1) == 149.5
    assert round(_step_estimate(arch, tmp_path, "gpt-oss-120b", 4, 4), 1) == 261.7


def test_moe_paths_takes_the_trainer_command_after_dash_m_trainer():
    moe_paths = _module("moe_paths")
    assert moe_paths.split(["--output", "x.json", "-m", "trainer", "--config", "finetune", "-m", "y"]) == (
        ["--output", "x.json"], ["--config", "finetune", "-m", "y"])
    for argv in (["--output", "x.json"], ["--output", "x.json", "-m", "torch.distributed.run"],
                 ["--output", "x.json", "-m"]):
        with pytest.raises(SystemExit, match="give the trainer's command after `-m trainer`"):
            moe_paths.split(argv)
