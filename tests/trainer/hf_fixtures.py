"""Tiny random Hugging Face checkpoints, tokenizers and reference numbers for the HF-loading tests.

The trainer reads Hugging Face checkpoints (config.json, sharded safetensors, tokenizer.json) without
importing transformers: it is not a run-time dependency of the nodes' wheel. These helpers are the
independent side of those tests. They build real checkpoints with transformers itself (so key names,
shapes, rope conventions, tied embeddings and shard indexes are exactly what the Hub ships) and compute
reference losses with transformers' own modelling code in fp32 with eager attention (stable to ~1e-6 on
CPU), for the trainer's numbers to be compared against.

Everything is seeded and small: a model has 2 layers (qwen3-moe: one dense, one of 8 experts, top-2;
mixtral: both of 4 experts, top-2, a 16-token window; qwen2-moe: one dense, one of 8 experts, top-2, plus
a shared expert; gpt-oss: a sliding-window block and a full one,
4 stacked experts, top-2, YaRN, sinks), hidden 64, a
~400-token byte-level BPE vocabulary, and builds, saves and evaluates in well under 2 s on CPU.
Biases and norm weights are random rather than 0/1, so a loader that skips them changes the loss and
is caught. Shards are kept small (max_shard_size="60KB") so every checkpoint has several
*.safetensors files and an index.

transformers, tokenizers and safetensors are test-only dependencies: import this module only from tests.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch

FAMILIES = ("llama", "llama-tied", "qwen2", "qwen3", "mistral", "qwen3-moe")
# Built by make_model too, tested on their own (tests/trainer/test_gpt_oss.py, tests/trainer/test_moe.py).
GPT_OSS = "gpt-oss"
MIXTRAL = "mixtral"
QWEN2_MOE = "qwen2-moe"  # tests/trainer/test_qwen2_moe.py

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<pad>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END, PAD)

# The BPE's training text doubles as the documents' sentences (ASCII only: byte and character offsets agree).
CORPUS: list[str] = [
    "The quick brown fox jumps over the lazy dog.",
    "A small model learns the shape of the data before it learns the data.",
    "Every rank holds one shard of every parameter.",
    "The gradients are reduced and scattered after the backward pass.",
    "She opened the window and the cold air came in.",
    "Numbers in a checkpoint must load back exactly as they were saved.",
    "The cluster starts at dawn and stops when the job is done.",
    "He wrote the test first and the code second.",
    "Rain fell on the roof all night long.",
    "The optimizer keeps two moments for every weight.",
    "A tokenizer turns text into numbers and numbers back into text.",
    "They walked along the river until the sun went down.",
    "The loss went down slowly, then all at once.",
    "Attention lets each token look at the tokens before it.",
    "The cat slept on the warm stone by the door.",
    "Learning rate warmup keeps the first steps from going astray.",
    "The library was quiet except for the turning of pages.",
    "Each layer has a norm, an attention block and a feed forward block.",
    "We measured the time of every step and wrote it down.",
    "The bridge was built of stone more than two hundred years ago.",
    "Rotary embeddings rotate queries and keys by their position.",
    "She asked a question and waited for the answer.",
    "The baker made bread before anyone else was awake.",
    "Memory on the device is the budget that decides the batch size.",
    "A good test fails for one reason only.",
    "The train left the station ten minutes late.",
    "Weights tied between the embedding and the head save memory.",
    "He counted the stars until he fell asleep.",
    "The network is fast inside a node and slower between nodes.",
    "Children played in the park while their parents talked.",
    "Every document starts with a token that marks its beginning.",
    "The answer was short, clear and correct.",
    "Old maps show roads that no longer exist.",
    "A checkpoint written by many ranks is read back by many ranks.",
    "The garden was full of flowers in the spring.",
    "Please summarize the report in three sentences.",
    "What is the capital of France? The capital of France is Paris.",
    "Two plus two is four, and four plus four is eight.",
    "The model answered politely and then stopped.",
    "Night came, the lamps were lit, and the town grew quiet.",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_VOCAB_SIZE = 400
# Weight init std (transformers' initializer_range; its default 0.02 leaves a 64-wide model's attention
# almost uniform and its logits almost flat, so that the llama3 rope scaling moved the loss by ~2e-5
# only). At 0.1 it moves it by ~8e-3 and resetting the norms to 1 by ~1e-2.
INIT_STD = 0.1
# Biases ~ N(0, BIAS_STD), norm weights ~ 1 + N(0, NORM_STD): zeroing the biases (qwen2) or resetting
# any one kind of norm weight to 1 moves the loss by 2e-4 to 4e-2 (the fp32 reference is stable to ~1e-6).
BIAS_STD = 0.1
NORM_STD = 0.2


def make_tokenizer(directory: Path) -> None:
    """A byte-level BPE (~400 tokens) trained on CORPUS, saved in Hugging Face form into `directory`.

    Special tokens take ids 0-4 (BOS, EOS, <|im_start|>, <|im_end|>, <pad>); encoding with special tokens
    prepends BOS (Llama 3 style); the chat template is ChatML with a leading BOS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # No ByteLevel post-processor: it would trim offsets; TemplateProcessing leaves them as they are.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(directory))


def _quiet() -> None:
    """No tqdm bars ("Writing model shards", "Loading weights") in the test output."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def load_tokenizer(directory: Path):
    """The directory's tokenizer.json exactly, as a fast tokenizer (offsets, chat template).

    Not AutoTokenizer: in transformers 5 it picks a model-specific class from config.json where it knows
    one (Qwen2Tokenizer for a qwen2 checkpoint), and Qwen2Tokenizer adds a token ("<|endoftext|>", id 400)
    that tokenizer.json does not have.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(directory))


def _config(family: str, *, vocab_size: int, layers: int, hidden: int, bos: int, eos: int, pad: int,
            dtype: torch.dtype, init_std: float):
    from transformers import (
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=256,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype=dtype,
        initializer_range=init_std,
    )
    if family in ("llama", "llama-tied"):
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # Small, so that the llama3 scaling changes frequencies that matter at these lengths.
            "original_max_position_embeddings": 64,
        }
        return LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=family == "llama-tied")
    if family == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                           tie_word_embeddings=False, use_sliding_window=False, sliding_window=None)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                           tie_word_embeddings=False, use_sliding_window=False, sliding_window=None)
    if family == "qwen3-moe":
        # Block 0 dense (mlp_only_layers), block 1 sparse: 8 experts of 32, top-2, renormalised. The
        # aux-loss coefficient is set but output_router_logits is false, so transformers' loss (and the
        # trainer's, which reads it the same way) is the NLL alone.
        rope = {"rope_type": "default", "rope_theta": 1e6}
        return Qwen3MoeConfig(**common, head_dim=24, rope_parameters=rope,
                              tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
                              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1,
                              router_aux_loss_coef=0.01, output_router_logits=False)
    if family == QWEN2_MOE:
        # As qwen3-moe, with Qwen2's attention (q/k/v biases, no q/k norm, head size hidden / heads), the
        # top-2 weights not renormalised (Qwen1.5-MoE's default) and a shared expert of 48 beside the
        # routed experts in block 1.
        rope = {"rope_type": "default", "rope_theta": 1e6}
        return Qwen2MoeConfig(**common, rope_parameters=rope, tie_word_embeddings=False,
                              use_sliding_window=False, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, shared_expert_intermediate_size=48,
                              norm_topk_prob=False, mlp_only_layers=[0], decoder_sparse_step=1,
                              router_aux_loss_coef=0.01, output_router_logits=False)
    if family == "mistral":
        # A window shorter than the tests' sequences, so that every block's sliding window matters.
        return MistralConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                             tie_word_embeddings=False, sliding_window=16)
    if family == MIXTRAL:
        # Every block sparse: 4 experts of 32, top-2 (always renormalised), every block's window 16
        # tokens as Mistral's.
        return MixtralConfig(**{**common, "intermediate_size": 32},
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                             tie_word_embeddings=False, sliding_window=16, num_local_experts=4,
                             num_experts_per_tok=2, router_aux_loss_coef=0.01, output_router_logits=False)
    if family == GPT_OSS:
        # Everything gpt-oss adds, active at the tests' 64-token sequences: block 0 slides over 8
        # tokens, block 1 is full; YaRN x4 stretches wavelengths beyond 16 positions (not truncated, as
        # gpt-oss); a head_dim other than hidden / heads; 4 stacked experts of 32, top-2; a clamp
        # limit low enough to cut some gate and up values (gpt-oss's 7 would never bind at this init).
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return GptOssConfig(**{**common, "intermediate_size": 32, "max_position_embeddings": 64}, head_dim=24,
                            rope_parameters=rope, sliding_window=8, layer_types=layer_types,
                            num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.5,
                            tie_word_embeddings=False, router_aux_loss_coef=0.01, output_router_logits=False,
                            attention_bias=True)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def make_model(family: str, directory: Path, *, dtype: torch.dtype = torch.bfloat16,
               max_shard_size: str | int = "60KB", seed: int = 0, layers: int = 2, hidden: int = 64,
               vocab_size: int | None = None, init_std: float = INIT_STD) -> Path:
    """A tiny random checkpoint of `family` (with its tokenizer) saved as several shards plus an index."""
    from transformers import AutoModelForCausalLM

    _quiet()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    make_tokenizer(directory)
    tok = load_tokenizer(directory)
    if vocab_size is None:
        vocab_size = -(-len(tok) // 8) * 8
    config = _config(family, vocab_size=vocab_size, layers=layers, hidden=hidden,
                     bos=tok.bos_token_id, eos=tok.eos_token_id, pad=tok.pad_token_id, dtype=dtype,
                     init_std=init_std)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # gpt-oss's stacked experts: gate_up_proj_bias, down_proj_bias
                p.copy_(BIAS_STD * torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks"):
                # Sinks about as large as the attention logits: they take a real share of each softmax.
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "norm" in name.rsplit(".", 2)[-2]:
                p.copy_(1.0 + NORM_STD * torch.randn(p.shape, generator=gen))
    model = model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(str(directory), max_shard_size=max_shard_size)
    tok.save_pretrained(str(directory))
    return directory


def documents(n: int, seed: int = 0) -> list[str]:
    """n documents of 1-6 sentences of CORPUS each, reproducible from `seed`."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(CORPUS) for _ in range(rng.randint(1, 6))) for _ in range(n)]


_SYSTEMS = ("You are a helpful assistant.", "Answer briefly.", "You are a careful reviewer.")


def chat_examples(n: int, seed: int = 0) -> list[list[dict]]:
    """n conversations: an optional system message, then one or two user/assistant turns."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        conv: list[dict] = []
        if rng.random() < 0.5:
            conv.append({"role": "system", "content": rng.choice(_SYSTEMS)})
        for _ in range(rng.choice((1, 1, 2))):
            conv.append({"role": "user", "content": rng.choice(CORPUS)})
            reply = " ".join(rng.choice(CORPUS) for _ in range(rng.randint(1, 3)))
            conv.append({"role": "assistant", "content": reply})
        out.append(conv)
    return out


def load_reference(model_dir: Path):
    """The checkpoint in transformers, fp32, eager attention, eval mode."""
    from transformers import AutoModelForCausalLM

    _quiet()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()


def _nll(model, ids: list[int], counted: list[bool] | None = None) -> tuple[float, int]:
    """Sum of next-token NLL predicting tokens 1..len-1 (those with counted[t], if given), and the count."""
    if len(ids) < 2:
        return 0.0, 0
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none").double()
    if counted is not None:
        mask = torch.tensor(counted[1:], dtype=torch.bool)
        nll = nll[mask]
    return float(nll.sum()), int(nll.numel())


def reference_eval(model_dir: Path, docs: list[str], seq_len: int) -> tuple[float, int]:
    """(mean next-token NLL, token count) over `docs`, each tokenized on its own with BOS, cut to seq_len."""
    tok = load_tokenizer(model_dir)
    model = load_reference(model_dir)
    total, count = 0.0, 0
    for doc in docs:
        ids = tok(doc)["input_ids"][:seq_len]
        s, c = _nll(model, ids)
        total, count = total + s, count + c
    return (total / count if count else math.nan), count


def assert_export_reloads_and_learned(source: Path, export: Path, docs: list[str], seq_len: int) -> dict:
    """A trained model's export loads in transformers with no missing, unexpected or mismatched key and
    evaluates clearly below the model it started from; its config.json, for the caller's own checks."""
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not any(info.values()), info
    before, _ = reference_eval(source, docs, seq_len)
    after, _ = reference_eval(export, docs, seq_len)
    assert after < before - 0.05
    return json.loads((export / "config.json").read_text())


def render(tok, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tok, messages: list[dict]) -> list[tuple[int, int]]:
    """Character ranges of the assistant replies: the content and <|im_end|>, not the newline the
    template puts after it (a separator the model never has to generate)."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render(tok, messages[:i], add_generation_prompt=True))
        full = render(tok, messages[: i + 1])
        assert full.startswith(render(tok, messages[:i], add_generation_prompt=True)), "template not a prefix"
        spans.append((start, len(full.rstrip())))
    return spans


def reference_chat_eval(model_dir: Path, conversations: list[list[dict]], seq_len: int) -> tuple[float, int]:
    """(mean NLL, count) over tokens whose character offset starts inside an assistant reply."""
    tok = load_tokenizer(model_dir)
    model = load_reference(model_dir)
    total, count = 0.0, 0
    for messages in conversations:
        text = render(tok, messages)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"][:seq_len]
        offsets = enc["offset_mapping"][:seq_len]
        spans = assistant_spans(tok, messages)
        counted = [any(a <= start < b for a, b in spans) for start, _ in offsets]
        s, c = _nll(model, ids, counted)
        total, count = total + s, count + c
    return (total / count if count else math.nan), count


def index_keys(model_dir: Path) -> list[str]:
    """The tensor names of a sharded checkpoint's model.safetensors.index.json."""
    return sorted(json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())["weight_map"])
