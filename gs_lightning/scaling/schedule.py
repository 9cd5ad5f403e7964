"""When a graph structure's backward decides the scales again, and why: the one owner of the update schedule.

A backward is an update iteration when its structure never decided (:attr:`UpdateReason.FIRST`), when
``update_interval`` of its backwards have run since (:attr:`UpdateReason.INTERVAL`, :meth:`UpdateSchedule.due`),
or when something since asked for one (a skipped step, the drift, ...: the other :class:`UpdateReason`
members, :meth:`UpdateSchedule.ask`). Each update is recorded with every reason that held
(:class:`UpdateRecord`); the scaler shows them (:attr:`GradientScaler.updates
<gs_lightning.scaling.GradientScaler.updates>`) and the Lightning callback logs them.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any, NamedTuple

from gs_lightning.scaling.drift import ROUNDING_LOG2, DriftReading


class UpdateReason(Enum):
    """Why a backward decided the scales again (its value: the text a log shows). Compared as members, never by
    text or position."""

    FIRST = "first backward of its graph structure"
    INTERVAL = "update_interval backwards since the last update"
    SKIPPED_STEP = "a skipped step: its gradients were non-finite"
    RETRIED_STEP = "a retried step: its gradients overflowed, and its forward and backward ran again"
    DRIFT = "the gradients shrank below the last update's by drift_tolerance_log2"
    ZERO_GRADIENT = "a gradient turned all zeros, or one all zeros at the last update did not stay so"
    NON_FINITE_GRADIENT = "a gradient was non-finite between updates"
    EXPECTED_MAXIMUM_EXCEEDED = "a weight gradient rose above what the last update expected, beyond its margin"
    UNMEASURED_WEIGHT_BOUND = "a weight gradient's bound held the scale on a layer it was not measured on"
    COMPILED_WITHOUT_SCALES = "a compiled module ran without the last update's scales"
    RESUMED = "asked for before the checkpoint it was restored from, which did not say why"


class UpdateRecord(NamedTuple):
    """One update iteration and why it ran.

    Attributes:
        iteration: Its index among every backward the scaler ran (:attr:`GradientScaler.iteration
            <gs_lightning.scaling.GradientScaler.iteration>` as it started).
        backward: Its index among the backwards of its graph structure (what ``update_interval`` counts).
        reasons: Every reason that held (at least one).
    """

    iteration: int
    backward: int
    reasons: frozenset[UpdateReason]

    def state_dict(self) -> list[Any]:
        """Plain containers: ``[iteration, backward, [reason names]]``."""
        return [self.iteration, self.backward, sorted(reason.name for reason in self.reasons)]

    @classmethod
    def from_state_dict(cls, state: list[Any]) -> UpdateRecord:
        iteration, backward, names = state
        return cls(int(iteration), int(backward), reasons_named(names))


class UpdateSchedule:
    """The update schedule of one graph structure (module docstring).

    Attributes:
        backwards: Backwards of the structure run so far: ``update_interval`` counts these.
        last_skip: :attr:`backwards` at the last skipped step the structure took part in.
        pending: What asked for an update since the last one (empty: only the interval or a first backward updates).
        last: The structure's last update, ``None`` before it has one.
    """

    def __init__(self) -> None:
        self.backwards = 0
        self.last_skip = 0
        self.pending: set[UpdateReason] = set()
        self.last: UpdateRecord | None = None

    def due(self, interval: int) -> bool:
        """The interval rule: whether the next backward's index among the structure's is a multiple of ``interval``
        (every ``interval``-th, counted from its first, whatever updated between)."""
        return self.backwards % interval == 0

    def clean_interval(self, backwards: int, interval: int) -> bool:
        """Whether backward ``backwards`` closes an interval (:meth:`due` held for it) with no skipped step in it:
        what relaxes the back-off (:meth:`SkipBackoff.updated <gs_lightning.scaling.backoff.SkipBackoff.updated>`)."""
        return backwards % interval == 0 and backwards - self.last_skip >= interval

    def reasons(self, interval: int, decided: bool) -> frozenset[UpdateReason]:
        """Why the next backward updates (empty: it replays). ``decided``: whether the structure has a plan."""
        reasons = set(self.pending)
        if not decided:
            reasons.add(UpdateReason.FIRST)
        elif self.due(interval):
            reasons.add(UpdateReason.INTERVAL)
        return frozenset(reasons)

    def ask(self, *reasons: UpdateReason) -> None:
        """The next backward updates, for ``reasons``."""
        self.pending.update(reasons)

    def skipped(self, retried: bool = False) -> None:
        """A step the structure's gradients took part in was skipped (or is ``retried``): the next backward updates
        under the back-off."""
        self.last_skip = self.backwards
        self.ask(UpdateReason.RETRIED_STEP if retried else UpdateReason.SKIPPED_STEP)

    def updated(self, iteration: int, reasons: frozenset[UpdateReason]) -> UpdateRecord:
        """The update that ``reasons`` asked for ran as backward ``iteration`` (the structure's :attr:`backwards`-th):
        what asked is answered. Returns its record."""
        self.last = UpdateRecord(iteration, self.backwards, reasons)
        self.pending.clear()
        return self.last

    def state_dict(self) -> dict[str, Any]:
        """Plain containers, keys as a :class:`~gs_lightning.scaling.graph_scales.GraphScales` state has them."""
        return {
            "backwards": self.backwards,
            "last_skip": self.last_skip,
            "update_reasons": sorted(reason.name for reason in self.pending),
            "last_update": None if self.last is None else self.last.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a state saved before reasons were kept has ``force_update`` (a bool) instead,
        read as :attr:`UpdateReason.RESUMED`."""
        self.backwards = int(state.get("backwards", 0))
        self.last_skip = int(state.get("last_skip", 0))
        if "update_reasons" in state:
            self.pending = set(reasons_named(state["update_reasons"]))
        else:
            self.pending = {UpdateReason.RESUMED} if state.get("force_update", False) else set()
        last = state.get("last_update")
        self.last = None if last is None else UpdateRecord.from_state_dict(last)


def drift_reasons(reading: DriftReading) -> frozenset[UpdateReason]:
    """Why a step's reading asks for an update (:attr:`DriftReading.drifted`; empty where it does not): a group's
    shrink (:attr:`~UpdateReason.DRIFT`; infinite where a gradient turned or stopped being all zeros, or was
    non-finite, recomputed or not), a weight gradient above what was expected of it."""
    reasons = set()
    if reading.shrank:
        if math.isfinite(reading.drift_log2):
            reasons.add(UpdateReason.DRIFT)
        elif reading.non_finite or reading.recomputed:
            reasons.add(UpdateReason.NON_FINITE_GRADIENT)
        else:
            reasons.add(UpdateReason.ZERO_GRADIENT)
    if reading.surprise_log2 > ROUNDING_LOG2:
        reasons.add(UpdateReason.EXPECTED_MAXIMUM_EXCEEDED)
    return frozenset(reasons)


def reasons_named(names: list[str]) -> frozenset[UpdateReason]:
    """The members ``names`` name (as :meth:`UpdateSchedule.state_dict` saved them)."""
    unknown = [name for name in names if name not in UpdateReason.__members__]
    if unknown:
        raise ValueError(f"unknown update reason(s) {unknown}; expected names of {list(UpdateReason.__members__)}")
    return frozenset(UpdateReason[name] for name in names)
