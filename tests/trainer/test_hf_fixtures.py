"""Self-checks of the Hugging Face test fixtures (tests/trainer/hf_fixtures.py)."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.trainer import hf_fixtures as hf


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_family_builds_shards_and_reloads(family, tmp_path):
    d = hf.make_model(family, tmp_path / family)
    shards = sorted(d.glob("*.safetensors"))
    assert len(shards) >= 2
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert {p.name for p in shards} == set(index["weight_map"].values())
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (d / name).is_file()

    model, info = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"
    assert cfg["vocab_size"] % 8 == 0 and cfg["vocab_size"] >= len(hf.load_tokenizer(d))
    # Biases and norm weights are not their trivial init (a loader that skips them must be caught).
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert p.abs().max() > 0, name
        if name.endswith("norm.weight"):
            assert not torch.allclose(p, torch.ones_like(p)), name

    loss, count = hf.reference_eval(d, hf.documents(4), seq_len=32)
    assert count > 0 and math.isfinite(loss) and loss > 0
    chat_loss, chat_count = hf.reference_chat_eval(d, hf.chat_examples(3), seq_len=64)
    assert chat_count > 0 and math.isfinite(chat_loss) and chat_loss > 0


def test_family_specifics(tmp_path):
    qwen3 = hf.make_model("qwen3", tmp_path / "qwen3")
    assert json.loads((qwen3 / "config.json").read_text())["head_dim"] == 24
    assert any(k.endswith("self_attn.q_norm.weight") for k in hf.index_keys(qwen3))

    tied = hf.make_model("llama-tied", tmp_path / "tied")
    assert json.loads((tied / "config.json").read_text())["tie_word_embeddings"] is True
    assert not any(k.startswith("lm_head") for k in hf.index_keys(tied))
    untied = hf.make_model("llama", tmp_path / "llama")
    assert "lm_head.weight" in hf.index_keys(untied)
    rope = json.loads((untied / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0 and rope["factor"] == 8.0

    qwen2 = hf.make_model("qwen2", tmp_path / "qwen2")
    assert "model.layers.0.self_attn.q_proj.bias" in hf.index_keys(qwen2)


def test_tokenizer_bos_and_chat_template(tmp_path):
    hf.make_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = tok("The cat slept.")["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok("The cat slept.", add_special_tokens=False)["input_ids"] == ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == "The cat slept."

    conv = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    text = tok.apply_chat_template(conv, tokenize=False)
    assert text == ("<|begin_of_text|><|im_start|>user\nHi.<|im_end|>\n"
                    "<|im_start|>assistant\nHello.<|im_end|>\n")
    prompt = tok.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")
    # The reply and <|im_end|>; the separator newline after it is not the model's to generate.
    assert hf.assistant_spans(tok, conv) == [(len(prompt), len(text.rstrip()))]


def test_deterministic(tmp_path):
    a = hf.make_model("qwen3", tmp_path / "a", seed=3)
    b = hf.make_model("qwen3", tmp_path / "b", seed=3)
    c = hf.make_model("qwen3", tmp_path / "c", seed=4)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    shards = [f for f in files if f.endswith(".safetensors")]
    assert any((a / f).read_bytes() != (c / f).read_bytes() for f in shards)
    assert hf.documents(5, seed=1) == hf.documents(5, seed=1) != hf.documents(5, seed=2)
    assert hf.chat_examples(5, seed=1) == hf.chat_examples(5, seed=1)
