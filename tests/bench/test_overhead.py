"""bench/overhead.py: the passes over the parameter gradients it times beside GradScaler's."""

from __future__ import annotations

import torch
from torch import nn


def test_gradient_passes_times_gradscalers_pass_and_gs_two_over_every_gradient(bench_module) -> None:
    overhead = bench_module("overhead")
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model(torch.randn(4, 8)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    passes = overhead.gradient_passes(model, torch.device("cpu"), rounds=3)
    assert passes["gradient values"] == sum(p.numel() for p in model.parameters())
    timed = ("GradScaler unscale and check ms", "GS unscale ms", "GS step read ms")
    assert all(passes[name] > 0.0 for name in timed)
    extra = passes["GS unscale ms"] + passes["GS step read ms"] - passes["GradScaler unscale and check ms"]
    assert passes["GS passes less GradScaler's ms"] == extra
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))  # timed with factors of 1: unchanged
