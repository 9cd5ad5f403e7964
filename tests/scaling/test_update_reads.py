"""What an update iteration leaves on the device (finiteness flags, underflow counted at scales an overflow
bound held down) is read with the step's one read, or when ``layers()`` asks: not in the backward."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from gs_lightning import GradientScaler


@contextlib.contextmanager
def counting_reads() -> Iterator[list[str]]:
    """The names of the host reads (``item``, ``tolist``) made inside the block."""
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist")}

    def counted(name: str):
        def read(self, *args, **kwargs):
            calls.append(name)
            return originals[name](self, *args, **kwargs)

        return read

    for name in originals:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _held_down() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A layer whose incoming gradient spans 2^-40..2^10: its largest values keep its scale below the one that meets
    γ' for its smallest, so the underflow at the chosen scale is counted over the whole sample, on the device."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64))
    x = torch.randn(32, 16)
    weights = 2.0 ** torch.linspace(-40, 10, 32 * 64).reshape(32, 64)
    return model, x, weights


def _update(scaler: GradientScaler, model: nn.Module, x: torch.Tensor, weights: torch.Tensor) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (model(x).float() * weights).sum()
    scaler.backward(loss)


def test_the_underflow_an_update_counted_on_the_device_is_read_with_the_step() -> None:
    model, x, weights = _held_down()
    stepped = GradientScaler(model)
    _update(stepped, model, x, weights)
    with counting_reads() as step_reads:
        stepped.step(torch.optim.SGD(model.parameters(), lr=0.0))
    with counting_reads() as layer_reads:
        layers = stepped.layers()
    assert len(step_reads) == 1 and layer_reads == []  # the step's one read took them
    held = [layer for layer in layers if layer.limit.is_overflow_bound and layer.measured_underflow is not None]
    assert held and all(0.0 < layer.measured_underflow <= layer.underflow_rate <= 1.0 for layer in held)

    model.zero_grad()
    asked = GradientScaler(model)  # the same update, no step: layers() reads them, once
    _update(asked, model, x, weights)
    assert any(t.dtype == torch.int64 for t in asked.graphs[-1].unread())  # underflow counts, beside the float flags
    with counting_reads() as layer_reads:
        assert asked.layers() == layers and asked.first_non_finite is None
    assert len(layer_reads) == 1
    assert all(math.isfinite(layer.underflow_rate) for layer in layers if layer.kind == "gemm")


class _Residual(nn.Module):
    """h = first(x); head(h + inner(h)): h's gradient is the sum of two parts, the one through ``inner`` scaled further."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.inner, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)
        with torch.no_grad():
            self.inner.weight.mul_(2.0**-12)  # its ∇X is small: inner decides a scale of its own, the branch merges two

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        return self.head(h + self.inner(h))


def test_a_merge_of_different_scales_reads_nothing_the_next_decision_reads_it() -> None:
    torch.manual_seed(0)
    model, x = _Residual(), torch.randn(64, 16)
    scaler = GradientScaler(model, recipe="paper")  # Algorithm 1 alone: one read per decision, no rule reads more
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).sum()
    with counting_reads() as reads:
        scaler.backward(loss)
    layers = {layer.name: layer for layer in scaler.layers()}
    assert layers["inner"].log2_total != layers["head"].log2_total  # the two parts carried different scales
    assert len(reads) == len(layers) == 4  # head's cast, head, inner, first: none for the merge
    scaler.step(torch.optim.SGD(model.parameters(), lr=0.0))
    assert not scaler.found_inf and all(torch.isfinite(p.grad).all() for p in model.parameters())
