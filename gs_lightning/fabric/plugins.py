"""Lightning Fabric precision plugins: fp16 autocast, a scaling method, and steps skipped on non-finite gradients.

``Fabric(plugins=[GradientScalingPlugin()])`` runs the forward under fp16 autocast,
``fabric.backward(loss)`` through the plugin's scaler, and ``optimizer.step()`` only if the
optimizer's gradients are finite. ``fabric.clip_gradients`` sees true gradients. The plugin is
stateful: put it (or ``plugin.scaler``) in the state given to ``fabric.save`` / ``fabric.load``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.optim import LBFGS, Optimizer

from gs_lightning.fabric.methods import (
    DynamicLossScaling,
    GradientScaling,
    LossScaling,
    NoScaling,
    Scaler,
)
from gs_lightning.fabric.packages import FABRIC_PRECISIONS


class FP16MixedPrecision(*FABRIC_PRECISIONS):  # type: ignore[misc]
    """Base of the Fabric fp16 plugins, as Fabric's ``MixedPrecision("16-mixed")`` with the scaler of a scaling method.

    The scaling method (:mod:`gs_lightning.fabric.methods`) builds the scaler for the modules
    ``fabric.setup`` is given (their layers name the scales; gradient scaling restores the
    buffers of every one of them on a skipped step).
    Float inputs are cast to fp16 and outputs back to the default dtype, as Fabric's own plugin does.

    Args:
        device: Device type for autocast (``"cuda"``, ``"cpu"``). ``None``: the device type of the
            model's parameters (where Fabric has moved them).
    """

    precision: Literal["16-mixed"] = "16-mixed"

    def __init__(self, device: str | None = None) -> None:
        self.device = device
        self._modules: list[nn.Module] = []
        self._scaler: Scaler | None = None

    @property
    def scaler(self) -> Scaler:
        """The scaling method's scaler, built for the model set up with Fabric."""
        return self._build_scaler_once()

    def _build_scaler_once(self) -> Scaler:
        if self._scaler is None:
            self.settle_emulation(self._device_type())  # type: ignore[attr-defined]
            self._scaler = self._build_scaler(self._set_up_module(), self._device_type())  # type: ignore[attr-defined]
            for module in self._modules[1:]:
                self._attach_module(module)  # type: ignore[attr-defined]
        return self._scaler

    def _set_up_module(self) -> nn.Module:
        if not self._modules:
            raise RuntimeError(f"{type(self).__name__}: the scaler is built for the model; call fabric.setup(model) first.")
        return self._modules[0]

    def _device_type(self) -> str:
        if self.device is not None:
            return self.device
        param = next(self._set_up_module().parameters(), None)
        return param.device.type if param is not None else "cpu"

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Remember every module set up (a GAN's generator and discriminator): the scaler serves them all."""
        self._modules.append(module)
        if self._scaler is not None:
            self._attach_module(module)  # type: ignore[attr-defined]
        return module

    def forward_context(self) -> AbstractContextManager:
        """fp16 autocast on the model's device type."""
        # Before the first forward changes the model's buffers (BatchNorm statistics): the scaler keeps
        # them as they were, for a skipped first step to restore.
        self._build_scaler_once()
        return self._emulated_autocast(self._device_type())

    @contextmanager
    def _emulated_autocast(self, device_type: str) -> Generator[None, None, None]:
        with self.emulation(), torch.autocast(device_type, dtype=torch.float16):  # type: ignore[attr-defined]
            yield

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, function=_to_dtype(torch.float16), dtype=torch.Tensor)

    def convert_output(self, data: Any) -> Any:
        return apply_to_collection(data, function=_to_dtype(torch.get_default_dtype()), dtype=torch.Tensor)

    def backward(self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """``scaler.scale(tensor).backward()``: per-layer scaled with gradient scaling, the scaled loss's otherwise."""
        with self.emulation():  # type: ignore[attr-defined]
            super().backward(self.scaler.scale(tensor), model, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step unless one of the optimizer's gradients is non-finite, then end the scaler's iteration."""
        if isinstance(optimizer, LBFGS):
            raise TypeError(f"{type(self).__name__} and the LBFGS optimizer are not compatible.")
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return step_output

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Bring ``.grad`` to true values before clipping (already true with gradient scaling)."""
        self.scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (for ``fabric.save``)."""
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler's state (``fabric.load``); the model must be set up first."""
        self.scaler.load_state_dict(state_dict)


def _to_dtype(dtype: torch.dtype) -> Any:
    def convert(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype) if torch.is_floating_point(tensor) else tensor

    return convert


class GradientScalingPlugin(GradientScaling, FP16MixedPrecision):
    __doc__ = GradientScaling.__doc__


class DynamicLossScalingPlugin(DynamicLossScaling, FP16MixedPrecision):
    __doc__ = DynamicLossScaling.__doc__


class LossScalingPlugin(LossScaling, FP16MixedPrecision):
    __doc__ = LossScaling.__doc__


class FP16Plugin(NoScaling, FP16MixedPrecision):
    __doc__ = NoScaling.__doc__
