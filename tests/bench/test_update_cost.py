"""bench/update_cost.py on one small zoo model: the zoo builds, times are taken, the exactness check can fail."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn


@pytest.fixture
def update_cost(bench_module):
    return bench_module("update_cost")


def test_zoo_model_is_timed_and_bit_exact(update_cost) -> None:
    (entry,) = update_cost.zoo(("rnn",), names=("rnn-tanh-bidirectional",))
    model, forward = entry.build(1, "cpu")
    assert model.training and math.isfinite(forward().item())

    result = update_cost.measure(entry, rounds=1)
    assert not result.error
    assert set(result.times) == {"plain", "update", "replay"} and all(t > 0 for t in result.times.values())
    assert result.exact_update and result.exact_replay
    assert any(layer["kind"] == "gemm" for layer in result.layers)
    table = update_cost.report([result])
    assert "| rnn | rnn-tanh-bidirectional |" in table and "| rnn | 1 |" in table and "| 1 of 1 |" in table


def _identity_backward_by(backward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x`` as a custom Function whose backward returns ``backward(grad)``."""

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            return backward(grad)

    return Identity.apply


def test_gradients_that_differ_are_reported_not_exact(update_cost) -> None:
    """A custom Function whose backward is not linear in its gradient (a constant) breaks what scaling assumes:
    its parameters' gradients differ from plain backward's, and the table says NO."""
    constant = _identity_backward_by(torch.ones_like)

    def build(batch_scale: int, device: str):
        layer, x = nn.Linear(4, 3), torch.ones(2, 4)
        return layer, lambda: constant(layer(x)).square().sum()

    result = update_cost.measure(update_cost.ZooModel("rnn", "constant", build), rounds=1)
    assert not result.error and result.nondeterministic == 0 and not result.exact_update and not result.exact_replay
    assert "NO (no, no)" in update_cost.report([result])


def test_a_model_that_fails_is_a_row_and_unknown_families_are_refused(
    update_cost, capsys: pytest.CaptureFixture
) -> None:
    def build(batch_scale: int, device: str):
        raise RuntimeError("no such layer")

    result = update_cost.measure(update_cost.ZooModel("timm", "broken", build), rounds=1)
    assert result.error == "RuntimeError: no such layer"
    assert "| timm | broken | | | | | | | failed: RuntimeError: no such layer |" in update_cost.report([result])
    capsys.readouterr()
    with pytest.raises(ValueError, match="unknown zoo families"):
        update_cost.zoo(("keras",))


def test_image_size_sets_the_vision_models_images(update_cost) -> None:
    """``--image-size`` (ImageNet's 224 in the README's second table) reaches the model; 32 is the floor,
    and a transformer width must split into heads."""
    (entry,) = update_cost.zoo(("torchvision",), names=("squeezenet1_1",), image_size=48)
    model, forward = entry.build(1, "cpu")
    seen = []
    model.features[0].register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    forward()
    assert seen == [(2, 3, 48, 48)]
    for bad in (["--image-size", "16"], ["--transformer-width", "100"]):
        with pytest.raises(SystemExit):
            update_cost.main(bad)


def test_parameters_plain_backward_computes_differently_each_time_are_not_compared(update_cost) -> None:
    """A backward that is not deterministic (a parallel ``index_put_`` on several CPU threads) is not a
    difference GS made: those parameters are counted apart, the others still compared."""
    calls = itertools.count()
    jitter = _identity_backward_by(lambda grad: grad + next(calls) * 1e-3)

    def build(batch_scale: int, device: str):
        jittered, steady, x = nn.Linear(4, 3), nn.Linear(4, 3), torch.ones(2, 4)
        return nn.ModuleList([jittered, steady]), lambda: jitter(jittered(x)).square().sum() + steady(x).square().sum()

    result = update_cost.measure(update_cost.ZooModel("rnn", "jitter", build), rounds=1)
    assert not result.error and result.nondeterministic == 2  # the jittered layer's weight and bias
    assert result.exact_update and result.exact_replay
    assert "| yes (2 nondeterministic in plain backward) |" in update_cost.report([result])
