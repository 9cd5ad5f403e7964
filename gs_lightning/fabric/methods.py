"""The four ways the fp16 plugins scale gradients, each building a scaler with ``torch.amp.GradScaler``'s interface.

A scaling method holds its options (checked when the plugin is made) and builds its scaler
(``scale``, ``unscale_``, ``step``, ``update``, ``state_dict``, ``load_state_dict``) once the model
is known. Both plugin families, Fabric's (:mod:`gs_lightning.fabric`) and the Trainer's
(:mod:`gs_lightning.lightning`), combine one of these with their fp16 base class, as
``GradientScalingPlugin(GradientScaling, FP16MixedPrecision)``; they live here, in the Fabric
package, because Lightning's Trainer builds on Fabric too.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from gs_lightning.scaling import GradientScaler
from gs_lightning.scaling.finite import unscale_and_check_
from gs_lightning.scaling.recipe import ScalingRecipe, resolve_recipe


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
    device and dtype); ``step`` skips the optimizer's step if one was non-finite. As with
    ``GradScaler``, ``unscale_`` may be called once per optimizer between two ``update()`` calls.

    Args:
        scale: The loss scale; 1 is plain fp16 with skipped non-finite steps.
    """

    def __init__(self, scale: float = 128.0) -> None:
        if not scale > 0:
            raise ValueError(f"{type(self).__name__}: scale must be positive, got {scale}")
        self._scale = float(scale)
        self._found_inf: dict[int, list[torch.Tensor]] = {}  # per optimizer unscaled since the last update
        self._stepped: set[int] = set()

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
        if id(optimizer) in self._found_inf:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        grads = (param.grad for group in optimizer.param_groups for param in group["params"])
        self._found_inf[id(optimizer)] = unscale_and_check_(grads, 1.0 / self._scale)

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)`` unless a gradient is non-finite (unscales first if not yet done)."""
        if id(optimizer) in self._stepped:
            raise RuntimeError("step() has already been called since the last update().")
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        self._stepped.add(id(optimizer))
        if any(bool(flag.item()) for flag in self._found_inf[id(optimizer)]):
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """End the iteration: every optimizer may be unscaled and stepped again."""
        self._found_inf.clear()
        self._stepped.clear()

    def state_dict(self) -> dict[str, Any]:
        """Nothing: a fixed scale has no state (it comes from the plugin's options)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore."""


_GRAD_DTYPES = ("float16", "float8_e5m2", "float8_e4m3fn")


class _ScalingMethod:
    """Options of one scaling method; ``_build_scaler`` makes its scaler once the model is known.

    Every method can run on emulated fp16 (:func:`gs_lightning.simulate.emulate`: GEMMs computed in
    fp32 and rounded, at fp32 speed on a CPU), optionally with fp8 backward-GEMM gradients.

    Args:
        device: Autocast device type; ``None`` follows the model.
        emulate: Emulate fp16 GEMMs and convolutions (forward and backward) instead of running
            the device's fp16 kernels; ``"auto"``: emulate on a CPU (the same rounding at fp32
            speed: CPUs without fp16 units run fp16 convolutions many times slower), run the
            device's own fp16 kernels elsewhere, settled when the model's device is known.
        grad_dtype: With ``emulate``, the format the gradients of backward GEMMs are rounded to:
            ``"float16"`` (the default) or ``"float8_e5m2"`` / ``"float8_e4m3fn"`` (also a
            ``torch.dtype``). Gradient scaling then protects that format's range.
    """

    def __init__(
        self,
        device: str | None = None,
        emulate: bool | Literal["auto"] = False,
        grad_dtype: str | torch.dtype | None = None,
    ) -> None:
        self.grad_dtype = _grad_dtype(grad_dtype)
        if emulate not in (True, False, "auto"):
            raise ValueError(f"{type(self).__name__}: emulate must be true, false or 'auto', got {emulate!r}")
        if self.grad_dtype != torch.float16 and emulate is not True:
            raise ValueError(
                f"{type(self).__name__}: grad_dtype={grad_dtype!r} needs emulate=True (no device computes fp8 gradients here)"
            )
        self.emulate: bool | Literal["auto"] = emulate
        self._emulation: AbstractContextManager | None = None
        super().__init__(device)  # type: ignore[call-arg]  # the plugin's fp16 base class

    def settle_emulation(self, device_type: str) -> bool:
        """Settle ``emulate="auto"`` for the device type the model runs on; return whether it emulates."""
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
    model's modules: ``plugin.scaler.scales()`` for logging.

    Args:
        recipe: The scaling recipe (:class:`~gs_lightning.scaling.recipe.ScalingRecipe`), or a
            preset's name (``"default"``, ``"paper"``); ``None``: the default.
        max_consecutive_skips: Stop with an error naming the first non-finite layer once more than
            this many steps in a row were skipped (a diverged run); ``None`` never stops.
        device: Autocast device type; ``None`` follows the model.
        emulate: Emulated fp16 (see :class:`_ScalingMethod`).
        grad_dtype: With ``emulate``, the gradients' format; the scales protect its range.
        **recipe_fields: Recipe fields to change (``update_interval=50``), validated with the
            recipe when the plugin is made.
    """

    def __init__(
        self,
        recipe: ScalingRecipe | str | None = None,
        max_consecutive_skips: int | None = 100,
        device: str | None = None,
        emulate: bool | Literal["auto"] = False,
        grad_dtype: str | torch.dtype | None = None,
        **recipe_fields: Any,
    ) -> None:
        self.recipe = resolve_recipe(recipe, **recipe_fields)
        self._max_consecutive_skips = max_consecutive_skips
        GradientScaler(
            recipe=self.recipe, max_consecutive_skips=max_consecutive_skips
        )  # bad options fail here, not at fit
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

    Args:
        init_scale: Initial loss scale.
        growth_factor: Factor applied after ``growth_interval`` finite steps.
        backoff_factor: Factor applied after a non-finite step.
        growth_interval: Finite steps between growths.
        device: Autocast device type; ``None`` follows the model.
        emulate: Emulated fp16 (see :class:`_ScalingMethod`).
        grad_dtype: With ``emulate``, the gradients' format.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        device: str | None = None,
        emulate: bool = False,
        grad_dtype: str | torch.dtype | None = None,
    ) -> None:
        self._options = {
            "init_scale": init_scale,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
        }
        torch.amp.GradScaler("cpu", **self._options)  # bad options fail here; the kept scaler needs the device
        super().__init__(device, emulate, grad_dtype)

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The ``GradScaler`` (built when the plugin meets the model)."""
        return super().scaler  # type: ignore[misc]

    def _build_scaler(self, module: nn.Module, device: str) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(device, **self._options)


class LossScaling(_ScalingMethod):
    """fp16 with a fixed loss scale (the paper's Fixed-LS baseline), through :class:`FixedLossScaler`.

    The loss is multiplied by ``scale`` before the backward; the optimizer's gradients are divided
    by it afterwards, and the step is skipped if any of them is non-finite.

    Args:
        scale: The loss scale (the paper's default is 128).
        device: Autocast device type; ``None`` follows the model.
        emulate: Emulated fp16 (see :class:`_ScalingMethod`).
        grad_dtype: With ``emulate``, the gradients' format.
    """

    def __init__(
        self,
        scale: float = 128.0,
        device: str | None = None,
        emulate: bool = False,
        grad_dtype: str | torch.dtype | None = None,
    ) -> None:
        FixedLossScaler(scale)  # bad options fail here, as for the other methods
        self.scale = float(scale)
        super().__init__(device, emulate, grad_dtype)

    @property
    def scaler(self) -> FixedLossScaler:
        """The :class:`FixedLossScaler` (built when the plugin meets the model)."""
        return super().scaler  # type: ignore[misc]

    def _build_scaler(self, module: nn.Module, device: str) -> FixedLossScaler:
        return FixedLossScaler(self.scale)


class NoScaling(LossScaling):
    """fp16 with no gradient scaling (a loss scale of 1): the baseline that underflows.

    Non-finite steps are still skipped.

    Args:
        device: Autocast device type; ``None`` follows the model.
        emulate: Emulated fp16 (see :class:`_ScalingMethod`).
        grad_dtype: With ``emulate``, the gradients' format.
    """

    def __init__(
        self, device: str | None = None, emulate: bool = False, grad_dtype: str | torch.dtype | None = None
    ) -> None:
        super().__init__(scale=1.0, device=device, emulate=emulate, grad_dtype=grad_dtype)
