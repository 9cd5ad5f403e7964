"""Callbacks that a part of an object holds, without the reference that would keep the object alive.

A bound method kept by one of its own object's parts is a reference cycle: the object, the models it holds and
FSDP's process-group state with them then live until the garbage collector runs, at the latest as the
interpreter exits, after ``destroy_process_group``; gloo then aborted some of those exits ("terminate called
without an active exception": 1 in 6 of a two-rank FSDP test's). Without the cycle they go with the last
reference, as with ``torch.amp.GradScaler``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a bound method) called through a weak reference to its object; ``None`` once the object is gone."""
    reference = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = reference()
        return None if bound is None else bound(*args, **kwargs)

    return call
