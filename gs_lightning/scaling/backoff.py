"""What a skipped step lowers, and when it relaxes again.

A non-finite gradient skips the optimizer step, and the next backward decides the scales again under
a cap. Where the step's read named the layers whose gradients overflowed, only those layers' scales
are capped, ``backoff_bits`` below what overflowed (:class:`LayerBackoff`, per graph structure;
which layers, :func:`overflow_origins`); otherwise (the overflow is not attributable: a non-finite
loss, a gradient written by user code) every accumulated scale is capped ``unattributed_backoff_bits``
below the largest that ran. The
global cap relaxes by one binade per ``update_interval`` without a skipped step, and goes once it no
longer binds.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gs_lightning.scaling.graph import GraphAnalysis, Slot
from gs_lightning.scaling.plan import ScalePlan
from gs_lightning.scaling.recipe import ScalingRecipe
from gs_lightning.scaling.walks import parameter_leaves

if TYPE_CHECKING:
    from gs_lightning.scaling.graph_scales import GraphScales
    from gs_lightning.scaling.update import UpdateRun

Edges = tuple[tuple[Slot | None, ...], ...]  # a plan's edges, node by node


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

    def skipped(self, ran: Sequence[GraphScales], retried: bool = False) -> None:
        """A step was skipped (or is ``retried``): cap the layers that overflowed in the structures whose
        gradients it would have used (``ran``), or every scale; their next backwards decide the scales again."""
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
            scales.schedule.skipped(retried)
        if not named:
            largest = max(
                (a for scales in ran for plan in scales.plans.values() for a in plan.alpha_out.values()), default=0
            )
            bits = recipe.unattributed_backoff_bits
            cap = largest - bits if self.cap is None else min(self.cap, largest) - bits
            self.cap = max(cap, recipe.min_backoff_log2)

    def updated(self, run: UpdateRun, scales: GraphScales, backwards: int) -> None:
        """An update of ``scales``' structure, its ``backwards``-th backward (not counting it), was read: relax what a
        full interval without a skipped step allows (``update_interval=1`` included)."""
        interval = self.recipe.update_interval
        scales.layer_backoff.relax(run.alpha_out, backwards, interval)
        if self.cap is not None and scales.schedule.clean_interval(backwards, interval):
            largest = max(run.alpha_out.values(), default=0)
            # one bit per clean interval; gone once it no longer binds
            self.cap = None if largest < self.cap else self.cap + 1


def log2_floor(value: float | None) -> int | None:
    """The largest power-of-two exponent at most ``value`` (a cap given as a scale), or ``None``."""
    return None if value is None else math.floor(math.log2(value))


@dataclass
class LayerBackoff:
    """Caps on the accumulated scale of single nodes of the loss's graph, set by overflows.

    Attributes:
        caps: Node index -> (log2 cap on the scale its outgoing gradients carry, iteration it was
            last set or relaxed).
    """

    caps: dict[int, tuple[int, int]] = field(default_factory=dict)

    def node_caps(self) -> dict[int, int]:
        """Node index -> log2 cap, for an update run."""
        return {i: cap for i, (cap, _) in self.caps.items()}

    def lower(self, caps: Mapping[int, int], iteration: int, floor: int) -> None:
        """Apply the caps of an overflow (keeping any lower one already there)."""
        for i, cap in caps.items():
            old = self.caps.get(i)
            self.caps[i] = (max(min(cap, old[0]) if old is not None else cap, floor), iteration)

    def relax(self, alpha_out: Mapping[int, int], iteration: int, interval: int) -> None:
        """After an update: once ``interval`` iterations passed since a cap was set or relaxed, relax it by one bit,
        or drop it if it no longer binds.

        Counted in iterations, not updates, so that updates the drift triggers relax nothing faster.
        """
        for i, (cap, since) in list(self.caps.items()):
            if iteration - since < interval:
                continue
            if alpha_out.get(i, cap - 1) < cap:
                del self.caps[i]
            else:
                self.caps[i] = (cap + 1, iteration)

    def state_dict(self) -> list[list[int]]:
        """The caps, as plain containers."""
        return [[i, cap, since] for i, (cap, since) in sorted(self.caps.items())]

    def load_state_dict(self, state: list[list[int]]) -> None:
        """Restore :meth:`state_dict`'s caps."""
        self.caps = {int(i): (int(cap), int(since)) for i, cap, since in state}


def overflow_caps(analysis: GraphAnalysis, plan: ScalePlan, non_finite: Iterable[int], bits: int) -> dict[int, int]:
    """Node -> log2 cap that lowers the layers an overflow between updates came from, and no other.

    A non-finite weight gradient at a GEMM came from that GEMM (its weight gradient overflowed) or
    from above it (the gradient it received was already non-finite). Of the GEMMs (or other nodes)
    whose weight gradients were non-finite, those with no such node above them are where it
    started; every node on the way from the loss to one of them that sent gradients at the scale
    it received them at, or higher, gets a cap ``bits`` below its own scale
    (:attr:`~gs_lightning.scaling.recipe.ScalingRecipe.backoff_bits`). Nodes in other
    branches keep theirs.
    """
    parents = _parents(plan.edges)
    caps: dict[int, int] = {}
    for i in overflow_origins(analysis, plan, non_finite):
        received = max((a for (j, _), a in plan.slot_alpha.items() if j == i), default=plan.alpha_out.get(i, 0))
        for n in _ancestors(parents, i) | {i}:
            alpha = plan.alpha_out.get(n)
            if alpha is not None and alpha >= received:
                caps[n] = min(caps.get(n, alpha - bits), alpha - bits)
    return caps


def overflow_origins(analysis: GraphAnalysis, plan: ScalePlan, non_finite: Iterable[int]) -> set[int]:
    """The nodes where an overflow between updates started.

    Of the nodes whose parameter gradients were non-finite, those with no such node above them: the
    others' were non-finite because a gradient they received already was.
    """
    bad = {computing_node(plan, analysis, j) for j in non_finite if j in analysis.leaf_sources}
    parents = _parents(plan.edges)
    return {i for i in bad if not _ancestors(parents, i) & (bad - {i})}


def overflow_leaves(analysis: GraphAnalysis, plan: ScalePlan, non_finite: Iterable[int]) -> set[int]:
    """Of the non-finite leaves, those whose gradient overflowed itself: computed at a node of
    :func:`overflow_origins`."""
    non_finite = [j for j in non_finite if j in analysis.leaf_sources]
    origins = overflow_origins(analysis, plan, non_finite)
    return {j for j in non_finite if computing_node(plan, analysis, j) in origins}


def computing_node(plan: ScalePlan, analysis: GraphAnalysis, leaf: int) -> int:
    """The node that computed a leaf's gradient: the GEMM behind a weight's cast or transpose, or its source (the
    layer an overflow of that gradient is attributed to)."""
    for i in analysis.weight_edges:
        if leaf in parameter_leaves(plan.names, plan.edges, analysis, i):
            return i
    return analysis.leaf_sources[leaf]


def _parents(edges: Edges) -> dict[int, list[int]]:
    parents: dict[int, list[int]] = defaultdict(list)
    for i, node_edges in enumerate(edges):
        for edge in node_edges:
            if edge is not None:
                parents[edge[0]].append(i)
    return parents


def _ancestors(parents: Mapping[int, list[int]], start: int) -> set[int]:
    seen: set[int] = set()
    frontier = [start]
    while frontier:
        for p in parents.get(frontier.pop(), ()):
            if p not in seen:
                seen.add(p)
                frontier.append(p)
    return seen
