"""Hugging Face Accelerate: :func:`install_gradient_scaler` puts a scaler into an ``Accelerator``.

Accelerate drives its scaler through ``GradScaler``'s methods only: ``accelerator.backward`` calls
``scaler.scale(loss).backward()``, ``clip_grad_norm_``/``clip_grad_value_`` call ``unscale_``, the
prepared optimizer's ``step`` calls ``scaler.step`` and ``scaler.update`` and records whether the
wrapped ``optimizer.step`` ran (``step_was_skipped``, which the prepared LR scheduler and
``accelerator.optimizer_step_was_skipped`` read), and ``save_state``/``load_state`` save
``scaler.state_dict()`` and load it with ``weights_only=True``. A ``GradientScaler`` serves all of
that as it is; what needs installing is the reference in each place Accelerate keeps one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer, patch_optimizer_step
from accelerate.utils import DistributedType, convert_outputs_to_fp32

from gs_lightning.scaling import GradientScaler

ScalerT = TypeVar("ScalerT", GradientScaler, torch.amp.GradScaler)

# Where Accelerate's own scaler is not the one that scales: these engines scale (or shard) gradients themselves.
_UNSUPPORTED = {
    DistributedType.DEEPSPEED: "DeepSpeed scales the loss inside its engine (its config's fp16 section)",
    DistributedType.MEGATRON_LM: "Megatron-LM scales the loss inside its engine",
    DistributedType.FSDP: "FSDP shards the gradients; its ShardedGradScaler reduces the finiteness flag across ranks",
    DistributedType.XLA: "XLA devices have no fp16 autocast in Accelerate",
}


def install_gradient_scaler(accelerator: Accelerator, scaler: ScalerT) -> ScalerT:
    """Make ``accelerator`` scale with ``scaler``, before or after ``accelerator.prepare``; returns ``scaler``.

    ``accelerator.scaler`` becomes ``scaler``, and so does the scaler of every optimizer already
    prepared (each keeps its own reference from ``prepare``); optimizers prepared later take
    ``accelerator.scaler`` by themselves. ``step_was_skipped`` then reports whether
    ``scaler.step`` skipped the step.

    On a CPU, Accelerate keeps ``mixed_precision="fp16"`` but turns autocast off and makes no
    scaler, so the model trains in fp32 without a warning. Here fp16 autocast is turned on
    (``accelerator.native_amp``): models prepared from now on run their forward under
    ``torch.autocast("cpu", dtype=torch.float16)`` as they would on a GPU, as do models already
    prepared, and ``accelerator.autocast()`` enters it too.

    Args:
        accelerator: Built with ``mixed_precision="fp16"`` (or ``accelerate launch --mixed_precision fp16``).
        scaler: A :class:`~gs_lightning.GradientScaler` (``GradientScaler(model)`` to name layers and
            restore buffers on a skipped step), or a ``torch.amp.GradScaler``, as a reference.

    Raises:
        TypeError: if ``accelerator`` is not an ``Accelerator`` or ``scaler`` has no ``GradScaler`` methods.
        ValueError: if the accelerator does not train in fp16, or trains through an engine that scales
            gradients itself (DeepSpeed, Megatron-LM, FSDP, XLA).
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"install_gradient_scaler: expected an accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    missing = [
        m for m in ("scale", "unscale_", "step", "update", "state_dict", "load_state_dict") if not hasattr(scaler, m)
    ]
    if missing:
        raise TypeError(
            f"install_gradient_scaler: expected a GradientScaler or torch.amp.GradScaler, got {type(scaler).__name__} "
            f"(no {', '.join(missing)})"
        )
    if accelerator.mixed_precision != "fp16":
        raise ValueError(
            f"install_gradient_scaler: the Accelerator trains with mixed_precision={accelerator.mixed_precision!r}; "
            "gradient scaling is for fp16: build it with Accelerator(mixed_precision='fp16')"
        )
    engine = DistributedType.FSDP if getattr(accelerator, "is_fsdp2", False) else accelerator.distributed_type
    if engine in _UNSUPPORTED:
        raise ValueError(f"install_gradient_scaler: not supported under {engine.value}: {_UNSUPPORTED[engine]}")
    if not accelerator.native_amp:
        _enable_cpu_autocast(accelerator)
    accelerator.scaler = scaler
    # Accelerator keeps its prepared optimizers only in the private `_optimizers` list; nothing public enumerates them.
    for optimizer in accelerator._optimizers:
        _set_optimizer_scaler(optimizer, scaler)
    return scaler


def _set_optimizer_scaler(optimizer: AcceleratedOptimizer, scaler: Any) -> None:
    """What ``AcceleratedOptimizer.__init__`` sets up when it is given a scaler.

    Its ``step`` swaps the wrapped optimizer's ``step`` for a patched one that records the call (the
    ``step_was_skipped`` flag) and back; those three attributes are private and exist only when a
    scaler was given at ``prepare`` (never on a CPU), so they are set here as ``__init__`` and
    ``__setstate__`` set them.
    """
    optimizer.scaler = scaler
    optimizer._accelerate_step_called = False
    if not hasattr(optimizer, "_optimizer_original_step_method"):
        optimizer._optimizer_original_step_method = optimizer.optimizer.step
        optimizer._optimizer_patched_step_method = patch_optimizer_step(optimizer, optimizer.optimizer.step)


def _enable_cpu_autocast(accelerator: Accelerator) -> None:
    """Turn on the fp16 autocast that Accelerate leaves off on a CPU.

    ``native_amp`` is what ``prepare``, ``autocast()`` and ``unscale_gradients`` read; the models
    prepared before it was set get the forward wrapper ``prepare_model`` gives when it is set (the
    model's ``_original_forward`` is where ``unwrap_model`` finds the plain forward again).
    """
    if accelerator.device.type != "cpu":
        raise ValueError(
            f"install_gradient_scaler: Accelerate runs fp16 without autocast on {accelerator.device.type!r}; "
            "only a CPU is expected here"
        )
    accelerator.native_amp = True
    # The models prepared so far are only in the private `_models` list.
    for model in accelerator._models:
        model._original_forward = model.forward
        model.forward = convert_outputs_to_fp32(_under_autocast(accelerator, model.forward))


def _under_autocast(accelerator: Accelerator, forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def forward_under_autocast(*args: Any, **kwargs: Any) -> Any:
        with accelerator.autocast():
            return forward(*args, **kwargs)

    return forward_under_autocast


__all__ = ["install_gradient_scaler"]
