"""Single-process pieces of the training step: peak FLOPs by device name, the chunked cross-entropy,
the interval arithmetic of the communication measurement, resuming hyperparameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.commtime import uncovered, union
from trainer.config import OptimConfig
from trainer.loss import loss_fn
from trainer.metrics import peak_flops_for_name
from trainer.train import build_optimizer, build_scheduler, follow_schedule


@pytest.mark.parametrize(("name", "tflops"), [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
    ("NVIDIA H200", 989), ("NVIDIA H200 NVL", 835), ("NVIDIA A100-SXM4-40GB", 312),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100 80GB PCIe", 312), ("Tesla V100-SXM2-16GB", None),
    ("NVIDIA L4", None)])
def test_peak_flops_by_device_name(name, tflops):
    peak = peak_flops_for_name(name)
    assert (peak / 1e12 if peak else None) == tflops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_loss_matches_fp32_reference(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(3, 50, 300) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, 300, (3, 50))
    got = loss_fn(logits, targets, chunk_tokens=32)  # 150 rows: 4 chunks, the last one short
    got.backward()
    got_grad = logits.grad.clone()
    logits.grad = None
    want = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    want.backward()
    assert got.dtype == torch.float32
    assert float(got.detach()) == pytest.approx(float(want.detach()), abs=1e-5)
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(got_grad.float(), logits.grad.float(), atol=1e-4, rtol=1e-2)


def test_chunked_loss_keeps_fp16_gradients_under_gradscalers_scale():
    # 4096 tokens: (p - y) / N stored in fp16 underflows for p < ~2.4e-4, and GradScaler's first
    # scale (65536) cast to fp16 is inf: either made the scaled fp16 gradient useless.
    torch.manual_seed(0)
    logits = torch.randn(4096, 512).to(torch.float16).requires_grad_()
    targets = torch.randint(0, 512, (4096,))
    scale = 65536.0
    (loss_fn(logits[None], targets[None], chunk_tokens=1024) * scale).backward()
    got = logits.grad
    reference = logits.detach().float().requires_grad_()
    (F.cross_entropy(reference, targets) * scale).backward()
    want = reference.grad.to(torch.float16)
    assert torch.isfinite(got).all()
    assert (got == 0).float().mean() <= (want == 0).float().mean() + 1e-3  # nothing underflows extra
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=1e-6)


def test_fp32_loss_is_plain_cross_entropy():
    logits, targets = torch.randn(2, 8, 16), torch.randint(0, 16, (2, 8))
    assert torch.equal(loss_fn(logits, targets), F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def test_chunked_loss_never_holds_the_whole_fp32_logits():
    from tests.trainer.memory import PeakTracker

    logits = torch.randn(4, 256, 2048).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 2048, (4, 256))
    full_fp32 = logits.numel() * 4
    with PeakTracker() as tracker:
        loss_fn(logits, targets, chunk_tokens=64).backward()
    # Measured: 5.5 MB chunked (the bf16 gradient, 4 MB, plus one fp32 chunk and its softmax),
    # 24 MB upcasting the whole 8 MB fp32 logits (copy, log-softmax, its gradient).
    assert tracker.peak < 0.75 * full_fp32, (tracker.peak, full_fp32)
    with PeakTracker() as upcast:
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
    assert upcast.peak > 2 * full_fp32


def test_exposed_communication_is_what_compute_does_not_cover():
    comm = union([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)])
    assert comm == [(0.0, 2.0), (3.0, 4.0)]
    compute = union([(0.2, 0.4), (1.5, 3.5)])
    # uncovered: 0-0.2, 0.4-1.5, 3.5-4.0
    assert uncovered(comm, compute) == pytest.approx(0.2 + 1.1 + 0.5)
    assert uncovered(comm, []) == pytest.approx(3.0)
    assert uncovered(comm, [(-1.0, 5.0)]) == 0.0


def test_fused_adamw_is_chosen_by_the_config_and_steps_like_foreach():
    torch.manual_seed(0)
    models = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
    models[1].load_state_dict(models[0].state_dict())
    cfgs = [OptimConfig(lr=1e-2, warmup_steps=0), OptimConfig(lr=1e-2, warmup_steps=0, fused=True)]
    optimizers = [build_optimizer(m, c) for m, c in zip(models, cfgs, strict=True)]
    assert (optimizers[0].defaults["foreach"], optimizers[1].defaults["fused"]) == (True, True)
    batch = torch.randn(4, 8)
    for _ in range(3):
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad()
            model(batch).square().mean().backward()
            optimizer.step()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_resume_applies_the_new_learning_rate():
    model = torch.nn.Linear(4, 4)
    old = OptimConfig(lr=3e-3, warmup_steps=2, min_lr_ratio=1.0)
    optimizer = build_optimizer(model, old)
    scheduler = build_scheduler(optimizer, old, 10)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    saved_optim, saved_sched = optimizer.state_dict(), scheduler.state_dict()
    new = OptimConfig(lr=1e-3, warmup_steps=2, min_lr_ratio=1.0, weight_decay=0.05)
    optimizer = build_optimizer(model, new)
    scheduler = build_scheduler(optimizer, new, 10)
    optimizer.load_state_dict(saved_optim)
    scheduler.load_state_dict(saved_sched)
    logged = []
    follow_schedule(optimizer, scheduler, new, logged.append)
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 1e-3]
    assert optimizer.param_groups[0]["weight_decay"] == 0.05
    assert any("optim.lr changed 0.003 -> 0.001" in line for line in logged)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
