"""The optimizer steps a scaler guards, in ``torch.amp.GradScaler``'s order and with its counts.

Within an iteration each optimizer is checked at most once (``unscale_``) and stepped at most once,
until ``update()``; its step is taken only where the gradients it uses are finite. Skipped steps are
counted, in a row too: more than ``max_consecutive_skips`` in a row is a diverged run, an error that
says where it diverged. A step on an optimizer that holds no gradient raises ``GradScaler``'s
``AssertionError``. :class:`~gs_lightning.scaling.GradientScaler` and the plugins'
``FixedLossScaler`` both keep their order here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import torch

# One optimizer's found-inf flags, one per device its gradients are on (``GradScaler``'s
# ``found_inf_per_device``): a ``bool``, or a tensor that is non-zero where a gradient is non-finite
# (read in ``step``). Empty: the optimizer holds no gradient to check.
FoundInf = Sequence["bool | torch.Tensor"]

NO_GRADIENT = (
    "No inf checks were recorded for this optimizer: none of its parameters has a gradient (every .grad is None), "
    "so no backward reached them since they were last zeroed. Backpropagate the loss through the scaler "
    "(scaler.scale(loss).backward() or scaler.backward(loss)) before step()."
)


class Stage(Enum):
    """Where an optimizer is in the iteration (``torch.amp.OptState``'s stages)."""

    READY = "ready"
    """Neither checked nor stepped since the last ``update()``."""
    UNSCALED = "unscaled"
    """Checked (``unscale_``): its step goes by that check."""
    STEPPED = "stepped"
    """Stepped, or its step skipped: nothing more until ``update()``."""


def check_max_consecutive_skips(value: int | None) -> int | None:
    """``value`` if it is a valid ``max_consecutive_skips`` (``None`` or a positive integer).

    Raises:
        ValueError: for anything else.
    """
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"GradientScaler: max_consecutive_skips must be None or a positive integer, got {value!r}")
    return value


class OptimizerSteps:
    """The per-optimizer stages of one iteration and the skipped steps of the run.

    The scalers say how to check an optimizer's gradients (a callable that returns its
    :data:`FoundInf` flags); this class says when: once per optimizer at ``unscale_``, or at ``step``
    if ``unscale_`` was not called, with ``GradScaler``'s errors for calls out of order.

    Args:
        max_consecutive_skips: Raise once more steps than this were skipped in a row; ``None`` never raises.

    Attributes:
        skipped: Steps skipped because a gradient was non-finite.
        consecutive: Steps skipped in a row up to the last one (0 once a step is taken).
    """

    def __init__(self, max_consecutive_skips: int | None) -> None:
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped = 0
        self.consecutive = 0
        self._skipped_this_iteration = False
        self._stage: dict[int, Stage] = {}  # per optimizer; absent: Stage.READY
        self._found_inf: dict[int, FoundInf] = {}  # per optimizer checked at unscale_ and not yet stepped

    @property
    def max_consecutive_skips(self) -> int | None:
        """More steps than this skipped in a row raise (``None``: never)."""
        return self._max_consecutive_skips

    @max_consecutive_skips.setter
    def max_consecutive_skips(self, value: int | None) -> None:
        self._max_consecutive_skips = check_max_consecutive_skips(value)

    def stage(self, optimizer: torch.optim.Optimizer) -> Stage:
        """Where ``optimizer`` is in this iteration."""
        return self._stage.get(id(optimizer), Stage.READY)

    def unscale(self, optimizer: torch.optim.Optimizer, check: Callable[[], FoundInf]) -> None:
        """``unscale_``: check ``optimizer``'s gradients now (``check``); its step goes by this check."""
        stage = self.stage(optimizer)
        if stage is Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if stage is Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._stage[id(optimizer)] = Stage.UNSCALED
        self._found_inf[id(optimizer)] = check()

    def overflowed(self, optimizer: torch.optim.Optimizer, check: Callable[[], FoundInf]) -> bool:
        """``step``: whether ``optimizer``'s gradients were non-finite at ``unscale_``, or are now if it was not called.

        Raises:
            RuntimeError: if ``optimizer`` was stepped since the last ``update()``.
            AssertionError: if it holds no gradient (``GradScaler``'s error; the optimizer is ready
                again, for a step after a backward).
        """
        if self.stage(optimizer) is Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        found_inf = self._found_inf.pop(id(optimizer), None)
        if found_inf is None:
            found_inf = check()
        if not found_inf:
            self._stage.pop(id(optimizer), None)
            raise AssertionError(NO_GRADIENT)
        self._stage[id(optimizer)] = Stage.STEPPED
        return any(bool(flag) for flag in found_inf)

    def retryable(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s check (``unscale_``) found a non-finite gradient, and no other optimizer was
        checked or stepped this iteration: the iteration may run again before its step."""
        found_inf = self._found_inf.get(id(optimizer), ())
        return set(self._stage) == {id(optimizer)} and any(bool(flag) for flag in found_inf)

    def skip(self) -> bool:
        """Count a skipped step; whether it is the iteration's first (several optimizers skip as one)."""
        if self._skipped_this_iteration:
            return False
        self._skipped_this_iteration = True
        self.skipped += 1
        self.consecutive += 1
        return True

    def stepped(self) -> bool:
        """A step was taken; whether the iteration skipped none (it ends a run of skipped steps)."""
        if self._skipped_this_iteration:
            return False
        self.consecutive = 0
        return True

    def check_diverged(self, first_non_finite: Callable[[], str | None]) -> None:
        """Raise where more steps than allowed were skipped in a row, naming the first non-finite layer.

        Raises:
            RuntimeError: after more than ``max_consecutive_skips`` skipped steps in a row.
        """
        if self.max_consecutive_skips is None or self.consecutive <= self.max_consecutive_skips:
            return
        first = first_non_finite()
        where = f"layer {first!r}" if first else "the loss (no layer had a non-finite gradient)"
        raise RuntimeError(
            f"GradientScaler: {self.consecutive} optimizer steps in a row were skipped for non-finite "
            f"gradients (max_consecutive_skips={self.max_consecutive_skips}); the first non-finite gradient in "
            f"backward order on the last update iteration was at {where}. The run has diverged or its forward "
            "produces inf/NaN: lower the learning rate or check the inputs."
        )

    def state_dict(self) -> dict[str, int]:
        """The skipped steps' counts."""
        return {"skipped_steps": self.skipped, "consecutive_skips": self.consecutive}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s counts (``consecutive_skips`` 0 where a state has none)."""
        self.skipped, self.consecutive = int(state["skipped_steps"]), int(state.get("consecutive_skips", 0))

    @property
    def any_stepped(self) -> bool:
        """Whether an optimizer stepped (or skipped its step) since the last :meth:`end_iteration`."""
        return Stage.STEPPED in self._stage.values()

    def end_iteration(self) -> None:
        """``update()``: every optimizer may be checked and stepped again."""
        self._stage.clear()
        self._found_inf.clear()
        self._skipped_this_iteration = False
