"""The gradient-scaling methods GS is compared with, behind one training-loop interface.

Each method has ``backward(loss)`` (leaves true gradients in ``.grad``), ``step(optimizer)``
(returns whether it stepped) and ``skipped_steps``, as :class:`~gs_lightning.GradientScaler`
has. A step whose gradients are non-finite is skipped by every method, so that one overflow does
not end a run with NaN weights; the count is reported.
"""

from __future__ import annotations

import torch

from gs_lightning.scaling.finite import any_non_finite, unscale_and_check_
from gs_lightning.simulate.delayed_scaling import DelayedScaling
from gs_lightning.simulate.grad_scaling import GradScaling


def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


class NoScaling:
    """Plain ``loss.backward()``; a step with a non-finite gradient is skipped."""

    grad_scaling: GradScaling | None = None

    def __init__(self) -> None:
        self.skipped_steps = 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` as is."""
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()`` unless a gradient is non-finite."""
        return self._step_if_finite(optimizer, any_non_finite(_grads(optimizer)))

    def _step_if_finite(self, optimizer: torch.optim.Optimizer, non_finite: bool) -> bool:
        if non_finite:
            self.skipped_steps += 1
            return False
        optimizer.step()
        return True


class FixedLossScale(NoScaling):
    """One constant loss scale: backward of ``loss * scale``, gradients divided by it before the step.

    Args:
        scale: The loss scale (a power of two keeps the unscaling exact).
    """

    def __init__(self, scale: float) -> None:
        if not scale > 0:
            raise ValueError(f"FixedLossScale: scale must be positive, got {scale}")
        super().__init__()
        self.scale = float(scale)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss * scale`` (:meth:`step` divides the gradients by it)."""
        (loss * self.scale).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale the gradients, then step unless one is non-finite."""
        flags = unscale_and_check_(_grads(optimizer), 1.0 / self.scale)
        return self._step_if_finite(optimizer, any(bool(flag.item()) for flag in flags))


class DynamicLossScale:
    """``torch.amp.GradScaler``: halve the loss scale on overflow (skipping the step), grow it after a run of good
    steps.

    Args:
        init_scale: First loss scale (GradScaler's default 2^16).
        growth_interval: Good steps before the scale doubles (GradScaler's default 2000).
        grad_scaling: Optional fp8 scaling recipe (:class:`DelayedScaling`, ``CurrentScaling``,
            ``MXBlockScaling``) this method's backward updates after each pass; passed to
            :func:`~gs_lightning.simulate.emulate` by the training loop. With it the method is
            that recipe's scaling of fp8 gradients under a dynamic loss scale, as fp16 training
            with Transformer Engine runs (the loss scale keeps the fp16 tensors between the fp8
            GEMMs in range; the recipe's scales fit each fp8 cast).
    """

    def __init__(
        self, init_scale: float = 2.0**16, growth_interval: int = 2000, grad_scaling: GradScaling | None = None
    ) -> None:
        self.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
        self.grad_scaling = grad_scaling
        self.skipped_steps = 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate the scaled loss (then update the per-tensor scales, if any)."""
        self.scaler.scale(loss).backward()
        if self.grad_scaling is not None:
            self.grad_scaling.update()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """GradScaler's step and update; returns whether the optimizer stepped."""
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        stepped = self.scaler.get_scale() >= before
        self.skipped_steps += not stepped
        return stepped


class RecipeScaling(NoScaling):
    """An fp8 scaling recipe alone, no loss scale: delayed, current or MX block scaling of the gradient casts.

    Args:
        grad_scaling: The recipe's state (default: :class:`DelayedScaling` with Transformer
            Engine's defaults); the training loop passes it to :func:`~gs_lightning.simulate.emulate`.
    """

    def __init__(self, grad_scaling: GradScaling | None = None) -> None:
        super().__init__()
        self.grad_scaling = grad_scaling if grad_scaling is not None else DelayedScaling()

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``, then let the recipe update its scales (delayed scaling's amax history)."""
        loss.backward()
        self.grad_scaling.update()
