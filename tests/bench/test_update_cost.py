"""bench/update_cost.py on one small zoo model: the zoo builds, times are taken, the exactness check can fail."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn


@pytest.fixture
def update_cost(bench_module):
    return bench_module("update_cost")


def test_zoo_model_is_timed_and_bit_exact(update_cost) -> None:
    (entry,) = update_cost.zoo(("rnn",), names=("rnn-tanh-bidirectional",))
    model, forward = entry.build(1)
    assert model.training and math.isfinite(forward().item())

    result = update_cost.measure(entry, rounds=1)
    assert not result.error
    assert set(result.times) == {"plain", "update", "replay"} and all(t > 0 for t in result.times.values())
    assert result.exact_update and result.exact_replay
    assert any(layer["kind"] == "gemm" for layer in result.layers)
    table = update_cost.report([result])
    assert "| rnn | rnn-tanh-bidirectional |" in table and "| rnn | 1 |" in table and "| 1 of 1 |" in table


def test_gradients_that_differ_are_reported_not_exact(update_cost) -> None:
    """A forward that changes between calls gives gradients unequal to plain backward's: the table says NO."""
    calls = itertools.count()

    def build(batch_scale: int):
        layer = nn.Linear(4, 3)
        return layer, lambda: layer(torch.full((2, 4), float(next(calls)))).square().sum()

    result = update_cost.measure(update_cost.ZooModel("rnn", "drifting", build), rounds=1)
    assert not result.error and not result.exact_update and not result.exact_replay
    assert "NO (no, no)" in update_cost.report([result])


def test_a_model_that_fails_is_a_row_and_unknown_families_are_refused(update_cost, capsys: pytest.CaptureFixture) -> None:
    def build(batch_scale: int):
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
    model, forward = entry.build(1)
    seen = []
    model.features[0].register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    forward()
    assert seen == [(2, 3, 48, 48)]
    for bad in (["--image-size", "16"], ["--transformer-width", "100"]):
        with pytest.raises(SystemExit):
            update_cost.main(bad)
