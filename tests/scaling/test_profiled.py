"""GradientScaler's own work shows in the PyTorch profiler's trace, layer by layer; without a profiler it costs
nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gs_lightning import GradientScaler


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))


def _iteration(model: nn.Module, scaler: GradientScaler, optimizer: torch.optim.Optimizer) -> None:
    scaler.backward(model(torch.randn(2, 3, 8, 8)).square().mean())
    scaler.step(optimizer)
    scaler.update()


def test_an_update_iteration_shows_each_decision_and_the_step_read_in_the_profiler() -> None:
    model = _net()
    scaler, optimizer = GradientScaler(model, update_interval=1), torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.profiler.profile() as profile:
        _iteration(model, scaler, optimizer)
    ranges = {event.key for event in profile.key_averages() if event.key.startswith("GradientScaler.")}
    decisions = {f"GradientScaler.decide:{layer.name}" for layer in scaler.layers()}
    assert decisions == {"GradientScaler.decide:0", "GradientScaler.decide:4"}
    assert ranges == {"GradientScaler.prepare", "GradientScaler.unscale", "GradientScaler.step_read", *decisions}


def test_without_a_profiler_no_range_is_opened(monkeypatch: pytest.MonkeyPatch) -> None:
    """A range costs a dispatcher call even when nothing records: none on an update iteration, a replay or a step."""
    model = _net()
    scaler, optimizer = GradientScaler(model, update_interval=2), torch.optim.SGD(model.parameters(), lr=0.1)

    def refuse(name: str) -> None:
        raise AssertionError(f"a profiler range ({name}) while no profiler records")

    monkeypatch.setattr(torch.profiler, "record_function", refuse)
    for _ in range(2):  # an update, then a replay
        _iteration(model, scaler, optimizer)
    assert scaler.update_iterations == 1
