"""The state-dict adapter: the trainer's parameter names to and from the Hugging Face names of the
Llama-style families (llama, mistral, qwen2, qwen3 share them; qwen3_moe adds its router `gate` and
per-expert projections; gpt_oss its `router`, stacked experts and attention sinks), and LoRA adapters
to PEFT's names.

The rotary layout needs no mapping: the model rotates halves as the checkpoints store them
(trainer/model.py), so every tensor is read and written as it is, slice by slice.
"""

from __future__ import annotations

import re

# Within block i: ours -> theirs (prefix of `.weight` / `.bias`).
_BLOCK = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
}
# A sparse block's feed-forward: the router and expert e's projections, as transformers'
# save_pretrained writes Qwen3-MoE (per-expert keys; in memory transformers 5 stacks them).
_MOE = {"router": "gate", "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT = re.compile(r"^feed_forward\.experts\.(\d+)\.(w1|w2|w3)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)$")
# Tensors without a .weight/.bias suffix, the same name on both sides: gpt-oss's sinks and stacked experts.
_UNSUFFIXED = {"attention.sinks": "self_attn.sinks",
               **{f"feed_forward.experts.{n}": f"mlp.experts.{n}"
                  for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}}
_UNSUFFIXED_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_UNSUFFIXED_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# The router's module: Qwen3-MoE calls it gate, gpt-oss router.
_ROUTER = {"gpt_oss": "mlp.router"}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAME = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias|lora_a|lora_b)$")
_HF_BLOCK_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# The linear layers LoRA can target, by the names PEFT users write in target_modules.
LORA_TARGETS = {hf.split(".")[-1]: ours for ours, hf in _BLOCK.items() if hf.endswith("_proj")}
PEFT_PREFIX = "base_model.model."


class UnknownParameter(KeyError):
    """A name the adapter has no mapping for."""


def to_hf(name: str, family: str) -> str:
    """`layers.3.attention.wq.weight` -> `model.layers.3.self_attn.q_proj.weight` (family: the
    config.json model_type, which names the router)."""
    if name in _TOP:
        return _TOP[name]
    unsuffixed = _UNSUFFIXED_NAME.match(name)
    if unsuffixed is not None and unsuffixed.group(2) in _UNSUFFIXED:
        return f"model.layers.{unsuffixed.group(1)}.{_UNSUFFIXED[unsuffixed.group(2)]}"
    match = _BLOCK_NAME.match(name)
    if match is None or match.group(3) not in ("weight", "bias"):
        raise UnknownParameter(name)
    layer, module, kind = match.groups()
    if module == "feed_forward.router":
        return f"model.layers.{layer}.{_ROUTER.get(family, 'mlp.gate')}.{kind}"
    expert = _EXPERT.match(module)
    if expert is not None:
        return f"model.layers.{layer}.mlp.experts.{expert.group(1)}.{_MOE[expert.group(2)]}.{kind}"
    if module not in _BLOCK:
        raise UnknownParameter(name)
    return f"model.layers.{layer}.{_BLOCK[module]}.{kind}"


def from_hf(name: str) -> str:
    """The inverse of to_hf."""
    for ours, theirs in _TOP.items():
        if name == theirs:
            return ours
    unsuffixed = _HF_UNSUFFIXED_NAME.match(name)
    reverse_unsuffixed = {theirs: ours for ours, theirs in _UNSUFFIXED.items()}
    if unsuffixed is not None and unsuffixed.group(2) in reverse_unsuffixed:
        return f"layers.{unsuffixed.group(1)}.{reverse_unsuffixed[unsuffixed.group(2)]}"
    match = _HF_BLOCK_NAME.match(name)
    if match is None:
        raise UnknownParameter(name)
    layer, module, kind = match.groups()
    if module in ("mlp.gate", "mlp.router"):
        return f"layers.{layer}.feed_forward.router.{kind}"
    expert = _HF_EXPERT.match(module)
    if expert is not None:
        ours = {theirs: ours for ours, theirs in _MOE.items()}[expert.group(2)]
        return f"layers.{layer}.feed_forward.experts.{expert.group(1)}.{ours}.{kind}"
    reverse = {theirs: ours for ours, theirs in _BLOCK.items()}
    if module not in reverse:
        raise UnknownParameter(name)
    return f"layers.{layer}.{reverse[module]}.{kind}"


def is_lora(name: str) -> bool:
    return name.endswith((".lora_a", ".lora_b"))


def to_peft(name: str) -> str:
    """`layers.0.attention.wq.lora_a` -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`
    (the keys `peft` saves in adapter_model.safetensors)."""
    match = _BLOCK_NAME.match(name)
    if match is None or not is_lora(name):
        raise UnknownParameter(name)
    layer, module, kind = match.groups()
    matrix = "lora_A" if kind == "lora_a" else "lora_B"
    return f"{PEFT_PREFIX}model.layers.{layer}.{_BLOCK[module]}.{matrix}.weight"
