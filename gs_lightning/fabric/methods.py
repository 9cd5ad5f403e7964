"""The four ways the fp16 plugins scale gradients, each building a scaler with ``torch.amp.GradScaler``'s interface,
and :data:`PLUGINS`, the one table of the plugins made of them.

A scaling method holds its options (checked when the plugin is made) and builds its scaler
(``scale``, ``unscale_``, ``step``, ``update``, ``state_dict``, ``load_state_dict``) once the model
is known. Both plugin families, Fabric's (:mod:`gs_lightning.fabric`) and the Trainer's
(:mod:`gs_lightning.lightning`), combine each method of :data:`PLUGINS` with their fp16 base class
(and, where FSDP can run it, their FSDP base class) through :func:`plugin_classes`; they live here,
in the Fabric package, because Lightning's Trainer builds on Fabric too.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from gs_lightning.scaling import GradientScaler
from gs_lightning.scaling.finite import unscale_and_check_
from gs_lightning.scaling.recipe import ScalingRecipe, resolve_recipe
from gs_lightning.scaling.steps import FoundInf, OptimizerSteps, check_max_consecutive_skips


class Scaler(Protocol):
    """What the plugins call: ``torch.amp.GradScaler``'s interface."""

    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    def unscale_(self, optimizer: Optimizer) -> None: ...

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any: ...

    def update(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class FixedLossScaler:
    """``torch.amp.GradScaler``'s interface with one loss scale that never changes.

    ``unscale_`` divides the optimizer's gradients by the scale and checks them (one fused kernel per
    device and dtype); ``step`` skips the optimizer's step if one was non-finite. The order of the
    calls is ``GradScaler``'s, kept by :class:`~gs_lightning.scaling.steps.OptimizerSteps` as for
    :class:`~gs_lightning.scaling.GradientScaler`: ``unscale_`` and ``step`` at most once per
    optimizer between two ``update()`` calls, and ``step`` on an optimizer that holds no gradient is
    an ``AssertionError``.

    Args:
        scale: The loss scale; 1 is plain fp16 with skipped non-finite steps.
    """

    def __init__(self, scale: float = 128.0) -> None:
        self._scale = _check_scale(type(self).__name__, scale)
        self._steps = OptimizerSteps(max_consecutive_skips=None)

    def get_scale(self) -> float:
        """The loss scale."""
        return self._scale

    def is_enabled(self) -> bool:
        """Always true (``GradScaler``'s interface)."""
        return True

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        """``outputs`` multiplied by the loss scale."""
        return outputs * self._scale

    def unscale_(self, optimizer: Optimizer) -> None:
        """Divide the optimizer's gradients by the loss scale, in place, and note whether one is non-finite."""
        self._steps.unscale(optimizer, partial(self._unscale, optimizer))

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)`` unless a gradient is non-finite (unscales first if not yet done).

        Raises:
            AssertionError: if none of the optimizer's parameters has a gradient, as ``GradScaler`` raises.
        """
        if self._steps.overflowed(optimizer, partial(self._unscale, optimizer)):
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """End the iteration: every optimizer may be unscaled and stepped again."""
        self._steps.end_iteration()

    def state_dict(self) -> dict[str, Any]:
        """Nothing: a fixed scale has no state (it comes from the plugin's options)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore."""

    def _unscale(self, optimizer: Optimizer) -> FoundInf:
        """Unscale ``optimizer``'s gradients; their found-inf flags, one per device, unread."""
        grads = (param.grad for group in optimizer.param_groups for param in group["params"])
        return unscale_and_check_(grads, 1.0 / self._scale)


def _check_scale(owner: str, scale: float) -> float:
    """``scale`` as a float if it is a positive finite number."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"{owner}: scale must be a positive finite number, got {scale!r}")
    return float(scale)


_GRAD_DTYPES = ("float16", "float8_e5m2", "float8_e4m3fn")

Emulate = bool | Literal["auto"]


class _ScalingMethod:
    """Options of one scaling method; ``_build_scaler`` makes its scaler once the model is known.

    Every method can run on emulated fp16 (:func:`gs_lightning.simulate.emulate`: GEMMs computed in
    fp32 and rounded, at fp32 speed on a CPU), optionally with fp8 backward-GEMM gradients.

    Args:
        device: Autocast device type; ``None`` follows the model.
        emulate: ``"auto"`` (the default, as the app's ``precision.emulate``): emulate fp16 GEMMs and
            convolutions on a CPU (the same rounding at fp32 speed: CPUs without fp16 units run fp16
            convolutions many times slower) and run the device's own fp16 kernels elsewhere, settled
            when the model's device is known (:meth:`settle_emulation`). ``True`` / ``False`` force either.
            Under emulation ``torch.compile`` runs the model eagerly: on a CPU, pass ``False`` to compile.
        grad_dtype: With ``emulate=True``, the format the gradients of backward GEMMs are rounded to:
            ``"float16"`` (the default) or ``"float8_e5m2"`` / ``"float8_e4m3fn"`` (also a
            ``torch.dtype``). Gradient scaling then protects that format's range.
    """

    def __init__(
        self,
        device: str | None = None,
        emulate: Emulate = "auto",
        grad_dtype: str | torch.dtype | None = None,
    ) -> None:
        self.grad_dtype = _grad_dtype(grad_dtype)
        if emulate not in (True, False, "auto"):
            raise ValueError(f"{type(self).__name__}: emulate must be true, false or 'auto', got {emulate!r}")
        if self.grad_dtype != torch.float16 and emulate is not True:
            raise ValueError(
                f"{type(self).__name__}: grad_dtype={grad_dtype!r} needs emulate=True "
                "(no device computes fp8 gradients here)"
            )
        self.emulate: Emulate = emulate
        self._emulation: AbstractContextManager | None = None
        super().__init__(device)  # type: ignore[call-arg]  # the plugin's fp16 base class
        if device is not None:  # the device is known: no model needed to settle "auto"
            self.settle_emulation(device)

    def settle_emulation(self, device_type: str) -> bool:
        """Settle ``emulate="auto"`` for the device type the model runs on; return whether it emulates.

        The one place ``auto`` is resolved: the plugins call it when they meet the model, the app
        (``precision.emulate=auto``) when the Trainer knows its device.
        """
        if self.emulate == "auto":
            self.emulate = device_type == "cpu"
        return bool(self.emulate)

    def emulation(self) -> AbstractContextManager:
        """The context the forward and the backward run in: emulated low precision, or nothing."""
        if self.emulate == "auto":
            raise RuntimeError(
                f"{type(self).__name__}: emulate='auto' is settled when the model's device is known (fit, fabric.setup)"
            )
        if not self.emulate:
            return nullcontext()
        if self._emulation is None:
            from gs_lightning.simulate import emulate  # only emulated runs need it

            self._emulation = emulate(torch.float16, self.grad_dtype)
        return self._emulation

    def _build_scaler(self, module: nn.Module, device: str) -> Scaler:
        raise NotImplementedError

    def _attach_module(self, module: nn.Module) -> None:
        """A further module set up with Fabric: nothing to do unless the scaler tracks models."""


def _grad_dtype(value: str | torch.dtype | None) -> torch.dtype:
    if value is None:
        return torch.float16
    name = value if isinstance(value, str) else str(value).removeprefix("torch.")
    if name not in _GRAD_DTYPES:
        raise ValueError(f"grad_dtype must be one of {list(_GRAD_DTYPES)}, got {value!r}")
    return getattr(torch, name)


class GradientScaling(_ScalingMethod):
    """fp16 with per-layer gradient scaling (Zhao et al., IJCAI 2020), through :class:`GradientScaler`.

    Every backpropagated gradient gets its own power-of-two scale, and weight gradients are divided
    by theirs before they accumulate, so ``.grad`` (and DDP's all-reduce, gradient accumulation and
    clipping) only ever see true gradients. The scaler (``plugin.scaler``) names layers after the
    model's modules: ``plugin.scaler.scales()`` for logging. On a CPU fp16 is emulated by default
    (``emulate="auto"``).

    Args:
        recipe: The scaling recipe (:class:`~gs_lightning.scaling.recipe.ScalingRecipe`), or a
            preset's name (``"default"``, ``"paper"``); ``None``: the default.
        max_consecutive_skips: Stop with an error naming the first non-finite layer once more than
            this many steps in a row were skipped (a diverged run); ``None`` never stops.
        device: Autocast device type; ``None`` follows the model.
        emulate: ``"auto"`` (default): emulated fp16 GEMMs and convolutions on a CPU (fp32 compute
            rounded to fp16, at fp32 speed), the GPU's own fp16 kernels on a GPU; ``True`` / ``False``
            force either.
        grad_dtype: With ``emulate=True``, the gradients' format; the scales protect its range.
        **recipe_fields: Recipe fields to change (``update_interval=50``), validated with the
            recipe when the plugin is made.
    """

    def __init__(
        self,
        recipe: ScalingRecipe | str | None = None,
        max_consecutive_skips: int | None = 100,
        device: str | None = None,
        emulate: Emulate = "auto",
        grad_dtype: str | torch.dtype | None = None,
        **recipe_fields: Any,
    ) -> None:
        self.recipe = resolve_recipe(recipe, **recipe_fields)  # bad options fail here, not at fit
        self._max_consecutive_skips = check_max_consecutive_skips(max_consecutive_skips)
        super().__init__(device, emulate, grad_dtype)

    @property
    def scaler(self) -> GradientScaler:
        """The :class:`GradientScaler` (built when the plugin meets the model)."""
        return super().scaler  # type: ignore[misc]

    def _build_scaler(self, module: nn.Module, device: str) -> GradientScaler:
        return GradientScaler(
            module, self.recipe, dtype=self.grad_dtype, max_consecutive_skips=self._max_consecutive_skips
        )

    def _attach_module(self, module: nn.Module) -> None:
        """Its layers get names, and a skipped step restores its buffers too."""
        self.scaler.attach(module)


class DynamicLossScaling(_ScalingMethod):
    """fp16 with dynamic loss scaling (the paper's Dyn-LS baseline), through ``torch.amp.GradScaler``.

    The loss scale halves on every non-finite step and doubles after ``growth_interval`` finite ones.
    On a CPU fp16 is emulated by default (``emulate="auto"``).

    Args:
        init_scale: Initial loss scale.
        growth_factor: Factor applied after ``growth_interval`` finite steps (above 1).
        backoff_factor: Factor applied after a non-finite step (between 0 and 1).
        growth_interval: Finite steps between growths.
        device: Autocast device type; ``None`` follows the model.
        emulate: ``"auto"`` (default): emulated fp16 on a CPU, the GPU's own fp16 kernels on a GPU;
            ``True`` / ``False`` force either.
        grad_dtype: With ``emulate=True``, the gradients' format.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        device: str | None = None,
        emulate: Emulate = "auto",
        grad_dtype: str | torch.dtype | None = None,
    ) -> None:
        name = type(self).__name__
        _check_scale(name, init_scale)
        if isinstance(growth_factor, bool) or not isinstance(growth_factor, (int, float)) or not growth_factor > 1:
            raise ValueError(f"{name}: growth_factor must be a number above 1, got {growth_factor!r}")
        if (
            isinstance(backoff_factor, bool)
            or not isinstance(backoff_factor, (int, float))
            or not 0 < backoff_factor < 1
        ):
            raise ValueError(f"{name}: backoff_factor must be a number between 0 and 1, got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"{name}: growth_interval must be a positive integer, got {growth_interval!r}")
        self._options = {
            "init_scale": init_scale,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
        }
        super().__init__(device, emulate, grad_dtype)

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The ``GradScaler`` (built when the plugin meets the model)."""
        return super().scaler  # type: ignore[misc]

    def _build_scaler(self, module: nn.Module, device: str) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(device, **self._options)


class ShardedDynamicLossScaling(DynamicLossScaling):
    """Through torch's ``ShardedGradScaler``: ``GradScaler`` with the non-finite flag reduced across FSDP's ranks.

    :class:`DynamicLossScaling` under FSDP, whose ranks each hold a shard of the gradients
    (:func:`sharded_grad_scaler`).
    """

    def _build_scaler(self, module: nn.Module, device: str) -> Any:
        return sharded_grad_scaler(device, self._options)


def sharded_grad_scaler(device: str, options: dict[str, Any]) -> Any:
    """torch's ``ShardedGradScaler``: ``GradScaler`` with the non-finite flag reduced across FSDP's ranks.

    Each rank holds a shard of the gradients, so each finds only its own non-finite values.
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device, **options)


class LossScaling(_ScalingMethod):
    """fp16 with a fixed loss scale (the paper's Fixed-LS baseline), through :class:`FixedLossScaler`.

    The loss is multiplied by ``scale`` before the backward; the optimizer's gradients are divided
    by it afterwards, and the step is skipped if any of them is non-finite. On a CPU fp16 is
    emulated by default (``emulate="auto"``).

    Args:
        scale: The loss scale (the paper's default is 128).
        device: Autocast device type; ``None`` follows the model.
        emulate: ``"auto"`` (default): emulated fp16 on a CPU, the GPU's own fp16 kernels on a GPU;
            ``True`` / ``False`` force either.
        grad_dtype: With ``emulate=True``, the gradients' format.
    """

    def __init__(
        self,
        scale: float = 128.0,
        device: str | None = None,
        emulate: Emulate = "auto",
        grad_dtype: str | torch.dtype | None = None,
    ) -> None:
        self.scale = _check_scale(type(self).__name__, scale)
        super().__init__(device, emulate, grad_dtype)

    @property
    def scaler(self) -> FixedLossScaler:
        """The :class:`FixedLossScaler` (built when the plugin meets the model)."""
        return super().scaler  # type: ignore[misc]

    def _build_scaler(self, module: nn.Module, device: str) -> FixedLossScaler:
        return FixedLossScaler(self.scale)


class NoScaling(LossScaling):
    """fp16 with no gradient scaling (a loss scale of 1): the baseline that underflows.

    Non-finite steps are still skipped. On a CPU fp16 is emulated by default (``emulate="auto"``).

    Args:
        device: Autocast device type; ``None`` follows the model.
        emulate: ``"auto"`` (default): emulated fp16 on a CPU, the GPU's own fp16 kernels on a GPU;
            ``True`` / ``False`` force either.
        grad_dtype: With ``emulate=True``, the gradients' format.
    """

    def __init__(
        self, device: str | None = None, emulate: Emulate = "auto", grad_dtype: str | torch.dtype | None = None
    ) -> None:
        super().__init__(scale=1.0, device=device, emulate=emulate, grad_dtype=grad_dtype)


@dataclass(frozen=True)
class PluginEntry:
    """One row of :data:`PLUGINS`: a plugin's name and the scaling method it is made of.

    Attributes:
        name: The plugin's class name (its FSDP plugin's is ``"FSDP" + name``).
        method: The scaling method, combined with a package's fp16 base class.
        fsdp_method: The method combined with the package's FSDP base class, for ``"FSDP" + name``;
            ``None``: no FSDP plugin.
    """

    name: str
    method: type[_ScalingMethod]
    fsdp_method: type[_ScalingMethod] | None


PLUGINS: tuple[PluginEntry, ...] = (
    PluginEntry("GradientScalingPlugin", GradientScaling, GradientScaling),
    PluginEntry("DynamicLossScalingPlugin", DynamicLossScaling, ShardedDynamicLossScaling),
    PluginEntry("LossScalingPlugin", LossScaling, None),
    PluginEntry("FP16Plugin", NoScaling, None),
)
"""Every plugin, once: both plugin modules (:mod:`gs_lightning.fabric.plugins`, :mod:`gs_lightning.lightning.plugins`)
make their classes from it with :func:`plugin_classes`."""


def plugin_classes(fp16_base: type, fsdp_base: type, module: str, fsdp_strategy: str) -> dict[str, type]:
    """The classes of :data:`PLUGINS` on one package's base classes, by name.

    Each ``name`` is ``(method, fp16_base)``, with the method's docstring; each ``"FSDP" + name``
    with an FSDP method is ``(fsdp_method, fsdp_base)``. The classes say they belong to ``module``
    (their pickled name, and the key Lightning saves the scaler's state under in a checkpoint, are
    their names there), which must bind each under its name.

    Args:
        fp16_base: The package's fp16 base class (``FP16MixedPrecision``).
        fsdp_base: The package's FSDP base class (``FSDPMixedPrecision``).
        module: The ``__name__`` of the module that binds them.
        fsdp_strategy: How the FSDP plugins' docstrings name the strategy they are for.
    """
    classes: dict[str, type] = {}

    def make(name: str, bases: tuple[type, ...], doc: str | None) -> None:
        classes[name] = type(name, bases, {"__module__": module, "__qualname__": name, "__doc__": doc})

    for entry in PLUGINS:
        make(entry.name, (entry.method, fp16_base), entry.method.__doc__)
        if entry.fsdp_method is not None:
            through = "" if entry.fsdp_method is entry.method else f" {_summary(entry.fsdp_method)}"
            doc = (
                f":class:`{entry.name}` (the same options) for {fsdp_strategy}: "
                f"see :class:`{fsdp_base.__name__}`.{through}"
            )
            make(f"FSDP{entry.name}", (entry.fsdp_method, fsdp_base), doc)
    return classes


def _summary(cls: type) -> str:
    """The first line of ``cls``'s docstring."""
    return (cls.__doc__ or "").strip().splitlines()[0]
