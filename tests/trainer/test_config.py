"""Config loading and validation: every error names the key, the value and the fix."""

from __future__ import annotations

import pytest

from tests.docstrings import field_docstrings
from trainer.__main__ import build_parser, main
from trainer.config import ConfigError, Strategy, derive_layout, load_config, parse_config


def _problems(excinfo) -> dict[str, str]:
    return {p.key: str(p) for p in excinfo.value.problems}


def test_defaults_follow_the_guide():
    cfg = parse_config({})
    assert cfg.optim.warmup_steps == 500
    assert cfg.training.gradient_accumulation == 16
    assert cfg.training.global_batch_size == 4096
    assert cfg.optim.lr == 1e-5
    assert cfg.checkpoint.interval == 1000
    assert cfg.parallel.strategy is Strategy.FULL_SHARD
    # Sharding degree defaults to the ranks per node.
    hybrid = parse_config({"parallel": {"strategy": "HYBRID_SHARD"}})
    layout = derive_layout(hybrid, world_size=16, local_world_size=8)
    assert (layout.replicate, layout.shard, layout.micro_batch_size) == (2, 8, 16)


def test_shipped_names_and_overrides():
    cfg = load_config("tiny", ["optim.lr=0.5", "parallel.strategy=NO_SHARD", "checkpoint.dir=/tmp/ck"],
                      {"training.steps": 7, "metrics.file": "yes"})
    assert cfg.optim.lr == 0.5 and cfg.parallel.strategy is Strategy.NO_SHARD
    assert cfg.checkpoint.dir == "/tmp/ck"
    # Plain flags arrive typed: a file named "yes" stays a string.
    assert cfg.training.steps == 7 and cfg.metrics.file == "yes"


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError) as excinfo:
        load_config("tiny", ["optim.learning_rate=1e-4", "parallel.stratgy=FULL_SHARD"])
    problems = _problems(excinfo)
    assert "did you mean `parallel.strategy`" in problems["parallel.stratgy"]
    assert "optim.learning_rate" in problems


def test_bad_values_name_key_value_and_fix():
    with pytest.raises(ConfigError) as excinfo:
        parse_config({"optim": {"lr": -1}, "parallel": {"strategy": "ZERO3"},
                      "model": {"dim": 100, "n_heads": 3}})
    problems = _problems(excinfo)
    assert set(problems) >= {"optim.lr", "parallel.strategy", "model.dim"}
    assert "-1" in problems["optim.lr"] and "Fix:" in problems["optim.lr"]
    assert "FULL_SHARD" in problems["parallel.strategy"]
    assert "n_heads" in problems["model.dim"]


def test_cross_section_problems():
    with pytest.raises(ConfigError) as excinfo:
        parse_config({"data": {"source": "tokens", "seq_len": 4096}, "model": {"max_seq_len": 2048},
                      "parallel": {"reduce_dtype": "fp16"}})
    problems = _problems(excinfo)
    assert "parallel.reduce_dtype" in problems
    with pytest.raises(ConfigError) as excinfo:
        parse_config({"data": {"source": "tokens", "seq_len": 4096}, "model": {"max_seq_len": 2048}})
    problems = _problems(excinfo)
    assert "model.max_seq_len" in problems["data.seq_len"]
    assert "trainer.data build" in problems["data.path"]


@pytest.mark.parametrize(("overrides", "world", "local", "key", "needle"), [
    # A shard group of one: FSDP1 would silently stop syncing gradients; refused.
    ({"strategy": "HYBRID_SHARD"}, 4, 1, "parallel.sharding_degree", "NO_SHARD"),
    ({"strategy": "HYBRID_SHARD", "sharding_degree": 3}, 4, 4, "parallel.sharding_degree", "divide"),
    ({"strategy": "FULL_SHARD", "sharding_degree": 2}, 4, 4, "parallel.sharding_degree", "HYBRID_SHARD"),
])
def test_meshes_that_cannot_work_are_refused(overrides, world, local, key, needle):
    cfg = parse_config({"parallel": overrides, "training": {"global_batch_size": 64,
                                                            "gradient_accumulation": 2}})
    with pytest.raises(ConfigError) as excinfo:
        derive_layout(cfg, world, local)
    assert needle in _problems(excinfo)[key]


def test_batch_that_does_not_split_is_refused():
    cfg = parse_config({"training": {"global_batch_size": 48, "gradient_accumulation": 16}})
    with pytest.raises(ConfigError) as excinfo:
        derive_layout(cfg, world_size=2, local_world_size=2)
    assert "multiple of 32" in _problems(excinfo)["training.global_batch_size"]
    cfg = parse_config({"training": {"global_batch_size": 64, "gradient_accumulation": 2,
                                     "micro_batch_size": 4}})
    with pytest.raises(ConfigError) as excinfo:
        derive_layout(cfg, world_size=2, local_world_size=2)
    assert "training.micro_batch_size" in _problems(excinfo)
    assert derive_layout(cfg, world_size=8, local_world_size=8).micro_batch_size == 4


def test_cli_reports_config_errors_before_training(capsys):
    assert main(["--config", "no-such-config"]) == 2
    err = capsys.readouterr().err
    assert "no-such-config" in err and "tiny" in err and "smoke" in err
    # Single process, HYBRID_SHARD: a shard group of one, refused before any process group exists.
    assert main(["--config", "tiny", "--set", "parallel.strategy=HYBRID_SHARD"]) == 2
    assert "parallel.sharding_degree" in capsys.readouterr().err
    assert main(["--config", "tiny", "--set", "oops"]) == 2
    assert "key=value" in capsys.readouterr().err


def test_cli_options_are_full_words():
    parser = build_parser()
    assert parser.allow_abbrev is False
    args = parser.parse_args(["--config", "tiny", "--resume"])
    assert args.resume == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--config", "tiny", "--step", "3"])


def test_every_config_key_has_a_docstring():
    from pydantic import BaseModel

    from trainer.config import TrainConfig

    def undocumented(model: type[BaseModel], prefix: str = "") -> list[str]:
        found = []
        documented = field_docstrings(model)
        for name, info in model.model_fields.items():
            if name not in documented:
                found.append(prefix + name)
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
                found += undocumented(info.annotation, f"{prefix}{name}.")
        return found

    assert undocumented(TrainConfig) == []


@pytest.mark.parametrize("moe", [False, True])
def test_lora_flops_count_no_weight_gradient_for_the_frozen_base(moe):
    # 6 FLOPs per parameter per token is 2 forward, 2 for the input's gradient and 2 for the weight's;
    # LoRA's frozen base needs no weight gradient. The adapters counted from the config are those
    # apply_lora makes (attention everywhere, feed-forward in dense blocks only).
    import torch

    from trainer.lora import apply_lora
    from trainer.model import build_model

    shape = ["model.n_experts=4", "model.n_active_experts=2", "model.moe_ffn_dim=32",
             "model.moe_layers=[1]"] if moe else []
    cfg = load_config("tiny", [*shape, "parallel.lora.rank=4"])
    model = build_model(cfg.model)
    apply_lora(model, cfg.parallel.lora, torch.float32)
    adapters = sum(p.numel() for name, p in model.named_parameters() if name.endswith((".lora_a", ".lora_b")))
    assert adapters == sum(4 * (i + o) for i, o in cfg.model.lora_shapes(cfg.parallel.lora.target_modules))
    full = cfg.model.flops_per_token(cfg.data.seq_len)
    frozen = cfg.model.flops_per_token(cfg.data.seq_len, frozen_weights=True)
    attention = 6 * cfg.model.n_layers * cfg.model.n_heads * 2 * cfg.model.head_size * cfg.data.seq_len
    assert (frozen - attention) * 6 == (full - attention) * 4
    assert cfg.flops_per_token() == frozen + 6 * adapters < full
    assert load_config("tiny", shape).flops_per_token() == full
