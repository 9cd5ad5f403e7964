"""Regions the scaler cannot see into (custom autograd Functions, compiled regions) are scaled as one unit.

Before, they passed their incoming scale through with none of their own, so gradients shrinking
inside them got no more protection than the scale they arrived with (issue 16).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gs_lightning import GradientScaler


class _OpaqueLinearFunction(torch.autograd.Function):
    """``x @ w.T`` with a hand-written backward: a custom Function, as fused layers from other libraries are."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        return grad @ weight.to(grad.dtype), grad.t() @ x.to(grad.dtype)


class OpaqueLinear(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OpaqueLinearFunction.apply(x, self.weight.to(x.dtype))


class Shrink(nn.Module):
    """Activations 10^4 smaller: the weight gradient of the layer after it underflows in fp16 unless scaled."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e-4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), Shrink(), OpaqueLinear(32), nn.ReLU(), nn.Linear(32, 4))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(32, 16), torch.randint(0, 4, (32,))


def _loss(model: nn.Module, fp16: bool) -> torch.Tensor:
    x, y = batch()
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        return F.cross_entropy(model(x).float(), y)


def _opaque_weight_error(model: nn.Module, reference: nn.Module) -> float:
    """Relative error of the opaque layer's weight gradient, computed in fp16 inside the custom Function."""
    got, expected = model[3].weight.grad, reference[3].weight.grad
    return ((got - expected).norm() / expected.norm()).item()


def test_a_custom_function_whose_gradients_would_underflow_gets_a_scale_of_its_own() -> None:
    reference = make_model()
    _loss(reference, fp16=False).backward()
    errors = {}
    for method in ("none", "GradScaler", "GS"):
        model = make_model()
        if method == "none":
            _loss(model, fp16=True).backward()
        elif method == "GradScaler":
            scaler = torch.amp.GradScaler("cpu")
            scaler.scale(_loss(model, fp16=True)).backward()
            scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
        else:
            gs = GradientScaler(model)
            with pytest.warns(RuntimeWarning, match="_OpaqueLinearFunctionBackward.*scaled as one unit"):
                gs.backward(_loss(model, fp16=True))
        errors[method] = _opaque_weight_error(model, reference)
    (opaque,) = [layer for layer in gs.layers() if layer.kind == "opaque"]
    assert opaque.log2_scale > 0 and opaque.log2_total >= 16
    assert errors["none"] > 10 * errors["GradScaler"], errors  # unscaled, that gradient underflows
    assert errors["GS"] <= 1.5 * errors["GradScaler"], errors  # at least a dynamic loss scale's protection


@pytest.mark.parametrize("update_interval", [1, 100], ids=["update", "replay"])
def test_opaque_regions_keep_fp32_gradients_bit_exact(update_interval: int) -> None:
    model, reference = make_model(), make_model()
    scaler = GradientScaler(model, update_interval=update_interval)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            model.zero_grad()
            reference.zero_grad()
            scaler.backward(_loss(model, fp16=False))
            _loss(reference, fp16=False).backward()
            assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))
    assert all(layer.log2_scale > 0 for layer in scaler.layers() if layer.kind == "opaque")
    assert scaler.iteration == 3


def test_a_custom_function_inside_a_compiled_model_is_scaled_as_one_unit() -> None:
    """Inside torch.compile's backward the layers get their own scales (``test_compiled.py``); a custom Function
    there is still opaque and gets a scale of its own, replayed inside the compiled graph, and fp32 stays exact."""
    torch._dynamo.reset()
    model, reference = make_model(), make_model()
    compiled = torch.compile(model, backend="aot_eager")  # AOTAutograd's compiled backward, without codegen
    scaler = GradientScaler(compiled, update_interval=2)
    x, y = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):  # update, replay, update
            compiled.zero_grad()
            reference.zero_grad()
            scaler.backward(F.cross_entropy(compiled(x), y))
            F.cross_entropy(reference(x), y).backward()
            assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))
    (region,) = [layer for layer in scaler.layers() if layer.kind == "opaque"]
    assert "CompiledFunction" not in region.name and scaler.compiled_modules[0].eager_reason is None
    assert region.log2_total >= 16  # GradScaler's initial scale
