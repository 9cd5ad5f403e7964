"""Gradient fidelity of fp16 training methods against fp32, on the same weights and batch.

An analysis tool kept apart from the core: ``bench/fidelity.py`` and the tests measure with it.
Each method runs one forward under fp16 autocast and one backward, and is compared with an
fp32 forward/backward: the relative error of all parameter gradients, and the fraction of
nonzero fp32 activation gradients that are zero under the method (underflow).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from gs_lightning.scaling import GradientScaler

LossFn = Callable[[nn.Module], torch.Tensor]


@dataclass(frozen=True)
class Fidelity:
    """Relative gradient error vs fp32 and activation-gradient underflow of one method."""

    error: float
    underflow: float


@contextmanager
def _activation_grads(model: nn.Module, store: list[torch.Tensor]) -> Iterator[None]:
    """Record the gradient reaching every leaf module's output, in forward order."""

    def forward_hook(module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            slot = len(store)
            store.append(torch.empty(0))
            output.register_hook(lambda grad: store.__setitem__(slot, grad.detach()))

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(forward_hook) for m in leaves]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def run_backward(
    model: nn.Module,
    loss_fn: LossFn,
    backward: Callable[[torch.Tensor], None],
    autocast: bool,
    device_type: str,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One forward/backward; returns (parameter gradients, activation gradients)."""
    model.zero_grad(set_to_none=True)
    activations: list[torch.Tensor] = []
    with _activation_grads(model, activations), torch.autocast(device_type, dtype=torch.float16, enabled=autocast):
        loss = loss_fn(model)
    backward(loss)
    return _grads(model), activations


def relative_error(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """‖g − g_ref‖ / ‖g_ref‖ over all parameters; ``inf`` if any gradient is non-finite."""
    diff = sum(float((g - r).double().pow(2).sum()) for g, r in zip(grads, reference))
    norm = sum(float(r.double().pow(2).sum()) for r in reference)
    return math.sqrt(diff / norm) if math.isfinite(diff) else math.inf


def underflow_fraction(activations: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Fraction of nonzero fp32 activation gradients that are exactly zero under the method."""
    nonzero = lost = 0
    for a, r in zip(activations, reference):
        if a.numel() == 0 or a.shape != r.shape:
            continue
        mask = r != 0
        nonzero += int(mask.sum())
        lost += int((mask & (a == 0)).sum())
    return lost / max(nonzero, 1)


class FidelityProbe:
    """Measures methods on one model, batch and set of weights against fp32."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, device_type: str = "cpu") -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.device_type = device_type
        self.reference, self.reference_activations = run_backward(
            model, loss_fn, lambda loss: loss.backward(), autocast=False, device_type=device_type
        )

    def measure(self, backward: Callable[[torch.Tensor], None], unscale: float = 1.0) -> Fidelity:
        """Fidelity of a backward run under fp16 autocast; grads are divided by ``unscale``."""
        grads, activations = run_backward(self.model, self.loss_fn, backward, autocast=True, device_type=self.device_type)
        grads = [g / unscale for g in grads]
        return Fidelity(relative_error(grads, self.reference), underflow_fraction(activations, self.reference_activations))

    def none(self) -> Fidelity:
        """fp16 with no scaling."""
        return self.measure(lambda loss: loss.backward())

    def fixed(self, scale: float) -> Fidelity:
        """A fixed loss scale."""
        return self.measure(lambda loss: (loss * scale).backward(), unscale=scale)

    def best_fixed(self, exponents: range = range(0, 25)) -> tuple[float, Fidelity]:
        """The oracle: the fixed scale 2^k with the lowest gradient error."""
        results = {2.0**k: self.fixed(2.0**k) for k in exponents}
        scale = min(results, key=lambda s: results[s].error)
        return scale, results[scale]

    def dynamic(self, init_scale: float = 2.0**24) -> tuple[float, Fidelity]:
        """GradScaler at its steady state: the largest power of two whose gradients stay finite."""
        scale = init_scale
        while scale > 1.0:
            result = self.fixed(scale)
            if math.isfinite(result.error):
                return scale, result
            scale /= 2.0
        return scale, self.fixed(scale)

    def gradient_scaling(self, **options: Any) -> tuple[GradientScaler, Fidelity]:
        """GS with the given ``GradientScaler`` options, on its first (update) iteration."""
        scaler = GradientScaler(self.model, **options)
        return scaler, self.measure(scaler.backward)
