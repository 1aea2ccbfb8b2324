"""A decoder-only transformer: RMSNorm, rotary position embeddings, SwiGLU feed-forward.

Built on the meta device (no memory), sharded, then materialised shard by shard: `init_weights`
fills each rank's local rows from random streams keyed by (seed, parameter name, row chunk), so the
initial model is the same whatever the world size or strategy and no rank ever holds a whole matrix.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils.checkpoint import checkpoint

from trainer.config import ModelConfig
from trainer.seeding import stream_seed

# Rows per independent random stream: small enough that a rank wastes little generating the rows of
# a chunk it shares with its neighbour, large enough that seeding is negligible.
INIT_CHUNK_ROWS = 256


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: bf16/fp16 squares lose too much precision.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(cfg: ModelConfig, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    half = cfg.head_dim // 2
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(half, device=device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (even, odd) feature pairs of x [batch, seq, heads, head_dim] by position angles."""
    xf = x.float().unflatten(-1, (-1, 2))
    x1, x2 = xf[..., 0], xf[..., 1]
    cos, sin = cos[: x.shape[1], None, :], sin[: x.shape[1], None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rotary(self.wq(x).view(b, t, self.n_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.wk(x).view(b, t, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        # Set by parallelize: recompute this block's activations in backward instead of storing them.
        self.activation_checkpointing = False

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg, "meta")
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | str) -> None:
        """Fill every (possibly sharded) parameter in place and recompute the rotary tables."""
        self.rope_cos, self.rope_sin = rotary_tables(self.cfg, buffer_device)
        # GPT-2 style: residual-branch output projections shrink with depth so the residual stream's
        # variance does not grow with the number of layers.
        out_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                std = out_std if name.endswith(("wo.weight", "w2.weight")) else self.cfg.init_std
                _fill_normal(param, std, seed, name)


def _fill_normal(param: torch.Tensor, std: float, seed: int, name: str) -> None:
    """Fill this rank's rows of a parameter from per-chunk random streams of the full tensor."""
    if isinstance(param, DTensor):
        local = param.to_local()
        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        row0 = offset[0]
    else:
        local, row0 = param, 0
    rows = local.shape[0]
    if rows == 0:
        return
    gen = torch.Generator(device=local.device)
    first, last = row0 // INIT_CHUNK_ROWS, (row0 + rows - 1) // INIT_CHUNK_ROWS
    total_rows = param.shape[0]
    for chunk in range(first, last + 1):
        start = chunk * INIT_CHUNK_ROWS
        chunk_rows = min(INIT_CHUNK_ROWS, total_rows - start)
        gen.manual_seed(stream_seed(seed, name, chunk))
        values = torch.randn((chunk_rows, *local.shape[1:]), generator=gen, device=local.device,
                             dtype=torch.float32)
        lo, hi = max(start, row0), min(start + chunk_rows, row0 + rows)
        local[lo - row0: hi - row0].copy_(values[lo - start: hi - start].mul_(std))


def build_model(cfg: ModelConfig) -> Transformer:
    """The model on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return Transformer(cfg)
