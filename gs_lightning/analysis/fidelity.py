"""Gradient fidelity of fp16 training methods against fp32, on the same weights and batch.

An analysis tool kept apart from the core: ``bench/fidelity.py`` and the tests measure with it.
The fp32 reference is one forward/backward in true fp32 (TF32 off). Every method then
backpropagates one shared forward under fp16 autocast (run once, its graph kept), so methods
differ only in their backward, and a sweep over loss scales costs one backward per scale. Each
is compared with the reference on:

* the relative error of all parameter gradients, ``‖g − g_ref‖ / ‖g_ref‖``;
* underflow: the fraction of nonzero fp32 activation gradients (the gradients reaching every
  leaf module's output) that are exactly zero under the method;
* per parameter, its own error, its share of the total squared error and the fraction of its
  nonzero fp32 gradient elements that are zero: where the error comes from.

The model must compute the same function on every forward (no dropout): the fp32 and the fp16
forward must see the same network.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from gs_lightning.scaling import GradientScaler, LayerScale

LossFn = Callable[[nn.Module], torch.Tensor]
Backward = Callable[[torch.Tensor], None]

_MAX_DYNAMIC_EXPONENT = 64  # GradScaler's scale has no cap; stop searching somewhere


@dataclass(frozen=True)
class GradientFidelity:
    """One parameter's gradient under a method, against fp32.

    Attributes:
        name: Qualified parameter name, e.g. ``"layer1.0.conv1.weight"``.
        error: ``‖g − g_ref‖ / ‖g_ref‖`` of this parameter alone (``inf`` if ``g_ref`` is zero and
            ``g`` is not).
        share: Its share of the total squared error ``Σ‖g − g_ref‖²`` over all parameters.
        underflow: Fraction of its nonzero fp32 gradient elements that are zero under the method.
        reference_max: Largest magnitude of its fp32 gradient: times the scale a method gives
            the gradient, it must stay below the format's λmax.
    """

    name: str
    error: float
    share: float
    underflow: float
    reference_max: float


@dataclass(frozen=True)
class Fidelity:
    """How close one method's gradients come to fp32.

    Attributes:
        error: Relative error of all parameter gradients; ``inf`` if any is non-finite.
        underflow: Fraction of nonzero fp32 activation gradients that are zero under the method.
        weight_underflow: The same over all parameter-gradient elements.
        parameters: Per parameter, in ``model.named_parameters()`` order.
        activations: {leaf module name: its activation-gradient underflow}, over all its calls.
    """

    error: float
    underflow: float
    weight_underflow: float = 0.0
    parameters: tuple[GradientFidelity, ...] = field(default=(), repr=False, compare=False)
    activations: dict[str, float] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class ScalingRun:
    """GS on one batch: its iterations up to the first with finite gradients.

    Attributes:
        scaler: The GradientScaler, after the last iteration.
        attempts: Fidelity of every iteration; all but the last overflowed and were skipped.
        layers: Per iteration, the scales it chose (``GradientScaler.layers()``).
    """

    scaler: GradientScaler
    attempts: tuple[Fidelity, ...]
    layers: tuple[tuple[LayerScale, ...], ...]

    @property
    def fidelity(self) -> Fidelity:
        """The last iteration: the first whose step would go through."""
        return self.attempts[-1]


@contextmanager
def ieee_fp32() -> Iterator[None]:
    """Run fp32 matmuls and convolutions in true fp32: TF32 would make the reference itself inexact."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


class _ActivationCounts:
    """What tensor hooks on the leaf modules' outputs collect, slot by slot in forward order.

    Kept apart from the probe: the hooks live in the retained fp16 graph, and a hook holding the
    probe (which holds that graph) would make a reference cycle through C++ that Python's
    garbage collector cannot see, leaking the graph.
    """

    def __init__(self) -> None:
        self.nonzero: dict[int, torch.Tensor] = {}  # slot -> mask of nonzero fp32 gradients
        self.lost: dict[int, torch.Tensor] = {}  # slot -> count of those that are zero under a method

    def reference(self, slot: int, grad: torch.Tensor) -> None:
        self.nonzero[slot] = grad != 0

    def method(self, slot: int, grad: torch.Tensor) -> None:
        mask = self.nonzero.get(slot)
        if mask is not None:  # None: no gradient reached this output in fp32
            self.lost[slot] = (mask & (grad == 0)).sum()


def _forward(
    model: nn.Module, loss_fn: LossFn, device_type: str, autocast: bool, on_grad: Callable[[int, torch.Tensor], None]
) -> tuple[torch.Tensor, list[str]]:
    """One forward with ``on_grad(slot, grad)`` hooked on every leaf module output; returns (loss, slot names)."""
    names: list[str] = []

    def forward_hook(name: str, module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(partial(on_grad, len(names)))
            names.append(name)  # a module called several times (SegNet's pooling) gets a slot per call

    handles = [
        module.register_forward_hook(partial(forward_hook, name))
        for name, module in model.named_modules()
        if not any(True for _ in module.children())
    ]
    try:
        with torch.autocast(device_type, dtype=torch.float16, enabled=autocast):
            loss = loss_fn(model)
    finally:
        for handle in handles:
            handle.remove()
    return loss, names


def _ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator`` with 0/0 = 0 and x/0 = inf: an error where fp32 has none."""
    if denominator > 0.0:
        return numerator / denominator
    return 0.0 if numerator == 0.0 else math.inf


class FidelityProbe:
    """Measures fp16 methods on one model, batch and set of weights against fp32.

    Args:
        model: The network, in the mode to measure (training mode for training gradients).
        loss_fn: ``model -> scalar loss`` on a fixed batch; called once in fp32 and once under
            fp16 autocast.
        device_type: ``"cpu"`` or ``"cuda"``, for autocast.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, device_type: str = "cpu") -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.device_type = device_type
        self._parameters = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self._counts = _ActivationCounts()
        model.zero_grad(set_to_none=True)
        with ieee_fp32():
            loss, self._slot_names = _forward(model, loss_fn, device_type, False, self._counts.reference)
            loss.backward()
        self.reference = [self._grad(p) for _, p in self._parameters]
        self._half_loss: torch.Tensor | None = None
        self._fixed: dict[int, Fidelity] = {}  # by log2 of the scale

    @staticmethod
    def _grad(p: torch.Tensor) -> torch.Tensor:
        return p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)

    def _half_forward(self) -> torch.Tensor:
        """The fp16 forward every method backpropagates, run on first use."""
        if self._half_loss is None:
            with ieee_fp32():
                loss, names = _forward(self.model, self.loss_fn, self.device_type, True, self._counts.method)
            if names != self._slot_names:
                raise RuntimeError("FidelityProbe: the fp16 forward ran other modules than the fp32 one")
            self._half_loss = loss
        return self._half_loss

    def measure(self, backward: Backward, unscale: float = 1.0) -> Fidelity:
        """Fidelity of one backward of the shared fp16 forward.

        Args:
            backward: Called with the fp16-forward loss; must keep the graph (``retain_graph=True``)
                for the methods measured after it.
            unscale: The parameter gradients are divided by it (a loss scale).
        """
        loss = self._half_forward()
        self.model.zero_grad(set_to_none=True)
        self._counts.lost.clear()
        with ieee_fp32():
            backward(loss)
        return self._compare(unscale)

    def _compare(self, unscale: float) -> Fidelity:
        rows = []
        for (_, p), ref in zip(self._parameters, self.reference):
            grad = self._grad(p) / unscale
            nonzero = ref != 0
            rows.append(
                torch.stack(
                    [
                        (grad - ref).double().pow(2).sum(),
                        ref.double().pow(2).sum(),
                        nonzero.sum().double(),
                        (nonzero & (grad == 0)).sum().double(),
                        ref.abs().max().double(),
                    ]
                )
            )
        # All statistics reach the host in one transfer.
        stats = torch.stack(rows).tolist() if rows else []
        slots = sorted(self._counts.lost)
        lost = torch.stack([self._counts.lost[s] for s in slots]).tolist() if slots else []
        nonzero = torch.stack([self._counts.nonzero[s].sum() for s in slots]).tolist() if slots else []

        total_diff = sum(row[0] for row in stats)
        total_ref = sum(row[1] for row in stats)
        finite = math.isfinite(total_diff)
        parameters = tuple(
            GradientFidelity(
                name,
                math.sqrt(_ratio(diff, ref)) if math.isfinite(diff) else math.inf,
                diff / total_diff if finite and total_diff > 0 else math.nan,
                _ratio(lost_w, count),
                largest,
            )
            for (name, _), (diff, ref, count, lost_w, largest) in zip(self._parameters, stats)
        )
        per_module: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for slot, lost_a, count in zip(slots, lost, nonzero):
            per_module[self._slot_names[slot]][0] += lost_a
            per_module[self._slot_names[slot]][1] += count
        return Fidelity(
            error=math.sqrt(_ratio(total_diff, total_ref)) if finite else math.inf,
            underflow=sum(lost) / max(sum(nonzero), 1),
            weight_underflow=sum(row[3] for row in stats) / max(sum(row[2] for row in stats), 1),
            parameters=parameters,
            activations={name: lost_a / max(count, 1) for name, (lost_a, count) in per_module.items()},
        )

    def none(self) -> Fidelity:
        """fp16 with no scaling."""
        return self.measure(lambda loss: loss.backward(retain_graph=True))

    def fixed(self, scale: float) -> Fidelity:
        """A fixed loss scale, a power of two (results are cached by scale)."""
        exponent = math.log2(scale)
        if not exponent.is_integer():
            raise ValueError(f"FidelityProbe.fixed: scale must be a power of two, got {scale}")
        k = int(exponent)
        if k not in self._fixed:
            self._fixed[k] = self.measure(lambda loss: (loss * scale).backward(retain_graph=True), unscale=scale)
        return self._fixed[k]

    def sweep(self, exponents: Iterable[int] = range(0, 25)) -> dict[float, Fidelity]:
        """Fixed scales 2^k in increasing k, up to the first that overflows (a non-finite gradient).

        Larger scales overflow too, as dynamic loss scaling also assumes, so they are not run.
        """
        results = {}
        for k in sorted(exponents):
            results[2.0**k] = self.fixed(2.0**k)
            if not math.isfinite(results[2.0**k].error):
                break
        return results

    def best_fixed(self, exponents: Iterable[int] = range(0, 25)) -> tuple[float, Fidelity]:
        """The oracle: the fixed scale 2^k of :meth:`sweep` with the lowest gradient error."""
        results = self.sweep(exponents)
        scale = min(results, key=lambda s: results[s].error)
        return scale, results[scale]

    def dynamic(self, init_scale: float = 2.0**24) -> tuple[float, Fidelity]:
        """GradScaler at its steady state: the largest power of two whose gradients stay finite.

        GradScaler halves its scale on every overflow and doubles it after a run of finite steps,
        so it settles at that scale. Searched from ``init_scale`` up or down, reusing :meth:`fixed`.
        """
        k = int(math.log2(init_scale))
        if math.isfinite(self.fixed(2.0**k).error):
            while k < _MAX_DYNAMIC_EXPONENT and math.isfinite(self.fixed(2.0 ** (k + 1)).error):
                k += 1
        else:
            while k > 0 and not math.isfinite(self.fixed(2.0**k).error):
                k -= 1
        return 2.0**k, self.fixed(2.0**k)

    def gradient_scaling_run(self, max_skips: int = 32, **options: Any) -> ScalingRun:
        """GS with the given ``GradientScaler`` options, as training would run it on this batch.

        The first iteration is an update iteration: its scales come from the gradients at hand.
        If a gradient is non-finite, ``GradientScaler.step`` skips the step and backs off (caps
        the accumulated scale), and the next iteration recomputes the scales; this repeats until
        the gradients are finite or ``max_skips`` steps were skipped.
        """
        scaler = GradientScaler(self.model, **options)
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.0)  # only ever asked to skip
        attempts, layers = [], []
        while True:
            attempts.append(self.measure(partial(scaler.backward, retain_graph=True)))
            layers.append(tuple(scaler.layers()))
            if not scaler.found_inf or scaler.skipped_steps >= max_skips:
                return ScalingRun(scaler, tuple(attempts), tuple(layers))
            scaler.step(optimizer)

    def gradient_scaling(self, **options: Any) -> tuple[GradientScaler, Fidelity]:
        """GS with the given options: the scaler and its first iteration with finite gradients."""
        run = self.gradient_scaling_run(**options)
        return run.scaler, run.fidelity
