"""What an update iteration leaves on the device (finiteness flags, underflow counted at scales an overflow
bound held down) is read with the step's one read, or when ``layers()`` asks: not in the backward."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch
import torchvision
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gs_lightning import GradientScaler
from gs_lightning.scaling.gradient_stats import DeviceRead

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")  # Tensor methods that read to the host


class RecordingRead(DeviceRead):
    """A :class:`DeviceRead` that keeps the tensors put into it, to be looked at."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[torch.Tensor] = []

    def put(self, key, tensors) -> None:
        tensors = list(tensors)
        self.tensors += tensors
        super().put(key, tensors)


class _ScalarReads(TorchDispatchMode):
    """Records the reads of a tensor's value that no Python method shows (indexing by a tensor, ``int(t)`` in C++)."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.calls.append("_local_scalar_dense")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_reads() -> Iterator[list[str]]:
    """The names of the host reads (:data:`READS`, ``torch.nonzero``, and every scalar read) made inside the block."""
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}
    nonzero = torch.nonzero

    def counted(name: str, original):
        def read(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    torch.nonzero = counted("nonzero", nonzero)
    try:
        with _ScalarReads(calls):
            yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.nonzero = nonzero


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
    read = RecordingRead()
    asked.graphs[-1].put_unread(read)
    assert any(t.dtype == torch.int64 for t in read.tensors)  # underflow counts, beside the float flags
    with counting_reads() as layer_reads:
        assert asked.layers() == layers and asked.first_non_finite is None
    assert len(layer_reads) == 1
    assert all(math.isfinite(layer.underflow_rate) for layer in layers if layer.kind == "gemm")


class _Residual(nn.Module):
    """``depth`` blocks h + inner(h) after a first layer: each block's input gradient is the sum of two parts, the one
    through ``inner`` at a scale of its own (its weights are small)."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.first, self.head = nn.Linear(16, 32), nn.Linear(32, 8)
        self.inner = nn.ModuleList(nn.Linear(32, 32) for _ in range(depth))
        with torch.no_grad():
            for layer in self.inner:
                layer.weight.mul_(2.0**-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        for layer in self.inner:
            h = h + layer(h)
        return self.head(h)


def test_decisions_and_merges_read_nothing_the_step_reads_them() -> None:
    """Algorithm 1 alone (the paper preset) and the default recipe: the decisions and the merges' common scales
    are taken on the device, whatever the depth, and the backward reads none of them: the step's one read does."""
    for recipe, depth in (("paper", 1), ("paper", 6), ("default", 6)):
        torch.manual_seed(0)
        model, x = _Residual(depth), torch.randn(64, 16)
        scaler = GradientScaler(model, recipe=recipe)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).sum()
        with counting_reads() as reads:
            scaler.backward(loss)
        assert reads == []
        with counting_reads() as reads:
            layers = {layer.name: layer for layer in scaler.layers()}
        assert reads == ["tolist"]  # asked before the step: read now, once
        assert len(layers) == depth + 3  # head's cast, head, the inner layers, first
        assert layers["inner.0"].log2_total != layers["head"].log2_total  # the merged parts carried different scales
        scaler.step(torch.optim.SGD(model.parameters(), lr=0.0))
        assert not scaler.found_inf


def _encoder() -> tuple[nn.Module, torch.Tensor]:
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(32, 10)), torch.randn(
        4, 6, 32
    )


@pytest.mark.parametrize(
    "caps", [{}, {"max_layer_scale": 16.0, "max_total_scale": 1024.0}], ids=["uncapped", "reference-caps"]
)
@pytest.mark.parametrize(
    "build",
    [lambda: (torchvision.models.resnet18(num_classes=10), torch.randn(2, 3, 32, 32)), _encoder],
    ids=["resnet18", "encoder"],
)
def test_host_reads_per_iteration(build, caps: dict[str, float]) -> None:
    """Host reads, scalar reads by the dispatcher included, under fp16 autocast: a backward reads nothing, update or
    replay (one read per decision point before issue 33); a step once, an update's scales and decisions with the
    gradients. The second update takes the two vectors the drift's expectation computes on the host from the
    steps' reads (``GradientDrift.expect``: CPU tensors built from host values, on any model's device). The same
    with the reference code's caps on the local and the accumulated scales (which cap holds is found on the device)."""
    torch.manual_seed(0)
    model, x = build()
    scaler = GradientScaler(model, update_interval=2, **caps)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    backward_reads, step_reads = [], []
    for _ in range(4):  # update, replay, update, replay
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        with counting_reads() as reads:
            scaler.backward(loss)
        backward_reads.append(len(reads))
        with counting_reads() as reads:
            scaler.step(optimizer)
            scaler.update()
        step_reads.append(len(reads))
    assert scaler.update_iterations == 2 and not scaler.found_inf
    assert backward_reads == [0, 0, 2, 0]
    assert step_reads == [1, 1, 1, 1]


def test_gradient_accumulation_reads_the_update_as_the_next_backward_starts() -> None:
    """Two backwards before a step: the second replays the plan the first decided, which it reads as it starts (once);
    the step then reads the gradients (once), and the accumulated gradients are those of two plain backwards."""
    torch.manual_seed(0)
    model, x = _Residual(2), torch.randn(64, 16)
    plain = [torch.zeros_like(p) for p in model.parameters()]
    for half in x.chunk(2):
        for total, grad in zip(plain, torch.autograd.grad(model(half).pow(2).sum(), list(model.parameters()))):
            total += grad
    scaler, reads = GradientScaler(model), []
    for half in x.chunk(2):
        with counting_reads() as backward_reads:
            scaler.backward(model(half).pow(2).sum())
        reads.append(len(backward_reads))
    with counting_reads() as step_reads:
        scaler.step(torch.optim.SGD(model.parameters(), lr=0.0))
    assert reads == [0, 1] and len(step_reads) == 1 and scaler.update_iterations == 1
    assert all(torch.equal(p.grad, total) for p, total in zip(model.parameters(), plain))
