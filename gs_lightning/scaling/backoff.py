"""What a skipped step lowers, and when it relaxes again.

A non-finite gradient skips the optimizer step, and the next backward decides the scales again under
a cap. Where the step's read named the layers whose gradients overflowed, only those layers' scales
are capped, each one binade below what overflowed (:class:`~gs_lightning.scaling.drift.LayerBackoff`,
per graph structure); otherwise (the overflow is not attributable: a non-finite loss, a gradient
written by user code) every accumulated scale is capped one binade below the largest that ran. The
global cap relaxes by one binade per ``update_interval`` without a skipped step, and goes once it no
longer binds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gs_lightning.scaling.drift import overflow_caps, overflow_leaves
from gs_lightning.scaling.graph_scales import GraphScales
from gs_lightning.scaling.recipe import ScalingRecipe
from gs_lightning.scaling.update import UpdateRun


class SkipBackoff:
    """The caps skipped steps put on the scales (module docstring).

    Attributes:
        cap: log2 cap on every accumulated scale after a skip no layer could be named for, or ``None``.
    """

    def __init__(self, recipe: ScalingRecipe) -> None:
        self.recipe = recipe
        self.cap: int | None = None

    def total_cap(self) -> int | None:
        """The log2 cap on every accumulated scale: the back-off's, the recipe's ``max_total_scale`` and fp32's
        range."""
        recipe = self.recipe
        caps = [c for c in (self.cap, log2_floor(recipe.max_total_scale), recipe.max_log2_total_scale) if c is not None]
        return min(caps) if caps else None

    def skipped(self, ran: Sequence[GraphScales]) -> None:
        """A step was skipped: cap the layers that overflowed in the structures whose gradients it would have used
        (``ran``), or every scale; their next backwards decide the scales again."""
        recipe = self.recipe
        named = False
        for scales in ran:
            plan, analysis, reading = scales.plans.get(()), scales.analyses.get(()), scales.drift.last
            known = plan is not None and analysis is not None and reading.some_overflowed
            caps = overflow_caps(analysis, plan, reading.non_finite, recipe.backoff_bits) if known else {}
            scales.drift.keep_overflows_of(
                overflow_leaves(analysis, plan, reading.non_finite) if known else frozenset()
            )
            if caps:  # the overflowing layers are known: lower those only
                scales.layer_backoff.lower(caps, scales.schedule.backwards, recipe.min_backoff_log2)
                named = True
            scales.schedule.skipped()
        if not named:
            largest = max(
                (a for scales in ran for plan in scales.plans.values() for a in plan.alpha_out.values()), default=0
            )
            cap = largest - 1 if self.cap is None else min(self.cap, largest) - 1
            self.cap = max(cap, recipe.min_backoff_log2)

    def updated(self, run: UpdateRun, scales: GraphScales, backwards: int) -> None:
        """An update of ``scales``' structure, its ``backwards``-th backward (not counting it), was read: relax what a
        full interval without a skipped step allows (``update_interval=1`` included)."""
        interval = self.recipe.update_interval
        scales.layer_backoff.relax(run.alpha_out, backwards, interval)
        if self.cap is not None and scales.schedule.clean_interval(backwards, interval):
            largest = max(run.alpha_out.values(), default=0)
            self.cap = (
                None if largest < self.cap else self.cap + 1
            )  # one bit per clean interval; gone once it no longer binds


def log2_floor(value: float | None) -> int | None:
    """The largest power-of-two exponent at most ``value`` (a cap given as a scale), or ``None``."""
    return None if value is None else math.floor(math.log2(value))
