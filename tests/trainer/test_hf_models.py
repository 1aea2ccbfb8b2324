"""Real model families from Hugging Face directories: every number against transformers' own forward in
fp32 (tests/trainer/hf_fixtures.py builds the tiny random checkpoints with transformers itself).

- `trainer eval` equals transformers' mean next-token NLL per document, on 1 and 2 ranks, every family;
  chats count the assistant replies only;
- one step's gradients equal transformers' (2 ranks, sharded);
- training from HF weights under FULL_SHARD and HYBRID_SHARD, then the export reloads in transformers
  with the original keys, shapes and dtypes and a lower loss on the training documents; the export
  command writes the same tensors from the checkpoint;
- LoRA exports a PEFT adapter that peft loads, and merged weights equal to peft's merge;
- loading reads each rank's rows only (peak resident set against the shard on a model large enough
  to tell);
- bad directories, shards, tokenizers and model types are refused by name before anything starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer.conftest import REPO, assert_ok, torchrun
from tests.trainer.hf_fixtures import (
    FAMILIES,
    chat_examples,
    load_reference,
    make_model,
    reference_chat_eval,
    reference_eval,
)
from trainer.checkpoint.manifest import verify_checkpoint
from trainer.config import load_config
from trainer.errors import ConfigError

SEQ_LEN = 64
REL_TOL = 2e-4
FP32 = ["--set", "parallel.param_dtype=fp32", "--set", f"data.seq_len={SEQ_LEN}"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-models")
    return {family: make_model(family, root / family) for family in FAMILIES}


def _eval_args(model: Path, data: Path, *extra: str) -> list[str]:
    return ["-m", "trainer", "eval", "--config", "finetune", "--set", f"model.hf_dir={model}",
            "--set", f"data.path={data}", *FP32, *extra, "--json"]


def _single(args: list[str]) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def _json_line(proc: subprocess.CompletedProcess) -> dict:
    assert_ok(proc)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_eval_equals_transformers_on_one_rank(models, docs, family):
    path, texts = docs
    want_loss, want_tokens = reference_eval(models[family], texts, SEQ_LEN)
    got = _json_line(_single(_eval_args(models[family], path)))
    assert got["tokens"] == want_tokens
    assert got["loss"] == pytest.approx(want_loss, rel=REL_TOL)


@pytest.mark.parametrize("family", ["llama-tied", "qwen3"])
@pytest.mark.slow
def test_eval_equals_transformers_on_two_ranks(models, docs, family):
    path, texts = docs
    want_loss, want_tokens = reference_eval(models[family], texts, SEQ_LEN)
    got = _json_line(torchrun(2, _eval_args(models[family], path)))
    assert got == {"loss": pytest.approx(want_loss, rel=REL_TOL), "tokens": want_tokens}


@pytest.mark.slow
def test_chat_eval_counts_assistant_replies_only(models, tmp_path):
    chats = chat_examples(8)
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    want_loss, want_tokens = reference_chat_eval(models["llama"], chats, SEQ_LEN)
    got = _json_line(_single(_eval_args(models["llama"], path, "--set", "data.messages_field=messages")))
    assert got["tokens"] == want_tokens
    assert got["loss"] == pytest.approx(want_loss, rel=REL_TOL)
    # Counting the system and user tokens too (the whole rendering as text) changes the loss: the mask
    # is what makes the figure above.
    from tests.trainer.hf_fixtures import load_tokenizer, render

    tok = load_tokenizer(models["llama"])
    whole = tmp_path / "whole.jsonl"
    whole.write_text("".join(json.dumps({"text": render(tok, c)}) + "\n" for c in chats))
    unmasked = _json_line(_single(_eval_args(models["llama"], whole)))
    assert unmasked["tokens"] > got["tokens"]
    assert abs(unmasked["loss"] - got["loss"]) > 10 * REL_TOL * got["loss"]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama-tied"])
@pytest.mark.slow
def test_one_step_gradients_equal_transformers(models, docs, tmp_path, family):
    path, _ = docs
    out = tmp_path / "grads.json"
    assert_ok(torchrun(2, ["-m", "tests.trainer.hf_worker", "grads", str(models[family]), str(path),
                           str(out)], timeout=300))
    worst = json.loads(out.read_text())
    assert len(worst) >= 2 * 9  # every parameter of both blocks was compared
    assert max(worst.values()) < 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


def _train(tmp: Path, model: Path, data: Path, nproc: int, *extra: str) -> dict:
    metrics = tmp / "metrics.jsonl"
    args = ["-m", "trainer", "--config", "finetune", "--set", f"model.hf_dir={model}", "--set",
            f"data.path={data}", *FP32, "--set", "training.global_batch_size=4", "--set", "training.steps=8",
            "--set", "optim.lr=2e-3", "--set", "optim.warmup_steps=1", "--set",
            f"checkpoint.hf_export_dir={tmp / 'export'}", "--checkpoint-dir", str(tmp / "ckpt"),
            "--metrics-file", str(metrics), *extra]
    assert_ok(torchrun(nproc, args, timeout=400))
    return json.loads(metrics.read_text().splitlines()[-1])


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize(("strategy", "nproc"), [("FULL_SHARD", 2), ("HYBRID_SHARD", 4)])
@pytest.mark.slow
def test_train_export_reload_in_transformers(models, docs, tmp_path, strategy, nproc):
    path, texts = docs
    source = models["qwen3"]
    extra = ["--set", f"parallel.strategy={strategy}", "--set", "eval.interval=4", "--set",
             f"eval.path={path}"]
    if strategy == "HYBRID_SHARD":
        extra += ["--set", "parallel.sharding_degree=2"]  # 2 replicas x 2 shards
    summary = _train(tmp_path, source, path, nproc, *extra)
    assert summary["final_loss"] < summary["first_loss"]
    # The validation loss every 4 steps, in the JSONL and the summary; TensorBoard next to it.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [4, 8] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert evals[0]["eval_tokens"] == reference_eval(source, texts, SEQ_LEN)[1]
    assert summary["eval_loss"] == evals[-1]["eval_loss"]
    assert list((tmp_path / "metrics.tensorboard").glob("events.out.tfevents.*"))
    export = tmp_path / "export"
    assert verify_checkpoint(export) == []
    assert_ok(_single(["-m", "trainer.checkpoint", "verify", str(export)]))
    assert json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    original, exported = _tensors(source), _tensors(export)
    assert {k: (v.shape, v.dtype) for k, v in exported.items()} == {
        k: (v.shape, v.dtype) for k, v in original.items()}
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (export / name).read_bytes() == (source / name).read_bytes()
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    before, _ = reference_eval(source, texts, SEQ_LEN)
    after, _ = reference_eval(export, texts, SEQ_LEN)
    assert after < before - 0.05
    if strategy == "FULL_SHARD":
        # The same export from the checkpoint alone, on one rank: the same tensors, bit for bit.
        checkpoint = sorted((tmp_path / "ckpt").glob("step_*"))[-1]
        again = tmp_path / "again"
        assert_ok(_single(["-m", "trainer", "export", "--checkpoint", str(checkpoint), "--out", str(again)]))
        assert verify_checkpoint(again) == []
        for name, tensor in _tensors(again).items():
            assert torch.equal(tensor, exported[name]), name
        # The manifest covers the export: one flipped byte in a shard is found.
        shard = sorted(again.glob("*.safetensors"))[0]
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
        assert any("SHA256 mismatch" in p for p in verify_checkpoint(again))


@pytest.mark.slow
def test_lora_exports_a_peft_adapter_and_merged_weights(models, docs, tmp_path):
    path, texts = docs
    source = models["llama"]
    _train(tmp_path, source, path, 2, "--set", "parallel.lora.rank=4", "--set", "parallel.lora.alpha=8",
           "--set", "optim.lr=5e-3")
    adapter = tmp_path / "export"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                          "manifest.json"]
    from peft import PeftModel

    base = load_reference(source)
    peft_model = PeftModel.from_pretrained(base, adapter)
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 2 * 7 and all(p.abs().max() > 0 for p in lora_b)  # every target trained
    merged_by_peft = peft_model.merge_and_unload()
    # The merged export, from the checkpoint: the same model as peft's merge.
    checkpoint = sorted((tmp_path / "ckpt").glob("step_*"))[-1]
    merged = tmp_path / "merged"
    assert_ok(_single(["-m", "trainer", "export", "--checkpoint", str(checkpoint), "--out", str(merged),
                       "--set", "parallel.lora.export=merged"]))
    ours = load_reference(merged)
    ids = torch.tensor([[0, 5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        # bf16 weights in the export (the source's dtype): the logits agree to bf16 rounding.
        assert torch.allclose(ours(ids).logits, merged_by_peft(ids).logits, atol=5e-2)
    before, _ = reference_eval(source, texts, SEQ_LEN)
    after, _ = reference_eval(merged, texts, SEQ_LEN)
    assert after < before


@pytest.mark.slow
def test_loading_reads_each_ranks_rows_only(tmp_path):
    """A 4-layer, hidden-1024 model saved in fp32 (~66 MB): the peak resident set of each of 2 ranks
    grows by about its half while loading, far below the whole model."""
    model = make_model("llama", tmp_path / "big", dtype=torch.float32, max_shard_size="20MB", layers=4,
                       hidden=1024, vocab_size=4096)
    out = tmp_path / "memory.json"
    assert_ok(torchrun(2, ["-m", "tests.trainer.hf_worker", "load-memory", str(model), str(out)],
                       timeout=300))
    rows = json.loads(out.read_text())
    full = rows[0]["full_bytes"]
    assert full > 50e6
    for row in rows:
        assert row["shard_bytes"] < 0.55 * full
        assert row["growth"] < 0.75 * full, (row, full)
    expected = sum(float(t.double().sum()) for t in _tensors(model).values())
    assert rows[0]["checksum"] == pytest.approx(expected, rel=1e-6)


# -- bad input, refused before anything starts -----------------------------------------------------


def _problem(excinfo) -> str:
    return str(excinfo.value)


def test_directory_without_config_json_and_a_hub_id(tmp_path):
    from trainer.hf.fetch import FetchError

    (tmp_path / "model").mkdir()
    with pytest.raises(FetchError) as e:
        load_config("finetune", [f"model.hf_dir={tmp_path / 'model'}", "data.path=x.jsonl"])
    assert "model.hf_dir" in _problem(e) and "has no config.json" in _problem(e)
    with pytest.raises(FetchError) as e:
        load_config("finetune", ["model.hf_dir=meta-llama/Llama-3.1-8B", "data.path=x.jsonl"])
    assert "not downloaded from the Hugging Face Hub" in _problem(e)


def test_unknown_model_type_and_rope_type(models, tmp_path):
    for field, value, words in (("model_type", "falcon", "model_type"),
                                ("rope_parameters", {"rope_type": "yarn", "factor": 4.0}, "rope_type")):
        broken = tmp_path / f"broken-{field}"
        broken.mkdir()
        config = json.loads((models["llama"] / "config.json").read_text())
        config[field] = value
        (broken / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError) as e:
            load_config("finetune", [f"model.hf_dir={broken}", "data.path=x.jsonl"])
        assert words in _problem(e) and str(broken) in _problem(e)


def _prepare(model_dir: Path, data: Path):
    from trainer.train import prepare

    cfg = load_config("finetune", [f"model.hf_dir={model_dir}", f"data.path={data}",
                                   f"data.seq_len={SEQ_LEN}", "training.global_batch_size=1"])
    return prepare(cfg, lambda _m: None)


def test_missing_shard_named_in_the_index(models, docs, tmp_path):
    import shutil

    broken = tmp_path / "missing-shard"
    shutil.copytree(models["qwen2"], broken)
    victim = sorted(broken.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ConfigError) as e:
        _prepare(broken, docs[0])
    assert victim.name in _problem(e) and "model.safetensors.index.json" in _problem(e)


def test_weights_that_do_not_fit_the_config(models, docs, tmp_path):
    import shutil

    broken = tmp_path / "wrong-shape"
    shutil.copytree(models["qwen2"], broken)
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 128
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        _prepare(broken, docs[0])
    assert "mlp.gate_proj.weight" in _problem(e) and "[96, 64]" in _problem(e)


def test_tokenizer_larger_than_the_embedding(docs, tmp_path):
    # Weights and config.json agree on 256 rows; the 400-token tokenizer does not fit them.
    broken = make_model("mistral", tmp_path / "small-embedding", vocab_size=256)
    with pytest.raises(ConfigError) as e:
        _prepare(broken, docs[0])
    assert "tokenizer.json" in _problem(e) and "256" in _problem(e)


@pytest.mark.slow
def test_model_and_data_from_s3_on_two_ranks(models, docs, tmp_path, moto_s3):
    """model.hf_dir and data.path as s3:// prefixes (a moto server on loopback): downloaded once into
    the cache before any process group, then the same loss as from the local copies."""
    import boto3

    path, texts = docs
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="team")
    for file in models["qwen2"].iterdir():
        s3.upload_file(str(file), "team", f"models/qwen2/{file.name}")
    s3.upload_file(str(path), "team", "data/docs.jsonl")
    cache = tmp_path / "cache"
    got = _json_line(torchrun(2, [
        "-m", "trainer", "eval", "--config", "finetune", "--set", "model.hf_dir=s3://team/models/qwen2",
        "--set", "data.path=s3://team/data/docs.jsonl", "--set", f"model.cache_dir={cache}", *FP32,
        "--json"]))
    want_loss, want_tokens = reference_eval(models["qwen2"], texts, SEQ_LEN)
    assert got == {"loss": pytest.approx(want_loss, rel=REL_TOL), "tokens": want_tokens}
    local = cache / "team" / "models" / "qwen2"
    assert (local / "config.json").read_bytes() == (models["qwen2"] / "config.json").read_bytes()
    assert (cache / "team" / "data" / "docs.jsonl").read_bytes() == path.read_bytes()
