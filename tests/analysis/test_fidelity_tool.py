"""The fidelity analysis tool: shared fp16 forward, sweeps, dynamic steady state, GS back-off."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gs_lightning.analysis.fidelity import FidelityProbe


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def test_loss_scale_one_is_plain_backward_and_shares_sum_to_one() -> None:
    model = _mlp()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    probe = FidelityProbe(model, lambda m: F.cross_entropy(m(x).float(), y))
    none = probe.none()
    assert probe.fixed(1.0) == none  # the same fp16 forward, the same backward
    assert 0 < none.error < 0.05
    assert sum(p.share for p in none.parameters) == pytest.approx(1.0)
    assert [p.name for p in none.parameters] == [name for name, _ in model.named_parameters()]
    assert all(p.reference_max > 0 for p in none.parameters)
    assert set(none.activations) == {"0", "1", "2", "3", "4"}


def test_tiny_gradients_underflow_without_scaling_and_not_at_the_best_scale() -> None:
    model = _mlp()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    probe = FidelityProbe(model, lambda m: F.cross_entropy(m(x).float(), y) * 1e-8)
    none = probe.none()
    scale, best = probe.best_fixed()
    assert none.underflow > 0.9 and none.weight_underflow > 0.9
    assert scale >= 2.0**16 and best.error < none.error / 100 and best.underflow < 0.01


def test_sweep_stops_at_the_first_overflow_and_dynamic_is_the_largest_finite_scale() -> None:
    model = _mlp()
    x, y = torch.randn(8, 16) * 100, torch.randint(0, 4, (8,))
    probe = FidelityProbe(model, lambda m: F.cross_entropy(m(x).float(), y) * 100)
    results = probe.sweep(range(0, 25))
    exponents = [int(math.log2(s)) for s in results]
    assert exponents == list(range(len(exponents))) and len(exponents) < 25
    assert not math.isfinite(results[2.0 ** exponents[-1]].error)
    assert all(math.isfinite(f.error) for s, f in results.items() if s < 2.0 ** exponents[-1])
    scale, dynamic = probe.dynamic()
    assert scale == 2.0 ** (exponents[-1] - 1) and dynamic == results[scale]


class _Amplify(nn.Module):
    """Multiplies by a constant: in fp16 backward it scales the gradient up after GS's last decision."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1024


def test_gradient_scaling_run_skips_overflowing_iterations_until_finite() -> None:
    # Wide log-normal upstream gradients make the cast scale them up as far as they stay finite;
    # the x1024 in between is linear, so GS passes its scale through and the gradient overflows.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), _Amplify())
    x = torch.randn(256, 64)
    upstream = torch.exp(-10 + 3 * torch.randn(256, 64))
    probe = FidelityProbe(model, lambda m: (m(x).float() * upstream).sum())
    run = probe.gradient_scaling_run()
    assert len(run.attempts) > 1 and run.scaler.skipped_steps == len(run.attempts) - 1
    assert not math.isfinite(run.attempts[0].error) and math.isfinite(run.fidelity.error)
    assert len(run.layers) == len(run.attempts)
    first = max(layer.log2_total for layer in run.layers[0])
    assert max(layer.log2_total for layer in run.layers[-1]) < first  # backed off


def test_probe_frees_the_retained_fp16_graph() -> None:
    model = _mlp()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    probe = FidelityProbe(model, lambda m: F.cross_entropy(m(x).float(), y))
    probe.none()
    loss = weakref.ref(probe._half_loss)
    del probe  # no gc.collect(): the hooks in the graph must not hold the probe
    assert loss() is None
