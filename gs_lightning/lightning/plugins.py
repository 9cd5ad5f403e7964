"""Lightning precision plugins: fp16 autocast, a scaling strategy, and steps skipped on non-finite gradients.

Every plugin here shares :class:`FP16MixedPrecision`; they differ only in how gradients are scaled:

* :class:`GradientScalingPlugin`: per-layer scales on the backward graph (Zhao et al., IJCAI 2020).
* :class:`DynamicLossScalingPlugin`: one loss scale that backs off on overflow (``torch.amp.GradScaler``).
* :class:`LossScalingPlugin`: one fixed loss scale.
* :class:`FP16Plugin`: no scaling at all.

With all of them ``.grad`` holds true gradients from ``on_before_optimizer_step`` on, so clipping and
the hook see real values, and a step with a non-finite gradient leaves the weights alone. Such a
step does not advance the learning-rate schedulers either (:class:`SkipAwareScheduler`), which
Lightning's own ``MixedPrecision`` gets wrong (Lightning issues #5558, #18828).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Literal, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn
from torch.optim import LBFGS, Optimizer

from gs_lightning.scaling import GradientScaler


class SkipAwareScheduler:
    """An LR scheduler that never steps past its optimizer.

    Lightning steps the schedulers after every training batch whether or not the optimizer
    stepped, so a step skipped for a non-finite gradient still advances the schedule (and a
    skipped first step makes torch warn "Detected call of `lr_scheduler.step()` before
    `optimizer.step()`"). This wrapper lets ``step()`` through only if its optimizer has stepped
    since the scheduler last did, which it learns from a step post-hook on the optimizer, so it
    needs no cooperation from whoever skips steps. Everything else (``state_dict``,
    ``get_last_lr``, attributes) is the wrapped scheduler's, so checkpoints are unchanged.

    With ``interval="step"`` this skips exactly the iterations whose step was skipped; with
    ``interval="epoch"`` (or a ``frequency`` above 1) the scheduler steps if the optimizer
    stepped at least once in the period.

    Args:
        scheduler: The scheduler to wrap (anything with ``.optimizer`` and ``.step()``).
    """

    def __init__(self, scheduler: Any) -> None:
        # The wrapper's own attributes bypass __setattr__, which forwards to the scheduler.
        object.__setattr__(self, "scheduler", scheduler)
        object.__setattr__(self, "_optimizer_stepped", False)
        scheduler.optimizer.register_step_post_hook(self._record_optimizer_step)

    def _record_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        object.__setattr__(self, "_optimizer_stepped", True)

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped scheduler if its optimizer has stepped since the last scheduler step."""
        if self._optimizer_stepped:
            object.__setattr__(self, "_optimizer_stepped", False)
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # only while unpickling or copying, before __dict__ is filled
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.scheduler, name, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.scheduler!r})"


class _Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class FP16MixedPrecision(Precision, ABC):
    """Base of the fp16 plugins: autocast forward, true gradients before the step, non-finite steps skipped.

    The forward runs under ``torch.autocast(dtype=torch.float16)`` on the model's device type
    (CUDA or CPU). After the backward a subclass brings ``.grad`` to true values (``_unscale``),
    then ``on_before_optimizer_step`` and gradient clipping run, then the subclass steps the
    optimizer unless a gradient is non-finite (``_step``). Learning-rate schedulers are wrapped in
    :class:`SkipAwareScheduler`. A subclass with a stateful scaler builds it in ``_build_scaler``;
    its state is then saved in and restored from checkpoints.

    Args:
        device: Device type for autocast (``"cuda"``, ``"cpu"``). ``None``: the device type of the
            model's parameters when the Trainer connects the plugin.
    """

    precision: Literal["16-mixed"] = "16-mixed"

    def __init__(self, device: str | None = None) -> None:
        self.device = device
        self._autocast_device = device
        self._scaler: _Stateful | None = None

    # --- scaling strategy: what subclasses choose -------------------------------------------

    def _build_scaler(self, module: nn.Module) -> _Stateful | None:
        """The stateful scaler of this strategy, built once, when the plugin first connects."""
        return None

    def _scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss that is backpropagated."""
        return loss

    def _unscale(self, optimizer: Optimizer) -> None:
        """Bring the optimizer's ``.grad`` to true values (nothing to do if the backward left them so)."""

    @abstractmethod
    def _step(self, optimizer: Optimizer, **kwargs: Any) -> None:
        """``optimizer.step(**kwargs)`` unless a gradient since the last step is non-finite."""

    # --- Lightning's Precision interface ----------------------------------------------------

    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[LRSchedulerConfig]
    ) -> tuple[nn.Module, list[Optimizer], list[LRSchedulerConfig]]:
        """Find the autocast device, build the scaler once, and make the schedulers skip-aware."""
        self._autocast_device = self.device or _device_type(model)
        if self._scaler is None:
            self._scaler = self._build_scaler(_lightning_module(model))
        for config in lr_schedulers:
            if not isinstance(config.scheduler, SkipAwareScheduler):  # connect runs again for every fit
                config.scheduler = SkipAwareScheduler(config.scheduler)
        return model, optimizers, lr_schedulers

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """fp16 autocast on the model's device type."""
        if self._autocast_device is None:
            raise RuntimeError(f"{type(self).__name__}: no device yet; pass `device=` or let the Trainer connect the plugin.")
        # Lightning's MixedPrecision autocast settings, so that side-by-side runs differ only in scaling.
        with torch.autocast(self._autocast_device, dtype=torch.float16, cache_enabled=False):
            yield

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        return super().pre_backward(self._scale_loss(tensor), module)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure, unscale, call ``on_before_optimizer_step`` and clip, then step unless non-finite."""
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException(f"{type(self).__name__} and the LBFGS optimizer are not compatible.")
        closure_result = closure()
        # In automatic optimization a training_step that returns None runs no backward: nothing to step.
        ran_backward = closure_result is not None or not model.automatic_optimization
        if ran_backward:
            self._unscale(optimizer)
        self._after_closure(model, optimizer)
        if ran_backward:
            self._step(optimizer, **kwargs)
        return closure_result

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, if this strategy keeps one (saved in checkpoints)."""
        return self._scaler.state_dict() if self._scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler's state; the Trainer calls this after connecting the plugin."""
        self._connected_scaler().load_state_dict(state_dict)

    def _connected_scaler(self) -> Any:
        if self._scaler is None:
            raise RuntimeError(f"{type(self).__name__}: the scaler is built when a Trainer connects the plugin (at fit).")
        return self._scaler


class LossScalingPlugin(FP16MixedPrecision):
    """fp16 with a fixed loss scale (the paper's Fixed-LS baseline).

    The loss is multiplied by ``scale`` before the backward; the optimizer's gradients are divided
    by it afterwards, and the step is skipped if any of them is non-finite.

    Args:
        scale: The loss scale (the paper's default is 128).
        device: Autocast device type; ``None`` follows the model.
    """

    def __init__(self, scale: float = 128.0, device: str | None = None) -> None:
        if not scale > 0:
            raise ValueError(f"{type(self).__name__}: scale must be positive, got {scale}")
        super().__init__(device)
        self.scale = float(scale)
        self._found_inf: list[torch.Tensor] = []

    def _scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def _unscale(self, optimizer: Optimizer) -> None:
        self._found_inf = _unscale_grads_(optimizer, 1.0 / self.scale)

    def _step(self, optimizer: Optimizer, **kwargs: Any) -> None:
        if not any(bool(flag.item()) for flag in self._found_inf):
            optimizer.step(**kwargs)


class FP16Plugin(LossScalingPlugin):
    """fp16 with no gradient scaling (a loss scale of 1): the baseline that underflows.

    Args:
        device: Autocast device type; ``None`` follows the model.
    """

    def __init__(self, device: str | None = None) -> None:
        super().__init__(scale=1.0, device=device)


class DynamicLossScalingPlugin(FP16MixedPrecision):
    """fp16 with dynamic loss scaling (the paper's Dyn-LS baseline), through ``torch.amp.GradScaler``.

    The loss scale halves on every non-finite step and doubles after ``growth_interval`` finite ones.

    Args:
        init_scale: Initial loss scale.
        growth_factor: Factor applied after ``growth_interval`` finite steps.
        backoff_factor: Factor applied after a non-finite step.
        growth_interval: Finite steps between growths.
        device: Autocast device type; ``None`` follows the model.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        device: str | None = None,
    ) -> None:
        super().__init__(device)
        self._options = {
            "init_scale": init_scale,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
        }
        torch.amp.GradScaler("cpu", **self._options)  # bad options fail here; the kept scaler needs the device

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The ``GradScaler`` (exists once a Trainer has connected the plugin)."""
        return self._connected_scaler()

    def _build_scaler(self, module: nn.Module) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(self._autocast_device, **self._options)

    def _scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def _unscale(self, optimizer: Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def _step(self, optimizer: Optimizer, **kwargs: Any) -> None:
        self.scaler.step(optimizer, **kwargs)
        self.scaler.update()


class GradientScalingPlugin(FP16MixedPrecision):
    """fp16 with per-layer gradient scaling (Zhao et al., IJCAI 2020), through :class:`GradientScaler`.

    Every backpropagated gradient gets its own power-of-two scale, and weight gradients are divided
    by theirs before they accumulate, so ``.grad`` (and DDP's all-reduce, gradient accumulation and
    clipping) only ever see true gradients. The backward is the scaler's, so an override of
    ``LightningModule.backward`` is not used; ``retain_graph`` is passed on.

    Args:
        underflow_rate: γ', the target fraction of a gradient's elements that may underflow.
        update_interval: Recompute the scales every this many backward passes.
        lambda_min: ``"normal"`` or ``"subnormal"``: the λmin of the underflow model.
        relu_factor: Multiplies the accumulation length in the model of a GEMM output.
        max_layer_scale: Optional cap on each local scale.
        max_total_scale: Optional cap on each accumulated scale.
        device: Autocast device type; ``None`` follows the model.
    """

    def __init__(
        self,
        underflow_rate: float = 1e-3,
        update_interval: int = 100,
        lambda_min: Literal["normal", "subnormal"] = "normal",
        relu_factor: float = 1.0,
        max_layer_scale: float | None = None,
        max_total_scale: float | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__(device)
        self._options = {
            "underflow_rate": underflow_rate,
            "update_interval": update_interval,
            "lambda_min": lambda_min,
            "relu_factor": relu_factor,
            "max_layer_scale": max_layer_scale,
            "max_total_scale": max_total_scale,
        }
        GradientScaler(**self._options)  # bad options fail here; the kept scaler needs the model's layer names

    @property
    def scaler(self) -> GradientScaler:
        """The :class:`GradientScaler` (exists once a Trainer has connected the plugin)."""
        return self._connected_scaler()

    def _build_scaler(self, module: nn.Module) -> GradientScaler:
        return GradientScaler(module, dtype=torch.float16, **self._options)

    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: pl.LightningModule,
        optimizer: Optimizer | None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Per-layer scaled backward; afterwards ``.grad`` holds true gradients."""
        self.scaler.backward(tensor, *args, **kwargs)

    def _step(self, optimizer: Optimizer, **kwargs: Any) -> None:
        self.scaler.step(optimizer, **kwargs)


def _lightning_module(model: nn.Module) -> nn.Module:
    """The LightningModule inside a strategy's wrapper (DDP's ``.module``), so layers get their own names."""
    return next((m for m in model.modules() if isinstance(m, pl.LightningModule)), model)


def _device_type(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"


def _unscale_grads_(optimizer: Optimizer, inv_scale: float) -> list[torch.Tensor]:
    """Multiply the optimizer's gradients by ``inv_scale`` in place; one flag per group, 1 if non-finite. No sync."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                groups[(param.grad.device, param.grad.dtype)].append(param.grad)
    flags = []
    for (device, _), grads in groups.items():
        flag = torch.zeros(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, torch.full((1,), inv_scale, device=device))
        flags.append(flag)
    return flags
