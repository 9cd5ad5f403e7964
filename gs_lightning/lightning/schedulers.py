"""Learning-rate schedulers that do not advance on a step skipped for a non-finite gradient."""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer


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
