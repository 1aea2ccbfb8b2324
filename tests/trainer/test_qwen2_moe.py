"""Qwen2-MoE: Qwen2's attention and the mixture of experts of trainer/moe.py plus the shared expert, against
transformers' own Qwen2MoeForCausalLM.

The tiny fixture (tests/trainer/hf_fixtures.py, "qwen2-moe"): block 0 dense, block 1 sparse with 8 experts
of 32, top-2 (not renormalised) and a shared expert of 48 behind its sigmoid gate; q/k/v biases. Here:
- the config.json fields read, parameter counts against the built model and transformers', the
  checkpoint's tensor names and shapes (per-expert routed experts, the shared expert and its gate);
  other shared-expert fields, a missing shared width and an unplaced sliding window refused by name;
- the sparse block's output equal to transformers' Qwen2MoeSparseMoeBlock on a fixed input;
- LoRA adapts the shared expert where it adapts a dense feed-forward (PEFT's names), and the estimate
  counts its activations;
- `trainer eval` on 2 ranks with and without expert parallelism (EP 2) and on 4 (EP 2 x FSDP 2), one
  step's gradients with EP 2, and 8 training steps on 2 ranks with EP 2 and the aux loss on, exported
  and reloaded by transformers with a lower loss, and its step-4 checkpoint resumed without EP giving
  the same losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.conftest import assert_ok, torchrun
from tests.trainer.hf_fixtures import (
    QWEN2_MOE,
    assert_export_reloads_and_learned,
    load_reference,
    make_model,
    reference_eval,
)
from tests.trainer.test_gpt_oss import assert_same_losses_resumed_without_expert_parallel
from tests.trainer.test_hf_models import REL_TOL, SEQ_LEN, _eval_args, _json_line, _tensors, _train
from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.hf.adapter import from_hf, to_hf, to_peft
from trainer.hf.config import architecture_from_dict
from trainer.hf.weights import checkpoint_shapes
from trainer.model import FeedForward, build_model
from trainer.moe import MoEFeedForward

SHARED = ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
          "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight")


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory) -> Path:
    return make_model(QWEN2_MOE, tmp_path_factory.mktemp("hf-qwen2-moe") / "qwen2-moe")


def _raw(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _overrides(model_dir: Path, *extra: str) -> list[str]:
    return [f"model.hf_dir={model_dir}", "data.path=x.jsonl", "data.seq_len=64", *extra]


def test_config_fields_counts_and_checkpoint_names(qwen2_moe):
    cfg = load_config("finetune", _overrides(qwen2_moe)).model
    assert (cfg.family, cfg.n_experts, cfg.n_active_experts, cfg.moe_ffn_dim) == ("qwen2_moe", 8, 2, 32)
    assert (cfg.shared_expert_ffn_dim, cfg.ffn_dim, cfg.moe_layers) == (48, 96, [1])
    assert cfg.qkv_bias and not (cfg.o_bias or cfg.qk_norm or cfg.norm_topk_prob or cfg.router_bias)
    assert cfg.router_aux_loss_coef == 0.0 and cfg.sliding_window is None
    # transformers 5's qkv_bias switch, and its rule for the sparse blocks.
    raw = _raw(qwen2_moe)
    assert architecture_from_dict({**raw, "qkv_bias": False}, "x").model_fields["qkv_bias"] is False
    six = {**raw, "num_hidden_layers": 6, "mlp_only_layers": [1], "decoder_sparse_step": 2,
           "layer_types": ["full_attention"] * 6}
    assert architecture_from_dict(six, "x").model_fields["moe_layers"] == [3, 5]

    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params
    assert sum(p.numel() for p in load_reference(qwen2_moe).parameters()) == cfg.num_params
    # Every token uses the shared expert: only 6 of the 8 routed experts are inactive.
    assert cfg.num_params - cfg.active_params == 6 * 3 * 64 * 32
    shapes = checkpoint_shapes(model)
    assert shapes == {name: tuple(p.shape) for name, p in _tensors(qwen2_moe).items()}
    assert shapes["model.layers.1.mlp.experts.7.up_proj.weight"] == (32, 64)
    assert shapes["model.layers.1.mlp.shared_expert.down_proj.weight"] == (64, 48)
    assert shapes["model.layers.1.mlp.shared_expert_gate.weight"] == (1, 64)
    assert {from_hf(n) for n in shapes} == {n for n, _ in model.named_parameters()}
    for name in SHARED:
        assert to_hf(from_hf(f"model.layers.1.{name}"), "qwen2_moe") == f"model.layers.1.{name}"


@pytest.mark.parametrize(("field", "value", "words"), [
    ("n_shared_experts", 2, "shared experts"),
    ("num_shared_experts", 2, "shared experts"),
    ("router_jitter_noise", 0.1, "router noise"),
    ("shared_expert_intermediate_size", 0, "positive integer"),
    ("use_sliding_window", True, "layer_types"),
])
def test_unsupported_fields_are_refused_by_name(qwen2_moe, field, value, words):
    raw = {**_raw(qwen2_moe), field: value}
    if field == "use_sliding_window":
        raw.pop("layer_types", None)
    with pytest.raises(ConfigError) as e:
        architecture_from_dict(raw, "config.json")
    assert f"config.json: {field}" in str(e.value) and words in str(e.value)


def test_sparse_block_equals_transformers(qwen2_moe):
    cfg = load_config("finetune", _overrides(qwen2_moe)).model
    block = load_reference(qwen2_moe).model.layers[1].mlp
    ours = MoEFeedForward(cfg, shared_expert=FeedForward(cfg.dim, cfg.shared_expert_ffn_dim))
    with torch.no_grad():
        ours.router.weight.copy_(block.gate.weight)
        ours.experts.gate_up_proj.copy_(block.experts.gate_up_proj)
        ours.experts.down_proj.copy_(block.experts.down_proj)
        for mine, theirs in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
            getattr(ours.shared_expert, mine).weight.copy_(getattr(block.shared_expert, theirs).weight)
        ours.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
        x = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(0))
        want = block(x)
        assert torch.allclose(ours(x), want, rtol=1e-5, atol=1e-6)
        # The shared expert matters: without it the output is another one.
        ours.shared_expert_gate.weight.fill_(-1e4)  # sigmoid -> 0
        assert (ours(x) - want).abs().max() > 1e-2
    assert ours.stats.tokens_per_expert.min() > 0


def test_lora_adapts_the_shared_expert_and_the_estimate_counts_it(qwen2_moe):
    from trainer.estimate import activation_bytes
    from trainer.lora import apply_lora

    cfg = load_config("finetune", _overrides(qwen2_moe, "parallel.lora.rank=4"))
    model = build_model(cfg.model)
    adapted = apply_lora(model, cfg.parallel.lora, torch.bfloat16)
    attention = [f"layers.{i}.attention.w{x}" for i in (0, 1) for x in "kqvo"]
    dense = [f"layers.0.feed_forward.w{x}" for x in "123"]
    shared = [f"layers.1.feed_forward.shared_expert.w{x}" for x in "123"]
    assert sorted(adapted) == sorted(attention + dense + shared)
    adapters = sum(p.numel() for name, p in model.named_parameters() if name.endswith((".lora_a", ".lora_b")))
    assert adapters == sum(4 * (i + o) for i, o in cfg.model.lora_shapes(cfg.parallel.lora.target_modules))
    assert to_peft("layers.1.feed_forward.shared_expert.w1.lora_a") == (
        "base_model.model.model.layers.1.mlp.shared_expert.gate_proj.lora_A.weight")
    # Feed-forward targets alone are fine here: they adapt the shared expert of every sparse block.
    assert load_config("finetune", _overrides(qwen2_moe, "parallel.lora.rank=4",
                                              "parallel.lora.target_modules=[gate_proj]")).parallel.lora.enabled
    # Its activations: the shared expert's SwiGLU tensors, gate's sigmoid and output, per token of the
    # sparse block.
    m = cfg.model
    without = cfg.model_copy(update={"model": m.model_copy(update={"shared_expert_ffn_dim": 0})})
    extra = activation_bytes(cfg, 1, checkpointing=False) - activation_bytes(without, 1, checkpointing=False)
    assert extra == 64 * 2 * (4 * 48 + 1 + 64)


@pytest.mark.parametrize(("nproc", "expert_parallel"), [(2, 1), (2, 2), (4, 2)])
@pytest.mark.slow
def test_eval_equals_transformers_on_several_ranks(qwen2_moe, docs, nproc, expert_parallel):
    """The routed experts split by EP (on 4 ranks also sharded by FSDP within each half), the shared
    expert and its gate sharded by FSDP over every rank with the rest of the block."""
    path, texts = docs
    want_loss, want_tokens = reference_eval(qwen2_moe, texts, SEQ_LEN)
    got = _json_line(torchrun(nproc, _eval_args(qwen2_moe, path, "--set",
                                                f"parallel.expert_parallel={expert_parallel}")))
    assert got == {"loss": pytest.approx(want_loss, rel=REL_TOL), "tokens": want_tokens}


@pytest.mark.slow
def test_one_step_gradients_equal_transformers_with_expert_parallelism(qwen2_moe, docs, tmp_path):
    path, _ = docs
    out = tmp_path / "grads.json"
    assert_ok(torchrun(2, ["-m", "tests.trainer.hf_worker", "grads", str(qwen2_moe), str(path), str(out),
                           "parallel.expert_parallel=2"], timeout=300))
    worst = json.loads(out.read_text())
    assert len(worst) == len(_tensors(qwen2_moe))
    assert all(f"model.layers.1.{name}" in worst for name in SHARED)
    assert max(worst.values()) < 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.slow
def test_train_with_expert_parallelism_export_reload_and_resume_without_it(qwen2_moe, docs, tmp_path):
    path, texts = docs
    trained = tmp_path / "ep2"
    trained.mkdir()
    # The aux loss on: the resume below (test_gpt_oss.py's helper) trains with it too.
    summary = _train(trained, qwen2_moe, path, 2, "--set", "model.router_aux_loss_coef=0.01", "--set",
                     "parallel.expert_parallel=2", "--set", "checkpoint.interval=4")
    assert summary["final_loss"] < summary["first_loss"]
    # The step-4 checkpoint resumed on the same 2 ranks without expert parallelism: the routed experts go
    # from all of half the experts per rank to half of every expert, the shared expert stays sharded by
    # FSDP, and steps 5-8 give the same losses.
    assert_same_losses_resumed_without_expert_parallel(trained, qwen2_moe, path, tmp_path / "ep1")
    export = trained / "export"
    original, exported = _tensors(qwen2_moe), _tensors(export)
    assert {k: (v.shape, v.dtype) for k, v in exported.items()} == {
        k: (v.shape, v.dtype) for k, v in original.items()}
    for name in ("mlp.gate.weight", *SHARED, *(f"mlp.experts.{e}.down_proj.weight" for e in range(8))):
        assert not torch.equal(exported[f"model.layers.1.{name}"], original[f"model.layers.1.{name}"]), name
    assert assert_export_reloads_and_learned(qwen2_moe, export, texts, SEQ_LEN)["model_type"] == "qwen2_moe"
