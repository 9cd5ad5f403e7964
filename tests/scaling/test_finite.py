"""The fused finiteness check shared by the scaler and the loss-scaling baselines."""

from __future__ import annotations

import torch
from torch import nn

from gs_lightning.scaling.finite import any_non_finite, unscale_and_check_


def test_one_flag_per_device_and_in_place_unscale() -> None:
    grads = [torch.full((3,), 4.0), torch.full((2,), 8.0, dtype=torch.float64)]
    (flag,) = unscale_and_check_(grads, inv_scale=0.5)
    assert float(flag) == 0.0
    assert torch.equal(grads[0], torch.full((3,), 2.0)) and torch.equal(
        grads[1], torch.full((2,), 4.0, dtype=torch.float64)
    )
    shared: dict = {}
    unscale_and_check_([torch.tensor([1.0, float("nan")])], found_inf=shared)
    unscale_and_check_([torch.ones(2)], inv_scale=0.25, found_inf=shared)  # later calls set flags, never clear them
    assert [float(f) for f in shared.values()] == [1.0]


def test_sparse_gradients_are_checked_and_unscaled_through_their_values() -> None:
    embedding = nn.Embedding(10, 3, sparse=True)
    embedding(torch.tensor([1, 1, 4])).sum().backward()
    grad = embedding.weight.grad
    assert grad.is_sparse and not any_non_finite([grad])
    unscale_and_check_([grad], inv_scale=0.25)
    assert torch.equal(grad.to_dense()[1], torch.full((3,), 0.5)) and torch.equal(
        grad.to_dense()[4], torch.full((3,), 0.25)
    )
    grad._values()[0, 0] = float("inf")
    assert any_non_finite([grad])


def test_missing_and_integer_gradients_are_ignored() -> None:
    assert not any_non_finite([None, torch.tensor([1, 2])])
    assert unscale_and_check_([]) == []
