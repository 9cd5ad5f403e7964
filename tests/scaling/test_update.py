"""Decisions of an update iteration, measured end to end through GradientScaler.

Each test takes the exact fp32 gradient a decision point sends on (from a plain fp32 backward)
and the accumulated scale the scaler gave it, and measures the fraction of its nonzero elements
that scaling leaves below λmin: issue #8's bar is ≤ 2γ'.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gs_lightning import GradientScaler
from gs_lightning.scaling.gains import bounded_gains, node_gains
from gs_lightning.scaling.graph import analyze, walk

TARGET = 1e-3
LAMBDA_MIN = 2.0**-14  # fp16's smallest normal, the default λmin


def _underflow(grad: torch.Tensor, log2_total: int) -> float:
    magnitude = grad.abs().double()
    nonzero = magnitude > 0
    return float((nonzero & (magnitude * 2.0**log2_total < LAMBDA_MIN)).sum() / nonzero.sum())


def _layer(scaler: GradientScaler, name: str):
    return next(layer for layer in scaler.layers() if layer.name == name)


def test_regression_head_with_one_output_meets_the_target() -> None:
    """Linear(1024, 1): each input-gradient element is one product of two Gaussians (N = 1)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1))
    x = torch.randn(512, 64, requires_grad=True)
    hidden = model[1](model[0](x))
    hidden.retain_grad()
    loss = (model[2](hidden) * torch.randn(512, 1) * 1e-7).sum()
    loss.backward(retain_graph=True)
    exact = hidden.grad.clone()
    scaler = GradientScaler(model)
    scaler.backward(loss)
    head = _layer(scaler, "2")
    assert head.log2_scale > 0 and _underflow(exact, head.log2_total) <= 2 * TARGET


@pytest.mark.parametrize("shape", ["gaussian", "laplace", "sparse"])
def test_cast_of_a_non_log_normal_gradient_meets_the_target(shape: str) -> None:
    """An fp32→fp16 cast whose fp32 gradient is not log-normal (a regression loss, a LayerNorm exit)."""
    torch.manual_seed(0)
    layer = nn.Linear(32, 256)
    x = torch.randn(256, 32)
    upstream = {
        "gaussian": torch.randn(256, 256),
        "laplace": torch.distributions.Laplace(0.0, 1.0).sample((256, 256)),
        "sparse": torch.randn(256, 256) * (torch.rand(256, 256) < 0.05),
    }[shape] * 2e-6
    scaler = GradientScaler(layer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    scaler.backward((out.float() * upstream).sum())
    cast = next(layer for layer in scaler.layers() if layer.kind == "cast")
    assert cast.log2_scale > 0 and _underflow(upstream, cast.log2_total) <= 2 * TARGET


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 3 * 32)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.proj(x).unflatten(-1, (3, 4, 8)).permute(2, 0, 3, 1, 4))  # 3 × (batch, heads, length, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(*self.qkv(x))


def test_fused_attention_is_a_decision_point_that_meets_the_target() -> None:
    torch.manual_seed(0)
    model = _Attention()
    x = torch.randn(8, 64, 32)
    upstream = torch.randn(8, 4, 64, 8) * 1e-6
    q, k, v = (t.detach().requires_grad_() for t in model.qkv(x))
    exact = torch.autograd.grad((F.scaled_dot_product_attention(q, k, v) * upstream).sum(), (q, k, v))
    scaler = GradientScaler(model)
    scaler.backward((model(x) * upstream).sum())
    attention = _layer(scaler, "proj.attention")
    assert attention.kind == "attention" and attention.log2_scale > 0
    assert max(_underflow(g, attention.log2_total) for g in exact) <= 2 * TARGET


def _capture_gemm_output(scale_g: float, weight_std: float, lambda_min: str) -> tuple[torch.Tensor, GradientScaler]:
    """Gradient leaving a Linear layer in fp16, as it is stored, scaled by the chosen scales."""
    torch.manual_seed(4)
    layer = nn.Linear(256, 64, bias=False)
    nn.init.normal_(layer.weight, std=weight_std)
    x0 = torch.randn(1024, 256, requires_grad=True)
    upstream = torch.randn(1024, 64) * scale_g
    captured: list[torch.Tensor] = []
    scaler = GradientScaler(layer, lambda_min=lambda_min)
    with torch.autocast("cpu", dtype=torch.float16):
        x = (x0 * 1.0).half()  # a non-leaf, so the layer's input gradient is an activation gradient
        x.register_hook(captured.append)
        loss = (layer(x).float() * upstream).sum()
    scaler.backward(loss)
    return captured[0], scaler


def test_gemm_scale_meets_target_in_fp16() -> None:
    """End to end: the fp16 gradient a Linear layer sends on has ~γ' of its elements below λmin."""
    grad, scaler = _capture_gemm_output(1e-9, 0.05, "normal")
    threshold = scaler.lambda_min_value  # fp16 values below the smallest normal are subnormal
    assert grad.dtype == torch.float16 and scaler.scales()["Linear"] > 1.0

    def below(g: torch.Tensor) -> float:
        return float((g.abs() < threshold).double().mean())

    assert below(grad.float()) <= TARGET
    assert below(grad.float() / 2) > TARGET  # half the scale misses the target


def test_a_product_by_a_constant_counts_as_a_gain() -> None:
    """The scaler's own factors, recorded by ``create_graph=True``, multiply a second backward's gradient
    (a gradient penalty): an update counts a product by a constant scalar as a gain, as it does a batch norm's;
    one below 1 counts as 1."""
    x = torch.randn(4, 8, requires_grad=True)
    graph = walk(((x * 64.0).tanh() * 0.5).sum().grad_fn)
    found = node_gains(graph, analyze(graph, {}))
    gains = sorted((graph.names[j], float(gain)) for j, gain in bounded_gains(found).items())
    assert gains == [("MulBackward0", 1.0), ("MulBackward0", 64.0)]  # the product by 0.5 grows nothing
