"""Qwen3-MoE and Mixtral (trainer/moe.py): the mixture-of-experts block against transformers' own code.

The tiny fixtures (tests/trainer/hf_fixtures.py): "qwen3-moe" has block 0 dense and block 1 sparse
(8 experts of 32, top-2, norm_topk_prob); "mixtral" both blocks sparse (4 experts of 32, top-2) and a
16-token window. The generic family tests (test_hf_models.py) cover Qwen3-MoE's eval on one rank; here:
- the config.json fields read (sparse blocks, aux coefficient), refusals by name, parameter counts
  against the built model and transformers'; the stacked experts' per-expert checkpoint tensors,
  names and shapes, against the files transformers wrote;
- the router's logits, top-k choice and weights, and the block's output, equal transformers' on a
  fixed input (the grouped-GEMM path's forward equal to the loop's); the aux loss equals
  transformers' load_balancing_loss_func, gradient included;
- `trainer eval` on 2 ranks with and without expert parallelism (EP 2) and on 4 (EP 2 x FSDP 2), one
  step's gradients (2 ranks, EP 1 and 2), 8 training steps on 2 ranks with EP 2 and the aux loss on,
  exported and reloaded by transformers, and its step-4 checkpoint resumed without EP giving the same
  losses;
- Mixtral: eval with EP 2 on 2 ranks, and 8 steps with EP 2 exported and reloaded by transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.conftest import assert_ok, torchrun
from tests.trainer.hf_fixtures import (
    MIXTRAL,
    assert_export_reloads_and_learned,
    load_reference,
    make_model,
    reference_eval,
)
from tests.trainer.test_gpt_oss import assert_same_losses_resumed_without_expert_parallel
from tests.trainer.test_hf_models import REL_TOL, SEQ_LEN, _eval_args, _json_line, _tensors, _train
from trainer.config import ModelConfig, load_config
from trainer.errors import ConfigError
from trainer.hf.adapter import checkpoint_tensors, from_hf
from trainer.hf.config import architecture_from_dict
from trainer.hf.weights import checkpoint_shapes
from trainer.model import build_model
from trainer.moe import MoEFeedForward, RouterStats, route, router_aux_loss


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return make_model("qwen3-moe", tmp_path_factory.mktemp("hf-moe") / "qwen3-moe")


def _raw(moe: Path) -> dict:
    return json.loads((moe / "config.json").read_text())


def test_config_fields_and_counts(moe):
    cfg = load_config("finetune", [f"model.hf_dir={moe}", "data.path=x.jsonl", "data.seq_len=64"]).model
    assert (cfg.family, cfg.n_experts, cfg.n_active_experts, cfg.moe_ffn_dim) == ("qwen3_moe", 8, 2, 32)
    assert cfg.norm_topk_prob and cfg.qk_norm and cfg.moe_layers == [1]
    # output_router_logits is false: transformers adds no aux loss, nor does the trainer by default...
    assert cfg.router_aux_loss_coef == 0.0
    # ...but it may be set beside model.hf_dir, and config.json's coefficient counts when transformers' would.
    on = load_config("finetune", [f"model.hf_dir={moe}", "data.path=x.jsonl", "data.seq_len=64",
                                  "model.router_aux_loss_coef=0.01"])
    assert on.model.router_aux_loss_coef == 0.01
    raw = {**_raw(moe), "output_router_logits": True}
    assert architecture_from_dict(raw, "x").model_fields["router_aux_loss_coef"] == 0.01
    # transformers' rule for which blocks are sparse.
    raw = {**_raw(moe), "num_hidden_layers": 6, "mlp_only_layers": [1], "decoder_sparse_step": 2}
    assert architecture_from_dict(raw, "x").model_fields["moe_layers"] == [3, 5]

    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params
    reference = load_reference(moe)
    assert sum(p.numel() for p in reference.parameters()) == cfg.num_params
    experts = 8 * 3 * 64 * 32
    assert cfg.num_params - cfg.active_params == experts - 2 * 3 * 64 * 32
    # FLOPs count the active parameters: 2 of the 8 experts.
    attention = 6 * 2 * 4 * (2 * 24) * 64
    assert cfg.flops_per_token(64) == 6 * (cfg.active_params - cfg.embedding_params) + attention
    # The stacked experts are the checkpoint's per-expert tensors, shapes included.
    shapes = checkpoint_shapes(model)
    assert shapes == {name: tuple(p.shape) for name, p in _tensors(moe).items()}
    assert shapes["model.layers.1.mlp.experts.7.gate_proj.weight"] == (32, 64)
    assert {from_hf(n) for n in shapes} == {n for n, _ in model.named_parameters()}
    assert all(n in {t.name for t in checkpoint_tensors(from_hf(n), "qwen3_moe", 8)} for n in shapes)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("shared_expert_intermediate_size", 64, "shared expert"),
    ("router_jitter_noise", 0.1, "router noise"),
    ("n_shared_experts", 2, "shared experts"),
])
def test_unsupported_moe_fields_are_refused_by_name(moe, field, value, words):
    with pytest.raises(ConfigError) as e:
        architecture_from_dict({**_raw(moe), field: value}, "config.json")
    assert field in str(e.value) and words in str(e.value)


def test_lora_on_moe_adapts_attention_and_dense_blocks_only(moe):
    from trainer.lora import apply_lora

    cfg = load_config("finetune", [f"model.hf_dir={moe}", "data.path=x.jsonl", "data.seq_len=64",
                                   "parallel.lora.rank=4"])
    model = build_model(cfg.model)
    adapted = apply_lora(model, cfg.parallel.lora, torch.bfloat16)
    attention = [f"layers.{i}.attention.w{x}" for i in (0, 1) for x in "kqvo"]
    dense = [f"layers.0.feed_forward.w{x}" for x in "123"]  # block 0 is dense (mlp_only_layers)
    assert sorted(adapted) == sorted(attention + dense)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{m}.lora_{x}" for m in adapted for x in "ab"}


def _ours_from_theirs(block, norm_topk_prob: bool) -> MoEFeedForward:
    """Our MoE block with the weights of transformers' Qwen3MoeSparseMoeBlock or MixtralSparseMoeBlock
    (transformers 5 stacks the experts in memory as we do)."""
    n, two_f, dim = block.experts.gate_up_proj.shape
    ours = MoEFeedForward(_moe_config(dim, two_f // 2, n, block.gate.top_k, norm_topk_prob))
    with torch.no_grad():
        ours.router.weight.copy_(block.gate.weight)
        ours.experts.gate_up_proj.copy_(block.experts.gate_up_proj)
        ours.experts.down_proj.copy_(block.experts.down_proj)
    return ours


def _moe_config(dim: int, ffn: int, experts: int, top_k: int, norm_topk_prob: bool) -> ModelConfig:
    return ModelConfig(dim=dim, n_heads=4, moe_ffn_dim=ffn, n_experts=experts, n_active_experts=top_k,
                       norm_topk_prob=norm_topk_prob)


def test_router_and_block_equal_transformers(moe):
    block = load_reference(moe).model.layers[1].mlp
    ours = _ours_from_theirs(block, block.gate.norm_topk_prob)
    x = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(0))
    flat = x.reshape(-1, 64)
    with torch.no_grad():
        their_logits, their_weights, their_indices = block.gate(flat)
        logits = ours.router(flat)
        _, weights, indices = route(logits, 2, True)
        assert torch.equal(logits, their_logits)
        assert torch.equal(indices, their_indices) and torch.equal(weights, their_weights)
        # Non-trivial routing: every expert chosen, none by every token.
        counts = torch.bincount(indices.reshape(-1), minlength=8)
        assert counts.min() > 0 and counts.max() < flat.shape[0]
        assert torch.allclose(ours(x), block(x), rtol=1e-5, atol=1e-6)
        # The grouped-GEMM path (CUDA bf16 in training; its forward runs on CPU too) equals the loop.
        routed = torch.randn(int(counts.sum()), 64, generator=torch.Generator().manual_seed(1))
        assert torch.allclose(ours.experts.grouped(routed, counts), ours.experts.looped(routed, counts),
                              rtol=1e-5, atol=1e-5)
    assert torch.equal(ours.stats.tokens_per_expert, counts.float())


def test_the_grouped_path_compiles_to_one_graph(monkeypatch):
    """parallel.compile compiles each block; on CUDA in bf16 the experts run by grouped GEMM with the run
    lengths on the device, so the block needs no break in its graph. Counting the runs with bincount broke
    it (its output's length depends on the data): compiled gpt-oss blocks gained only 1.09x on an H200
    (docs/gpu-check.md, 2026-12-05). Dynamo traces the grouped forward on CPU as on CUDA."""
    import torch._dynamo

    from trainer import moe as moe_module

    monkeypatch.setattr(moe_module.StackedExperts, "forward", moe_module.StackedExperts.grouped)
    block = MoEFeedForward(_moe_config(32, 48, 8, 2, True)).to(torch.bfloat16)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.1)
    x = torch.randn(2, 24, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(block)(x)
    assert [str(reason.reason).splitlines()[0] for reason in explained.break_reasons] == []
    assert explained.graph_count == 1


def test_aux_loss_equals_transformers(moe):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    gen = torch.Generator().manual_seed(1)
    logits = [torch.randn(50, 8, generator=gen).requires_grad_() for _ in range(2)]
    theirs = load_balancing_loss_func(tuple(logits), 8, 2)
    stats = []
    for lg in logits:
        probs, _, indices = route(lg, 2, True)
        counts = torch.bincount(indices.reshape(-1), minlength=8).float()
        stats.append(RouterStats(counts, probs.sum(0), lg.shape[0]))
    ours = router_aux_loss(stats, 8)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    their_grads = torch.autograd.grad(theirs, logits)
    our_grads = torch.autograd.grad(ours, logits)
    for a, b in zip(our_grads, their_grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-8)
    # Through the model: the last forward's stats of the sparse block.
    model = load_reference(moe)
    block = model.model.layers[1].mlp
    ours_block = _ours_from_theirs(block, block.gate.norm_topk_prob)
    x = torch.randn(2, 30, 64, generator=gen)
    ours_block(x)
    their_logits = block.gate(x.reshape(-1, 64))[0]
    want = load_balancing_loss_func((their_logits,), 8, 2)
    assert router_aux_loss([ours_block.stats], 8).item() == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.parametrize(("nproc", "expert_parallel"), [(2, 1), (2, 2), (4, 2)])
@pytest.mark.slow
def test_eval_equals_transformers_on_several_ranks(moe, docs, nproc, expert_parallel):
    """Each of 2 ranks holding half of every expert (FSDP), all of half the experts (EP 2), and on 4
    ranks a quarter (EP 2 x FSDP 2): each rank loads its experts' per-expert tensors only."""
    path, texts = docs
    want_loss, want_tokens = reference_eval(moe, texts, SEQ_LEN)
    got = _json_line(torchrun(nproc, _eval_args(moe, path, "--set",
                                                f"parallel.expert_parallel={expert_parallel}")))
    assert got == {"loss": pytest.approx(want_loss, rel=REL_TOL), "tokens": want_tokens}


@pytest.mark.parametrize("expert_parallel", [1, 2])
@pytest.mark.slow
def test_one_step_gradients_equal_transformers(moe, docs, tmp_path, expert_parallel):
    path, _ = docs
    out = tmp_path / "grads.json"
    assert_ok(torchrun(2, ["-m", "tests.trainer.hf_worker", "grads", str(moe), str(path), str(out),
                           f"parallel.expert_parallel={expert_parallel}"], timeout=300))
    worst = json.loads(out.read_text())
    # Every parameter, each expert's three projections and the router included.
    assert len(worst) == len(json.loads((moe / "model.safetensors.index.json").read_text())["weight_map"])
    assert sum(".mlp.experts." in name for name in worst) == 8 * 3
    assert max(worst.values()) < 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.slow
def test_train_with_expert_parallelism_export_reload_and_resume_without_it(moe, docs, tmp_path):
    path, texts = docs
    trained = tmp_path / "ep2"
    trained.mkdir()
    summary = _train(trained, moe, path, 2, "--set", "model.router_aux_loss_coef=0.01", "--set",
                     "parallel.expert_parallel=2", "--set", "checkpoint.interval=4")
    assert summary["final_loss"] < summary["first_loss"]
    # Every step's record has the load balance: the whole job's top-2 assignments per expert of the one
    # sparse block (2 per counted-or-not token slot: 4 rows x 64 tokens x 2), and the aux loss.
    steps = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()
             if '"event"' not in line]
    for record in steps:
        (load,) = record["tokens_per_expert"]
        assert len(load) == 8 and sum(load) == 4 * SEQ_LEN * 2
        assert record["expert_load_max_over_mean"][0] >= 1.0 and record["router_aux_loss"] > 0
    # The step-4 checkpoint (stacked experts, [8, ...] whole in DCP's view) resumed on the same 2 ranks
    # without expert parallelism: each rank now holds 4 experts of every stacked tensor by FSDP instead
    # of 4 experts by expert parallelism, and steps 5-8 give the same losses.
    assert_same_losses_resumed_without_expert_parallel(trained, moe, path, tmp_path / "ep1")
    export = trained / "export"
    original, exported = _tensors(moe), _tensors(export)
    assert {k: (v.shape, v.dtype) for k, v in exported.items()} == {
        k: (v.shape, v.dtype) for k, v in original.items()}
    # The router and every expert trained.
    for name in ("model.layers.1.mlp.gate.weight", *(f"model.layers.1.mlp.experts.{e}.down_proj.weight"
                                                      for e in range(8))):
        assert not torch.equal(exported[name], original[name]), name
    assert assert_export_reloads_and_learned(moe, export, texts, SEQ_LEN)["model_type"] == "qwen3_moe"


def test_estimate_counts_the_experts(moe):
    from trainer.estimate import activation_bytes, estimate

    cfg = load_config("finetune", [f"model.hf_dir={moe}", "data.path=x.jsonl", "data.seq_len=64",
                                   "training.global_batch_size=2"])
    result = estimate(cfg, 2)
    assert result.params == pytest.approx(4 * cfg.model.num_params / 2, rel=0.05)
    # Activations: the sparse block's feed-forward counted for k x tokens at the expert width.
    m = cfg.model
    more_experts = cfg.model_copy(update={"model": m.model_copy(update={"n_active_experts": 4})})
    wider = activation_bytes(more_experts, 1, checkpointing=False)
    assert wider > activation_bytes(cfg, 1, checkpointing=False)
    # Expert parallelism 2: the sparse block, the largest FSDP unit, gathers half of its experts (bf16,
    # twice: this unit and the next one prefetched) and reduces half of their gradients (bf16 + fp32).
    split = load_config("finetune", [f"model.hf_dir={moe}", "data.path=x.jsonl", "data.seq_len=64",
                                     "training.global_batch_size=2", "parallel.expert_parallel=2"])
    half_the_experts = 8 * 3 * 64 * 32 // 2
    assert result.gathered - estimate(split, 2).gathered == (2 * 2 + 2 + 4) * half_the_experts


def test_expert_parallelism_splits_swiglu_experts(moe):
    """Qwen3-MoE's experts are stacked as gpt-oss's are, so expert parallelism takes them; it must still
    divide the expert count."""
    overrides = [f"model.hf_dir={moe}", "data.path=x.jsonl", "data.seq_len=64"]
    assert load_config("finetune", [*overrides, "parallel.expert_parallel=2"]).parallel.expert_parallel == 2
    with pytest.raises(ConfigError) as e:
        load_config("finetune", [*overrides, "parallel.expert_parallel=3"])
    assert "parallel.expert_parallel" in str(e.value) and "n_experts=8" in str(e.value)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_aux_loss_gradient_reaches_the_router(checkpointing):
    """The aux loss of a forward (read after it, as train_step does) back-propagates into the routers,
    the same with activation checkpointing (recomputed blocks) as without."""
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=32,
                      n_experts=4, n_active_experts=2, moe_ffn_dim=16, moe_layers=[1])
    grads = {}
    for ac in (False, checkpointing):
        model = build_model(cfg)
        model.to_empty(device="cpu")
        model.init_weights(seed=0, buffer_device="cpu")
        for layer in model.layers:
            layer.activation_checkpointing = ac
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        logits = model(tokens)
        aux = model.router_aux_loss()
        assert model.tokens_per_expert().shape == (1, 4) and model.tokens_per_expert().sum() == 2 * 32
        (logits.float().logsumexp(-1).mean() + aux).backward()
        grads[ac] = model.layers[1].feed_forward.router.weight.grad.clone()
        assert grads[ac].abs().max() > 0
        # Every expert gets a gradient tensor, even one routed no token (FSDP reduce-scatters them all).
        assert all(p.grad is not None for p in model.layers[1].feed_forward.experts.parameters())
    assert torch.allclose(grads[False], grads[checkpointing], rtol=1e-5, atol=1e-7)


def test_an_expert_without_tokens_still_gets_a_zero_gradient():
    block = MoEFeedForward(_moe_config(8, 4, experts=4, top_k=2, norm_topk_prob=False))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        block.router.weight.zero_()
        block.router.weight[:2] = 1.0  # experts 0 and 1 win for every positive input
        for param in block.experts.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    block(torch.rand(5, 8, generator=gen) + 0.1).sum().backward()
    assert block.stats.tokens_per_expert.tolist() == [5, 5, 0, 0]
    for param in (block.experts.gate_up_proj, block.experts.down_proj):
        assert torch.equal(param.grad[2:], torch.zeros_like(param.grad[2:]))
        assert param.grad[:2].abs().amax(dim=(1, 2)).gt(0).all()


def test_own_model_with_experts_trains_but_has_no_hf_export():
    cfg = load_config("finetune", ["model.n_experts=4", "model.n_active_experts=2", "model.dim=64",
                                   "model.n_heads=4", "data.path=x.jsonl", "data.seq_len=64"])
    assert cfg.model.is_moe_layer(0) and cfg.model.num_params == sum(
        p.numel() for p in build_model(cfg.model).parameters())
    with pytest.raises(ConfigError) as e:
        load_config("finetune", ["model.n_experts=4", "model.dim=64", "model.n_heads=4", "data.path=x.jsonl",
                                 "data.seq_len=64", "checkpoint.hf_export_dir=/tmp/out"])
    assert "checkpoint.hf_export_dir" in str(e.value)


# -- Mixtral -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    return make_model(MIXTRAL, tmp_path_factory.mktemp("hf-mixtral") / "mixtral")


def test_mixtral_config_fields_counts_and_checkpoint_names(mixtral):
    cfg = load_config("finetune", [f"model.hf_dir={mixtral}", "data.path=x.jsonl", "data.seq_len=64"]).model
    assert (cfg.family, cfg.n_experts, cfg.n_active_experts, cfg.expert_ffn_dim) == ("mixtral", 4, 2, 32)
    assert cfg.norm_topk_prob and cfg.moe_layers is None and cfg.expert_kind == "swiglu"
    assert (cfg.sliding_window, cfg.sliding_layers) == (16, None)
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.qk_norm or cfg.router_bias)
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params
    assert sum(p.numel() for p in load_reference(mixtral).parameters()) == cfg.num_params
    shapes = checkpoint_shapes(model)
    assert shapes == {name: tuple(p.shape) for name, p in _tensors(mixtral).items()}
    assert shapes["model.layers.0.block_sparse_moe.experts.3.w3.weight"] == (32, 64)
    assert {from_hf(n) for n in shapes} == {n for n, _ in model.named_parameters()}


def test_mixtral_block_equals_transformers(mixtral):
    block = load_reference(mixtral).model.layers[0].mlp
    ours = _ours_from_theirs(block, norm_topk_prob=True)
    x = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours(x), block(x), rtol=1e-5, atol=1e-6)
    assert ours.stats.tokens_per_expert.min() > 0


@pytest.mark.slow
def test_mixtral_eval_with_expert_parallelism_equals_transformers(mixtral, docs):
    path, texts = docs
    want_loss, want_tokens = reference_eval(mixtral, texts, SEQ_LEN)
    got = _json_line(torchrun(2, _eval_args(mixtral, path, "--set", "parallel.expert_parallel=2")))
    assert got == {"loss": pytest.approx(want_loss, rel=REL_TOL), "tokens": want_tokens}


@pytest.mark.slow
def test_mixtral_train_with_expert_parallelism_export_reload(mixtral, docs, tmp_path):
    path, texts = docs
    summary = _train(tmp_path, mixtral, path, 2, "--set", "parallel.expert_parallel=2")
    assert summary["final_loss"] < summary["first_loss"]
    original, exported = _tensors(mixtral), _tensors(tmp_path / "export")
    assert {k: (v.shape, v.dtype) for k, v in exported.items()} == {
        k: (v.shape, v.dtype) for k, v in original.items()}
    for name in ("model.layers.0.block_sparse_moe.gate.weight",
                 *(f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight" for e in range(4))):
        assert not torch.equal(exported[name], original[name]), name
    assert_export_reloads_and_learned(mixtral, tmp_path / "export", texts, SEQ_LEN)
