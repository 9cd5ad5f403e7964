"""timm: :class:`TimmGradientScaler`, a ``GradientScaler`` in the place of timm's ``NativeScaler``.

timm's training script and helpers use a loss scaler only through ``NativeScaler``'s interface:
``loss_scaler(loss, optimizer, clip_grad=..., clip_mode=..., parameters=..., create_graph=...,
need_update=...)`` for backward, clipping and step, ``state_dict_key`` (the key of its state in a
checkpoint: ``CheckpointSaver``, ``resume_checkpoint``) and ``state_dict``/``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from timm.utils.clip_grad import dispatch_clip_grad

from gs_lightning.scaling import GradientScaler


class TimmGradientScaler:
    """timm's ``NativeScaler`` with a :class:`~gs_lightning.GradientScaler` inside: pass it as ``loss_scaler``.

    ``loss_scaler = TimmGradientScaler(GradientScaler(model))`` where timm would take
    ``NativeScaler()``. A call backpropagates ``loss`` with per-layer scales; with ``need_update``
    (the last micro-batch of an accumulation) it checks the gradients, clips them as timm clips
    (``'norm'``, ``'value'`` or ``'agc'`` through ``timm.utils.dispatch_clip_grad``), and steps
    ``optimizer`` unless a gradient is non-finite.

    Its checkpoint entry is ``"gradient_scaler"``, not ``NativeScaler``'s ``"amp_scaler"``: a
    ``GradScaler``'s state has no per-layer scales to restore, so a checkpoint written with
    ``NativeScaler`` resumes with a fresh ``GradientScaler`` (its scales are decided on the first
    backward), and one written with this class resumes under ``NativeScaler`` with a fresh ``GradScaler``.

    Args:
        scaler: the ``GradientScaler`` (``GradientScaler(model)`` names layers and restores
            BatchNorm statistics on a skipped step).
    """

    state_dict_key = "gradient_scaler"

    def __init__(self, scaler: GradientScaler) -> None:
        if not isinstance(scaler, GradientScaler):
            raise TypeError(
                f"TimmGradientScaler: expected a gs_lightning.GradientScaler, got {type(scaler).__name__} "
                "(for torch.amp.GradScaler use timm.utils.NativeScaler)"
            )
        self.scaler = scaler

    def __call__(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        clip_grad: float | None = None,
        clip_mode: str = "norm",
        parameters: Iterable[torch.Tensor] | None = None,
        create_graph: bool = False,
        need_update: bool = True,
    ) -> None:
        """Backward of ``loss``; with ``need_update``, clip (if ``clip_grad``) and step ``optimizer``.

        Raises:
            ValueError: if ``clip_grad`` is given without the ``parameters`` to clip.
        """
        if need_update and clip_grad is not None and parameters is None:
            raise ValueError(
                "TimmGradientScaler: clip_grad needs the parameters to clip (parameters=model.parameters())"
            )
        self.scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                self.scaler.unscale_(optimizer)  # checks: the gradients are already true
                dispatch_clip_grad(parameters, clip_grad, mode=clip_mode)
            self.scaler.step(optimizer)
            self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """The ``GradientScaler``'s state (plain containers: loads with ``torch.load(weights_only=True)``)."""
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`."""
        self.scaler.load_state_dict(state_dict)


__all__ = ["TimmGradientScaler"]
