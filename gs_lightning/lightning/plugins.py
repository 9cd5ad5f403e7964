"""Lightning Trainer precision plugins: fp16 autocast, a scaling method, and steps skipped on non-finite gradients.

Every plugin here shares :class:`FP16MixedPrecision`; they differ only in how gradients are scaled
(the scaling methods of :mod:`gs_lightning.fabric.methods`):

* :class:`GradientScalingPlugin`: per-layer scales on the backward graph (Zhao et al., IJCAI 2020).
* :class:`DynamicLossScalingPlugin`: one loss scale that backs off on overflow (``torch.amp.GradScaler``).
* :class:`LossScalingPlugin`: one fixed loss scale.
* :class:`FP16Plugin`: no scaling at all.

Lightning's ``FSDPStrategy`` takes only an ``FSDPPrecision``: :class:`FSDPGradientScalingPlugin` and
:class:`FSDPDynamicLossScalingPlugin` are those (:class:`FSDPMixedPrecision`). DeepSpeed, which runs the
backward and keeps a loss scale of its own, is refused at setup.

Each works in ``lightning.pytorch.Trainer`` and in ``pytorch_lightning.Trainer``
(:mod:`gs_lightning.lightning.packages`). With all of them ``.grad`` holds true gradients from
``on_before_optimizer_step`` on, so clipping and the hook see real values, and a step with a
non-finite gradient leaves the weights alone. Such a step does not advance the learning-rate
schedulers either (:class:`SkipAwareScheduler`), which Lightning's own ``MixedPrecision`` gets
wrong (Lightning issues #5558, #18828).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from importlib import import_module
from typing import Any, Literal

import torch
from torch import nn
from torch.optim import LBFGS, Optimizer

from gs_lightning.fabric.methods import Scaler, plugin_classes
from gs_lightning.fabric.plugins import fp32_sharding_policy, refuse_unsupported_parallelism
from gs_lightning.lightning.packages import LIGHTNING_MODULES, PACKAGES, package_of
from gs_lightning.lightning.schedulers import SkipAwareScheduler
from gs_lightning.scaling import GradientScaler

# Each package's FSDPPrecision: its FSDPStrategy takes no other plugin.
_FSDP_PRECISIONS: tuple[type, ...] = tuple(
    import_module(f"{package.name}.plugins.precision").FSDPPrecision for package in PACKAGES
)


class FP16MixedPrecision(*(package.Precision for package in PACKAGES)):  # type: ignore[misc]
    """Base of the Trainer's fp16 plugins: autocast forward, true gradients before the step, non-finite steps skipped.

    The forward runs under ``torch.autocast(dtype=torch.float16)`` on the model's device type
    (CUDA or CPU). The loss is backpropagated as ``scaler.scale(loss)``; after the backward
    ``scaler.unscale_`` brings ``.grad`` to true values, then ``on_before_optimizer_step`` and
    gradient clipping run, then ``scaler.step`` steps the optimizer unless a gradient is non-finite,
    and ``scaler.update`` ends the iteration. The scaler is the scaling method's, built once when the
    Trainer first connects the plugin; its state is saved in and restored from checkpoints.
    Learning-rate schedulers are wrapped in :class:`SkipAwareScheduler`.

    Args:
        device: Device type for autocast (``"cuda"``, ``"cpu"``). ``None``: the device type of the
            model's parameters when the Trainer connects the plugin.
    """

    precision: Literal["16-mixed"] = "16-mixed"

    def __init__(self, device: str | None = None) -> None:
        self.device = device
        self._autocast_device = device
        self._scaler: Scaler | None = None

    @property
    def scaler(self) -> Scaler:
        """The scaling method's scaler (exists once a Trainer has connected the plugin)."""
        if self._scaler is None:
            raise RuntimeError(
                f"{type(self).__name__}: the scaler is built when a Trainer connects the plugin (at fit)."
            )
        return self._scaler

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Refuse a strategy that owns the backward (DeepSpeed); every strategy's setup calls this first."""
        trainer = getattr(module, "_trainer", None)  # the LightningModule's Trainer, if it has one
        if trainer is not None:
            refuse_unsupported_parallelism(self, trainer.strategy)
        return super().convert_module(module)

    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Check the wrapped model, find the autocast device, build the scaler once, make the schedulers skip-aware."""
        refuse_unsupported_parallelism(self, model)
        self._autocast_device = self.device or _device_type(model)
        self.settle_emulation(self._autocast_device)  # type: ignore[attr-defined]
        if self._scaler is None:
            self._scaler = self._build_scaler(_lightning_module(model), self._autocast_device)  # type: ignore[attr-defined]
        for config in lr_schedulers:
            if not isinstance(config.scheduler, SkipAwareScheduler):  # connect runs again for every fit
                config.scheduler = SkipAwareScheduler(config.scheduler)
        return model, optimizers, lr_schedulers

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """fp16 autocast on the model's device type."""
        if self._autocast_device is None:
            raise RuntimeError(
                f"{type(self).__name__}: no device yet; pass `device=` or let the Trainer connect the plugin."
            )
        # Lightning's MixedPrecision autocast settings, so that side-by-side runs differ only in scaling.
        with self.emulation(), torch.autocast(self._autocast_device, dtype=torch.float16, cache_enabled=False):  # type: ignore[attr-defined]
            yield

    # Lightning's base class runs these with its own package's globals (hooks, isinstance checks):
    # each goes to the base class of the package the LightningModule comes from.

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        """Scale the loss (with gradient scaling: the loss itself, set up for the per-layer scaled backward)."""
        return package_of(module).Precision.pre_backward(self, self.scaler.scale(tensor), module)

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """The LightningModule's backward, in the emulation context when the plugin emulates fp16."""
        with self.emulation():  # type: ignore[attr-defined]
            package_of(model).Precision.backward(self, tensor, model, *args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        return package_of(module).Precision.post_backward(self, tensor, module)

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        package_of(model).Precision._after_closure(self, model, optimizer)

    def _clip_gradients(self, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        package_of(model).Precision._clip_gradients(self, model, optimizer, *args, **kwargs)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure, unscale, call ``on_before_optimizer_step`` and clip, then step unless non-finite.

        With gradient scaling, where the gradients overflowed in layers the scaler names, the closure runs once more
        on the same batch under the back-off instead of the step being skipped
        (:attr:`~gs_lightning.scaling.recipe.ScalingRecipe.retry_overflowed_steps`): in automatic optimization
        without gradient accumulation, where the closure is the whole iteration (``training_step``, its logging
        included, runs twice on that batch).
        """
        if isinstance(optimizer, LBFGS):
            raise package_of(model).MisconfigurationException(
                f"{type(self).__name__} and the LBFGS optimizer are not compatible."
            )
        closure_result = closure()
        # In automatic optimization a training_step that returns None runs no backward: nothing to step.
        ran_backward = closure_result is not None or not model.automatic_optimization
        if ran_backward:
            self.scaler.unscale_(optimizer)
            if _closure_is_the_iteration(model) and isinstance(self.scaler, GradientScaler):
                if self.scaler.prepare_retry(optimizer):
                    closure_result = closure()
                    self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if ran_backward:
            self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
        return closure_result

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (saved in checkpoints; a fixed loss scale has none)."""
        return self._scaler.state_dict() if self._scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler's state and settings (GS: its recipe, as ``GradScaler`` restores its own), warning
        once where they differ from the constructor's; the Trainer calls this after connecting the plugin."""
        self.scaler.load_state_dict(state_dict)


def _closure_is_the_iteration(model: Any) -> bool:
    """Whether the optimizer's closure runs the whole iteration: automatic optimization (Lightning's closure runs
    ``training_step`` and the backward, and zeroes the gradients first) without accumulation over micro-batches."""
    trainer = getattr(model, "_trainer", None)
    return bool(model.automatic_optimization) and trainer is not None and trainer.accumulate_grad_batches == 1


class FSDPMixedPrecision(FP16MixedPrecision, *_FSDP_PRECISIONS):  # type: ignore[misc]
    """Base of the plugins for ``FSDPStrategy`` (FSDP1): an ``FSDPPrecision`` scaling as :class:`FP16MixedPrecision`.

    FSDP gets :func:`~gs_lightning.fabric.plugins.fp32_sharding_policy` as its mixed-precision
    config (float32 sharded parameters, gradients and reductions), where Lightning's
    ``FSDPPrecision("16-mixed")`` gives float16 ones: the plugins unscale each gradient before FSDP
    reduces it, and in float16 the small ones would flush. The fp16 compute is autocast's. The rest is
    ``FSDPPrecision``'s: ``convert_module`` leaves the module as it is, inputs are cast to float32,
    and ``gradient_clip_algorithm="norm"`` is refused (FSDP1 shards would need the root's
    ``clip_grad_norm_``). A ``FSDPStrategy(mixed_precision=...)`` with float16 parameters or
    reductions is refused at setup.

    Args:
        device: Device type for autocast; ``None``: the device type of the model's parameters.
    """

    def __init__(self, device: str | None = None) -> None:
        super().__init__(device)
        self._desired_input_dtype = torch.float32  # FSDPPrecision's dtype for inputs and module/tensor init contexts

    @property
    def mixed_precision_config(self) -> Any:
        """What ``FSDPStrategy`` gives FSDP: :func:`~gs_lightning.fabric.plugins.fp32_sharding_policy`."""
        return fp32_sharding_policy()


# The plugins of the table in gs_lightning.fabric.methods (Fabric's, gs_lightning.fabric.plugins, are made from the
# same table), bound by name for imports, Hydra's _target_, pickling and the checkpoint key of their state.
_PLUGINS = plugin_classes(FP16MixedPrecision, FSDPMixedPrecision, __name__, fsdp_strategy="``FSDPStrategy``")
GradientScalingPlugin = _PLUGINS["GradientScalingPlugin"]
DynamicLossScalingPlugin = _PLUGINS["DynamicLossScalingPlugin"]
LossScalingPlugin = _PLUGINS["LossScalingPlugin"]
FP16Plugin = _PLUGINS["FP16Plugin"]
FSDPGradientScalingPlugin = _PLUGINS["FSDPGradientScalingPlugin"]
FSDPDynamicLossScalingPlugin = _PLUGINS["FSDPDynamicLossScalingPlugin"]


def _lightning_module(model: nn.Module) -> nn.Module:
    """The LightningModule inside a strategy's wrapper (DDP's ``.module``), so layers get their own names."""
    return next((m for m in model.modules() if isinstance(m, LIGHTNING_MODULES)), model)


def _device_type(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"
