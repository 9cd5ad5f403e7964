"""Lightning Fabric precision plugins: fp16 autocast, a scaling method, and steps skipped on non-finite gradients.

``Fabric(plugins=[GradientScalingPlugin()])`` runs the forward under fp16 autocast,
``fabric.backward(loss)`` through the plugin's scaler, and ``optimizer.step()`` only if the
optimizer's gradients are finite. ``fabric.clip_gradients`` sees true gradients. The plugin is
stateful: put it (or ``plugin.scaler``) in the state given to ``fabric.save`` / ``fabric.load``.

``Fabric(strategy="fsdp")`` takes the ``FSDP...`` plugins (:class:`FSDPMixedPrecision`); DeepSpeed,
which runs the backward and keeps a loss scale of its own, is refused (:func:`refuse_unsupported_parallelism`).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager
from importlib import import_module
from typing import Any, Literal

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.optim import LBFGS, Optimizer

from gs_lightning.fabric.methods import Scaler, plugin_classes
from gs_lightning.fabric.packages import FABRIC_PRECISIONS
from gs_lightning.scaling import GradientScaler
from gs_lightning.scaling.attached import is_fsdp1_unit

# Each package's FSDPPrecision: its FSDPStrategy takes no other plugin.
_FABRIC_FSDP_PRECISIONS: tuple[type, ...] = tuple(
    import_module(cls.__module__.rpartition(".")[0]).FSDPPrecision for cls in FABRIC_PRECISIONS
)

# Wrappers whose engine runs the backward and the optimizer step with a loss scale of its own: the
# plugins' scaled backward and skipped steps would bypass it (DeepSpeed's ZeRO reduction and overflow check).
# Known by class name, so that detecting them needs no import of the library.
_OWN_THE_BACKWARD = ("DeepSpeedStrategy", "DeepSpeedEngine")
# Gradients that FSDP computes or reduces in these dtypes are already unscaled there: small ones flush.
_FLUSHING_DTYPES = (torch.float16,)


def refuse_unsupported_parallelism(plugin: object, *wrappers: object) -> None:
    """Raise if a strategy or a wrapped model is one the plugin cannot scale gradients under.

    Refused: DeepSpeed (its engine owns the backward and the fp16 loss scale), and FSDP
    (``FullyShardedDataParallel``) whose ``MixedPrecision`` computes or reduces gradients in
    float16: the plugin divides each gradient by its scale before FSDP reduces it, so in float16 the
    small ones flush to zero.

    Args:
        plugin: The precision plugin (named in the message).
        wrappers: Lightning strategies, or the modules a strategy wrapped (searched through ``.modules()``).

    Raises:
        RuntimeError: for DeepSpeed.
        ValueError: for FSDP with a float16 ``param_dtype`` or ``reduce_dtype``.
    """
    name = type(plugin).__name__
    for wrapper in wrappers:
        owner = next((cls.__name__ for cls in type(wrapper).__mro__ if cls.__name__ in _OWN_THE_BACKWARD), None)
        if owner is not None:
            raise RuntimeError(
                f"{name} cannot run under DeepSpeed ({owner}): its engine runs the backward and the step with a loss "
                "scale of its own, which per-layer scaling would bypass; use DDP, FSDP (strategy='fsdp' with the "
                "FSDP... plugins) or ModelParallelStrategy instead."
            )
        for module in wrapper.modules() if isinstance(wrapper, nn.Module) else ():
            policy = module.mixed_precision if is_fsdp1_unit(module) else None
            if policy is not None and (
                policy.param_dtype in _FLUSHING_DTYPES or policy.reduce_dtype in _FLUSHING_DTYPES
            ):
                raise ValueError(
                    f"{name}: FSDP's MixedPrecision(param_dtype={policy.param_dtype}, "
                    f"reduce_dtype={policy.reduce_dtype}) computes or reduces the gradients in float16 after they were "
                    "unscaled, which flushes the small ones; leave both float32 (the plugin's mixed_precision_config: "
                    "autocast computes in float16)."
                )


def fp32_sharding_policy() -> Any:
    """FSDP's ``MixedPrecision`` for the plugins: float32 sharded parameters, gradients and reductions.

    Lightning's ``FSDPPrecision("16-mixed")`` asks FSDP for float16 parameters and reductions instead;
    then every weight gradient is computed and reduced in float16 after the plugin unscaled it, and the
    small ones flush. fp16 compute comes from autocast, as under DDP.
    """
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32)


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
        # ids of the strategy-wrapped models refuse_unsupported_parallelism passed
        self._checked_wrappers: set[int] = set()

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
            raise RuntimeError(
                f"{type(self).__name__}: the scaler is built for the model; call fabric.setup(model) first."
            )
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
        """``scaler.scale(tensor).backward()``: per-layer scaled with gradient scaling, the scaled loss's otherwise.

        ``model`` is what the strategy made of the module (a DeepSpeed engine, an FSDP wrapper): one
        this plugin cannot scale under is refused (:func:`refuse_unsupported_parallelism`).
        """
        if model is not None and id(model) not in self._checked_wrappers:
            refuse_unsupported_parallelism(self, model)
            self._checked_wrappers.add(id(model))
        scaler = self.scaler  # first: building the scaler settles emulate="auto"
        with self.emulation():  # type: ignore[attr-defined]
            # Fabric's plain Precision.backward: an FSDPPrecision base (FSDPMixedPrecision) would scale once more.
            FABRIC_PRECISIONS[0].backward(self, scaler.scale(tensor), model, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step unless one of the optimizer's gradients is non-finite, then end the scaler's iteration.

        ``optimizer.step(closure)``: the closure (the iteration's forward and ``fabric.backward``, its gradients
        zeroed first, as torch's optimizers expect) runs here, before the check, and its result is returned. With
        gradient scaling, where the gradients overflowed in layers the scaler names, it runs once more on the same
        batch under the back-off instead of the step being skipped
        (:attr:`~gs_lightning.scaling.recipe.ScalingRecipe.retry_overflowed_steps`); without a closure an overflowed
        step is skipped. Synchronises as :meth:`GradientScaler.step <gs_lightning.scaling.GradientScaler.step>` does:
        once, twice where the step is retried.
        """
        if isinstance(optimizer, LBFGS):
            raise TypeError(f"{type(self).__name__} and the LBFGS optimizer are not compatible.")
        closure = kwargs.pop("closure", None)
        if closure is None:
            step_output = self.scaler.step(optimizer, **kwargs)
        else:
            step_output = closure()
            if isinstance(self.scaler, GradientScaler):
                self.scaler.step(optimizer, retry=closure, **kwargs)
            else:
                self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return step_output

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Bring ``.grad`` to true values before clipping (already true with gradient scaling)."""
        self.scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (for ``fabric.save``)."""
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler's state and settings (GS: its recipe, as ``GradScaler`` restores its own) from
        ``fabric.load``; the model must be set up first."""
        self.scaler.load_state_dict(state_dict)


def _to_dtype(dtype: torch.dtype) -> Any:
    def convert(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype) if torch.is_floating_point(tensor) else tensor

    return convert


class FSDPMixedPrecision(FP16MixedPrecision, *_FABRIC_FSDP_PRECISIONS):  # type: ignore[misc]
    """Base of the Fabric plugins for ``Fabric(strategy="fsdp")``: ``FSDPPrecision``, fp16 autocast, a scaling method.

    As :class:`FP16MixedPrecision`, except that FSDP gets :func:`fp32_sharding_policy` (float32
    sharded parameters and reductions; Fabric's ``FSDPPrecision("16-mixed")`` would give float16
    ones) and modules are created in float32 (``fabric.init_module``).

    Args:
        device: Device type for autocast; ``None``: the device type of the model's parameters.
    """

    def __init__(self, device: str | None = None) -> None:
        super().__init__(device)
        # FSDPPrecision's dtype for tensor_init_context and module_init_context
        self._desired_input_dtype = torch.float32

    @property
    def mixed_precision_config(self) -> Any:
        """What FSDP is given: :func:`fp32_sharding_policy`."""
        return fp32_sharding_policy()


# The plugins of the table in gs_lightning.fabric.methods (the Trainer's, gs_lightning.lightning.plugins, are made
# from the same table), bound by name for imports, pickling and Lightning's checkpoint keys.
_PLUGINS = plugin_classes(FP16MixedPrecision, FSDPMixedPrecision, __name__, fsdp_strategy='``Fabric(strategy="fsdp")``')
GradientScalingPlugin = _PLUGINS["GradientScalingPlugin"]
DynamicLossScalingPlugin = _PLUGINS["DynamicLossScalingPlugin"]
LossScalingPlugin = _PLUGINS["LossScalingPlugin"]
FP16Plugin = _PLUGINS["FP16Plugin"]
FSDPGradientScalingPlugin = _PLUGINS["FSDPGradientScalingPlugin"]
FSDPDynamicLossScalingPlugin = _PLUGINS["FSDPDynamicLossScalingPlugin"]
