"""What bounds each node's scale on an update: the overflow bounds' rules, the caps, the gains downstream.

The decision core (:mod:`~gs_lightning.scaling.decide`) measures a node's statistics and turns them into
an underflow bound and overflow bounds; :meth:`ScaleBounds.choose` picks the scale from those and from
every cap (the user's, the back-off's, what the GEMMs downstream keep), and says what held it down.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from gs_lightning.scaling.gains import bounded_gains, gains_after, kept_downstream, node_gains
from gs_lightning.scaling.graph import AutogradGraph, GraphAnalysis, Slot, decision_nodes
from gs_lightning.scaling.limits import Bound, Limit, UnreadBound, bound_position, candidates, rule_position
from gs_lightning.scaling.plan import Exponent, LeafTargets
from gs_lightning.scaling.recipe import ScalingRecipe
from gs_lightning.scaling.recompute import recomputable
from gs_lightning.scaling.underflow import (
    as_float64,
    below_bounds,
    constant,
    finite,
    highest_below,
    sufficient_log2_scale,
)
from gs_lightning.scaling.walks import fed_leaves, parameter_leaves


@dataclass(frozen=True)
class Settings:
    """What an update run needs from the scaler, fixed for the run.

    Attributes:
        underflow_rate: γ', the target underflow rate.
        lambda_min: λmin of the underflow model.
        lambda_lost: Below this a gradient's value is lost, not only less precise: the format's
            smallest subnormal, raised by the drift the scales tolerate between updates. Spike room
            (:attr:`ScalingRecipe.spike_room_log2`) may lower a GEMM's scale as far as this bound allows.
        lambda_max: λmax, the format's largest finite value.
        relu_factor: Multiplies the accumulation length of Lemma 1.
        layer_cap: log2 cap on each local scale, or ``None``.
        total_cap: log2 cap on each accumulated scale (user cap and back-off), or ``None``.
        node_caps: Node index -> log2 cap on that node's accumulated scale (per-layer back-off).
        expected_maxima: Leaf index -> how large its gradient is expected to get on the coming
            batches (:meth:`GradientDrift.expect`): a weight gradient's overflow bound.
        recompute: Whether the replays can recompute weight gradients that overflow
            (:mod:`~gs_lightning.scaling.recompute`): eager replays, in a format that overflows.
        retry: Whether an overflowed step runs again (:attr:`ScalingRecipe.retry_overflowed_steps`, where the last
            step offered a retry): every GEMM is bounded as a recomputable one.
        level_maxima: Leaf index -> its gradient's level, without the spikes
            (:meth:`GradientDrift.expect`): with ``recompute`` or ``retry``, what bounds a recomputable GEMM,
            with :attr:`ScalingRecipe.recomputed_spike_share` of the spikes.
        previous_totals: GEMM node -> the accumulated scale of the plan the update replaces, which a GEMM whose
            incoming gradient is all zeros keeps (:attr:`ScalingRecipe.keep_scale_on_zero_gradient`; empty: none).
        own_input_scale: Whether a GEMM may send on at a scale of its own
            (:attr:`ScalingRecipe.own_input_gradient_scale`, on eager graphs).
        sent_maxima: GEMM -> the largest input gradient it sent on at a scale of its own in the recent replays
            (:meth:`SentMaxima.expected <gs_lightning.scaling.sent_maxima.SentMaxima.expected>`): what bounds that
            scale; none before a replay measured it.
        measured_weight_nodes: The GEMMs whose weight gradients are computed exactly, where their Cauchy–Schwarz bound
            binds (:meth:`NodeDecisions.gemm_scale <gs_lightning.scaling.decide.NodeDecisions.gemm_scale>`): those
            where it held the scale on an earlier update (:attr:`GraphScales.measured_weights
            <gs_lightning.scaling.graph_scales.GraphScales.measured_weights>`); ``None``: every GEMM. Only where no
            expected maximum bounds the GEMM's parameter gradients instead (:attr:`expected_maxima`), and every GEMM
            where :attr:`retrying`.
        retrying: Whether this update is a retried step's (:attr:`ScalingRecipe.retry_overflowed_steps`): its batch went
            beyond what was expected, so the expected maxima bound no weight gradient in place of its Cauchy–Schwarz
            bound, and every GEMM's is measured, as on the first update.
        recipe: The rules' settings (margins, headroom, probe budgets).
    """

    underflow_rate: float
    lambda_min: float
    lambda_lost: float
    lambda_max: float
    relu_factor: float
    layer_cap: int | None
    total_cap: int | None
    node_caps: Mapping[int, int] = field(default_factory=dict)
    expected_maxima: Mapping[int, float] = field(default_factory=dict)
    recompute: bool = False
    retry: bool = False
    level_maxima: Mapping[int, float] = field(default_factory=dict)
    previous_totals: Mapping[int, Exponent] = field(default_factory=dict)
    measured_weight_nodes: frozenset[int] | None = None
    retrying: bool = False
    own_input_scale: bool = False
    sent_maxima: Mapping[int, float] = field(default_factory=dict)
    recipe: ScalingRecipe = field(default_factory=ScalingRecipe)


def expected_total(expected: float, lambda_max: float, margin_log2: float) -> int:
    """The highest accumulated scale that keeps a parameter gradient expected to reach ``expected``
    ``margin_log2`` binades (:attr:`ScalingRecipe.expected_maxima_margin_log2`) below ``lambda_max``."""
    # host values, read by the step (expected > 0)
    return math.ceil(math.log2(lambda_max / (expected * 2.0**margin_log2))) - 1


class ScaleBounds:
    """The bounds and caps on each node's scale during one update run (module docstring).

    Args:
        graph: The walked backward graph.
        analysis: Its node classification.
        settings: Targets, ranges and caps.
        leaves: Which leaves are deferred (what the replays can recompute).

    Attributes:
        expected: GEMM node -> the largest value its parameter gradients are expected to reach.
        recomputable: GEMMs whose weight gradients the replays recompute in fp32 if they overflow.
        spike_shared: GEMMs bounded by their level and a share of their spikes: the recomputable ones, every one
            where an overflowed step runs again.
        fed_maxima: Such a GEMM -> the expected maxima of the parameter gradients it feeds.
        kept_downstream: Node -> the highest accumulated scale any gradient it sends on is used at.
    """

    def __init__(self, graph: AutogradGraph, analysis: GraphAnalysis, settings: Settings, leaves: LeafTargets) -> None:
        self.graph, self.analysis, self.settings, self.leaves = graph, analysis, settings, leaves
        self.recomputable: set[int] = set()
        self.spike_shared: set[int] = set()
        self.fed_maxima: dict[int, float] = {}
        self.expected = self._expected_maxima()
        recipe = settings.recipe
        self.kept_downstream = (
            kept_downstream(graph, analysis, {i: self.expected_total(i) for i in self.expected})
            if recipe.kept_downstream_cap
            else {}
        )
        # before the backward frees what the nodes saved
        self._gains = node_gains(graph, analysis) if recipe.gain_bounds else []
        self._gains_after: dict[int, torch.Tensor] | None = None

    @property
    def gains_after(self) -> dict[int, torch.Tensor]:
        """Node -> how much the gradient it receives can grow before the next decision (:func:`gains_after`),
        on the device, unread; found as the first decision asks."""
        if self._gains_after is None:
            self._gains_after = gains_after(self.graph, self.analysis, bounded_gains(self._gains))
        return self._gains_after

    def _expected_maxima(self) -> dict[int, float]:
        """GEMM node -> the largest value its parameter gradients are expected to reach (where known);
        where the replays can recompute them or the step runs again, their level and
        :attr:`ScalingRecipe.recomputed_spike_share` of the spikes."""
        graph, analysis, maxima = self.graph, self.analysis, {}
        parameters = analysis.derive(
            "parameter leaves",
            lambda: {i: parameter_leaves(graph.names, graph.edges, analysis, i) for i in analysis.gemms},
        )
        for i in analysis.gemms:
            leaves = parameters[i]
            expected = max((self.settings.expected_maxima.get(j, 0.0) for j in leaves), default=0.0)
            level = max((self.settings.level_maxima.get(j, 0.0) for j in leaves), default=0.0)
            if self.settings.recompute and recomputable(graph, analysis, i, self.leaves.deferred):
                self.recomputable.add(i)
            if (i in self.recomputable or self.settings.retry) and expected > 0.0 and level > 0.0:
                self.spike_shared.add(i)
                maxima[i] = level * (expected / level) ** self.settings.recipe.recomputed_spike_share
                fed = max((self.settings.expected_maxima.get(j, 0.0) for j in self._fed_leaves(i)), default=0.0)
                if fed > 0.0:
                    self.fed_maxima[i] = fed
            elif expected > 0.0:
                maxima[i] = expected
        return maxima

    def _fed_leaves(self, i: int) -> set[int]:
        """The parameters whose gradients GEMM ``i``'s outgoing gradient reaches before the next decision
        (a normalisation's weight and bias): computed at the scale ``i`` chose, and not recomputed."""
        fed = self.analysis.derive("fed leaves", dict)  # GEMM -> the leaves it feeds, found on first use
        if i not in fed:
            decides = self.analysis.derive("decision nodes", lambda: decision_nodes(self.analysis))
            fed[i] = fed_leaves(self.graph.edges, self.analysis, i, decides)
        return fed[i]

    def expected_total(self, i: int) -> int:
        """The highest accumulated scale GEMM node ``i`` can keep under its expected maxima (as
        :meth:`NodeDecisions.gemm_scale <gs_lightning.scaling.decide.NodeDecisions.gemm_scale>` bounds it)."""
        return expected_total(self.expected[i], self.settings.lambda_max, self.expected_margin())

    def expected_margin(self) -> float:
        """:attr:`ScalingRecipe.expected_maxima_margin_log2` (there are expected maxima only where the rule is on)."""
        margin = self.settings.recipe.expected_maxima_margin_log2
        return 0.0 if margin is None else margin

    def total_cap(self, i: int) -> int | None:
        """The lowest cap on node ``i``'s accumulated scale (``None``: uncapped)."""
        return min((c for _, c in self._total_caps(i)), default=None)

    def _total_caps(self, i: int) -> list[tuple[Limit, int]]:
        """(reason, cap) of each cap on node ``i``'s accumulated scale, in the order :meth:`choose` names the first
        that holds a scale (:data:`TOTAL_CAPS`): the user's or the back-off's, the layer's back-off, what the
        GEMMs downstream keep."""
        s = self.settings
        caps = {
            Limit.TOTAL_CAP: s.total_cap,
            Limit.BACKOFF: s.node_caps.get(i),
            Limit.KEPT_DOWNSTREAM: self.kept_downstream.get(i),
        }
        return [(limit, caps[limit]) for limit in TOTAL_CAPS if caps[limit] is not None]

    def capped(self, exponent: Exponent, i: int) -> Exponent:
        cap = self.total_cap(i)
        if cap is None:
            return exponent
        return exponent.clamp(max=cap) if isinstance(exponent, torch.Tensor) else min(exponent, cap)

    def ceiling(self, i: int, alpha: Exponent, device: torch.device) -> torch.Tensor | None:
        """The highest local scale node ``i`` may take, receiving ``alpha`` (``None`` where nothing caps it), on
        ``device``."""
        ceiling, _ = self._ceiling(i, alpha)
        return None if ceiling is None else as_float64(ceiling, device)

    def gain_into(self, edge: Slot | None) -> torch.Tensor | None:
        """How much a gradient sent along ``edge`` can grow in batch norms before anything bounds it again
        (:func:`gains_after`, at least 1), a 0-dim float64 tensor, unread; ``None`` where nothing makes it grow
        (then no kernel multiplies by 1)."""
        return None if edge is None or edge in self.analysis.branch_slots else self.gains_after.get(edge[0])

    def choose(
        self, i: int, alpha: Exponent, lower: torch.Tensor, bounds: list[Bound], limits: torch.Tensor
    ) -> tuple[torch.Tensor, UnreadBound]:
        """The scale from the underflow bound ``lower`` and the overflow bounds ``limits`` (log2, one per bound of
        ``bounds``), and what held it below ``lower``.

        On the device of ``lower`` (float64 tensors, as ``limits`` is), with no value read: the scale as a 0-dim
        float64 tensor, the reason as an :class:`UnreadBound`. Under expected parameter-gradient maxima,
        :attr:`ScalingRecipe.spike_room_log2` may lower the scale as far as the same bound against
        :attr:`Settings.lambda_lost` allows.
        """
        s, recipe, device = self.settings, self.settings.recipe, lower.device
        # Exact bounds keep at least the replay headroom; the others are loose already.
        values = limits - _per_bound(tuple(b.limit.exact for b in bounds), recipe.replay_headroom_log2, device)
        upper = values.amin() if bounds else as_float64(math.inf, device)
        ceiling, cap = self._ceiling(i, alpha)
        # each used twice
        lower_up, lower_finite, highest = (
            torch.ceil(lower),
            finite(lower),
            highest_below(upper, device),
        )
        sufficient = sufficient_log2_scale(lower_up, lower_finite)
        beta = below_bounds(sufficient, highest, ceiling)  # choose_log2_scale, its first half kept for the spike room
        reason = (
            bound_position(values.argmin())
            if bounds
            else torch.full((), rule_position(Limit.NONE), dtype=torch.int64, device=device)
        )
        if ceiling is not None:  # the cap holds beta where it meets it, unless the overflow bound is as low
            # which cap: found on the device
            cap = cap if isinstance(cap, torch.Tensor) else constant(cap, device, reason.dtype)
            reason = torch.where((beta == ceiling) & (beta < highest), cap, reason)
        reason = torch.where(
            (beta >= lower_up) | ~(lower < math.inf), constant(rule_position(Limit.NONE), device, reason.dtype), reason
        )
        if (
            recipe.spike_room_log2 > 0.0
            and any(bound.limit.expected for bound in bounds)
            and s.lambda_lost < s.lambda_min
        ):
            # both bounds are log2(λ / the same order statistic)
            lost_lower = lower - math.log2(s.lambda_min / s.lambda_lost)
            roomy = (
                values - _per_bound(tuple(b.limit.expected for b in bounds), recipe.spike_room_log2, device)
            ).amin()
            with_room = torch.maximum(
                below_bounds(sufficient, highest_below(roomy, device), ceiling),
                torch.minimum(beta, torch.ceil(lost_lower)),
            )
            roomier = lower_finite & (with_room < beta)
            beta, reason = (
                torch.where(roomier, with_room, beta),
                torch.where(roomier, constant(rule_position(Limit.SPIKE_ROOM), device, reason.dtype), reason),
            )
        return beta, UnreadBound(candidates(bounds), reason)

    def _ceiling(self, i: int, alpha: Exponent) -> tuple[Exponent | None, int | torch.Tensor]:
        """The highest local scale the caps leave node ``i`` receiving ``alpha`` (``None``: uncapped), and which cap
        that is (its position in :meth:`choose`'s candidates, :func:`~gs_lightning.scaling.limits.rule_position`:
        the layer cap where it is as low, else the first of :data:`TOTAL_CAPS` at the lowest value)."""
        s, totals, layer = self.settings, self._total_caps(i), rule_position(Limit.LAYER_CAP)
        if not totals:
            return s.layer_cap, layer
        lowest = min(c for _, c in totals)
        total, position = lowest - alpha, rule_position(next(limit for limit, c in totals if c == lowest))
        if s.layer_cap is None:
            return total, position
        if not isinstance(total, torch.Tensor):
            return (s.layer_cap, layer) if s.layer_cap <= total else (total, position)
        which = torch.where(
            total >= s.layer_cap,
            constant(layer, total.device, torch.int64),
            constant(position, total.device, torch.int64),
        )
        return total.clamp(max=s.layer_cap), which

    def expected_maxima(self, i: int, alpha: Exponent, device: torch.device) -> dict[Bound, torch.Tensor]:
        """The largest values of the parameter gradients GEMM ``i`` computes and feeds, as expected on the batches to
        come, times ``2^alpha`` and :attr:`ScalingRecipe.expected_maxima_margin_log2` (the bound on the local scale
        leaves room for the scale ``alpha`` it receives): what :meth:`choose`'s overflow bounds keep below λmax."""
        expected, maxima = self.expected.get(i, 0.0), {}
        if expected > 0.0:
            kind = Limit.RECOMPUTED_SPIKES if i in self.spike_shared else Limit.EXPECTED_PARAMETER_GRADIENTS
            maxima[Bound(kind)] = expected
        if i in self.fed_maxima:
            maxima[Bound(Limit.FED_PARAMETER_GRADIENTS)] = self.fed_maxima[i]
        if not maxima:
            return {}
        scaled = torch.exp2(as_float64(self.expected_margin() + alpha, device))  # exact: an integer exponent
        return {bound: value * scaled for bound, value in maxima.items()}


# The caps on a node's accumulated scale, in the order choose() names the first that holds a scale where several
# are as low (the layer cap, on the local scale, is named before them all).
TOTAL_CAPS = (Limit.TOTAL_CAP, Limit.BACKOFF, Limit.KEPT_DOWNSTREAM)


@functools.lru_cache(maxsize=256)
def _per_bound(applies: tuple[bool, ...], value: float, device: torch.device) -> torch.Tensor:
    """A float64 vector on ``device``: ``value`` where ``applies``, else 0; made once per pattern (filled in
    there, not copied from the host)."""
    vector = torch.zeros(len(applies), dtype=torch.float64, device=device)
    for k, applied in enumerate(applies):
        if applied:
            vector[k] = value
    return vector
