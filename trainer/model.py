"""A decoder-only transformer: RMSNorm, rotary position embeddings, SwiGLU feed-forward, in one
configurable block that covers the project's own GPT and the Hugging Face Llama, Qwen2, Qwen3 and
Mistral families (optional q/k/v and output biases, q/k RMSNorm, explicit head size, tied embeddings,
Llama 3.1 and YaRN rope scaling, sliding-window layers, attention sinks), and the mixtures of experts
of Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss, whose sparse blocks swap the feed-forward for
trainer/moe.py (Qwen2-MoE's keeps a SwiGLU of its own beside the experts, the shared expert). Parameter
names are the project's; trainer/hf/adapter.py maps them to and from the Hugging Face names.

Rotary embeddings rotate the two halves of each head (x[:d/2], x[d/2:]), the layout Hugging Face
checkpoints are stored in: loading is then a pure renaming, read slice by slice, where the
interleaved-pairs layout would need a permutation of every query and key row (and of Qwen3's q/k norm
gains) that crosses the row shards a rank reads.

Built on the meta device (no memory), sharded, then materialised shard by shard: `init_weights`
fills each rank's local rows from random streams keyed by (seed, parameter name, row chunk), so the
initial model is the same whatever the world size or strategy and no rank ever holds a whole matrix;
or trainer/hf/weights.py loads each rank's rows from safetensors files.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils.checkpoint import checkpoint

from trainer.config import ModelConfig, RopeScaling
from trainer.moe import MoEFeedForward, router_aux_loss
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


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's rule: wavelengths longer than original / low_freq_factor are divided by factor,
    shorter than original / high_freq_factor kept, the band between interpolated smoothly."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_seq_len / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_inv_freq(inv_freq: torch.Tensor, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: dimensions that rotate more than beta_fast
    times over the original context keep their frequency, those rotating fewer than beta_slow times
    are divided by factor, a linear ramp between; and the cos/sin multiplier (attention_factor)."""
    dim = 2 * inv_freq.shape[0]

    def dimension(rotations: float) -> float:
        """The dimension whose wavelength fits `rotations` times into the original context."""
        wavelengths = scaling.original_max_seq_len / (rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-point band: avoid dividing by zero
    index = torch.arange(dim // 2, device=inv_freq.device, dtype=torch.float32)
    ramp = ((index - low) / (high - low)).clamp(0, 1)
    scaled = inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)
    factor = scaling.attention_factor
    if factor is None:
        factor = 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0
    return scaled, factor


def rotary_tables(cfg: ModelConfig, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's angles, [max_seq_len, head_size / 2], in fp32 (YaRN scales
    both by its attention factor)."""
    half = cfg.head_size // 2
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(half, device=device, dtype=torch.float32) / half)
    magnitude = 1.0
    if cfg.rope_scaling is not None and cfg.rope_scaling.type == "yarn":
        inv_freq, magnitude = yarn_inv_freq(inv_freq, cfg.rope_theta, cfg.rope_scaling)
    elif cfg.rope_scaling is not None:
        inv_freq = scaled_inv_freq(inv_freq, cfg.rope_scaling)
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos() * magnitude, angles.sin() * magnitude


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_size] by the angles cos/sin [batch or 1, seq, head_size / 2]:
    feature i pairs with feature i + head_size / 2 (the Hugging Face layout)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


def attention_mask(seq_len: int, device: torch.device | str, document_ids: torch.Tensor | None = None,
                   window: int | None = None) -> torch.Tensor | None:
    """Who may attend to whom, [batch or 1, 1, seq, seq] (True = may): causal, within each packed
    document, and within `window` tokens (the query and the window - 1 before it). None for a plain
    causal sequence, which SDPA handles without a mask."""
    if document_ids is None and window is None:
        return None
    index = torch.arange(seq_len, device=device)
    allowed = index[None, :] <= index[:, None]
    if window is not None:
        allowed = allowed & (index[:, None] - index[None, :] < window)
    allowed = allowed[None, None]
    if document_ids is not None:
        allowed = allowed & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
    return allowed


def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                         mask: torch.Tensor | None) -> torch.Tensor:
    """gpt-oss attention, q/k/v [batch, heads, seq, head_size]: each head's softmax gets one more logit,
    its learned sink, which is then dropped, so the weights on the real keys sum to less than one.
    SDPA has no sink. On CUDA: FlexAttention (compiled, no seq x seq scores in memory) returns each
    row's log-sum-exp, and scaling its output by sigmoid(lse - sink) = Z / (Z + e^sink) adds the sink
    to the denominator. Elsewhere the scores are computed in full, as FlexAttention has no CPU
    backward; both equal transformers' eager attention (tests/trainer/test_gpt_oss.py)."""
    if q.is_cuda:
        return flex_attention_with_sinks(q, k, v, sinks, mask, compiled=True)
    return full_attention_with_sinks(q, k, v, sinks, mask)


def full_attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                              mask: torch.Tensor | None) -> torch.Tensor:
    """The sink attention with every score materialised (fp32)."""
    b, heads, seq, head_size = q.shape
    groups = heads // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if mask is None:
        mask = attention_mask(seq, q.device, window=seq)
    scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(head_size)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, heads, 1, 1).expand(b, heads, seq, 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return weights.to(v.dtype) @ v


_compiled_flex_attention = None


def flex_attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                              mask: torch.Tensor | None, *, compiled: bool) -> torch.Tensor:
    """The sink attention through FlexAttention's log-sum-exp (compiled: the fused kernel; eager:
    the reference implementation, forward only on CPU)."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    global _compiled_flex_attention
    b, _, seq, _ = q.shape
    if mask is None:
        def mask_mod(batch, head, query, key):
            return key <= query
        rows = None
    else:
        allowed = mask.expand(b, 1, seq, seq)

        def mask_mod(batch, head, query, key):
            return allowed[batch, 0, query, key]
        rows = b
    block_mask = create_block_mask(mask_mod, B=rows, H=None, Q_LEN=seq, KV_LEN=seq, device=q.device)
    attend = flex_attention
    if compiled:
        if _compiled_flex_attention is None:
            _compiled_flex_attention = torch.compile(flex_attention)
        attend = _compiled_flex_attention
    out, aux = attend(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1],
                      return_aux=AuxRequest(lse=True))
    scale = torch.sigmoid(aux.lse.float() - sinks.float().view(1, -1, 1))
    return out * scale.unsqueeze(-1).to(out.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_size
        q, kv = cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
        self.wq = nn.Linear(cfg.dim, q, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, kv, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, kv, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q, cfg.dim, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_size, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_size, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attention_sinks else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.sinks is not None:
            out = attention_with_sinks(q, k, v, self.sinks, mask)
        else:
            # Packed documents and sliding windows pass an explicit mask; otherwise the causal flag
            # lets SDPA pick its fastest kernel.
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                 enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """The SwiGLU w2(silu(w1 x) * w3 x): a dense block's feed-forward, or Qwen2-MoE's shared expert."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: MoEFeedForward | FeedForward
        if cfg.is_moe_layer(layer_id):
            shared = FeedForward(cfg.dim, cfg.shared_expert_ffn_dim) if cfg.shared_expert_ffn_dim else None
            self.feed_forward = MoEFeedForward(cfg, shared_expert=shared)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)
        # Attends within cfg.sliding_window tokens (the Transformer passes this block that mask).
        self.sliding = cfg.is_sliding_layer(layer_id)
        # Set by parallelize: recompute this block's activations in backward instead of storing them.
        self.activation_checkpointing = False

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, mask, use_reentrant=False)
        return self._forward(x, cos, sin, mask)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rotary_tables(cfg, "meta")
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for tokens [batch, seq]. Packed documents give each token's position within its
        document (the rotation restarts at each document) and its document id (attention stays
        within a document); without them, one causal sequence from position 0."""
        if positions is None:
            cos, sin = self.rope_cos[None, : tokens.shape[1]], self.rope_sin[None, : tokens.shape[1]]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        seq = tokens.shape[1]
        full_mask = attention_mask(seq, tokens.device, document_ids)
        window_mask = None
        if any(layer.sliding for layer in self.layers) and self.cfg.sliding_window < seq:
            window_mask = attention_mask(seq, tokens.device, document_ids, self.cfg.sliding_window)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, window_mask if layer.sliding and window_mask is not None else full_mask)
        return self.output(self.norm(h))

    def moe_blocks(self) -> list[MoEFeedForward]:
        return [layer.feed_forward for layer in self.layers if isinstance(layer.feed_forward, MoEFeedForward)]

    def router_aux_loss(self) -> torch.Tensor | None:
        """The load-balancing loss of the last forward (transformers' load_balancing_loss_func over
        every MoE block); None for a dense model."""
        stats = [block.stats for block in self.moe_blocks() if block.stats is not None]
        return router_aux_loss(stats, self.cfg.n_experts) if stats else None

    def tokens_per_expert(self) -> torch.Tensor | None:
        """[MoE blocks, n_experts]: top-k assignments per expert in the last forward (this rank's
        tokens); None for a dense model."""
        stats = [block.stats for block in self.moe_blocks() if block.stats is not None]
        return torch.stack([s.tokens_per_expert for s in stats]) if stats else None

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | str) -> None:
        """Fill every (possibly sharded) parameter in place and recompute the rotary tables."""
        self.init_buffers(buffer_device)
        # GPT-2 style: residual-branch output projections shrink with depth so the residual stream's
        # variance does not grow with the number of layers.
        out_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if name.endswith((".lora_a", ".lora_b")):
                continue  # LoRA's own initialisation (trainer/lora.py)
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith((".bias", "_bias")):
                param.zero_()
            else:
                std = out_std if name.endswith(("wo.weight", "w2.weight", "down_proj")) else self.cfg.init_std
                fill_normal(param, std, seed, name)

    def init_buffers(self, device: torch.device | str) -> None:
        """The rotary tables (not part of any checkpoint), on the compute device."""
        self.rope_cos, self.rope_sin = rotary_tables(self.cfg, device)


def fill_normal(param: torch.Tensor, std: float, seed: int, name: str) -> None:
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
    # A stacked-experts tensor's "row" is a whole expert matrix: one stream each.
    rows_per_chunk = INIT_CHUNK_ROWS if param.ndim < 3 else 1
    gen = torch.Generator(device=local.device)
    first, last = row0 // rows_per_chunk, (row0 + rows - 1) // rows_per_chunk
    total_rows = param.shape[0]
    for chunk in range(first, last + 1):
        start = chunk * rows_per_chunk
        chunk_rows = min(rows_per_chunk, total_rows - start)
        gen.manual_seed(stream_seed(seed, name, chunk))
        values = torch.randn((chunk_rows, *local.shape[1:]), generator=gen, device=local.device,
                             dtype=torch.float32)
        lo, hi = max(start, row0), min(start + chunk_rows, row0 + rows)
        local[lo - row0: hi - row0].copy_(values[lo - start: hi - start].mul_(std))


def build_model(cfg: ModelConfig) -> Transformer:
    """The model on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return Transformer(cfg)
