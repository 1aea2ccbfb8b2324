"""A Hugging Face `config.json` read into the trainer's model keys, or refused by field.

The families share one block (trainer/model.py); what differs is read here:

| model_type | q/k/v bias | output bias | q/k norm | head size | rope |
|---|---|---|---|---|---|
| llama   | attention_bias | attention_bias | - | head_dim or hidden/heads | default, llama3 |
| mistral | - | - | - | head_dim or hidden/heads | default |
| mixtral | - | - | - | head_dim or hidden/heads | default |
| qwen2   | always | - | - | hidden/heads | default |
| qwen3   | attention_bias | attention_bias | yes | head_dim | default |
| qwen3_moe | attention_bias | attention_bias | yes | head_dim | default |
| qwen2_moe | qkv_bias (default true) | - | - | head_dim or hidden/heads | default |
| gpt_oss | attention_bias (true) | attention_bias (true) | - | head_dim | yarn |

Sliding-window layers come from layer_types (transformers 5 writes it for every family; gpt-oss:
every other block), else from Mistral's and Mixtral's sliding_window (every block), else from Qwen2/3's
use_sliding_window (the blocks from max_window_layers on; refused for qwen2_moe, whose rule differs).

qwen3_moe adds the mixture of experts (trainer/moe.py): num_experts (transformers 5 writes
num_local_experts), num_experts_per_tok, moe_intermediate_size, norm_topk_prob, and which blocks are
sparse (not in mlp_only_layers, (index + 1) a multiple of decoder_sparse_step; the others keep the
dense intermediate_size feed-forward). qwen2_moe reads the same fields and adds to every sparse block
a shared expert (shared_expert_intermediate_size) gated by sigmoid(shared_expert_gate x). mixtral makes
every block sparse with num_local_experts SwiGLU experts of intermediate_size, the top-k always
renormalised. gpt_oss makes every block sparse with
num_local_experts stacked experts of intermediate_size (biases, clamped SwiGLU: swiglu_alpha,
swiglu_limit), a router with a bias, and attention sinks. router_aux_loss_coef counts when
output_router_logits is true, as in transformers. Other shared-expert fields (n_shared_experts,
num_shared_experts, shared_expert_intermediate_size outside qwen2_moe) and router noise are refused by
name.

Both spellings of the rotary settings are read: transformers 4 writes `rope_theta` + `rope_scaling`,
transformers 5 `rope_parameters`. Anything this trainer would compute differently from transformers
(another activation, MLP biases, a rope type it does not implement) is refused before any process
group starts, naming the config.json field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError, Problem

SUPPORTED_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "gpt_oss")
# The one family whose sparse blocks have a shared expert (shared_expert_intermediate_size).
SHARED_EXPERT_FAMILY = "qwen2_moe"
# Mixture-of-experts fields this trainer does not implement: refused when set (non-zero, non-empty);
# shared_expert_intermediate_size only outside SHARED_EXPERT_FAMILY.
_UNSUPPORTED_MOE_FIELDS = {
    "shared_expert_intermediate_size": "a shared expert",
    "n_shared_experts": "shared experts",
    "num_shared_experts": "shared experts",
    "router_jitter_noise": "router noise",
    "moe_capacity_factor": "an expert capacity (dropped tokens)",
}
BUNDLED_DIR = Path(__file__).resolve().parent.parent / "configs" / "hf"
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class HFArchitecture:
    """What a config.json says about the model."""

    model_fields: dict[str, Any]
    """ModelConfig keys and values (validated by ModelConfig itself)."""
    dtype: str
    """The weights' dtype as config.json names it (bfloat16, float16, float32): exports keep it."""
    raw: dict[str, Any]
    """The file as read: exports write it back with only what training changed."""
    source: str
    """Where it came from, for messages."""


def bundled_config_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.json"))


def config_path(name_or_path: str, key: str) -> Path:
    """A config.json path: a file, a directory holding config.json, or a bundled name."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError([Problem(key, name_or_path, "is a directory without config.json",
                                       "point it at a Hugging Face model directory (config.json, "
                                       "*.safetensors, tokenizer.json)")])
        return path
    if path.is_file():
        return path
    bundled = BUNDLED_DIR / f"{name_or_path}.json"
    if bundled.is_file():
        return bundled
    raise ConfigError([Problem(key, name_or_path, "is neither a directory, a config.json nor a bundled "
                               "architecture", f"use a model directory or one of: "
                               f"{', '.join(bundled_config_names())}")])


def read_architecture(name_or_path: str, key: str) -> HFArchitecture:
    path = config_path(name_or_path, key)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError([Problem(key, str(path), f"cannot be read as JSON: {e}",
                                   "restore the model's config.json")]) from None
    if not isinstance(raw, dict):
        raise ConfigError([Problem(key, str(path), "is not a JSON object",
                                   "restore the model's config.json")])
    return architecture_from_dict(raw, str(path))


def _rope(raw: dict[str, Any], problems: list[Problem], where: str) -> dict[str, Any]:
    """rope_theta and rope_scaling from either spelling."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta, scaling, field = params.get("rope_theta", raw.get("rope_theta")), params, "rope_parameters"
    else:
        theta, scaling, field = raw.get("rope_theta"), raw.get("rope_scaling"), "rope_scaling"
    out: dict[str, Any] = {"rope_theta": float(theta if theta is not None else 10000.0)}
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "llama3":
        original = scaling.get("original_max_position_embeddings")
        if not scaling.get("factor") or not original:
            problems.append(Problem(f"{where}: {field}", scaling, "has rope_type llama3 without factor or "
                                    "original_max_position_embeddings", "restore the model's config.json"))
            return out
        out["rope_scaling"] = {"type": "llama3", "factor": float(scaling["factor"]),
                               "low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
                               "high_freq_factor": float(scaling.get("high_freq_factor", 4.0)),
                               "original_max_seq_len": int(original)}
    elif rope_type == "yarn":
        original = scaling.get("original_max_position_embeddings")
        # transformers' rule for a missing factor: the context stretch itself.
        stretch = raw.get("max_position_embeddings", 0) / original if original else 0
        factor = scaling.get("factor") or stretch
        if not factor or not original:
            problems.append(Problem(f"{where}: {field}", scaling, "has rope_type yarn without factor or "
                                    "original_max_position_embeddings", "restore the model's config.json"))
            return out
        if scaling.get("mscale") or scaling.get("mscale_all_dim") or scaling.get("partial_rotary_factor"):
            problems.append(Problem(f"{where}: {field}", scaling, "sets mscale, mscale_all_dim or "
                                    "partial_rotary_factor, which this trainer's YaRN does not implement",
                                    "use a model without them (gpt-oss has none)"))
            return out
        out["rope_scaling"] = {"type": "yarn", "factor": float(factor), "original_max_seq_len": int(original),
                               "beta_fast": float(scaling.get("beta_fast") or 32.0),
                               "beta_slow": float(scaling.get("beta_slow") or 1.0),
                               "truncate": bool(scaling.get("truncate", True)),
                               "attention_factor": scaling.get("attention_factor")}
    elif rope_type != "default":
        problems.append(Problem(f"{where}: {field}.rope_type", rope_type, "is a rotary scaling this trainer "
                                "does not implement", "use a model with rope_type default, llama3 or yarn"))
    return out


def _moe(raw: dict[str, Any], family: str, problems: list[Problem], where: str) -> dict[str, Any]:
    """Qwen3-MoE's, Qwen2-MoE's and Mixtral's expert fields, as transformers' Qwen3MoeDecoderLayer,
    Qwen2MoeDecoderLayer and MixtralDecoderLayer read them."""
    shared = family == SHARED_EXPERT_FAMILY
    for name, what in _UNSUPPORTED_MOE_FIELDS.items():
        if shared and name == "shared_expert_intermediate_size":
            continue
        if raw.get(name):
            problems.append(Problem(f"{where}: {name}", raw[name], f"asks for {what}, which this trainer "
                                    "does not implement", "use a model without it"))
    mixtral = family == "mixtral"
    if mixtral:
        experts_field, width_field = "num_local_experts", "intermediate_size"
        experts = raw.get("num_local_experts")
    else:
        experts_field, width_field = "num_experts", "moe_intermediate_size"
        experts = raw.get("num_experts", raw.get("num_local_experts"))
    names = {experts_field: experts, "num_experts_per_tok": raw.get("num_experts_per_tok"),
             width_field: raw.get(width_field)}
    bad = [name for name, value in names.items() if not isinstance(value, int) or value < 0]
    if bad:
        problems.extend(Problem(f"{where}: {name}", names[name], "is missing or not an integer",
                                "restore the model's config.json") for name in bad)
        return {}
    if experts == 0:
        return {}
    coef = float(raw.get("router_aux_loss_coef") or 0.0) if raw.get("output_router_logits") else 0.0
    fields = {"n_experts": experts, "n_active_experts": names["num_experts_per_tok"],
              "moe_ffn_dim": names[width_field], "router_aux_loss_coef": coef}
    if mixtral:  # every block sparse, the top-k always renormalised
        return {**fields, "norm_topk_prob": True}
    if shared:
        width = raw.get("shared_expert_intermediate_size")
        if not isinstance(width, int) or width < 1:
            problems.append(Problem(f"{where}: shared_expert_intermediate_size", width, "is missing or not a "
                                    "positive integer", "restore the model's config.json"))
            return {}
        fields["shared_expert_ffn_dim"] = width
    step = raw.get("decoder_sparse_step") or 1
    dense = set(raw.get("mlp_only_layers") or [])
    sparse = [i for i in range(raw["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0]
    return {**fields, "norm_topk_prob": bool(raw.get("norm_topk_prob")), "moe_layers": sparse}


def _gpt_oss_moe(raw: dict[str, Any], problems: list[Problem], where: str) -> dict[str, Any]:
    """gpt-oss: every block sparse, stacked experts with biases and the clamped SwiGLU, a router bias,
    attention sinks."""
    experts = raw.get("num_local_experts")
    top_k = raw.get("num_experts_per_tok", raw.get("experts_per_token"))
    bad = [(name, value) for name, value in (("num_local_experts", experts), ("num_experts_per_tok", top_k))
           if not isinstance(value, int) or value < 1]
    if bad:
        problems.extend(Problem(f"{where}: {name}", value, "is missing or not a positive integer",
                                "restore the model's config.json") for name, value in bad)
        return {}
    coef = float(raw.get("router_aux_loss_coef") or 0.0) if raw.get("output_router_logits") else 0.0
    return {"n_experts": experts, "n_active_experts": top_k, "moe_ffn_dim": raw["intermediate_size"],
            "norm_topk_prob": True, "router_bias": True, "expert_kind": "gpt_oss",
            "swiglu_alpha": float(raw.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(raw.get("swiglu_limit", 7.0)),
            "router_aux_loss_coef": coef, "attention_sinks": True}


def _sliding(raw: dict[str, Any], family: str, problems: list[Problem], where: str) -> dict[str, Any]:
    """sliding_window and sliding_layers from layer_types, Mistral's sliding_window or Qwen's
    use_sliding_window."""
    n_layers = raw["num_hidden_layers"]
    layer_types = raw.get("layer_types")
    if layer_types:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown or len(layer_types) != n_layers:
            problems.append(Problem(f"{where}: layer_types", unknown or len(layer_types),
                                    f"must be {n_layers} entries of full_attention or sliding_attention",
                                    "restore the model's config.json"))
            return {}
        sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    elif family in ("mistral", "mixtral") and raw.get("sliding_window"):
        sliding = list(range(n_layers))
    elif raw.get("use_sliding_window") and family == "qwen2_moe":
        problems.append(Problem(f"{where}: use_sliding_window", True, "has no layer_types saying which "
                                "blocks slide (transformers 5 picks every other block below "
                                "max_window_layers for qwen2_moe, unlike qwen2's rule)",
                                "add the layer_types that transformers' save_pretrained writes, or set "
                                "use_sliding_window false"))
        return {}
    elif raw.get("use_sliding_window"):
        sliding = list(range(raw.get("max_window_layers", 0), n_layers))
    else:
        sliding = []
    if not sliding or not raw.get("sliding_window"):
        return {}
    return {"sliding_window": int(raw["sliding_window"]),
            "sliding_layers": None if len(sliding) == n_layers else sliding}


def architecture_from_dict(raw: dict[str, Any], where: str) -> HFArchitecture:
    problems: list[Problem] = []
    family = raw.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise ConfigError([Problem(f"{where}: model_type", family, "is not a family this trainer implements",
                                   f"use one of: {', '.join(SUPPORTED_FAMILIES)}")])
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    missing = [name for name in required if not isinstance(raw.get(name), int)]
    if missing:
        raise ConfigError([Problem(f"{where}: {name}", raw.get(name), "is missing or not an integer",
                                   "restore the model's config.json") for name in missing])
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(Problem(f"{where}: hidden_act", raw["hidden_act"], "is not silu (SwiGLU)",
                                "use a model with hidden_act silu"))
    if raw.get("mlp_bias"):
        problems.append(Problem(f"{where}: mlp_bias", True, "asks for feed-forward biases, which this "
                                "trainer does not implement", "use a model without MLP biases"))
    attention_bias = bool(raw.get("attention_bias", family == "gpt_oss"))
    fields: dict[str, Any] = {
        "family": family,
        "vocab_size": raw["vocab_size"],
        "dim": raw["hidden_size"],
        "n_layers": raw["num_hidden_layers"],
        "n_heads": raw["num_attention_heads"],
        "n_kv_heads": raw.get("num_key_value_heads") or raw["num_attention_heads"],
        "head_dim": raw.get("head_dim") or None,
        "ffn_dim": raw["intermediate_size"],
        "max_seq_len": int(raw.get("max_position_embeddings", 2048)),
        "norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always; Qwen2-MoE unless transformers 5's qkv_bias says otherwise.
        "qkv_bias": {"qwen2": True, "qwen2_moe": bool(raw.get("qkv_bias", True))}.get(family, attention_bias),
        "o_bias": False if family in ("qwen2", "qwen2_moe", "mistral", "mixtral") else attention_bias,
        "qk_norm": family in ("qwen3", "qwen3_moe"),
        **_rope(raw, problems, where),
    }
    if family in ("qwen3_moe", "qwen2_moe", "mixtral"):
        fields.update(_moe(raw, family, problems, where))
    if family == "gpt_oss":
        fields.update(_gpt_oss_moe(raw, problems, where))
    fields.update(_sliding(raw, family, problems, where))
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if dtype not in DTYPE_NAMES:
        problems.append(Problem(f"{where}: torch_dtype", dtype, "is not a dtype the trainer exports",
                                f"use one of: {', '.join(DTYPE_NAMES)}"))
    if problems:
        raise ConfigError(problems)
    return HFArchitecture(fields, dtype, raw, where)


def model_type_of(family: str) -> str:
    """The model_type an export writes: the project's own GPT is a Llama."""
    return "llama" if family == "gpt" else family
