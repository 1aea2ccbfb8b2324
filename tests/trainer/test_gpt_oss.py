"""gpt-oss: attention sinks, alternating sliding-window blocks, YaRN, stacked experts with biases and the
clamped SwiGLU, MXFP4 experts in; against transformers' own GptOss code.

The tiny fixture (tests/trainer/hf_fixtures.py, "gpt-oss") has every gpt-oss feature active at the
tests' 64-token sequences: block 0 slides over 8 tokens, block 1 is full, YaRN x4 over an original
context of 16, head_dim 24 (hidden 64 / 4 heads would be 16), sinks ~ N(0, 1), 4 experts of 32, top-2,
a clamp limit of 0.5.
- the config.json fields read, the parameter count against transformers', names both ways;
- YaRN's frequencies and factor equal transformers' (truncated or not); the sink attention equals
  transformers' eager attention, and so does the CUDA path (FlexAttention, run here forward-only);
  the MoE block equals transformers' GptOssMLP; the grouped-GEMM path equals the loop (forward:
  torch has no CPU backward for it);
- `trainer eval` equals transformers' loss on 1 and 2 ranks; one step's gradients (2 ranks);
- MXFP4 experts, quantised here by hand, load to transformers' own dequantisation;
- expert parallelism (parallel.expert_parallel): eval and one step's gradients equal transformers' on
  2 ranks (EP 2) and 4 ranks (EP 2 x FSDP 2, EP 4); 8 training steps on 2 ranks with EP 2, exported
  and reloaded by transformers with a lower loss; its step-4 checkpoint resumed without EP gives the
  same losses;
- LoRA (attention only: the experts stay frozen) with EP 2, its PEFT adapter loaded by peft onto
  transformers' GptOss, the merged export equal to peft's merge.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.trainer.conftest import assert_ok, torchrun
from tests.trainer.hf_fixtures import (
    GPT_OSS,
    assert_export_reloads_and_learned,
    load_reference,
    make_model,
    reference_eval,
)
from tests.trainer.test_hf_models import REL_TOL, SEQ_LEN, _eval_args, _json_line, _single, _tensors, _train
from trainer.config import ModelConfig, RopeScaling, load_config
from trainer.hf.adapter import from_hf, to_hf
from trainer.hf.config import architecture_from_dict
from trainer.model import (
    attention_mask,
    attention_with_sinks,
    build_model,
    flex_attention_with_sinks,
    full_attention_with_sinks,
    yarn_inv_freq,
)
from trainer.moe import MoEFeedForward

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Path:
    return make_model(GPT_OSS, tmp_path_factory.mktemp("hf-gpt-oss") / "gpt-oss")


def _model_config(model_dir: Path) -> ModelConfig:
    return load_config("finetune", [f"model.hf_dir={model_dir}", "data.path=x.jsonl",
                                    f"data.seq_len={SEQ_LEN}"]).model


def test_config_fields_counts_and_names(gpt_oss):
    cfg = _model_config(gpt_oss)
    assert (cfg.family, cfg.n_experts, cfg.n_active_experts, cfg.moe_ffn_dim, cfg.head_size) == (
        "gpt_oss", 4, 2, 32, 24)
    assert cfg.expert_kind == "gpt_oss" and cfg.router_bias and cfg.attention_sinks and cfg.norm_topk_prob
    assert (cfg.sliding_window, cfg.sliding_layers) == (8, [0])
    assert (cfg.swiglu_alpha, cfg.swiglu_limit, cfg.qkv_bias, cfg.o_bias) == (1.702, 0.5, True, True)
    assert cfg.rope_scaling == RopeScaling(type="yarn", factor=4.0, original_max_seq_len=16, truncate=False)
    reference = load_reference(gpt_oss)
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params
    assert sum(p.numel() for p in reference.parameters()) == cfg.num_params
    ours = {to_hf(n, "gpt_oss"): tuple(p.shape) for n, p in model.named_parameters()}
    assert ours == {n: tuple(p.shape) for n, p in reference.named_parameters()}
    assert all(to_hf(from_hf(n), "gpt_oss") == n for n in ours)
    # Each expert: gate_up [64, 64] + bias 64, down [32, 64] + bias 64; 2 of the 4 active.
    assert cfg.num_params - cfg.active_params == 2 * 2 * (64 * 64 + 64 + 32 * 64 + 64)


def test_the_real_configs_read():
    """The bundled gpt-oss-20b/120b config.json files as the Hub ships them (MXFP4 experts)."""
    for name, layers, experts, params in (("gpt-oss-20b", 24, 32, 20.9e9),
                                          ("gpt-oss-120b", 36, 128, 116.8e9)):
        cfg = load_config("finetune", [f"model.hf_config={name}", "data.path=x.jsonl"]).model
        assert (cfg.n_layers, cfg.n_experts, cfg.n_active_experts, cfg.head_size, cfg.dim) == (
            layers, experts, 4, 64, 2880)
        assert cfg.sliding_layers == list(range(0, layers, 2)) and cfg.sliding_window == 128
        assert cfg.rope_scaling.type == "yarn" and cfg.rope_scaling.factor == 32
        assert cfg.num_params == pytest.approx(params, rel=0.01)


@pytest.mark.parametrize(("field", "value"), [
    ("layer_types", ["sliding_attention", "chunked_attention"]),
    ("num_local_experts", None),
])
def test_bad_fields_are_refused_by_name(gpt_oss, field, value):
    from trainer.errors import ConfigError

    raw = {**json.loads((gpt_oss / "config.json").read_text()), field: value}
    with pytest.raises(ConfigError) as e:
        architecture_from_dict(raw, "config.json")
    assert field in str(e.value)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_equals_transformers(truncate):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": truncate, "original_max_position_embeddings": 4096}
    config = GptOssConfig(head_dim=64, rope_parameters=rope, max_position_embeddings=131072)
    theirs, their_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    base = 1.0 / 150000.0 ** (torch.arange(32, dtype=torch.float32) / 32)
    scaling = RopeScaling(type="yarn", factor=32.0, original_max_seq_len=4096, truncate=truncate)
    ours, factor = yarn_inv_freq(base, 150000.0, scaling)
    assert factor == pytest.approx(their_factor)
    assert torch.allclose(ours, theirs, rtol=1e-6)
    # Both ends of the band: the fastest dimensions kept, the slowest divided by the factor.
    assert ours[0] == base[0] and torch.isclose(ours[-1], base[-1] / 32)


def test_sink_attention_equals_transformers_eager():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(0)
    b, heads, kv_heads, seq, d = 2, 4, 2, 20, 8
    q = torch.randn(b, heads, seq, d, generator=gen)
    k, v = (torch.randn(b, kv_heads, seq, d, generator=gen) for _ in range(2))

    class Module(torch.nn.Module):
        num_key_value_groups = heads // kv_heads
        training = False

    module = Module()
    module.sinks = torch.randn(heads, generator=gen)
    for window in (None, 5):
        allowed = attention_mask(seq, "cpu", window=window if window else seq)
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        theirs, _ = eager_attention_forward(module, q, k, v, additive, scaling=d ** -0.5)
        ours = attention_with_sinks(q, k, v, module.sinks, attention_mask(seq, "cpu", window=window))
        assert torch.allclose(ours.transpose(1, 2), theirs, atol=1e-6)
    # The CUDA path (FlexAttention's log-sum-exp) computes the same, run here eagerly without grad (torch
    # has no CPU backward for it): with packed documents and a window, and plain causal.
    documents = torch.tensor([[0] * 12 + [1] * 8, [0] * 20])
    for mask in (attention_mask(seq, "cpu", documents, window=5), None):
        with torch.no_grad():
            flex = flex_attention_with_sinks(q, k, v, module.sinks, mask, compiled=False)
        assert torch.allclose(flex, full_attention_with_sinks(q, k, v, module.sinks, mask), atol=1e-5)
    # The sinks matter: without them the weights would sum to one.
    plain = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert not torch.allclose(plain, attention_with_sinks(q, k, v, module.sinks, None), atol=1e-3)


def _ours_from_theirs(mlp, cfg: ModelConfig) -> MoEFeedForward:
    ours = MoEFeedForward(cfg)
    with torch.no_grad():
        ours.router.weight.copy_(mlp.router.weight)
        ours.router.bias.copy_(mlp.router.bias)
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            getattr(ours.experts, name).copy_(getattr(mlp.experts, name))
    return ours


def test_moe_block_equals_transformers_and_grouped_equals_loop(gpt_oss):
    cfg = _model_config(gpt_oss)
    mlp = load_reference(gpt_oss).model.layers[1].mlp
    ours = _ours_from_theirs(mlp, cfg)
    x = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, _ = mlp(x)
        assert torch.allclose(ours(x), theirs, rtol=1e-5, atol=1e-6)
        counts = ours.stats.tokens_per_expert.long()
        assert counts.min() > 0 and counts.sum() == 3 * 40 * 2
        # The clamp binds: some gate and up values are beyond the 0.5 limit.
        gate_up = x.reshape(-1, 64) @ ours.experts.gate_up_proj[0] + ours.experts.gate_up_proj_bias[0]
        assert (gate_up.abs() > cfg.swiglu_limit).any()
        routed = torch.randn(int(counts.sum()), 64, generator=torch.Generator().manual_seed(1))
        assert torch.allclose(ours.experts.grouped(routed, counts), ours.experts.looped(routed, counts),
                              rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.slow
def test_eval_equals_transformers(gpt_oss, docs, nproc):
    path, texts = docs
    want_loss, want_tokens = reference_eval(gpt_oss, texts, SEQ_LEN)
    args = _eval_args(gpt_oss, path)
    got = _json_line(_single(args) if nproc == 1 else torchrun(2, args))
    assert got == {"loss": pytest.approx(want_loss, rel=REL_TOL), "tokens": want_tokens}


def test_sinks_window_and_yarn_each_change_the_loss(gpt_oss, docs, tmp_path):
    """The fixture exercises each feature: dropping any one moves transformers' loss by at least five
    times the tolerance the eval test uses (sinks ~9x, the window and YaRN more)."""
    _, texts = docs
    want, _ = reference_eval(gpt_oss, texts, SEQ_LEN)
    raw = json.loads((gpt_oss / "config.json").read_text())
    no_yarn = {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}
    for change in ({"sliding_window": 64}, no_yarn):
        changed = tmp_path / next(iter(change))
        shutil.copytree(gpt_oss, changed)
        (changed / "config.json").write_text(json.dumps({**raw, **change}))
        assert abs(reference_eval(changed, texts, SEQ_LEN)[0] - want) > 5 * REL_TOL * want, change
    model = load_reference(gpt_oss)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-math.inf)
    model.save_pretrained(tmp_path / "no-sinks")
    shutil.copy(gpt_oss / "tokenizer.json", tmp_path / "no-sinks")
    shutil.copy(gpt_oss / "tokenizer_config.json", tmp_path / "no-sinks")
    assert abs(reference_eval(tmp_path / "no-sinks", texts, SEQ_LEN)[0] - want) > 5 * REL_TOL * want


@pytest.mark.parametrize(("nproc", "expert_parallel"), [(2, 2), (4, 2)])
@pytest.mark.slow
def test_eval_with_expert_parallelism_equals_transformers(gpt_oss, docs, nproc, expert_parallel):
    path, texts = docs
    want_loss, want_tokens = reference_eval(gpt_oss, texts, SEQ_LEN)
    got = _json_line(torchrun(nproc, _eval_args(gpt_oss, path, "--set",
                                                f"parallel.expert_parallel={expert_parallel}")))
    assert got == {"loss": pytest.approx(want_loss, rel=REL_TOL), "tokens": want_tokens}


@pytest.mark.parametrize(("nproc", "expert_parallel"), [(2, 1), (4, 2), (4, 4)])
@pytest.mark.slow
def test_one_step_gradients_equal_transformers(gpt_oss, docs, tmp_path, nproc, expert_parallel):
    """Without expert parallelism, and with it: 4 ranks as 2 expert groups of 2 (each expert's
    gradient reduced over the 2 ranks that hold it, scaled to the world's average), and as one group
    of 4."""
    path, _ = docs
    out = tmp_path / "grads.json"
    assert_ok(torchrun(nproc, ["-m", "tests.trainer.hf_worker", "grads", str(gpt_oss), str(path), str(out),
                               f"parallel.expert_parallel={expert_parallel}",
                               f"training.global_batch_size={nproc}"], timeout=300))
    worst = json.loads(out.read_text())
    assert len(worst) == len(json.loads((gpt_oss / "model.safetensors.index.json").read_text())["weight_map"])
    assert {n.rsplit(".", 1)[-1] for n in worst} >= {"sinks", "gate_up_proj", "down_proj_bias"}
    assert max(worst.values()) < 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


# -- MXFP4 -----------------------------------------------------------------------------------------


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stacked [experts, in, out] tensor as the Hub stores gpt-oss's experts: [experts, out, in / 32, 16]
    bytes of two 4-bit codes (low nibble first) and [experts, out, in / 32] exponents + 127, each group's
    exponent the smallest that fits its largest magnitude under 6 (FP4's largest value), each value
    rounded to the nearest FP4 value."""
    rows = weight.transpose(1, 2).float()
    experts, out_dim, in_dim = rows.shape
    groups = rows.reshape(experts, out_dim, in_dim // 32, 32)
    biggest = groups.abs().amax(-1).clamp(min=1e-30)
    exponent = torch.ceil(torch.log2(biggest / 6.0)).to(torch.int32)
    scaled = groups / torch.pow(2.0, exponent.float())[..., None]
    table = torch.tensor(FP4_VALUES)
    magnitude_code = (scaled.abs()[..., None] - table).abs().argmin(-1)
    code = magnitude_code + 8 * (scaled < 0)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8)


@pytest.mark.slow
def test_mxfp4_experts_load_as_transformers_dequantises_them(gpt_oss, docs, tmp_path):
    """The trainer reads a checkpoint whose experts are MXFP4 (quantised here by hand) to the same loss
    as transformers on the checkpoint its own dequantiser (integrations.mxfp4) makes of them."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, texts = docs
    quantized, dequantized = tmp_path / "mxfp4", tmp_path / "dequantized"
    for directory in (quantized, dequantized):
        shutil.copytree(gpt_oss, directory)
    index = json.loads((gpt_oss / "model.safetensors.index.json").read_text())
    changed = 0
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(gpt_oss / file)
        plain, packed = dict(tensors), dict(tensors)
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            blocks, scales = quantize_mxfp4(tensors[name])
            del packed[name]
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            dequantized_values = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            plain[name] = dequantized_values.to(tensors[name].dtype)
            assert not torch.equal(plain[name], tensors[name])  # quantisation changed the weights...
            assert torch.allclose(plain[name].float(), tensors[name].float(), atol=0.1)  # ...a little
            changed += 1
        save_file(packed, quantized / file, metadata={"format": "pt"})
        save_file(plain, dequantized / file, metadata={"format": "pt"})
    assert changed == 4
    weight_map = {}
    for name, file in index["weight_map"].items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            weight_map[f"{name}_blocks"] = weight_map[f"{name}_scales"] = file
        else:
            weight_map[name] = file
    (quantized / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))

    want_loss, want_tokens = reference_eval(dequantized, texts, SEQ_LEN)
    # Each rank dequantises its own experts: half of every expert, or all of half the experts (EP 2).
    for extra in ((), ("--set", "parallel.expert_parallel=2")):
        got = _json_line(torchrun(2, _eval_args(quantized, path, *extra)))
        assert got == {"loss": pytest.approx(want_loss, rel=REL_TOL), "tokens": want_tokens}
    # A scale table of the wrong shape is refused before any process group, naming the tensor.
    first = next(f for n, f in weight_map.items() if n.endswith("gate_up_proj_scales"))
    tensors = load_file(quantized / first)
    name = next(n for n in tensors if n.endswith("gate_up_proj_scales"))
    save_file({**tensors, name: tensors[name][:, :-1].contiguous()}, quantized / first,
              metadata={"format": "pt"})
    proc = _single(_eval_args(quantized, path))
    assert proc.returncode != 0 and f"{name.removesuffix('_scales')}_blocks" in proc.stderr


def assert_same_losses_resumed_without_expert_parallel(trained: Path, model: Path, data: Path,
                                                       resumed_dir: Path) -> None:
    """An 8-step run with a checkpoint at step 4, resumed from it on 2 ranks without expert
    parallelism: steps 5-8 give the same losses."""
    reference = _losses(trained / "metrics.jsonl")
    assert sorted(reference) == list(range(1, 9))
    shutil.copytree(trained / "ckpt" / "step_00000004", resumed_dir / "ckpt" / "step_00000004")
    _train(resumed_dir, model, data, 2, "--set", "model.router_aux_loss_coef=0.01")
    resumed = _losses(resumed_dir / "metrics.jsonl")
    assert sorted(resumed) == [5, 6, 7, 8]
    assert resumed == pytest.approx({step: reference[step] for step in resumed}, rel=1e-5)


def _losses(metrics: Path) -> dict[int, float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines() if '"event"' not in line]
    return {record["step"]: record["loss"] for record in records if "loss" in record}


@pytest.mark.slow
def test_train_with_expert_parallelism_export_reload_and_resume_without_it(gpt_oss, docs, tmp_path):
    path, texts = docs
    trained = tmp_path / "ep2"
    trained.mkdir()
    summary = _train(trained, gpt_oss, path, 2, "--set", "model.router_aux_loss_coef=0.01", "--set",
                     "parallel.expert_parallel=2", "--set", "checkpoint.interval=4")
    assert summary["final_loss"] < summary["first_loss"]
    # The step-4 checkpoint of the expert-parallel run, resumed on the same 2 ranks without expert
    # parallelism (each rank now holds half of every expert instead of all of half the experts).
    assert_same_losses_resumed_without_expert_parallel(trained, gpt_oss, path, tmp_path / "ep1")
    export = trained / "export"
    original, exported = _tensors(gpt_oss), _tensors(export)
    assert {k: (v.shape, v.dtype) for k, v in exported.items()} == {
        k: (v.shape, v.dtype) for k, v in original.items()}
    for name in ("model.layers.0.self_attn.sinks", "model.layers.1.mlp.router.bias",
                 "model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj_bias"):
        assert not torch.equal(exported[name], original[name]), name
    config = assert_export_reloads_and_learned(gpt_oss, export, texts, SEQ_LEN)
    assert config["model_type"] == "gpt_oss" and "quantization_config" not in config


@pytest.mark.slow
def test_lora_with_expert_parallelism_exports_a_peft_adapter(gpt_oss, docs, tmp_path):
    path, texts = docs
    _train(tmp_path, gpt_oss, path, 2, "--set", "parallel.lora.rank=4", "--set", "parallel.lora.alpha=8",
           "--set", "optim.lr=5e-3", "--set", "parallel.expert_parallel=2")
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(load_reference(gpt_oss), tmp_path / "export")
    lora_b = {n: p for n, p in peft_model.named_parameters() if "lora_B" in n}
    # The four attention projections of both blocks, every one trained; no expert or router adapter.
    assert len(lora_b) == 2 * 4 and all(p.abs().max() > 0 for p in lora_b.values())
    assert all(".self_attn." in n for n in lora_b)
    merged_by_peft = peft_model.merge_and_unload()
    checkpoint = sorted((tmp_path / "ckpt").glob("step_*"))[-1]
    merged = tmp_path / "merged"
    assert_ok(_single(["-m", "trainer", "export", "--checkpoint", str(checkpoint), "--out", str(merged),
                       "--set", "parallel.lora.export=merged"]))
    ids = torch.tensor([[0, 5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        assert torch.allclose(load_reference(merged)(ids).logits, merged_by_peft(ids).logits, atol=5e-2)
    before, _ = reference_eval(gpt_oss, texts, SEQ_LEN)
    after, _ = reference_eval(merged, texts, SEQ_LEN)
    assert after < before


def test_lora_on_feed_forward_names_only_is_refused(gpt_oss):
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config("finetune", [f"model.hf_dir={gpt_oss}", "data.path=x.jsonl", "parallel.lora.rank=4",
                                 "parallel.lora.target_modules=[gate_proj,up_proj]"])
    assert "parallel.lora.target_modules" in str(e.value) and "q_proj" in str(e.value)
