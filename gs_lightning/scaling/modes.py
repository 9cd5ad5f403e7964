"""Dispatch modes that GradientScaler's update hooks step out of: those that only change low-precision GEMMs.

An update iteration's hooks run thousands of small fp32 operators (statistics, fp32 probes, the
decisions). Under a ``TorchDispatchMode`` each passes through the mode's Python ``__torch_dispatch__``,
a few µs apiece, although a mode that emulates low-precision arithmetic
(:class:`gs_lightning.simulate.emulate`) leaves every one of them as it is. Such a mode says so by
deriving from :class:`LowPrecisionOnly`; while it is the innermost mode, the hooks run outside it. Any
other mode (a user's ``FlopCounterMode``, a ``FakeTensorMode``) still sees every operator.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

Hook = TypeVar("Hook", bound=Callable)


class LowPrecisionOnly:
    """Marks a ``TorchDispatchMode`` that changes only GEMMs and batch norms whose floating-point operands are all
    in a low-precision format. GradientScaler's update hooks run none (their probes' GEMMs are fp32), and they
    run outside the mode: the same values, without the mode's Python dispatch on each operator."""


def outside_low_precision_modes(hook: Hook) -> Hook:
    """``hook``, run outside the innermost dispatch mode where that is a :class:`LowPrecisionOnly` one."""

    @functools.wraps(hook)
    def run(*args: object) -> object:
        if isinstance(_get_current_dispatch_mode(), LowPrecisionOnly):
            with _pop_mode_temporarily():
                return hook(*args)
        return hook(*args)

    return run  # type: ignore[return-value]
