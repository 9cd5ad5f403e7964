"""The optimizer steps a scaler guards, in ``torch.amp.GradScaler``'s order and with its counts.

Within an iteration each optimizer is checked at most once (``unscale_``) and stepped at most once,
until ``update()``; its step is taken only where the gradients it uses are finite. Skipped steps are
counted, in a row too: more than ``max_consecutive_skips`` in a row is a diverged run, an error that
says where it diverged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class OptimizerSteps:
    """The per-optimizer stages of one iteration and the skipped steps of the run.

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
        self._stage: dict[int, str] = {}  # GradScaler's per-optimizer "unscaled" / "stepped"
        self._found_inf: dict[int, bool] = {}

    @property
    def max_consecutive_skips(self) -> int | None:
        """More steps than this skipped in a row raise (``None``: never)."""
        return self._max_consecutive_skips

    @max_consecutive_skips.setter
    def max_consecutive_skips(self, value: int | None) -> None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"GradientScaler: max_consecutive_skips must be None or a positive integer, got {value!r}")
        self._max_consecutive_skips = value

    def unscale(self, optimizer: torch.optim.Optimizer, non_finite: Callable[[], bool]) -> None:
        """``unscale_``: check ``optimizer``'s gradients now (``non_finite``); its step goes by this check."""
        stage = self._stage.get(id(optimizer))
        if stage == "unscaled":
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if stage == "stepped":
            raise RuntimeError("unscale_() is being called after step().")
        self._stage[id(optimizer)] = "unscaled"
        self._found_inf[id(optimizer)] = non_finite()

    def overflowed(self, optimizer: torch.optim.Optimizer, non_finite: Callable[[], bool]) -> bool:
        """``step``: whether ``optimizer``'s gradients were non-finite at ``unscale_``, or are now if it was not called."""
        if self._stage.get(id(optimizer)) == "stepped":
            raise RuntimeError("step() has already been called since the last update().")
        overflow = self._found_inf.pop(id(optimizer), None)
        if overflow is None:
            overflow = non_finite()
        self._stage[id(optimizer)] = "stepped"
        return overflow

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
        return "stepped" in self._stage.values()

    def end_iteration(self) -> None:
        """``update()``: every optimizer may be checked and stepped again."""
        self._stage.clear()
        self._found_inf.clear()
        self._skipped_this_iteration = False
