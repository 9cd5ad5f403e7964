"""Hugging Face Transformers: :class:`GradientScalingTrainer`, a ``Trainer`` that scales with a ``GradientScaler``.

The ``Trainer`` has no hook between building its ``Accelerator`` and using its scaler: it builds
one in ``__init__`` and again for every ``hyperparameter_search`` trial
(``create_accelerator_and_postprocess``), and loads a checkpoint's ``scaler.pt`` into
``accelerator.scaler`` before ``on_train_begin``, so a ``TrainerCallback`` would be too late on a
resume. The mixin therefore overrides the two public methods that make what the scaler depends on:
``create_accelerator_and_postprocess`` (a new ``Accelerator``) and ``call_model_init`` (a new model).
Everything else (``accelerator.backward``, ``clip_grad_norm_``, the skipped step holding the LR
scheduler, ``scaler.pt`` in each checkpoint) is the ``Trainer``'s own code driving the installed scaler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from gs_lightning.integrations.accelerate import install_gradient_scaler
from gs_lightning.scaling import GradientScaler

ScalerFactory = Callable[[nn.Module | None], GradientScaler | torch.amp.GradScaler]


class GradientScalingMixin:
    """Mix into a ``Trainer`` subclass (before it) so that it scales gradients with a ``GradientScaler``.

    ``class MyTrainer(GradientScalingMixin, SFTTrainer): ...`` for a ``Trainer`` subclass of your
    own or a library's; :class:`GradientScalingTrainer` is the mixin on ``Trainer`` itself. The
    scaler is made by ``make_gradient_scaler(model)`` for each new ``Accelerator`` and each model
    ``model_init`` makes (every ``hyperparameter_search`` trial gets a fresh scaler for its model),
    installed with :func:`~gs_lightning.integrations.accelerate.install_gradient_scaler`, and saved
    in and restored from checkpoints as the ``Trainer`` saves ``GradScaler``'s state (``scaler.pt``).

    Args:
        make_gradient_scaler: keyword only; called with the model (``None`` while ``model_init``
            has not made one yet). Default :class:`~gs_lightning.GradientScaler`; for other
            settings ``functools.partial(GradientScaler, underflow_rate=1e-4)``.
        *args: the ``Trainer``'s positional arguments.
        **kwargs: the ``Trainer``'s keyword arguments. ``TrainingArguments(fp16=True)`` is required.

    Raises:
        ValueError: if the ``TrainingArguments`` do not ask for fp16 (``fp16=True``).
    """

    def __init__(self, *args: Any, make_gradient_scaler: ScalerFactory = GradientScaler, **kwargs: Any) -> None:
        if not callable(make_gradient_scaler):
            raise TypeError(
                f"{type(self).__name__}: make_gradient_scaler must be a callable taking the model, "
                f"got {type(make_gradient_scaler).__name__}"
            )
        self.make_gradient_scaler = make_gradient_scaler  # read by create_accelerator_and_postprocess in __init__
        super().__init__(*args, **kwargs)

    @property
    def gradient_scaler(self) -> GradientScaler | torch.amp.GradScaler:
        """The scaler in use (``self.accelerator.scaler``): counters such as ``skipped_steps``, ``scales()``."""
        return self.accelerator.scaler

    def create_accelerator_and_postprocess(self) -> None:
        """The ``Trainer``'s, then a new scaler for ``self.model`` installed in the new ``Accelerator``."""
        super().create_accelerator_and_postprocess()
        if not self.args.fp16:
            raise ValueError(
                f"{type(self).__name__}: gradient scaling is for fp16 training; pass TrainingArguments(fp16=True) "
                f"(got fp16=False, bf16={self.args.bf16})"
            )
        self._install_scaler(self.model)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """The ``Trainer``'s, then a new scaler for the new model (its layer names, its buffers)."""
        model = super().call_model_init(trial)
        self._install_scaler(model)
        return model

    def _install_scaler(self, model: nn.Module | None) -> None:
        install_gradient_scaler(self.accelerator, self.make_gradient_scaler(model))


class GradientScalingTrainer(GradientScalingMixin, Trainer):
    """``transformers.Trainer`` with per-layer gradient scaling: same arguments, plus ``make_gradient_scaler``.

    ``GradientScalingTrainer(model=model, args=TrainingArguments(..., fp16=True), train_dataset=...)``
    trains as ``Trainer`` does with its ``GradScaler``; see :class:`GradientScalingMixin`.
    """


__all__ = ["GradientScalingMixin", "GradientScalingTrainer"]
