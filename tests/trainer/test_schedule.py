"""Warm-up + cosine learning-rate schedule, and the learning rate after a resume."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from trainer.config import OptimConfig
from trainer.train import build_optimizer, build_scheduler, follow_schedule, lr_multiplier


def test_warmup_then_cosine_to_the_floor():
    values = [lr_multiplier(s, warmup=4, total=12, min_ratio=0.1) for s in range(14)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert values[8] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert values[12] == pytest.approx(0.1) and values[13] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(values[3:]))


def _optimizer_and_scheduler(total: int):
    model = torch.nn.Linear(4, 4)
    cfg = OptimConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.0)
    optimizer = build_optimizer(model, cfg)
    return model, optimizer, build_scheduler(optimizer, cfg, total)


def test_resume_with_more_steps_follows_the_new_schedule():
    model, optimizer, scheduler = _optimizer_and_scheduler(total=6)
    for _ in range(6):
        model(torch.ones(4)).sum().backward()
        optimizer.step()
        scheduler.step()
    saved_optimizer, saved_scheduler = optimizer.state_dict(), scheduler.state_dict()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0)

    _, optimizer, scheduler = _optimizer_and_scheduler(total=10)
    optimizer.load_state_dict(saved_optimizer)
    scheduler.load_state_dict(saved_scheduler)
    # The restored optimizer state still says lr 0 (the old run's end); the schedule for 10 steps says
    # otherwise for step 7.
    follow_schedule(optimizer, scheduler, OptimConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.0), print)
    expected = lr_multiplier(6, warmup=2, total=10, min_ratio=0.0)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([expected, expected])
    assert expected > 0.1
