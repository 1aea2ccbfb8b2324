"""The presets' parameter counts, computed from the config, match the model actually built (on the
meta device: no memory) and the name on the tin."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.config import SHIPPED_CONFIG_DIR, load_config
from trainer.model import build_model

NOMINAL = {"gpt-1b": 1e9, "gpt-7b": 7e9, "gpt-20b": 20e9, "gpt-120b": 120e9}


@pytest.mark.parametrize("name", sorted(NOMINAL))
def test_preset_parameter_count(name):
    cfg = load_config(name)
    model = build_model(cfg.model)
    built = sum(p.numel() for p in model.parameters())
    assert all(p.device.type == "meta" for p in model.parameters())
    assert built == cfg.model.num_params
    assert abs(built / NOMINAL[name] - 1) < 0.05, f"{name}: {built / 1e9:.2f}B parameters"
    assert model.tok_embeddings.weight.numel() == cfg.model.embedding_params


def test_presets_follow_the_guide_defaults():
    for name in NOMINAL:
        cfg = load_config(name)
        # The largest presets accumulate more so that a micro-batch fits their clusters (test_estimate.py).
        accumulation = 64 if name in ("gpt-20b", "gpt-120b") else 16
        assert (cfg.training.global_batch_size, cfg.training.gradient_accumulation) == (4096, accumulation)
        assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.checkpoint.interval) == (1e-5, 500, 1000)
        assert cfg.parallel.param_dtype == "bf16" and cfg.parallel.reduce_dtype == "fp32"


def test_flops_per_token_matches_palm_formula():
    cfg = load_config("gpt-7b").model
    seq = 2048
    n_dense = cfg.num_params - cfg.vocab_size * cfg.dim
    assert cfg.flops_per_token(seq) == 6 * n_dense + 12 * cfg.n_layers * cfg.n_heads * cfg.head_size * seq


def test_built_model_runs_on_cpu():
    cfg = load_config("tiny").model
    model = build_model(cfg)
    model.to_empty(device="cpu")
    model.init_weights(0, buffer_device="cpu")
    logits = model(torch.randint(cfg.vocab_size, (2, 16)))
    assert logits.shape == (2, 16, cfg.vocab_size) and torch.isfinite(logits).all()


# Published parameter counts of the models whose config.json the presets bundle.
HF_PRESETS = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "qwen3-32b": 32_762_123_264}


@pytest.mark.parametrize("name", sorted(HF_PRESETS))
def test_hf_preset_parameter_count(name):
    cfg = load_config(name)
    model = build_model(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == cfg.model.num_params == HF_PRESETS[name]


# The model card's totals (116.83B and 20.91B, experts included) and active parameters per token
# (5.13B and 3.61B, the input embedding excluded, the output projection counted).
GPT_OSS_PRESETS = {"gpt-oss-120b": (116.83e9, 5.13e9), "gpt-oss-20b": (20.91e9, 3.61e9)}


@pytest.mark.parametrize("name", sorted(GPT_OSS_PRESETS))
def test_gpt_oss_preset_parameter_counts(name):
    cfg = load_config(name)
    model = build_model(cfg.model)
    total, active = GPT_OSS_PRESETS[name]
    assert sum(p.numel() for p in model.parameters()) == cfg.model.num_params
    assert cfg.model.num_params == pytest.approx(total, rel=5e-4)
    assert cfg.model.active_params - cfg.model.embedding_params == pytest.approx(active, rel=5e-3)


def test_qwen15_moe_preset_reads_its_config_json_and_counts_the_shared_expert():
    cfg = load_config("qwen1.5-moe-a2.7b")
    m = cfg.model
    assert (m.family, m.n_layers, m.n_experts, m.n_active_experts) == ("qwen2_moe", 24, 60, 4)
    assert (m.moe_ffn_dim, m.shared_expert_ffn_dim, m.moe_layers) == (1408, 5632, list(range(24)))
    assert m.qkv_bias and not m.norm_topk_prob and m.sliding_window is None
    model = build_model(m)
    assert sum(p.numel() for p in model.parameters()) == m.num_params
    # transformers' own model of the bundled config.json, on the meta device: as many parameters.
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    raw = json.loads((SHIPPED_CONFIG_DIR / "hf" / "qwen1.5-moe-a2.7b.json").read_text())
    with torch.device("meta"):
        theirs = Qwen2MoeForCausalLM(Qwen2MoeConfig(**raw))
    assert sum(p.numel() for p in theirs.parameters()) == m.num_params
    # The model card: 14.3B parameters in total, 2.7B activated (every token's shared expert included).
    assert m.num_params == pytest.approx(14.3e9, rel=5e-3)
    assert m.active_params == pytest.approx(2.7e9, rel=5e-3)


def test_llama32_1b_ties_its_embeddings():
    cfg = load_config("finetune", ["model.hf_config=llama3.2-1b", "data.path=unused.jsonl"])
    model = build_model(cfg.model)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == cfg.model.num_params == 1_235_814_400


def test_lora_preset_trains_the_adapters_only():
    from trainer.lora import apply_lora

    cfg = load_config("llama3-70b-lora")
    model = build_model(cfg.model)
    apply_lora(model, cfg.parallel.lora, torch.bfloat16)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # r x (in + out) for q, k, v, o, gate, up, down in each of 80 layers.
    per_layer = 16 * ((8192 + 8192) * 2 + (8192 + 1024) * 2 + (8192 + 28672) * 3)
    assert trainable == 80 * per_layer
    assert all(p.dtype == torch.bfloat16 for p in model.parameters() if not p.requires_grad)


def test_gpt_oss_lora_preset_adapts_attention_only():
    from trainer.lora import apply_lora

    cfg = load_config("gpt-oss-120b-lora")
    model = build_model(cfg.model)
    apply_lora(model, cfg.parallel.lora, torch.bfloat16)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # r x (in + out) for q (2880 -> 64 x 64), k and v (2880 -> 8 x 64), o (4096 -> 2880), 36 blocks.
    per_layer = 16 * ((2880 + 4096) * 2 + (2880 + 512) * 2)
    assert trainable == 36 * per_layer
