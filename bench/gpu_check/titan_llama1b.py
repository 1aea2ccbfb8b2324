"""torchtitan 0.3.0's trainer on the Llama-3.2-1B shape with synthetic tokens: the GPU check's
`torchtitan_llama1b` step, beside the trainer's `hf_llama1b` step (docs/gpu-check.md).

    torchrun --standalone --nproc-per-node 1 -m torchtitan.train --module titan_llama1b \\
        --config llama3_2_1b --training.steps 30 --training.local_batch_size 8 --training.seq_len 2048 \\
        [--compile.enable] --dump_folder DIR

torchtitan's ConfigManager (torchtitan/config/manager.py, `_load_config`) imports `--module` as a fully
qualified module when it is not one of its own and calls the function named by `--config`, which returns
a `Trainer.Config` (torchtitan/trainer.py); the remaining options override that config
(`tyro.cli(..., default=loaded_config)`). This module is such a function plus the two components a run
without downloaded assets needs: a synthetic-token data loader in place of a Hugging Face dataset, and a
tokenizer that is never called (the trainer builds one from `hf_assets_path` unconditionally).
bench/gpu_check/titan_check.py imports this module to check torchtitan and these options without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import DebugConfig, TrainingConfig
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.common.rope import RoPE
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer

# Llama-3.2-1B's config.json (trainer/configs/hf/llama3.2-1b.json): rope_scaling factor 32. torchtitan's
# "1B" flavor (torchtitan/models/llama3/__init__.py, `_1b`) has every other figure of it (dim 2048, 16
# layers, 32/8 heads, ffn 8192, vocab 128256, tied embeddings, theta 500000, llama scaling) but keeps
# RoPE.Config's default scaling_factor of 8 (torchtitan/models/common/rope.py).
LLAMA32_ROPE_FACTOR = 32.0


class NoTokenizer(BaseTokenizer):
    """Synthetic tokens need no tokenizer; torchtitan/trainer.py builds one anyway, from hf_assets_path,
    which has no tokenizer files here (the GPU machine has no network to download them)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 128256

    def __init__(self, config: Config, *, tokenizer_path: str):
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError("a synthetic-token run tokenizes nothing")

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError("a synthetic-token run tokenizes nothing")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class SyntheticTokens(IterableDataset):
    """Uniform random token sequences, each one document: what HuggingFaceTextDataset yields
    (torchtitan/hf_datasets/text_datasets.py: {"input", "positions"} and the labels), without a dataset.
    Positions are always given because the Llama 3 flavors use FlexAttention, whose block mask
    torchtitan builds from them (Decoder.get_attention_masks)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.seed)
        positions = torch.arange(self.seq_len)
        while True:
            tokens = torch.randint(self.vocab_size, (self.seq_len + 1,), generator=generator)
            yield {"input": tokens[:-1], "positions": positions}, tokens[1:]


class SyntheticDataLoader(ParallelAwareDataloader):
    """torchtitan's data-parallel loader (torchdata's StatefulDataLoader) over SyntheticTokens, built
    with the arguments torchtitan/trainer.py passes every data loader."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        vocab_size: int = 128256
        seed: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer,
                 seq_len: int, local_batch_size: int, snapshot_every_n_steps: int | None = 1):
        # Each data-parallel rank draws its own tokens.
        dataset = SyntheticTokens(config.vocab_size, seq_len, config.seed + dp_rank)
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size,
                         num_workers=config.num_workers, pin_memory=config.pin_memory,
                         snapshot_every_n_steps=snapshot_every_n_steps)


def llama3_2_1b() -> Trainer.Config:
    """The Llama-3.2-1B shape on synthetic tokens, one data-parallel group over every rank (FSDP2; on
    one GPU torchtitan still applies fully_shard for the bf16 mixed-precision policy, see
    torchtitan/models/llama3/parallelize.py). Batch, sequence length, steps and compile come from the
    command line (--training.*, --compile.enable), as the GPU check sets them for both trainers."""
    model_spec = model_registry("1B")
    for _, rope, _, _ in model_spec.model.traverse(RoPE.Config):
        rope.scaling_factor = LLAMA32_ROPE_FACTOR
    vocab_size = decoder_vocab_size(model_spec)
    return Trainer.Config(
        model_spec=model_spec,
        # As torchtitan's own llama3 configs (torchtitan/models/llama3/config_registry.py).
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab_size)),
        optimizer=default_adamw(lr=3e-4),
        training=TrainingConfig(local_batch_size=8, seq_len=2048, steps=30),
        tokenizer=NoTokenizer.Config(vocab_size=vocab_size),
        dataloader=SyntheticDataLoader.Config(vocab_size=vocab_size),
        # A record per step, as the trainer's metrics.log_interval=1 in the check; no colour codes in the
        # log the summary parses.
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        # The trainer's hf_llama1b step keeps every activation too (parallel.activation_checkpointing=false).
        activation_checkpoint=None,
        # A per-rank trace log nothing reads; off is torchtitan at its fastest.
        debug=DebugConfig(enable_structured_logging=False),
    )
