"""LoRA: low-rank adapters on the attention and feed-forward projections (Hu et al. 2021, PEFT's
layout: y = W x + b + (alpha / r) * B A x, A [r, in] random, B [out, r] zero so training starts
from the base model exactly).

Applied on the meta device before sharding: each targeted nn.Linear becomes a LoRALinear that keeps
the same `weight`/`bias` names (so loading and exporting the base weights is unchanged) and gains
`lora_a`/`lora_b`. Everything else is frozen; FSDP2 shards adapters and frozen weights in the same
units (it all-gathers mixed dtypes and reduce-scatters only the adapters' gradients). Frozen weights
are kept in the compute dtype (parallel.param_dtype): they need no fp32 master copy since they never
change, which halves their memory under bf16.

Mixture-of-experts models: the attention projections of every block, the feed-forward projections of
the dense blocks and those of Qwen2-MoE's shared expert get adapters; the router, the shared expert's
gate and the routed experts stay frozen (the same linear layers PEFT's target_modules names match in
transformers 5, whose routed experts are stacked parameters, not linear layers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import LoraConfig
from trainer.hf.adapter import LORA_TARGETS
from trainer.model import Transformer, fill_normal
from trainer.moe import MoEFeedForward


class LoRALinear(nn.Linear):
    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None,
                         device=base.weight.device, dtype=base.weight.dtype)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_b = nn.Parameter(torch.empty(base.out_features, rank, device=base.weight.device))
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapter = F.linear(F.linear(x, self.lora_a), self.lora_b)
        return F.linear(x, self.weight, self.bias) + adapter * self.scaling

    def merged_weight(self, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
        """W + (alpha / r) B A in fp32, for full (unsharded) adapter matrices and this layer's local
        rows of W (the caller slices lora_b to the same rows)."""
        return self.weight.float() + (lora_b.float() @ lora_a.float()) * self.scaling


def apply_lora(model: Transformer, cfg: LoraConfig, frozen_dtype: torch.dtype) -> list[str]:
    """Adapters on the targeted projections of every block; freeze and cast everything else. Returns
    the adapted modules' names."""
    wanted = {LORA_TARGETS[name] for name in cfg.target_modules}
    adapted = []
    for block_no, block in enumerate(model.layers):
        for path in sorted(wanted):
            parent_name, attr = path.split(".")
            parent = getattr(block, parent_name)
            if isinstance(parent, MoEFeedForward):
                if parent.shared_expert is None:
                    continue  # a sparse block: its experts stay frozen
                # The feed-forward targets adapt the shared expert, a dense SwiGLU.
                parent, path = parent.shared_expert, f"{parent_name}.shared_expert.{attr}"
            setattr(parent, attr, LoRALinear(getattr(parent, attr), cfg.rank, cfg.alpha))
            adapted.append(f"layers.{block_no}.{path}")
    for name, param in model.named_parameters():
        if not name.endswith((".lora_a", ".lora_b")):
            param.requires_grad_(False)
            param.data = param.data.to(frozen_dtype)
    return adapted


@torch.no_grad()
def init_lora(model: Transformer, seed: int) -> None:
    """A: normal with std 1/sqrt(in_features), the scale of PEFT's Kaiming-uniform; B: zero, so the
    adapted model starts equal to the base model. Seeded per parameter name like init_weights."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            fill_normal(module.lora_a, module.in_features ** -0.5, seed, f"{name}.lora_a")
            module.lora_b.zero_()
