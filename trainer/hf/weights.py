"""Hugging Face safetensors in and out of the sharded model, without any rank holding the whole model.

In: `check_weights` (before any process group) reads only the safetensors headers and the index and
refuses a directory that cannot fill the model, naming the file and the tensor; `load_weights` then
lets DCP's HuggingFaceStorageReader copy each rank's rows of each tensor straight from the files
(safetensors slices) into the rank's shard, converting the dtype on the way; Qwen3-MoE's and Mixtral's
per-expert tensors go straight into the rows of the stacked experts the rank holds (a rank reads only
its own experts' tensors; the export writes them back the same way). gpt-oss's experts as the
Hub ships them, MXFP4 (`*_blocks` 4-bit values in groups of 32, `*_scales` a power-of-two exponent per
group, stored [experts, out, in]), are read by each rank for its own experts only (safetensors slices of
the blocks and scales), dequantised one expert at a time and transposed into the [experts, in, out]
parameter. (torch 2.13's QuantizedHuggingFaceStorageReader returned wrong values for such a tensor in
tests/trainer/test_gpt_oss.py, against transformers' own dequantisation.)

Out: `export_model` writes every rank's rows with HuggingFaceStorageWriter (all ranks in parallel),
consolidates them into `model-0000N-of-0000M.safetensors` with each rank writing its share of the
output files, writes `model.safetensors.index.json`, the config.json, the tokenizer files and a SHA256
manifest, in a temporary directory renamed into place when complete. LoRA runs export either the
merged weights or a PEFT adapter directory.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files_on_every_rank,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from trainer.checkpoint.manifest import (
    EXPORT_FORMAT,
    MANIFEST,
    TMP_SUFFIX,
    fsync_dir,
    replace_dir,
    sha256_file,
)
from trainer.config import ModelConfig, TrainConfig
from trainer.errors import ConfigError, Problem
from trainer.hf.adapter import checkpoint_tensors, is_lora, to_hf, to_peft
from trainer.hf.config import DTYPE_NAMES, HFArchitecture, model_type_of, read_architecture
from trainer.lora import LoRALinear
from trainer.model import Transformer

INDEX = "model.safetensors.index.json"
# Files of the source directory an export carries over (the tokenizer and generation defaults).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "generation_config.json")
# Output shards of about this size, as transformers' save_pretrained cuts them.
EXPORT_SHARD_BYTES = 5 * 10**9
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# MXFP4: 32 values share one exponent (a byte, biased by 127); two 4-bit values per byte, low nibble
# first, each a sign bit and an FP4 (E2M1) magnitude.
MXFP4_GROUP = 32
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class TensorHeader:
    file: str
    shape: tuple[int, ...]
    dtype: str


def _read_header(path: Path) -> dict[str, TensorHeader]:
    """A safetensors file's tensor table, from its JSON header alone (8-byte length, then JSON)."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(length))
    return {name: TensorHeader(path.name, tuple(entry["shape"]), entry["dtype"])
            for name, entry in header.items() if name != "__metadata__"}


def read_tensor_table(model_dir: Path) -> dict[str, TensorHeader]:
    """Every tensor in the directory's safetensors files; the index, when there is one, must name only
    files that exist and tensors they hold."""
    index_path = model_dir / INDEX
    files = sorted(model_dir.glob("*.safetensors"))
    problems = []
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError([Problem("model.hf_dir", str(index_path), f"is not a safetensors index ({e})",
                                       "restore the model's model.safetensors.index.json")]) from None
        for missing in sorted(set(weight_map.values()) - {f.name for f in files}):
            names = sorted(k for k, v in weight_map.items() if v == missing)
            problems.append(Problem("model.hf_dir", str(model_dir), f"{INDEX} names {missing} (holding "
                                    f"{len(names)} tensors, e.g. {names[0]}), which is missing",
                                    "download the model again (all shards named in the index)"))
    if not files and not problems:
        problems.append(Problem("model.hf_dir", str(model_dir), "has no *.safetensors files",
                                "use a directory with the model's safetensors weights (PyTorch .bin "
                                "pickles are not read)"))
    if problems:
        raise ConfigError(problems)
    table: dict[str, TensorHeader] = {}
    for path in files:
        try:
            table.update(_read_header(path))
        except (OSError, ValueError, json.JSONDecodeError) as e:
            raise ConfigError([Problem("model.hf_dir", str(path), f"is not a readable safetensors file ({e})",
                                       "download that shard again")]) from None
    return table


def is_mxfp4(hf_name: str, table: dict[str, TensorHeader]) -> bool:
    """The tensor is stored quantised (`{name}_blocks` + `{name}_scales`) instead of as itself."""
    return hf_name not in table and f"{hf_name}_blocks" in table and f"{hf_name}_scales" in table


def _mxfp4_problem(hf_name: str, shape: tuple[int, ...], table: dict[str, TensorHeader],
                   model_dir: Path) -> Problem | None:
    """Whether `{name}_blocks`/`_scales` can fill a stacked [experts, in, out] parameter."""
    blocks, scales = table[f"{hf_name}_blocks"], table[f"{hf_name}_scales"]
    if len(shape) != 3 or shape[1] % MXFP4_GROUP:
        return Problem("model.hf_dir", f"{model_dir}/{blocks.file}", f"stores {hf_name} as MXFP4, which this "
                       f"trainer reads only for stacked experts with rows in groups of {MXFP4_GROUP} (shape "
                       f"{list(shape)})", "use bf16 weights for this tensor")
    experts, rows_in, cols_out = shape
    groups = rows_in // MXFP4_GROUP
    want_blocks, want_scales = (experts, cols_out, groups, MXFP4_GROUP // 2), (experts, cols_out, groups)
    if blocks.shape != want_blocks or scales.shape != want_scales or {blocks.dtype, scales.dtype} != {"U8"}:
        return Problem("model.hf_dir", f"{model_dir}/{blocks.file}",
                       f"holds {hf_name}_blocks {blocks.dtype}{list(blocks.shape)} and _scales "
                       f"{scales.dtype}{list(scales.shape)}; the config.json needs U8{list(want_blocks)} "
                       f"and U8{list(want_scales)}", "use the weights that belong to this config.json")
    return None


def check_weights(model: Transformer, model_dir: Path) -> None:
    """Before any process group: every parameter the model loads is in the files with its shape."""
    table = read_tensor_table(model_dir)
    problems = []
    for hf_name, shape in checkpoint_shapes(model).items():
        header = table.get(hf_name)
        if header is None and is_mxfp4(hf_name, table):
            problem = _mxfp4_problem(hf_name, shape, table, model_dir)
            problems.extend([problem] if problem else [])
        elif header is None:
            problems.append(Problem("model.hf_dir", str(model_dir), f"has no tensor {hf_name}",
                                    "use the weights that belong to this config.json"))
        elif header.shape != shape:
            problems.append(Problem("model.hf_dir", f"{model_dir}/{header.file}",
                                    f"holds {hf_name} with shape {list(header.shape)}, the config.json "
                                    f"gives {list(shape)}", "use the weights that belong to this "
                                    "config.json"))
        elif header.dtype not in SAFETENSORS_DTYPES:
            problems.append(Problem("model.hf_dir", f"{model_dir}/{header.file}", f"stores {hf_name} as "
                                    f"{header.dtype}", "use bf16, fp16 or fp32 weights (of quantised "
                                    "weights only gpt-oss's MXFP4 experts are read)"))
    if problems:
        raise ConfigError(problems)


def checkpoint_views(model: Transformer) -> dict[str, torch.Tensor]:
    """What this rank loads and exports of the model's own (non-adapter) parameters, by Hugging Face
    name: each (sharded) parameter, or for experts the checkpoints store one expert apart (Qwen3-MoE,
    Mixtral), views of this rank's experts' rows (other ranks hold the other experts). Tied embeddings
    appear once, as the input embedding, which is how save_pretrained stores them."""
    views = {}
    for name, param in model.named_parameters():
        if is_lora(name):
            continue
        parts = checkpoint_tensors(name, model.cfg.family, model.cfg.n_experts)
        if parts[0].expert is None:
            views[parts[0].name] = param
            continue
        rows = _local_rows(param)
        local = (param.to_local() if isinstance(param, DTensor) else param).detach()
        views.update({part.name: part.view(local, rows.start) for part in parts
                      if rows.start <= part.expert < rows.stop})
    return views


def checkpoint_shapes(model: Transformer) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint holds for the model's own parameters, by Hugging Face name, with its
    shape (all experts, whichever rank holds them)."""
    shapes = {}
    for name, param in model.named_parameters():
        if not is_lora(name):
            whole = torch.empty(param.shape, device="meta")
            for part in checkpoint_tensors(name, model.cfg.family, model.cfg.n_experts):
                shapes[part.name] = tuple(part.view(whole).shape)
    return shapes


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., groups, 16] uint8 codes and [..., groups] uint8 exponents -> [..., groups x 32] fp32."""
    table = torch.tensor(FP4_MAGNITUDES + tuple(-v for v in FP4_MAGNITUDES), device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # low nibble first
    values = torch.ldexp(table[codes], (scales.to(torch.int32) - 127)[..., None])
    return values.flatten(-2)


def _load_mxfp4(param: torch.Tensor, hf_name: str, table: dict[str, TensorHeader], model_dir: Path) -> None:
    """This rank's experts of a stacked [experts, in, out] parameter from `{name}_blocks`/`_scales`
    ([experts, out, in / 32, 16] and [experts, out, in / 32]), one expert at a time."""
    from safetensors import safe_open

    local = param.to_local() if isinstance(param, DTensor) else param
    rows = _local_rows(param)
    blocks_file, scales_file = (model_dir / table[f"{hf_name}_{part}"].file for part in ("blocks", "scales"))
    with safe_open(blocks_file, "pt") as blocks_f, safe_open(scales_file, "pt") as scales_f:
        blocks, scales = blocks_f.get_slice(f"{hf_name}_blocks"), scales_f.get_slice(f"{hf_name}_scales")
        for i, expert in enumerate(range(rows.start, rows.stop)):
            values = dequantize_mxfp4(blocks[expert:expert + 1], scales[expert:expert + 1])[0]
            local[i].copy_(values.transpose(0, 1))


def load_weights(model: Transformer, model_dir: Path, log: Callable[[str], None]) -> None:
    """Collective: fill every rank's shards from the files (DCP reads each rank's slices only)."""
    started = time.monotonic()
    table = read_tensor_table(model_dir)
    params = {name: param.detach() for name, param in checkpoint_views(model).items()}
    quantized = {name: param for name, param in params.items() if is_mxfp4(name, table)}
    plain = {name: param for name, param in params.items() if name not in quantized}
    dcp.load(plain, storage_reader=HuggingFaceStorageReader(str(model_dir)))
    for name, param in quantized.items():
        _load_mxfp4(param, name, table, model_dir)
    mxfp4 = f", {len(quantized)} of them dequantised from MXFP4" if quantized else ""
    log(f"model: loaded {len(params)} tensors from {model_dir}{mxfp4} in {time.monotonic() - started:.1f}s "
        "(each rank read its own rows)")


# -- export ---------------------------------------------------------------------------------------


def _local_rows(param: torch.Tensor) -> slice:
    """The global rows (dim 0) this rank holds of a Shard(0) DTensor."""
    if not isinstance(param, DTensor):
        return slice(0, param.shape[0])
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return slice(offset[0], offset[0] + shape[0])


def _merged(module: LoRALinear, dtype: torch.dtype) -> torch.Tensor:
    """W + scale * B A for this rank's rows of W, as a DTensor of W's placement (the adapters are small
    enough to gather whole)."""
    lora_a = module.lora_a.full_tensor() if isinstance(module.lora_a, DTensor) else module.lora_a
    lora_b = module.lora_b.full_tensor() if isinstance(module.lora_b, DTensor) else module.lora_b
    weight = module.weight
    rows = _local_rows(weight)
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    merged = (local.float() + (lora_b[rows].float() @ lora_a.float()) * module.scaling).to(dtype)
    if isinstance(weight, DTensor):
        return DTensor.from_local(merged, weight.device_mesh, weight.placements, shape=weight.shape,
                                  stride=weight.stride())
    return merged


def export_state(model: Transformer, dtype: torch.dtype, merge_lora: bool) -> dict[str, torch.Tensor]:
    """Hugging Face name -> this rank's part of the tensor in the export dtype."""
    state = {}
    merged = {}
    if merge_lora:
        merged = {to_hf(f"{name}.weight", model.cfg.family): module for name, module in model.named_modules()
                  if isinstance(module, LoRALinear)}
    for hf_name, param in checkpoint_views(model).items():
        state[hf_name] = _merged(merged[hf_name], dtype) if hf_name in merged else param.detach().to(dtype)
    return state


def _file_index(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, shard_bytes: int) -> dict[str, int]:
    """Tensors in name order into files of about shard_bytes (a bigger tensor gets a file alone); the
    same on every rank, whichever tensors it writes."""
    mapping, index, filled = {}, 1, 0
    for name in sorted(shapes, key=_natural_key):
        size = math.prod(shapes[name]) * dtype.itemsize
        if filled and filled + size > shard_bytes:
            index, filled = index + 1, 0
        mapping[name] = index
        filled += size
    return mapping


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def hf_config_dict(model_cfg: ModelConfig, architecture: HFArchitecture | None, dtype_name: str) -> dict:
    """The config.json of an export: the source's, or a Llama config for the project's own GPT."""
    if architecture is not None:
        raw = dict(architecture.raw)
        key = "dtype" if "dtype" in raw and "torch_dtype" not in raw else "torch_dtype"
        raw[key] = dtype_name
        # The export's experts are plain tensors of dtype_name, whatever the source's quantisation.
        raw.pop("quantization_config", None)
        return raw
    if model_cfg.n_experts:
        raise ConfigError([Problem("model.n_experts", model_cfg.n_experts, "has no Hugging Face export for "
                                   "the project's own model (exports of it are Llama configs)",
                                   "fine-tune a qwen3_moe, qwen2_moe, mixtral or gpt_oss model from "
                                   "model.hf_dir, or export no HF copy")])
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": model_type_of(model_cfg.family),
        "vocab_size": model_cfg.vocab_size, "hidden_size": model_cfg.dim,
        "num_hidden_layers": model_cfg.n_layers, "num_attention_heads": model_cfg.n_heads,
        "num_key_value_heads": model_cfg.kv_heads, "head_dim": model_cfg.head_size,
        "intermediate_size": model_cfg.ffn_dim, "max_position_embeddings": model_cfg.max_seq_len,
        "rms_norm_eps": model_cfg.norm_eps, "rope_theta": model_cfg.rope_theta, "rope_scaling": None,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": model_cfg.tie_embeddings, "torch_dtype": dtype_name,
    }
    return config


def _write_manifest(directory: Path, extra: dict) -> None:
    """Every rank hashes a share of the files; rank 0 writes the manifest (same file list format as a
    checkpoint's, so `python -m trainer.checkpoint verify` checks it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = sorted(p.name for p in directory.iterdir() if p.is_file())
    mine = {name: {"sha256": sha256_file(directory / name), "size": (directory / name).stat().st_size}
            for name in names[rank::world]}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        files = {}
        for part in gathered:
            files.update(part)
        manifest = {"format": EXPORT_FORMAT, "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
                    "torch_version": torch.__version__, **extra, "files": dict(sorted(files.items()))}
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _on_rank0(work: Callable[[], None]) -> None:
    """Rank 0 does file-system work; every rank learns whether it failed, so none waits in vain."""
    error = None
    if dist.get_rank() == 0:
        try:
            work()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise RuntimeError(box[0])


def export_model(model: Transformer, out: Path, *, model_cfg: ModelConfig,
                 architecture: HFArchitecture | None, source_dir: Path | None, lora_export: str | None,
                 lora_info: dict | None, log: Callable[[str], None],
                 shard_bytes: int = EXPORT_SHARD_BYTES) -> Path:
    """Collective. Write a Hugging Face model directory (or, for lora_export="adapter", a PEFT adapter
    directory) at `out`, replacing what is there once the new one is complete."""
    started = time.monotonic()
    out = Path(out)
    tmp = out.with_name(out.name + TMP_SUFFIX)

    def prepare() -> None:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)

    _on_rank0(prepare)
    dtype_name = architecture.dtype if architecture else "bfloat16"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[DTYPE_NAMES[dtype_name]]
    if lora_export == "adapter":
        _write_adapter(model, tmp, lora_info or {}, source_dir)
    else:
        state = export_state(model, dtype, merge_lora=lora_export == "merged")
        mapping = _file_index(checkpoint_shapes(model), dtype, shard_bytes)
        sharded = tmp / "sharded"
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(
            str(sharded), fqn_to_index_mapping=mapping, save_distributed=True))
        consolidate_safetensors_files_on_every_rank(str(sharded), str(tmp), mapping)

        def finish() -> None:
            shutil.rmtree(sharded)
            (tmp / "config.json").write_text(json.dumps(hf_config_dict(model_cfg, architecture, dtype_name),
                                                        indent=2) + "\n")
            if source_dir is not None:
                for name in TOKENIZER_FILES:
                    if (source_dir / name).is_file():
                        shutil.copy2(source_dir / name, tmp / name)

        _on_rank0(finish)
    _write_manifest(tmp, {"kind": lora_export or "model", "dtype": dtype_name})

    def commit() -> None:
        fsync_dir(tmp)
        replace_dir(tmp, out)

    _on_rank0(commit)
    size = sum(p.stat().st_size for p in out.iterdir()) if dist.get_rank() == 0 else 0
    log(f"export: wrote {out} ({'PEFT adapter' if lora_export == 'adapter' else dtype_name + ' model'}, "
        f"{size / 1e6:.1f} MB) in {time.monotonic() - started:.1f}s")
    return out


def _write_adapter(model: Transformer, directory: Path, lora_info: dict, source_dir: Path | None) -> None:
    """PEFT's layout: adapter_config.json + adapter_model.safetensors (the adapters are small: rank 0
    gathers them whole)."""
    from safetensors.torch import save_file

    tensors = {}
    for name, param in model.named_parameters():
        if is_lora(name):
            full = param.full_tensor() if isinstance(param, DTensor) else param
            tensors[to_peft(name)] = full.detach().to("cpu", torch.float32).contiguous()
    if dist.get_rank() != 0:
        return
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_info["rank"],
              "lora_alpha": lora_info["alpha"], "target_modules": sorted(lora_info["target_modules"]),
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "base_model_name_or_path": str(source_dir) if source_dir else None}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")




def export_trained(model: Transformer, cfg: TrainConfig, out: Path, log: Callable[[str], None]) -> Path:
    """Collective: export_model with what the run's config says (source architecture and tokenizer,
    LoRA's export choice)."""
    location = cfg.model.hf_dir or cfg.model.hf_config
    architecture = read_architecture(location, "model.hf_dir") if location else None
    lora = cfg.parallel.lora
    return export_model(model, out, model_cfg=cfg.model, architecture=architecture,
                        source_dir=Path(cfg.model.hf_dir) if cfg.model.hf_dir else None,
                        lora_export=lora.export if lora.enabled else None,
                        lora_info=lora.model_dump(mode="json"), log=log)
