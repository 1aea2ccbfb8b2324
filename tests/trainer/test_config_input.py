"""Trainer input a newcomer gets wrong, each refused with its key, value and fix instead of a traceback
or a run nobody asked for: a binary or empty --config, a key given twice, an alias bomb, an unknown
key under a section, pydantic's own wording, --resume PATH without a checkpoint dir, a CUDA device
on a host without one, an estimate that does not fit, and the trainer's packages missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from trainer import distributed
from trainer.__main__ import main
from trainer.config import MAX_YAML_VALUES, ConfigError, load_config, parse_config, shipped_config_names
from trainer.errors import Problem

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def problems_of(excinfo) -> dict[str, str]:
    return {p.key: str(p) for p in excinfo.value.problems}


def test_a_binary_config_is_refused(tmp_path, capsys):
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert main(["--estimate", str(binary), "--world-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "--config: is not a text file (not UTF-8 YAML)" in err and "tiny" in err
    assert "Traceback" not in err and "UnicodeDecodeError" not in err


@pytest.mark.parametrize("text", ["", "# just a comment\n", "{}\n"])
def test_an_empty_config_is_refused_naming_the_shipped_ones(tmp_path, text):
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    with pytest.raises(ConfigError) as excinfo:
        load_config(str(empty))
    said = problems_of(excinfo)["--config"]
    assert "is empty: every key at its default trains the default 953M-parameter model" in said
    assert all(name in said for name in shipped_config_names())


def test_a_key_given_twice_is_refused(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("model:\n  dim: 64\noptim:\n  lr: 1.0e-4\n  lr: 3.0e-4\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(str(twice))
    assert ("is not valid YAML at line 5, column 3: key 'lr' is given twice (also on line 4); keep one"
            in problems_of(excinfo)["(file)"])


def test_an_alias_bomb_is_refused_in_a_line(tmp_path):
    levels = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    levels += [f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip("abcdef", "bcdefg", strict=True)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join([*levels, "data:\n  path: *g"]) + "\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(str(bomb))
    assert f"expand to more than {MAX_YAML_VALUES:,} values" in str(excinfo.value)
    assert len(str(excinfo.value)) < 500


def test_a_large_value_is_echoed_in_a_line():
    with pytest.raises(ConfigError) as excinfo:
        parse_config({"optim": {"lr": ["3e-4"] * 50_000}, "data": {"path": "p" * 1_000_000}})
    assert len(str(excinfo.value)) < 1_000
    assert len(str(Problem("k", "v" * 10_000, "m", "f"))) < 200


def test_an_unknown_key_under_a_section_suggests_that_sections_keys():
    with pytest.raises(ConfigError) as excinfo:
        load_config("tiny", ["optim.foo=1", "optim.lrr=1e-3", "optimm.lr=1e-3"])
    problems = problems_of(excinfo)
    assert problems["optim.foo"].endswith("Fix: remove it; the keys of optim are lr, min_lr_ratio, "
                                          "warmup_steps, weight_decay, beta1, beta2, eps, grad_clip, fused")
    assert problems["optim.lrr"].endswith("Fix: did you mean `optim.lr`?")
    assert problems["optimm"].endswith("Fix: did you mean `optim`?")


@pytest.mark.parametrize(("overrides", "key", "said"), [
    (["optim=3"], "optim", "optim: is not a section of keys (got 3). Fix: write it as `key: value` lines "
                           "indented under it (its keys: lr, min_lr_ratio"),
    (["training.steps=many"], "training.steps",
     "training.steps: is not a whole number (got 'many'). Fix: write a whole number, without quotes"),
    (["optim.lr=fast"], "optim.lr", "optim.lr: is not a number (got 'fast')"),
    (["parallel.strategy=ZERO3"], "parallel.strategy",
     "parallel.strategy: is not one of the allowed values (got 'ZERO3'). Fix: use 'FULL_SHARD'"),
    (["optim.lr=-1"], "optim.lr", "optim.lr: must be more than 0.0 (got -1). Fix: use a value above 0.0"),
])
def test_pydantic_errors_are_in_the_trainers_own_words(overrides, key, said):
    with pytest.raises(ConfigError) as excinfo:
        load_config("tiny", overrides)
    problems = problems_of(excinfo)
    assert problems[key].startswith(said), problems[key]
    assert not any("Input should" in p or "instance of" in p for p in problems.values())


def test_resume_from_a_path_needs_a_checkpoint_dir(capsys):
    assert main(["--config", "tiny", "--steps", "1", "--resume", "/tmp/ckpt/step_00000010"]) == 2
    err = capsys.readouterr().err
    assert ("checkpoint.resume: names a checkpoint to resume from, but checkpoint.dir is not set: "
            "checkpointing is off, so the run would start fresh and save nothing (got "
            "'/tmp/ckpt/step_00000010'). Fix: add --checkpoint-dir DIR") in err
    assert load_config("tiny", [], {"checkpoint.resume": "/tmp/x", "checkpoint.dir": "/tmp/c"}).checkpoint.dir


def test_a_cuda_device_where_there_is_none_or_too_few(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"distributed\.device: asks for a CUDA device, and none is"):
        distributed.check_cuda_device(0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    distributed.check_cuda_device(1)
    with pytest.raises(ConfigError, match=r"LOCAL_RANK: has no GPU of its own: the node shows 2 .*"
                                          r"--nproc-per-node 2"):
        distributed.check_cuda_device(2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_cuda_asked_for_on_a_host_without_it_is_a_one_line_error():
    result = subprocess.run([sys.executable, "-m", "trainer", "--config", "tiny", "--steps", "1", "--set",
                             "distributed.device=cuda"], capture_output=True, text=True, cwd=REPO,
                            timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "distributed.device: asks for a CUDA device, and none is visible" in result.stderr


def test_an_estimate_that_does_not_fit_exits_non_zero(capsys):
    assert main(["--estimate", "gpt-7b", "--world-size", "8", "--gpu", "a100-40gb"]) == 1
    assert "does NOT fit" in capsys.readouterr().out
    assert main(["--estimate", "gpt-7b", "--world-size", "8", "--gpu", "a100-40gb", "--json"]) == 1
    assert main(["--estimate", "gpt-7b", "--world-size", "16", "--gpu", "a100-40gb"]) == 0
    assert main(["--estimate", "gpt-7b", "--world-size", "8"]) == 0  # no GPU asked about: nothing to fail


def test_without_the_trainer_extra_it_says_what_to_install():
    """`pip install -e .` without `[trainer]`: no torch. Its import is made to fail as a missing one does."""
    hide_torch = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['fsdp-train', '--config', "
                  "'tiny']; runpy.run_module('trainer', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", hide_torch], capture_output=True, text=True, cwd=REPO,
                            timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == ("error: fsdp-train needs the Python package torch, which is not "
                                     "installed here. Fix: pip install -e '.[trainer]' in the repository "
                                     "(the nodes get it with `fsdpctl deploy`)")
