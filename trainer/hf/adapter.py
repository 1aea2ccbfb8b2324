"""The state-dict adapter: the trainer's parameter names to and from the Hugging Face names of the
Llama-style families (llama, mistral, qwen2, qwen3 share them; qwen3_moe, qwen2_moe and mixtral add a
router and per-expert projections, qwen2_moe also its shared expert (`mlp.shared_expert.*_proj`,
`mlp.shared_expert_gate`); gpt_oss its `router`, stacked experts and attention sinks), and LoRA adapters
to PEFT's names.

The rotary layout needs no mapping: the model rotates halves as the checkpoints store them
(trainer/model.py), so every tensor is read and written as it is, slice by slice. The experts are
stacked in the model for every family (trainer/moe.py); Qwen3-MoE's, Qwen2-MoE's and Mixtral's
checkpoints store each expert's projections apart (as transformers' save_pretrained writes them, though
transformers 5 stacks them in memory too), so each of those is one expert's row of a stacked parameter,
or for the gate and up projections, one half of that row (`CheckpointTensor`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

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
# Qwen2-MoE's shared expert: the dense feed-forward's projections inside the sparse block, and its gate.
_SHARED_EXPERT = {
    **{ours.replace("feed_forward.", "feed_forward.shared_expert."):
       theirs.replace("mlp.", "mlp.shared_expert.") for ours, theirs in _BLOCK.items()
       if ours.startswith("feed_forward.")},
    "feed_forward.shared_expert_gate": "mlp.shared_expert_gate",
}
_BLOCK_MODULES = {**_BLOCK, **_SHARED_EXPERT}
# Families whose checkpoints store each expert apart: the sparse block's module and the names of an
# expert's gate, up and down projections, as transformers' save_pretrained writes them.
_PER_EXPERT = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
               "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
               "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}
_HF_EXPERT = re.compile(r"^(mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)$")
# The stacked parameter each per-expert projection is part of.
_STACKED_OF = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj",
               "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}
_STACKED = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(gate_up_proj|down_proj)$")
# Tensors without a .weight/.bias suffix, the same name on both sides: gpt-oss's sinks and stacked experts.
_UNSUFFIXED = {"attention.sinks": "self_attn.sinks",
               **{f"feed_forward.experts.{n}": f"mlp.experts.{n}"
                  for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}}
_UNSUFFIXED_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_UNSUFFIXED_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# The router's module: Qwen3-MoE and Qwen2-MoE call it mlp.gate, Mixtral block_sparse_moe.gate, gpt-oss
# mlp.router.
_ROUTER = {"gpt_oss": "mlp.router", "mixtral": "block_sparse_moe.gate"}
_HF_ROUTERS = ("mlp.gate", "mlp.router", "block_sparse_moe.gate")
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAME = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias|lora_a|lora_b)$")
_HF_BLOCK_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# The linear layers LoRA can target, by the names PEFT users write in target_modules (the feed-forward's
# also name the shared expert's: trainer/lora.py).
LORA_TARGETS = {hf.split(".")[-1]: ours for ours, hf in _BLOCK.items() if hf.endswith("_proj")}
PEFT_PREFIX = "base_model.model."


class UnknownParameter(KeyError):
    """A name the adapter has no mapping for."""


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of a Hugging Face checkpoint and where it lives in a trainer parameter."""

    name: str
    """Its Hugging Face name."""
    expert: int | None = None
    """None: it is the whole parameter. Else the parameter is stacked experts stored one expert apart:
    it is expert `expert`'s matrix (row `expert` of dim 0)..."""
    half: int | None = None
    """...or of gate_up_proj's, its gate rows (0) or its up rows (1)."""

    def view(self, param: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
        """This tensor in `param` (the whole parameter, or stacked experts from `first_expert` on)."""
        if self.expert is None:
            return param
        matrix = param[self.expert - first_expert]
        return matrix if self.half is None else matrix.chunk(2)[self.half]


def checkpoint_tensors(name: str, family: str, n_experts: int) -> list[CheckpointTensor]:
    """The checkpoint's tensors of trainer parameter `name`: the parameter itself, or for Qwen3-MoE's and
    Mixtral's stacked experts, each expert's projections (gate_up_proj: 2 x n_experts, down_proj:
    n_experts)."""
    stacked = _STACKED.match(name)
    if stacked is None or family not in _PER_EXPERT:
        return [CheckpointTensor(to_hf(name, family))]
    layer, param = stacked.groups()
    module, (gate, up, down) = _PER_EXPERT[family]
    prefix = f"model.layers.{layer}.{module}.experts"
    if param == "down_proj":
        return [CheckpointTensor(f"{prefix}.{e}.{down}.weight", e) for e in range(n_experts)]
    return [CheckpointTensor(f"{prefix}.{e}.{projection}.weight", e, half)
            for e in range(n_experts) for half, projection in enumerate((gate, up))]


def to_hf(name: str, family: str) -> str:
    """`layers.3.attention.wq.weight` -> `model.layers.3.self_attn.q_proj.weight` (family: the
    config.json model_type, which names the router). Stacked experts that the family's checkpoints
    store one expert apart have no one name: see checkpoint_tensors."""
    if name in _TOP:
        return _TOP[name]
    if family in _PER_EXPERT and _STACKED.match(name):
        raise UnknownParameter(f"{name} is stored per expert by {family}: use checkpoint_tensors")
    unsuffixed = _UNSUFFIXED_NAME.match(name)
    if unsuffixed is not None and unsuffixed.group(2) in _UNSUFFIXED:
        return f"model.layers.{unsuffixed.group(1)}.{_UNSUFFIXED[unsuffixed.group(2)]}"
    match = _BLOCK_NAME.match(name)
    if match is None or match.group(3) not in ("weight", "bias"):
        raise UnknownParameter(name)
    layer, module, kind = match.groups()
    if module == "feed_forward.router":
        return f"model.layers.{layer}.{_ROUTER.get(family, 'mlp.gate')}.{kind}"
    if module not in _BLOCK_MODULES:
        raise UnknownParameter(name)
    return f"model.layers.{layer}.{_BLOCK_MODULES[module]}.{kind}"


def from_hf(name: str) -> str:
    """The trainer parameter a checkpoint tensor is (the inverse of to_hf) or is part of (of
    checkpoint_tensors)."""
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
    if module in _HF_ROUTERS:
        return f"layers.{layer}.feed_forward.router.{kind}"
    expert = _HF_EXPERT.match(module)
    if expert is not None and kind == "weight":
        return f"layers.{layer}.feed_forward.experts.{_STACKED_OF[expert.group(3)]}"
    reverse = {theirs: ours for ours, theirs in _BLOCK_MODULES.items()}
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
    return f"{PEFT_PREFIX}model.layers.{layer}.{_BLOCK_MODULES[module]}.{matrix}.weight"
