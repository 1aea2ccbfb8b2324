"""The trainer's typed configuration: one pydantic model, loaded from a YAML file (or a shipped
config name), then `--set key=value` overrides, then the plain command-line flags.

Bad input raises `ConfigError` listing every problem at once, each naming the key, the value and the
fix. Checks that need the launch (world size, GPUs per node) live in `derive_layout`, which runs
before any process group or tensor exists.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from trainer.checkpoint import CheckpointConfig
from trainer.errors import ConfigError, Problem, yaml_problem
from trainer.hf.config import read_architecture
from trainer.tracking import TrackingConfig

SHIPPED_CONFIG_DIR = Path(__file__).parent / "configs"
DOCS = "docs/trainer.md"


class _Section(BaseModel):
    # Each field's docstring documents it (tests/trainer/test_config.py checks every key has one, with
    # tests/docstrings.py). Pydantic is not asked to read them (use_attribute_docstrings): it parses each
    # class's source for that, 0.15 s of every rank's start.
    model_config = ConfigDict(extra="forbid", frozen=True)


class Strategy(StrEnum):
    """The FSDP1 names users know, mapped onto FSDP2 (see docs/trainer.md)."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    HYBRID_SHARD = "HYBRID_SHARD"
    NO_SHARD = "NO_SHARD"


DType = Literal["fp32", "bf16", "fp16"]


class RopeScaling(_Section):
    """Rotary scaling for contexts longer than pre-training: Llama 3.1's frequency-dependent rule
    (`rope_type: llama3` in config.json) or YaRN (`rope_type: yarn`, gpt-oss)."""

    type: Literal["llama3", "yarn"] = "llama3"
    """llama3: long wavelengths stretched by `factor`, short ones kept, the band between interpolated.
    yarn: the same idea with the band set by beta_fast/beta_slow rotations, and cos/sin multiplied by
    attention_factor."""
    factor: float = Field(gt=0)
    """How much the long wavelengths are stretched (8 for Llama 3.1, 32 for gpt-oss)."""
    low_freq_factor: float = Field(default=1.0, gt=0)
    """llama3: wavelengths above original_max_seq_len / low_freq_factor are divided by `factor`."""
    high_freq_factor: float = Field(default=4.0, gt=0)
    """llama3: wavelengths below original_max_seq_len / high_freq_factor are kept."""
    original_max_seq_len: int = Field(default=8192, ge=1)
    """The context the model was pre-trained with before scaling."""
    beta_fast: float = Field(default=32.0, gt=0)
    """yarn: dimensions rotating more than beta_fast times over the original context are kept."""
    beta_slow: float = Field(default=1.0, gt=0)
    """yarn: dimensions rotating fewer than beta_slow times are divided by `factor`."""
    truncate: bool = True
    """yarn: round the band's bounds to whole dimensions (gpt-oss: false)."""
    attention_factor: float | None = Field(default=None, gt=0)
    """yarn: the cos/sin multiplier; empty: 0.1 ln(factor) + 1, as the YaRN paper and transformers."""


class ModelConfig(_Section):
    """A decoder-only transformer (RMSNorm, rotary embeddings, SwiGLU): the project's own GPT shape or,
    from a Hugging Face `config.json`, Llama 3/3.1/3.2, Qwen2/2.5, Qwen3, Qwen3-MoE, Mistral, Mixtral and
    gpt-oss."""

    hf_dir: str | None = None
    """A Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or an s3:// prefix
    holding one: sets the architecture from its config.json and loads its weights, sharded
    (docs/trainer.md). The shape keys below are then taken from config.json."""
    hf_config: str | None = None
    """The architecture alone, from a config.json (a file path, or a bundled name such as
    `llama3-8b`): presets and the estimator. model.hf_dir, when set, wins."""
    cache_dir: str | None = None
    """Where an s3:// model.hf_dir is downloaded, once per node (shared or NVMe storage); empty:
    $FSDP_MODEL_CACHE, else ~/.cache/fsdp-cluster/models."""
    family: str = "gpt"
    """The config.json `model_type` (llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, qwen2_moe,
    gpt_oss); gpt: the project's own model (exported as llama, which it is shaped like)."""
    vocab_size: int = Field(default=32000, ge=2)
    """Tokens in the vocabulary (embedding and output projection rows)."""
    dim: int = Field(default=2048, ge=8)
    """Hidden size."""
    n_layers: int = Field(default=16, ge=1)
    """Transformer blocks."""
    n_heads: int = Field(default=16, ge=1)
    """Query heads per attention layer."""
    n_kv_heads: int | None = Field(default=None, ge=1)
    """Grouped-query attention: fewer key/value heads than query heads; empty means n_heads."""
    head_dim: int | None = Field(default=None, ge=2)
    """Size of one attention head; empty means dim / n_heads (Qwen3 sets it explicitly)."""
    ffn_dim: int = Field(default=5632, ge=1)
    """Hidden size of the SwiGLU feed-forward layer."""
    max_seq_len: int = Field(default=2048, ge=2)
    """Longest sequence the rotary tables are built for."""
    rope_theta: float = Field(default=10000.0, gt=0)
    """Base of the rotary embedding frequencies."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1 or YaRN rotary scaling; empty: none."""
    norm_eps: float = Field(default=1e-5, gt=0)
    """RMSNorm epsilon."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2, Llama with attention_bias)."""
    o_bias: bool = False
    """A bias on the attention output projection (attention_bias of Llama and Qwen3)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before the rotation (Qwen3)."""
    tie_embeddings: bool = False
    """The output projection is the input embedding (Llama 3.2 1B/3B)."""
    sliding_window: int | None = Field(default=None, ge=1)
    """Sliding-window attention: a token attends to itself and the sliding_window - 1 tokens before it
    in the blocks model.sliding_layers names (Mistral: every block; gpt-oss: every other)."""
    sliding_layers: list[int] | None = None
    """The blocks (0-based) with the sliding window; empty: every block when sliding_window is set.
    From a config.json: its layer_types entries that are sliding_attention."""
    attention_sinks: bool = False
    """gpt-oss's attention sinks: a learned logit per query head that joins every softmax
    denominator (attention can go nowhere), then is dropped."""
    init_std: float = Field(default=0.02, gt=0)
    """Standard deviation of the normal weight initialisation (models trained from scratch)."""
    n_experts: int = Field(default=0, ge=0)
    """Mixture of experts (Qwen3-MoE's num_experts): experts per sparse block; 0: every block is dense."""
    n_active_experts: int = Field(default=1, ge=1)
    """Experts each token is routed to (top-k, num_experts_per_tok)."""
    moe_ffn_dim: int | None = Field(default=None, ge=1)
    """Hidden size of one expert's SwiGLU (moe_intermediate_size); empty: ffn_dim."""
    norm_topk_prob: bool = False
    """Renormalise the top-k router probabilities to sum to 1 (Qwen3-MoE's norm_topk_prob)."""
    router_aux_loss_coef: float = Field(default=0.0, ge=0)
    """Weight of the load-balancing loss (Switch Transformer, as transformers computes it) added to the
    training loss; 0: not added (it is still computed and reported). From a config.json: its
    router_aux_loss_coef when output_router_logits is true (transformers adds it only then), else 0;
    may be set beside model.hf_dir."""
    moe_layers: list[int] | None = None
    """The sparse blocks (0-based); empty: every block when n_experts > 0. From a config.json: the
    blocks not in mlp_only_layers whose (index + 1) is a multiple of decoder_sparse_step."""
    router_bias: bool = False
    """A bias on the router's logits (gpt-oss)."""
    shared_expert_ffn_dim: int = Field(default=0, ge=0)
    """Qwen2-MoE's shared expert (shared_expert_intermediate_size): a SwiGLU of this width in every sparse
    block that every token goes through, its output scaled by sigmoid(shared_expert_gate x) and added to
    the routed experts'; 0: none."""
    expert_kind: Literal["swiglu", "gpt_oss"] = "swiglu"
    """swiglu: SwiGLU experts (Qwen3-MoE, Mixtral), stacked as transformers 5 holds them (gate_up_proj
    [experts, 2 x moe_ffn_dim, dim], gate rows then up rows, down_proj [experts, dim, moe_ffn_dim]).
    gpt_oss: stacked as gpt-oss stores them (gate_up_proj [experts, dim, 2 x moe_ffn_dim] with gate and
    up interleaved, down_proj, both with biases) with its clamped SwiGLU (swiglu_alpha, swiglu_limit)."""
    swiglu_alpha: float = Field(default=1.702, gt=0)
    """gpt_oss experts: the gate's activation is gate * sigmoid(swiglu_alpha * gate)."""
    swiglu_limit: float = Field(default=7.0, gt=0)
    """gpt_oss experts: gate clamped to at most swiglu_limit, up to +-swiglu_limit, before the product
    (up + 1) * activation."""

    @model_validator(mode="after")
    def _heads_fit(self) -> ModelConfig:
        problems = []
        if self.head_dim is None and self.dim % self.n_heads:
            problems.append(Problem("model.dim", self.dim,
                                    f"is not divisible by model.n_heads={self.n_heads}",
                                    "choose dim = n_heads * head_dim (e.g. 128 per head), or set "
                                    "model.head_dim"))
        elif self.head_size % 2:
            problems.append(Problem("model.head_dim" if self.head_dim else "model.n_heads",
                                    self.head_dim or self.n_heads,
                                    f"gives an odd head size {self.head_size} (rotary embeddings "
                                    "rotate pairs)", "choose an even head size"))
        kv = self.kv_heads
        if self.n_heads % kv:
            problems.append(Problem("model.n_kv_heads", kv, f"does not divide model.n_heads={self.n_heads}",
                                    "use a divisor of n_heads (or leave it empty for n_heads)"))
        if self.n_experts and self.n_active_experts > self.n_experts:
            problems.append(Problem("model.n_active_experts", self.n_active_experts,
                                    f"is more than model.n_experts={self.n_experts}",
                                    "route each token to at most n_experts experts"))
        block_lists = (("model.moe_layers", self.moe_layers), ("model.sliding_layers", self.sliding_layers))
        for key, layers in block_lists:
            bad = [i for i in layers or [] if not 0 <= i < self.n_layers]
            if bad:
                problems.append(Problem(key, bad, f"are not blocks 0..{self.n_layers - 1}",
                                        "list block indices below model.n_layers"))
        if self.shared_expert_ffn_dim and not self.n_experts:
            problems.append(Problem("model.shared_expert_ffn_dim", self.shared_expert_ffn_dim,
                                    "is a shared expert of the sparse blocks, and model.n_experts is 0",
                                    "set model.n_experts, or model.shared_expert_ffn_dim=0"))
        if self.sliding_layers and not self.sliding_window:
            problems.append(Problem("model.sliding_layers", self.sliding_layers, "needs model.sliding_window",
                                    "set model.sliding_window (tokens), or remove model.sliding_layers"))
        if problems:
            raise ConfigError(problems)
        return self

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` has the mixture of experts instead of the dense feed-forward."""
        return self.n_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    def is_sliding_layer(self, layer: int) -> bool:
        """Whether block `layer` attends within model.sliding_window tokens."""
        if self.sliding_window is None:
            return False
        return self.sliding_layers is None or layer in self.sliding_layers

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_dim

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """head_dim, or dim / n_heads when it is not set."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def num_params(self) -> int:
        """Parameter count from the sizes alone (tests check it against the built model)."""
        return self._params(self.n_experts)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: num_params with n_active_experts of the n_experts experts of
        each sparse block (the router counts whole); num_params for a dense model."""
        return self._params(self.n_active_experts)

    def _params(self, experts: int) -> int:
        q, kv = self.n_heads * self.head_size, self.kv_heads * self.head_size
        attention = self.dim * (q + 2 * kv) + q * self.dim
        attention += (q + 2 * kv) * self.qkv_bias + self.dim * self.o_bias + 2 * self.head_size * self.qk_norm
        attention += self.n_heads * self.attention_sinks
        sparse = sum(self.is_moe_layer(i) for i in range(self.n_layers))
        dense_ffn = 3 * self.dim * self.ffn_dim
        expert = 3 * self.dim * self.expert_ffn_dim
        if self.expert_kind == "gpt_oss":
            expert += 2 * self.expert_ffn_dim + self.dim  # the gate_up and down biases
        moe_ffn = experts * expert + self.n_experts * (self.dim + self.router_bias)  # + router
        if self.shared_expert_ffn_dim:  # every token's: its SwiGLU and its gate
            moe_ffn += 3 * self.dim * self.shared_expert_ffn_dim + self.dim
        per_layer = attention + 2 * self.dim
        output = 0 if self.tie_embeddings else self.dim * self.vocab_size
        return (self.n_layers * per_layer + (self.n_layers - sparse) * dense_ffn + sparse * moe_ffn
                + self.embedding_params + self.dim + output)

    def flops_per_token(self, seq_len: int, *, frozen_weights: bool = False) -> int:
        """Training FLOPs per token (forward + backward), PaLM appendix B: the matmul FLOPs of the
        non-embedding parameters a token uses (the active ones: k of n experts; the output
        projection counts, tied or not) plus the attention score/value products. 6 per parameter
        is 2 forward, 2 for the gradient of the input and 2 for the weight's; `frozen_weights`
        (LoRA's base) have no weight gradient, so 4."""
        attention = 6 * self.n_layers * self.n_heads * (2 * self.head_size) * seq_len
        output = self.embedding_params if self.tie_embeddings else 0
        per_param = 4 if frozen_weights else 6
        return per_param * (self.active_params - self.embedding_params + output) + attention

    def lora_shapes(self, targets: list[str]) -> list[tuple[int, int]]:
        """(in, out) of every projection LoRA adapts for `targets` (Hugging Face module names):
        attention in every block, the feed-forward in dense blocks and the sparse blocks' shared expert
        (the routed experts stay frozen)."""
        q, kv = self.n_heads * self.head_size, self.kv_heads * self.head_size
        attention = {"q_proj": (self.dim, q), "k_proj": (self.dim, kv), "v_proj": (self.dim, kv),
                     "o_proj": (q, self.dim)}

        def swiglu(width: int) -> dict[str, tuple[int, int]]:
            return {"gate_proj": (self.dim, width), "up_proj": (self.dim, width),
                    "down_proj": (width, self.dim)}

        dense, sparse = {**attention, **swiglu(self.ffn_dim)}, attention
        if self.shared_expert_ffn_dim:
            sparse = {**attention, **swiglu(self.shared_expert_ffn_dim)}
        shapes = []
        for layer in range(self.n_layers):
            modules = sparse if self.is_moe_layer(layer) else dense
            shapes += [modules[name] for name in targets if name in modules]
        return shapes


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(_Section):
    """Low-rank adapters (LoRA): the base weights are frozen (and kept in the compute dtype), only the
    adapters train, sharded with FSDP2 like everything else."""

    rank: int = Field(default=0, ge=0)
    """Rank r of each adapter; 0 turns LoRA off (full fine-tuning)."""
    alpha: float = Field(default=16.0, gt=0)
    """Scale: the adapter's output is multiplied by alpha / rank."""
    target_modules: list[Literal[LORA_MODULES]] = list(LORA_MODULES)
    """The linear layers that get adapters, by their Hugging Face (PEFT) names."""
    export: Literal["adapter", "merged"] = "adapter"
    """What checkpoint.hf_export_dir receives: a PEFT adapter directory (adapter_config.json,
    adapter_model.safetensors) or the base model with the adapters merged into its weights."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class ParallelConfig(_Section):
    strategy: Strategy = Strategy.FULL_SHARD
    """FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD (the FSDP1 names, mapped onto FSDP2)."""
    sharding_degree: int | None = Field(default=None, ge=1)
    """Ranks in one shard group (HYBRID_SHARD): empty means the local ranks of a node (GPUs per
    node)."""
    param_dtype: DType = "fp32"
    """Compute dtype of the all-gathered parameters; the sharded master copy stays fp32."""
    reduce_dtype: DType = "fp32"
    """Dtype of the gradient reduce-scatter/all-reduce. bf16 halves the gradient traffic of fp32:
    the "gradient compression" option (docs/trainer.md)."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer state in host memory."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass instead of keeping them."""
    compile: bool = False
    """torch.compile each transformer block."""
    lora: LoraConfig = LoraConfig()
    """Low-rank adapters for fine-tuning (rank 0: off)."""
    expert_parallel: int = Field(default=1, ge=1)
    """Expert parallelism for mixture-of-experts models: groups of this many consecutive ranks split
    each block's experts (n_experts / expert_parallel each), tokens travel to their experts' rank and
    back by all-to-all, and FSDP shards each rank's experts over the ranks holding the same ones; so
    no rank all-gathers more than n_experts / expert_parallel experts. 1: off. Divides the world size
    and model.n_experts; FULL_SHARD or SHARD_GRAD_OP."""

    @model_validator(mode="after")
    def _precision(self) -> ParallelConfig:
        if self.reduce_dtype == "fp16":
            raise ConfigError([Problem("parallel.reduce_dtype", "fp16",
                                       "overflows when gradients are summed across ranks",
                                       "use fp32 (exact) or bf16 (half the traffic, fp32 range)")])
        return self


class OptimConfig(_Section):
    lr: float = Field(default=1e-5, gt=0)
    """Peak learning rate (AdamW), reached after the warm-up."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """Fraction of lr the cosine schedule decays to at the last step."""
    warmup_steps: int = Field(default=500, ge=0)
    """Steps of linear warm-up from 0 to lr."""
    weight_decay: float = Field(default=0.1, ge=0)
    """AdamW weight decay (not applied to norm gains)."""
    beta1: float = Field(default=0.9, ge=0, lt=1)
    """AdamW first-moment decay."""
    beta2: float = Field(default=0.95, ge=0, lt=1)
    """AdamW second-moment decay."""
    eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this; empty disables clipping (the norm is still logged)."""
    fused: bool = False
    """AdamW's fused implementation (one kernel per parameter group and device: fewer launches than
    the default multi-tensor `foreach` one; torchtitan's default). Results match within rounding."""


class TrainingConfig(_Section):
    steps: int = Field(default=10000, ge=1)
    """Optimizer steps to reach."""
    global_batch_size: int = Field(default=4096, ge=1)
    """Sequences per optimizer step over all ranks and micro-batches."""
    gradient_accumulation: int = Field(default=16, ge=1)
    """Micro-batches per optimizer step on each rank."""
    micro_batch_size: int | None = Field(default=None, ge=1)
    """Sequences per rank per micro-batch; empty means global_batch_size / (accumulation * ranks)."""
    seed: int = Field(default=0, ge=0)
    """Seed of the initial weights and the data order."""


class DataConfig(_Section):
    source: Literal["synthetic", "tokens", "jsonl", "parquet"] = "synthetic"
    """synthetic: a deterministic, learnable token stream; tokens: memory-mapped token files made by
    `python -m trainer.data build` or `tokenize`; jsonl / parquet: text or chat records, tokenized at
    start-up with the model's own tokenizer (model.hf_dir) and packed with document masking."""
    path: str | None = None
    """tokens: a token file or a directory of `*.bin` files; jsonl / parquet: a file or a directory of
    `*.jsonl` / `*.parquet` files (read in sorted order)."""
    text_field: str = Field(default="text", min_length=1)
    """jsonl / parquet: the field holding a document's text; the loss counts every token."""
    messages_field: str | None = Field(default=None, min_length=1)
    """jsonl / parquet: the field holding a chat (a list of {role, content} messages), rendered with the
    model's chat template; the loss counts only the assistant replies. Set, it replaces text_field."""
    seq_len: int = Field(default=2048, ge=2)
    """Tokens per sequence."""
    prefetch: int = Field(default=2, ge=1)
    """Batches staged on the device ahead of the step."""


class MetricsConfig(_Section):
    file: str | None = None
    """JSONL file: one object per optimizer step and a summary (rank 0 writes it)."""
    log_interval: int = Field(default=10, ge=1)
    """Gather the buffered steps' losses over the ranks, write their records and a progress line
    (rank 0) every N steps; also after the first and last step, a checkpoint and a stop. The only
    device synchronisation of the loop, so not 1 at scale."""
    peak_flops: float | None = Field(default=None, gt=0)
    """Dense bf16 peak FLOP/s of one device for MFU; empty means look it up by device name."""
    prometheus_dir: str | None = None
    """node exporter's textfile collector directory (the monitoring role's
    /var/lib/prometheus/node-exporter): each rank rewrites `fsdp-trainer-<job>-rank<R>.prom` there
    after every step (docs/monitoring.md). Empty: no Prometheus metrics."""
    fault_leak_mib_per_step: float = Field(default=0, ge=0)
    """Fault injection, for tests only: the rank `fault_leak_rank` keeps this many MiB of host memory
    more after every step, so the smoke test's leak check can be shown to fail. 0: off."""
    fault_leak_rank: int = Field(default=0, ge=0)
    """The global rank that leaks when fault_leak_mib_per_step > 0."""
    profile_interval: int = Field(default=50, ge=1)
    """Sample the communication time (torch.profiler) every N steps."""
    profile_steps: int = Field(default=2, ge=0)
    """Steps profiled per sample, from the run's second step on; 0 turns sampling off."""

    @model_validator(mode="after")
    def _profile_window(self) -> MetricsConfig:
        if self.profile_steps >= self.profile_interval:
            raise ConfigError([Problem("metrics.profile_steps", self.profile_steps,
                                       f"is not below metrics.profile_interval={self.profile_interval}",
                                       "profile fewer steps than the interval (e.g. 2 of every 50)")])
        return self


class DistributedConfig(_Section):
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto (CUDA when available, else CPU), cuda or cpu."""
    timeout_s: int = Field(default=900, ge=30)
    """Collective time-out: a hung rank fails the job after this instead of hanging it."""


class EvalConfig(_Section):
    """A validation loss during training, computed as `python -m trainer eval` computes it: the mean
    next-token NLL over every counted position, each document on its own (torchtitan's validator)."""

    interval: int = Field(default=0, ge=0)
    """Evaluate every N optimizer steps (and after the last); 0: never."""
    path: str | None = None
    """A jsonl or parquet file or directory of held-out documents, read with the data.* fields
    (text_field / messages_field) and the model's tokenizer."""
    source: Literal["jsonl", "parquet"] = "jsonl"
    """The format of eval.path."""
    batch_size: int = Field(default=4, ge=1)
    """Packed rows per rank per forward pass."""


class TrainConfig(_Section):
    model: ModelConfig = ModelConfig()
    """The model's shape."""
    parallel: ParallelConfig = ParallelConfig()
    """How the model is sharded, and its precision."""
    optim: OptimConfig = OptimConfig()
    """Optimizer and learning-rate schedule."""
    training: TrainingConfig = TrainingConfig()
    """Steps, batch sizes and the seed."""
    data: DataConfig = DataConfig()
    """Where the tokens come from."""
    metrics: MetricsConfig = MetricsConfig()
    """What is logged, and where."""
    distributed: DistributedConfig = DistributedConfig()
    """Device and collective settings."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Sharded, verified checkpoints (docs/checkpoints.md) and the Hugging Face export."""
    eval: EvalConfig = EvalConfig()
    """Validation loss during training."""
    tracking: TrackingConfig = TrackingConfig()
    """TensorBoard always; Weights & Biases or MLflow when configured."""

    def flops_per_token(self) -> int:
        """Training FLOPs per token of this run, what its MFU divides by: the model's at data.seq_len;
        with LoRA the base weights frozen (no weight gradient) and 6 per adapter parameter."""
        lora = self.parallel.lora
        if not lora.enabled:
            return self.model.flops_per_token(self.data.seq_len)
        adapters = sum(lora.rank * (fan_in + fan_out)
                       for fan_in, fan_out in self.model.lora_shapes(lora.target_modules))
        return self.model.flops_per_token(self.data.seq_len, frozen_weights=True) + 6 * adapters

    @model_validator(mode="after")
    def _cross_section(self) -> TrainConfig:
        problems = []
        if self.data.seq_len > self.model.max_seq_len:
            problems.append(Problem("data.seq_len", self.data.seq_len,
                                    f"is longer than model.max_seq_len={self.model.max_seq_len}",
                                    "shorten data.seq_len or raise model.max_seq_len"))
        if self.eval.interval and not self.eval.path:
            problems.append(Problem("eval.path", None, f"is required when eval.interval={self.eval.interval}",
                                    "point it at held-out jsonl/parquet documents, or set eval.interval=0"))
        if self.data.source == "tokens" and not self.data.path:
            problems.append(Problem("data.path", None, "is required when data.source is tokens",
                                    "point it at a .bin file or a directory of them "
                                    "(make them with `python -m trainer.data build`)"))
        if self.data.source in ("jsonl", "parquet") and not self.data.path:
            problems.append(Problem("data.path", None, f"is required when data.source is {self.data.source}",
                                    f"point it at a .{self.data.source} file or a directory of them"))
        if self.data.messages_field and self.data.source in ("synthetic", "tokens"):
            problems.append(Problem("data.messages_field", self.data.messages_field,
                                    f"only applies to records (data.source is {self.data.source})",
                                    "use data.source jsonl or parquet, or remove it"))
        if self.training.global_batch_size % self.training.gradient_accumulation:
            problems.append(Problem("training.global_batch_size", self.training.global_batch_size,
                                    "is not divisible by training.gradient_accumulation="
                                    f"{self.training.gradient_accumulation}",
                                    "make global_batch_size a multiple of gradient_accumulation"))
        if self.checkpoint.resume not in ("auto", "none") and self.checkpoint.dir is None:
            problems.append(Problem("checkpoint.resume", self.checkpoint.resume,
                                    "names a checkpoint to resume from, but checkpoint.dir is not set: "
                                    "checkpointing is off, so the run would start fresh and save nothing",
                                    "add --checkpoint-dir DIR (where this run writes its checkpoints)"))
        if self.checkpoint.hf_export_dir and self.model.n_experts and self.model.family == "gpt":
            problems.append(Problem("checkpoint.hf_export_dir", self.checkpoint.hf_export_dir,
                                    "asks for a Hugging Face export of the project's own model with experts "
                                    "(exports of it are Llama configs, which have none)",
                                    "fine-tune a qwen3_moe, qwen2_moe, mixtral or gpt_oss model from "
                                    "model.hf_dir, or leave it empty"))
        lora, m = self.parallel.lora, self.model
        attention = {"q_proj", "k_proj", "v_proj", "o_proj"}
        all_sparse = all(m.is_moe_layer(i) for i in range(m.n_layers))
        if (lora.enabled and m.n_experts and all_sparse and not m.shared_expert_ffn_dim
                and not attention & set(lora.target_modules)):
            problems.append(Problem("parallel.lora.target_modules", lora.target_modules,
                                    "adapts only feed-forward projections, and every block of this model has "
                                    "experts instead (they stay frozen under LoRA)",
                                    "add the attention projections: q_proj, k_proj, v_proj, o_proj"))
        problems.extend(self._expert_parallel_problems())
        if self.parallel.param_dtype == "fp16" and self.parallel.reduce_dtype == "bf16":
            problems.append(Problem("parallel.reduce_dtype", "bf16", "mixes with fp16 parameters",
                                    "use reduce_dtype fp32 with fp16 parameters"))
        if problems:
            raise ConfigError(problems)
        return self


    def _expert_parallel_problems(self) -> list[Problem]:
        ep, m, par = self.parallel.expert_parallel, self.model, self.parallel
        if ep == 1:
            return []
        key = "parallel.expert_parallel"
        if not m.n_experts:
            return [Problem(key, ep, "splits experts, and the model has none", "set it to 1")]
        problems = []
        if m.n_experts % ep:
            problems.append(Problem(key, ep, f"does not divide model.n_experts={m.n_experts}",
                                    "use a divisor of the expert count"))
        if par.strategy not in (Strategy.FULL_SHARD, Strategy.SHARD_GRAD_OP):
            problems.append(Problem(key, ep, f"is not implemented with {par.strategy}",
                                    "use parallel.strategy FULL_SHARD or SHARD_GRAD_OP"))
        if par.cpu_offload:
            problems.append(Problem(key, ep, "is not implemented with parallel.cpu_offload",
                                    "set parallel.cpu_offload=false or expert_parallel=1"))
        return problems


@dataclass(frozen=True)
class Layout:
    """How the ranks of one launch are arranged: the device mesh and the per-rank batch."""

    world_size: int
    replicate: int  # data-parallel replicas that each hold a full copy of the shards
    shard: int  # ranks that split one copy of the parameters
    micro_batch_size: int


def derive_layout(cfg: TrainConfig, world_size: int, local_world_size: int) -> Layout:
    """The mesh and micro-batch for a launch, or ConfigError for meshes that cannot work."""
    problems = []
    par = cfg.parallel
    if par.strategy is Strategy.HYBRID_SHARD:
        shard = par.sharding_degree or local_world_size
        if shard == 1:
            # FSDP1 silently stops syncing gradients in this configuration; refuse it outright.
            problems.append(Problem("parallel.sharding_degree", shard,
                                    "gives HYBRID_SHARD a shard group of one rank (nothing is sharded)",
                                    "use NO_SHARD to replicate, or a sharding_degree >= 2 "
                                    "(default: the ranks per node)"))
        elif world_size % shard:
            problems.append(Problem("parallel.sharding_degree", shard,
                                    f"does not divide the world size {world_size}",
                                    f"use a divisor of {world_size} (ranks per node: {local_world_size})"))
        replicate = world_size // shard if shard else world_size
    elif par.strategy is Strategy.NO_SHARD:
        replicate, shard = world_size, 1
    else:
        if par.sharding_degree not in (None, world_size):
            problems.append(Problem("parallel.sharding_degree", par.sharding_degree,
                                    f"only applies to HYBRID_SHARD ({par.strategy} shards over all "
                                    f"{world_size} ranks)", "remove it, or use strategy HYBRID_SHARD"))
        replicate, shard = 1, world_size
    if world_size % par.expert_parallel:
        problems.append(Problem("parallel.expert_parallel", par.expert_parallel,
                                f"does not divide the world size {world_size}",
                                f"use a divisor of {world_size} (and of model.n_experts)"))
    tr = cfg.training
    per_micro_step = tr.global_batch_size // tr.gradient_accumulation
    micro = tr.micro_batch_size
    if micro is None:
        if per_micro_step % world_size:
            problems.append(Problem("training.global_batch_size", tr.global_batch_size,
                                    f"does not split evenly: {tr.global_batch_size} / "
                                    f"{tr.gradient_accumulation} accumulation steps / {world_size} ranks",
                                    f"make it a multiple of {tr.gradient_accumulation * world_size}"))
        micro = max(1, per_micro_step // world_size)
    elif micro * world_size * tr.gradient_accumulation != tr.global_batch_size:
        problems.append(Problem("training.micro_batch_size", micro,
                                f"x {world_size} ranks x {tr.gradient_accumulation} accumulation steps "
                                f"is {micro * world_size * tr.gradient_accumulation}, not "
                                f"training.global_batch_size={tr.global_batch_size}",
                                "leave micro_batch_size empty to derive it, or make the product match"))
    if problems:
        raise ConfigError(problems, "launch")
    return Layout(world_size, replicate, shard, micro)


MAX_YAML_VALUES = 100_000
"""The most values a config may hold once its YAML aliases (`*name`) are expanded: a config holds a
few hundred; a few hundred bytes of nested aliases can stand for billions, which validation and the
error message would walk. (The cluster spec's reader has the same limit; the trainer shares no code
with it.)"""


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error: PyYAML keeps
    the last one silently, so `lr: 1e-4` then `lr: 3e-4` would train at 3e-4."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in first_line:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice (also on line {first_line[key] + 1}); "
                        "keep one", key_node.start_mark)
            except TypeError:
                continue  # an unhashable key: the safe loader's own error names it
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _expands_beyond(data: Any, limit: int) -> bool:
    """Whether `data`, walked as validation walks it (a shared alias once per use), holds more than
    `limit` values; stops at the limit."""
    todo, count = [data], 0
    while todo:
        item = todo.pop()
        count += 1
        if count > limit:
            return True
        if isinstance(item, dict):
            todo += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            todo += item
    return False


def parse_yaml(text: str) -> Any:
    """YAML text as data; yaml.YAMLError for bad syntax, a key given twice, or aliases expanding to
    more than MAX_YAML_VALUES values."""
    data = yaml.load(text, Loader=_StrictLoader)
    if _expands_beyond(data, MAX_YAML_VALUES):
        raise yaml.YAMLError(f"its aliases (*name) expand to more than {MAX_YAML_VALUES:,} values; write "
                             "the values out, or repeat fewer of them")
    return data


def read_config_file(path: Path) -> dict[str, Any]:
    """A config file's sections, or a ConfigError naming the file: unreadable, not text, not YAML, or
    empty (every key at its default would train the default model, which nobody asks for by accident)."""
    names = ", ".join(shipped_config_names())
    try:
        data = parse_yaml(path.read_text())
    except UnicodeDecodeError:
        raise ConfigError([Problem("--config", str(path), "is not a text file (not UTF-8 YAML)",
                                   f"pass a trainer config YAML, or one of the shipped configs: {names}")],
                          str(path)) from None
    except OSError as e:
        raise ConfigError([Problem("--config", str(path), f"cannot be read ({e.strerror})",
                                   "check the path and its permissions")], str(path)) from None
    except yaml.YAMLError as e:
        raise ConfigError([yaml_problem(str(path), e)], str(path)) from None
    if data is None or data == {}:
        default = ModelConfig().num_params / 1e6
        raise ConfigError([Problem("--config", str(path),
                                   f"is empty: every key at its default trains the default {default:,.0f}M-"
                                   "parameter model", f"start from a shipped config ({names}), e.g. "
                                   "--config tiny, or give at least the model section")], str(path))
    return data


def resolve_config(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = SHIPPED_CONFIG_DIR / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    names = ", ".join(shipped_config_names())
    raise ConfigError([Problem("--config", name_or_path, "is neither a file nor a shipped config",
                               f"pass a YAML path or one of: {names}")])


def shipped_config_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED_CONFIG_DIR.glob("*.yaml"))


def assign(data: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError([Problem(key, value, f"goes below `{part}`, which is a value, not a section",
                                       f"set `{part}` itself, or check the key in {DOCS}")])
        node = child
    node[leaf] = value


def parse_assignment(assignment: str) -> tuple[str, Any]:
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError([Problem("--set", assignment, "is not key=value",
                                   "write e.g. --set optim.lr=3e-4 --set parallel.strategy=HYBRID_SHARD")])
    # YAML typing, so numbers, booleans and null arrive as they would from the file.
    try:
        return key.strip(), parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError([Problem("--set", assignment, f"has a value that is not valid YAML ({e})",
                                   "quote the value, e.g. --set data.path='a: b'")]) from None


# pydantic's error types, in the words of a config's author: (message, fix); {name} takes the error's
# context (the bound, the allowed values). pydantic's own text names Python types and classes. (The
# cluster spec words its errors the same way; the trainer shares no code with it.)
_MAPPING = ("is not a section of keys", "write it as `key: value` lines indented under it{keys}")
_WORDING = {
    **dict.fromkeys(("model_type", "model_attributes_type", "dict_type", "mapping_type"), _MAPPING),
    **dict.fromkeys(("int_type", "int_parsing", "int_from_float", "int_parsing_size"),
                    ("is not a whole number", "write a whole number, without quotes")),
    **dict.fromkeys(("float_type", "float_parsing", "finite_number"),
                    ("is not a number", "write a number, without quotes (e.g. 3e-4)")),
    **dict.fromkeys(("bool_type", "bool_parsing"), ("is not true or false", "write true or false")),
    "string_type": ("is not text", "write it as text (in quotes where it would read as a number)"),
    **dict.fromkeys(("list_type", "tuple_type", "set_type"),
                    ("is not a list", "write it as a YAML list: `[a, b]` or one `- item` per line")),
    **dict.fromkeys(("enum", "literal_error"), ("is not one of the allowed values", "use {expected}")),
    "greater_than_equal": ("is below the minimum, {ge}", "use {ge} or more"),
    "greater_than": ("must be more than {gt}", "use a value above {gt}"),
    "less_than_equal": ("is above the maximum, {le}", "use {le} or less"),
    "less_than": ("must be less than {lt}", "use a value below {lt}"),
}


def _section_keys(loc: tuple[Any, ...]) -> list[str] | None:
    """The keys of the section at `loc` (() is the top), when it is a section of TrainConfig."""
    model: type[BaseModel] = TrainConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        section = field.annotation if field is not None else None
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            return None
        model = section
    return list(model.model_fields)


def _problems_from_validation(err: ValidationError) -> list[Problem]:
    problems = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "(config)"
        ctx = e.get("ctx") or {}
        if isinstance(ctx.get("error"), ConfigError):
            problems.extend(ctx["error"].problems)
        elif e["type"] == "extra_forbidden":
            # The nearest key of the same section: `optim.lrr` is `optim.lr`, and `optim.foo` is no key.
            section = ".".join(str(p) for p in loc[:-1])
            keys = _section_keys(loc[:-1]) or []
            close = difflib.get_close_matches(str(loc[-1]), keys, n=1)
            fix = (f"did you mean `{'.'.join([*map(str, loc[:-1]), close[0]])}`?" if close else
                   f"remove it; the keys of {section or 'a config'} are {', '.join(keys)}" if keys else
                   f"remove it; the keys are listed in {DOCS}")
            problems.append(Problem(key, e.get("input"), "is not a known key", fix))
        elif e["type"] in _WORDING:
            message, fix = _WORDING[e["type"]]
            keys = _section_keys(loc)
            words = {**{k: str(v) for k, v in ctx.items()},
                     "keys": f" (its keys: {', '.join(keys)})" if keys else ""}
            problems.append(Problem(key, e.get("input"), message.format(**words), fix.format(**words)))
        else:
            msg = e["msg"].removeprefix("Value error, ")
            problems.append(Problem(key, e.get("input"), msg.replace("Input should be", "must be"),
                                    f"give a valid value (see {DOCS})"))
    return problems


# Keys a user may still set beside model.hf_dir / model.hf_config: how the model is used, not its shape.
_MODEL_USAGE_KEYS = {"hf_dir", "hf_config", "cache_dir", "max_seq_len", "init_std", "router_aux_loss_coef"}


def _same_value(name: str, given: Any, derived: Any) -> bool:
    """Whether a model key's value equals config.json's once both are read as the field's type (a saved
    run lists every key of a nested section such as rope_scaling, defaults included)."""
    field = ModelConfig.model_fields.get(name)
    if field is None or given == derived:
        return given == derived
    adapter = TypeAdapter(field.annotation)
    try:
        return adapter.validate_python(given) == adapter.validate_python(derived)
    except ValidationError:
        return False


def _with_hf_architecture(model: dict[str, Any]) -> dict[str, Any]:
    """The model section with its shape taken from config.json (model.hf_dir, else model.hf_config).
    An s3:// model.hf_dir is downloaded first (once per node, see trainer/hf/fetch.py) and replaced
    by the local copy, so every later stage reads files."""
    location, key = (model.get("hf_dir"), "model.hf_dir") if model.get("hf_dir") else (
        model.get("hf_config"), "model.hf_config")
    if not location:
        return model
    if not isinstance(location, str):
        raise ConfigError([Problem(key, location, "is not a path", "give a directory, a file or a name")])
    if key == "model.hf_dir":
        from trainer.hf.fetch import resolve_model_dir

        # A local directory is checked (config.json there, no Hub id); an s3:// one downloaded. FetchError
        # names the key and the fix.
        location = str(resolve_model_dir(location, model.get("cache_dir")))
        model = {**model, "hf_dir": location}
    architecture = read_architecture(location, key)
    # A key config.json does not set keeps its default (a saved run's config lists every key).
    defaults = {name: info.default for name, info in ModelConfig.model_fields.items()}
    derived = {name: architecture.model_fields.get(name, defaults.get(name)) for name in model}
    clashes = [Problem(f"model.{name}", model[name], f"is set by {architecture.source} ({key})",
                       f"remove it (config.json says {architecture.model_fields.get(name)!r}), or start "
                       "from a config without a model shape (--config finetune)")
               for name in model if name not in _MODEL_USAGE_KEYS
               and not _same_value(name, model[name], derived[name])]
    if clashes:
        raise ConfigError(clashes)
    return {**architecture.model_fields, **model}


def parse_config(data: dict[str, Any], source: str = "trainer config") -> TrainConfig:
    if not isinstance(data, dict):
        raise ConfigError([Problem("(config)", data, "must be a mapping of sections",
                                   "write YAML sections: model, parallel, optim, training, data, ...")],
                          source)
    try:
        if isinstance(data.get("model"), dict):
            data = {**data, "model": _with_hf_architecture(data["model"])}
        return TrainConfig.model_validate(data)
    except ConfigError as e:
        raise ConfigError(e.problems, source) from None
    except ValidationError as e:
        raise ConfigError(_problems_from_validation(e), source) from None


def load_config(name_or_path: str, overrides: list[str] = (), values: dict[str, Any] | None = None
                ) -> TrainConfig:
    """A shipped config name or YAML path, then `key=value` overrides (YAML-typed) in order, then
    already-typed `values` (the plain command-line flags)."""
    path = resolve_config(name_or_path)
    data = read_config_file(path)
    for assignment in overrides:
        assign(data, *parse_assignment(assignment))
    for key, value in (values or {}).items():
        assign(data, key, value)
    source = f"{path} with the command-line overrides" if overrides or values else str(path)
    return parse_config(data, source)
