"""Between scale updates: how far the weight gradients drifted, how large they were, and which layers overflowed.

All three come from the largest magnitude of each deferred weight gradient, taken by the pass
``step()`` (or ``unscale_``) makes over the gradients it uses (:func:`largest_magnitudes`: the
same values tell whether each is finite) and read in its one synchronisation: before any edit where
the loop unscales before it clips, as GradScaler loops, Lightning, Accelerate and timm do.

* **Drift.** The scales an update chose are the smallest that meet γ' for the gradients of that
  iteration. When the gradients of a scale group (the weight gradients that carry one
  accumulated scale) shrink by a binade, the underflow rate of what that group's layers send on
  roughly doubles: :class:`GradientDrift` asks for an update on the next backward, so
  ``update_interval`` is the longest interval, not a fixed period. Shrink, not one small batch: the
  group's largest value is judged by the larger of this batch's and the group's level (the median
  of its last :attr:`~gs_lightning.scaling.recipe.ScalingRecipe.level_steps` steps), as the
  update's reference is by the smaller; a fall that lasts asks for an update within about half
  that many steps (ResNet-8: 43-53 updates in 200 steps became 21-30). A weight gradient that is all
  zeros at an update gives its layers nothing to decide on; such gradients are common at
  initialisation (a residual branch behind a zero-initialised BatchNorm weight, LoRA's zero B) and
  turn nonzero with the first step: an update that meets a newly all-zero weight gradient asks for
  another on the next backward, and between updates one that turns nonzero counts as drift
  (:attr:`~gs_lightning.scaling.recipe.ScalingRecipe.update_after_zero_gradient`).
* **Surprise.** A weight gradient whose largest value rises above what the last update expected
  of it (the expected maxima below) may have used up part of the margin kept for it, and the next
  such batch may overflow: where its layer's scale no longer keeps that margin above the new value
  (:func:`within_margin`) it asks for an update on the next backward, which expects that batch too;
  elsewhere the value is expected from then on, and no update runs for it. Without the first the
  record waited for the next update, and on ResNet-8 (seed 0) a batch 2^1 larger came first and
  was skipped; without the second SegNet updated on 45-54 of 200 steps, 4-9 with it.
* **Expected maxima.** An update decides from one batch, but a weight gradient's largest value
  varies far more from batch to batch than the small values the underflow target is about (on a
  converged task whose gradient comes from a few hard examples, by 2^5-2^10 within 100 steps).
  Each weight gradient's level and the spikes above it in the last ``window`` steps
  (:meth:`GradientDrift.expect`) bound it at the next update, as Transformer Engine's
  amax history bounds a tensor's scale, but following a level that falls.
* **Overflow.** A non-finite maximum names the parameters whose gradient overflowed; with the
  plan's scales :func:`~gs_lightning.scaling.backoff.overflow_caps` lowers only the layers that produced it
  (:class:`~gs_lightning.scaling.backoff.LayerBackoff`), and only their gradients are remembered as spikes.
"""

from __future__ import annotations

import math
import statistics
from array import array
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Any

import torch

from gs_lightning.scaling.backoff import computing_node
from gs_lightning.scaling.finite import unscale_
from gs_lightning.scaling.graph import GraphAnalysis, Slot
from gs_lightning.scaling.plan import Exponent, ScalePlan

Edges = tuple[tuple[Slot | None, ...], ...]  # a graph's (or a plan's) edges, node by node

# The expected maxima go through log2 and exp2 in float64: a gradient whose largest value equals them
# (the same batch again with the weights unchanged; an fp8 gradient, whose largest value is one of few
# numbers) reads up to a few 1e-16 binades above. Not a surprise: ResNet-8 e5m2, seed 0, updated on
# step 27 for one.
ROUNDING_LOG2 = 1e-9


@dataclass
class DriftReading:
    """What the norms read at a step say.

    Attributes:
        drift_log2: The most binades a scale group's largest gradient fell below its value at the
            update (negative when every group grew; 0 on an update iteration, NaN when nothing
            was comparable, inf when a group's gradients became all zeros or non-finite, when a
            gradient all zeros at the update is not any more, or, on an update iteration, when a
            gradient is all zeros that was not at the update before).
        non_finite: Leaf indices (in the loss's graph) whose gradient holds inf or NaN.
        measured: Leaf indices whose gradient norms were read.
        surprise_log2: Between updates, the most binades a weight gradient's largest value rose
            above what the last update expected of it (:attr:`GradientDrift.expected`), negative
            when every one stayed below; -inf on update iterations and where nothing was expected.
        surprised: Leaf index -> the largest value of each gradient that rose above what was
            expected of it (beyond :data:`ROUNDING_LOG2`).
        tolerance_log2: The shrink that asks for an update
            (:attr:`~gs_lightning.scaling.recipe.ScalingRecipe.drift_tolerance_log2`); ``None``: none does
            (a reading of no step, which has no drift to judge).
        update: Whether an update iteration's gradients were among those read.
        recomputed: Leaf indices whose gradient overflowed and was recomputed in fp32 at the step
            (:mod:`~gs_lightning.scaling.recompute`): no longer in ``non_finite``, still why the reading asks for an
            update (:attr:`~gs_lightning.scaling.schedule.UpdateReason.NON_FINITE_GRADIENT`).
    """

    drift_log2: float = math.nan
    non_finite: frozenset[int] = frozenset()
    measured: frozenset[int] = frozenset()
    surprise_log2: float = -math.inf
    surprised: Mapping[int, float] = field(default_factory=dict)
    tolerance_log2: float | None = None
    update: bool = False
    recomputed: frozenset[int] = frozenset()

    @property
    def some_overflowed(self) -> bool:
        """Whether some measured gradients, not all, were non-finite: layers can be told apart."""
        return bool(self.non_finite) and self.non_finite != self.measured

    @property
    def shrank(self) -> bool:
        """Whether a scale group shrank by :attr:`tolerance_log2` or more (or turned all zeros, or non-finite)."""
        return self.tolerance_log2 is not None and self.drift_log2 >= self.tolerance_log2

    @property
    def drifted(self) -> bool:
        """Whether the reading asks for an update: a scale group :attr:`shrank`, or a weight gradient grew beyond
        what was expected of it (which the scaler takes in without one where its layer keeps the margin)."""
        return self.shrank or self.surprise_log2 > ROUNDING_LOG2


@dataclass
class GradientDrift:
    """The largest magnitude of each weight gradient, on update iterations and between them.

    The first five attributes are the recipe's (:class:`~gs_lightning.scaling.recipe.ScalingRecipe`), given by
    whoever makes one (:meth:`ScaledBackwards.new_drift <gs_lightning.scaling.backward.ScaledBackwards.new_drift>`),
    never defaulted.

    Attributes:
        window: How many steps :meth:`expect` looks back on (``update_interval``).
        reference: log2 scale -> (leaf indices, largest magnitude of their gradients) measured on
            the last update iteration.
        zero_at_update: Leaf indices whose gradient was all zeros on the last update iteration.
        expected: Leaf index -> the largest value the last update expected of its gradient
            (:meth:`expect`).
        recent: For each of the last ``window`` steps, leaf index -> largest magnitude of its
            (unscaled) gradient; where it overflowed, λmax over the scale it carried, the least it was.
        lambda_max: λmax of the gradients' format.
        tolerance_log2: The shrink that asks for an update (``None``: none does).
        level_steps: How many steps a level is the median of (1: the step's own value).
        zero_updates: Whether an update meeting a newly all-zero weight gradient asks for another, and one
            waking between updates counts as drift
            (:attr:`~gs_lightning.scaling.recipe.ScalingRecipe.update_after_zero_gradient`).
        summed: Leaf indices whose gradient is a sum of the gradient its GEMM receives (a bias's): a scale group
            all zeros with one of them received zeros, which is nothing to decide on, not drift
            (:attr:`~gs_lightning.scaling.recipe.ScalingRecipe.keep_scale_on_zero_gradient`; set with each update).
        last: The reading of the last step.
    """

    window: int
    lambda_max: float
    tolerance_log2: float | None
    level_steps: int
    zero_updates: bool
    reference: dict[int, tuple[tuple[int, ...], float]] = field(default_factory=dict)
    zero_at_update: frozenset[int] = frozenset()
    expected: dict[int, float] = field(default_factory=dict)
    recent: list[dict[int, float]] = field(default_factory=list)
    summed: frozenset[int] = frozenset()
    last: DriftReading = field(default_factory=DriftReading)
    _pending: list[tuple[int, tuple[int, ...], list[torch.Tensor]]] = field(default_factory=list, repr=False)
    _update: bool = field(default=False, repr=False)
    _kept_step: bool = field(default=False, repr=False)  # the last read added to recent

    def measure(self, alpha: Exponent, leaves: tuple[int, ...], grads: list[torch.Tensor], update: bool) -> None:
        """Queue one scale group's (already unscaled) gradients, whose largest magnitudes the step reads (an update's
        scale ``alpha`` still on the device, read with them: :meth:`read_in`).

        A leaf queued again before a read (gradient accumulation: the later backwards add into the same
        ``.grad``) is read once, in its latest group.
        """
        again = set(leaves)
        if any(again.intersection(queued) for _, queued, _ in self._pending):
            kept = [(a, [(j, g) for j, g in zip(ls, gs) if j not in again]) for a, ls, gs in self._pending]
            self._pending = [(a, tuple(j for j, _ in pairs), [g for _, g in pairs]) for a, pairs in kept if pairs]
        self._pending.append((alpha, leaves, grads))
        self._update = self._update or update

    def read_in(self, values: Mapping[torch.Tensor, float]) -> None:
        """The scales of queued groups an update left on the device, as read (``values``): before :meth:`read`."""
        self._pending = [
            (int(values[a]) if isinstance(a, torch.Tensor) else a, leaves, grads) for a, leaves, grads in self._pending
        ]

    def queued(self) -> list[tuple[Exponent, tuple[int, ...], list[torch.Tensor]]]:
        """The queued groups, unread: (the scale they were computed at, their leaves, their unscaled gradients)."""
        return list(self._pending)

    def pending(self) -> list[torch.Tensor]:
        """The queued gradients, in the order :meth:`read` takes their largest magnitudes."""
        return [grad for _, _, grads in self._pending for grad in grads]

    @property
    def reads_update(self) -> bool:
        """Whether the next :meth:`read` takes an update iteration's maxima."""
        return self._update

    def read(self, values: list[float], settled: Collection[int] = ()) -> DriftReading:
        """Consume the queued maxima, given their values in :meth:`pending`'s order. ``settled``: on an update, leaves
        all zeros there whose layers kept the last plan's scale (nothing to decide on, and nothing decided on none)."""
        groups: dict[int, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
        position, at_least, non_finite, surprise, surprised = 0, {}, set(), -math.inf, {}
        for alpha, leaves, norms in self._pending:
            group_leaves, group_maxima = groups[alpha]
            for leaf, value in zip(leaves, values[position : position + len(norms)]):
                group_leaves.append(leaf)
                group_maxima.append(value)
                if math.isfinite(value):
                    at_least[leaf] = value
                else:  # it overflowed at 2^alpha: it was at least λmax / 2^alpha
                    non_finite.add(leaf)
                    at_least[leaf] = self.lambda_max * 2.0**-alpha
            position += len(norms)
        measured = {alpha: (tuple(sorted(leaves)), _largest(values)) for alpha, (leaves, values) in groups.items()}
        if self._update and not non_finite:
            zero = frozenset(leaf for leaf, value in at_least.items() if value == 0.0) - frozenset(settled)
            # decided on no values: once more, next backward
            drift = math.inf if self.zero_updates and zero - self.zero_at_update else 0.0
            self.reference = {
                alpha: (leaves, self._group_level(leaves, largest)) for alpha, (leaves, largest) in measured.items()
            }
            self.zero_at_update = zero
        else:
            comparable = [
                (leaves, largest, self.reference[alpha][1])
                for alpha, (leaves, largest) in measured.items()
                if alpha in self.reference
                and self.reference[alpha][0] == leaves
                and not (largest == 0.0 and self.summed.intersection(leaves))  # received zeros: nothing shrank
            ]
            # only these are looked at between updates
            woke = self.zero_updates and any(at_least.get(leaf, 0.0) != 0.0 for leaf in self.zero_at_update)
            drift = math.inf if woke else self._largest_shrink(comparable)
            ratios = {j: v / self.expected[j] for j, v in at_least.items() if j in self.expected}
            ratio = max(ratios.values(), default=0.0)  # one log2, not one per gradient
            surprise = math.log2(ratio) if ratio > 0.0 else -math.inf
            if surprise > ROUNDING_LOG2:
                surprised = {j: at_least[j] for j, r in ratios.items() if r > 0.0 and math.log2(r) > ROUNDING_LOG2}
        if at_least:
            self.recent = [*self.recent, {leaf: v for leaf, v in at_least.items() if math.isfinite(v)}][-self.window :]
        self._kept_step = bool(at_least)
        update, self._update = self._update, False
        self._pending.clear()
        measured_leaves = frozenset(j for leaves, _ in measured.values() for j in leaves)
        self.last = DriftReading(
            drift, frozenset(non_finite), measured_leaves, surprise, surprised, self.tolerance_log2, update
        )
        return self.last

    def _group_level(self, leaves: tuple[int, ...], largest: float) -> float:
        """What a scale group's largest gradient at an update is compared with later: its value then, or its
        level (the median of the last :attr:`level_steps` steps' values) where that is lower.

        A group's largest value varies from batch to batch by more than a binade; against an update made
        on a batch above its level, ordinary batches read as drift (ResNet-8, fp16: 44 of 63 updates in
        200 steps).
        """
        level = self._level(leaves, largest)
        return min(largest, level) if level > 0.0 else largest

    def _largest_shrink(self, groups: list[tuple[tuple[int, ...], float, float]]) -> float:
        """The most binades a scale group's largest gradient fell below its reference (``groups``: leaves, this
        step's largest, reference), each judged as :meth:`_current` has it; NaN without groups.

        A level can only lessen a group's shrink, so levels are taken in the order of the batch's own
        shrink and only while one could still exceed the largest so far: one or two groups a step, not
        every group (this runs on every step).
        """
        if not groups:
            return math.nan
        largest_shrink = -math.inf
        for batch_shrink, leaves, largest, reference in sorted(
            ((_shrink_log2(largest, reference), leaves, largest, reference) for leaves, largest, reference in groups),
            key=lambda g: g[0],
            reverse=True,
        ):
            if batch_shrink <= largest_shrink:
                break
            largest_shrink = max(largest_shrink, _shrink_log2(self._current(leaves, largest), reference))
        return largest_shrink

    def _current(self, leaves: tuple[int, ...], largest: float) -> float:
        """What a scale group's largest gradient of this step is compared with its reference as: the larger of
        it and the group's level, so that one batch below the level is not drift (ResNet-8, fp16: 43-50
        updates in 200 steps, 21-27 so). All zeros or non-finite, as it is."""
        if not math.isfinite(largest) or largest <= 0.0:
            return largest
        return max(largest, self._level(leaves, largest))

    def _level(self, leaves: tuple[int, ...], largest: float) -> float:
        """The median of a scale group's largest values over the last :attr:`level_steps` steps, this one's
        (``largest``) included."""
        # step.get(leaf, 0.0) by map, twice as fast as a generator: this runs for every group on every step
        earlier = self.recent[-(self.level_steps - 1) :] if self.level_steps > 1 else []  # [-0:] would be all
        steps = [max(map(step.get, leaves, repeat(0.0)), default=0.0) for step in earlier]
        return statistics.median_low([*steps, largest])

    def keep_overflows_of(self, leaves: set[int] | frozenset[int]) -> None:
        """Forget the last step's overflows but those of ``leaves``, where the overflow started.

        A gradient computed from one that had overflowed is non-finite whatever its own size: read
        as at least λmax over its scale, it would be a spike it never had, holding its layer's scale
        down for a whole window (SSD300's backbone, after an overflow in a head).
        """
        if self.recent:
            self.recent[-1] = {
                leaf: v for leaf, v in self.recent[-1].items() if leaf in leaves or leaf not in self.last.non_finite
            }

    def forget_step(self) -> None:
        """The step just read runs again (a retried step): its maxima, lower bounds where its gradients overflowed,
        are not kept; the retry's read takes their place."""
        if self._kept_step and self.recent:
            self.recent.pop()
        self._kept_step = False

    def recomputed(self, maxima: Mapping[int, float]) -> None:
        """The last step's overflowed gradients of ``maxima``'s leaves were recomputed: their true largest
        values replace the lower bounds recorded for them, and they are no longer non-finite."""
        if self.recent:
            self.recent[-1] = {**self.recent[-1], **{leaf: v for leaf, v in maxima.items() if math.isfinite(v)}}
        self.last = replace(
            self.last, non_finite=self.last.non_finite - frozenset(maxima), recomputed=frozenset(maxima)
        )

    def raise_expected(self, maxima: Mapping[int, float]) -> None:
        """Expect these largest values (leaf -> value) from now on: gradients that rose above what the last
        update expected of them, taken in without an update (their layers' scales keep the margin)."""
        self.expected.update({leaf: max(value, self.expected.get(leaf, 0.0)) for leaf, value in maxima.items()})

    def discard(self) -> None:
        """Forget queued maxima that no step read (the iteration ended without a step)."""
        self._pending.clear()
        self._update = False

    def expect(self, bounded: Collection[int] | None = None) -> tuple[dict[int, float], dict[int, float]]:
        """Leaf index -> how large its gradient's largest value is expected to get on the coming batches, and
        leaf index -> its level now, without the spikes; the first is kept (:attr:`expected`), so that a
        batch above it asks for the next update. Only of the leaves ``bounded`` names, where given: those whose
        gradients the format can overflow (:func:`~gs_lightning.scaling.walks.format_bounded_leaves`).

        The level is the median of its last :attr:`level_steps` log2 maxima; the expected maximum adds
        the largest spike in the window (how far one step's value rose above the median of the
        :attr:`level_steps` before it). A level, not the window's maximum, so that gradients shrinking
        as training starts (SSD300's weight gradients by 2^10 in 64 steps) do not hold the scales down;
        the spikes, so that a converged task's occasional hard batch (ResNet-8's, up to 2^10 above the
        median) is expected. The levels alone bound the GEMMs whose weight gradients are recomputed when
        a spike overflows them (:mod:`~gs_lightning.scaling.recompute`). Computed on update iterations
        only, on the host, in one pass over the window (ResNet-50's 161 weight gradients over 100 steps:
        9-12 ms on the 2-core development machine, one thread, against 25-34 ms for the two computed
        apart, the same values).
        """
        seen = set().union(*self.recent)
        leaves = sorted(seen if bounded is None else seen.intersection(bounded))
        if not leaves:
            self.expected = {}
            return {}, {}
        # NaN where a gradient was all zeros or not computed; a tensor from a list is 2x slower than from an array
        log2 = array(
            "d",
            [math.log2(v) if (v := step.get(leaf, 0.0)) > 0.0 else math.nan for step in self.recent for leaf in leaves],
        )
        x = torch.frombuffer(log2, dtype=torch.float64).view(len(self.recent), len(leaves)).T
        # levels[:, t]: the median of the (up to) level_steps steps before step t; the last, of the last ones
        padded = torch.cat([torch.full((len(leaves), self.level_steps), math.nan, dtype=torch.float64), x], dim=1)
        # 2x faster than on the strided view
        levels = padded.unfold(1, self.level_steps, 1).contiguous().nanmedian(dim=-1).values
        spikes = (x - levels[:, :-1]).nan_to_num(nan=-math.inf).amax(dim=1).clamp(min=0.0)
        expected, level = (torch.exp2(log2_maxima).tolist() for log2_maxima in (levels[:, -1] + spikes, levels[:, -1]))
        self.expected = {leaf: v for leaf, v in zip(leaves, expected) if math.isfinite(v)}
        return self.expected, {leaf: v for leaf, v in zip(leaves, level) if math.isfinite(v)}

    def state_dict(self) -> dict[str, Any]:
        """The reference maxima, the gradients zero at the update, the expected and the recent maxima, as plain
        containers."""
        return {
            "reference": [[alpha, list(leaves), norm] for alpha, (leaves, norm) in sorted(self.reference.items())],
            "zero_at_update": sorted(self.zero_at_update),
            "expected": sorted([leaf, value] for leaf, value in self.expected.items()),
            "recent": [sorted([leaf, value] for leaf, value in step.items()) for step in self.recent],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` holds."""
        self.reference = {
            int(alpha): (tuple(int(j) for j in leaves), float(norm))
            for alpha, leaves, norm in state.get("reference", [])
        }
        self.zero_at_update = frozenset(int(j) for j in state.get("zero_at_update", []))
        self.expected = {int(leaf): float(value) for leaf, value in state.get("expected", [])}
        self.recent = [{int(leaf): float(value) for leaf, value in step} for step in state.get("recent", [])]


def fused_inf_norm(device: torch.device) -> bool:
    """Whether :func:`largest_magnitudes` takes the maxima on ``device`` in one fused ``_foreach_norm(ord=inf)``
    (everywhere but on a CPU; ``bench/gpu_estimate.py`` counts a GPU's path on a CPU through it)."""
    return device.type != "cpu"


def largest_magnitudes(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each dense gradient's largest magnitude, in one vector on the first one's device, nothing read: inf or
    NaN exactly where the gradient holds one (the reductions propagate NaN), so the same values check it.

    One fused ``_foreach_norm(ord=inf)`` per device on a GPU. On a CPU that norm is an unvectorised
    loop (68 ms over ResNet-50's 161 gradients against 4.6 ms for the L2 norm, one thread): there,
    each gradient's ``aminmax`` (4.9 ms) and one reduction of them all.
    """
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for k, grad in enumerate(grads):
        by_device[grad.device].append(k)
    parts, order = [], []
    for device, positions in by_device.items():
        group = [grads[k] for k in positions]
        if fused_inf_norm(device):
            part = torch.stack(torch._foreach_norm(group, math.inf)).float()
        else:
            extremes = [v for g in group for v in (torch.aminmax(g) if g.numel() else (g.new_zeros(()),) * 2)]
            part = (
                torch.stack([v.float() for v in extremes] if len({v.dtype for v in extremes}) > 1 else extremes)
                .view(-1, 2)
                .abs()
                .amax(dim=1)
                .float()
            )
        parts.append(part.to(grads[0].device))
        order += positions
    if len(parts) == 1:
        return parts[0]
    merged = torch.cat(parts)
    return merged[torch.tensor(order, device=merged.device).argsort()]


def _largest(values: list[float]) -> float:
    """The largest of a group's maxima; inf if one is NaN (``max`` would pass it over)."""
    return math.inf if any(math.isnan(v) for v in values) else max(values)


def _shrink_log2(norm: float, reference: float) -> float:
    """How many binades a group's largest gradient fell below its reference (negative: it grew)."""
    if not math.isfinite(norm) or norm <= 0.0:
        return math.inf if norm != reference else 0.0  # non-finite, or all zeros now
    if reference <= 0.0:
        return -math.inf  # all zeros at the update
    return math.log2(reference / norm)


def unscale_and_measure(
    leaves: Iterable[tuple[int, torch.Tensor, int]],
    drift: GradientDrift | None,
    update: bool,
    unscaled: Iterable[tuple[int, torch.Tensor, int]] = (),
) -> None:
    """Divide each leaf's ``.grad`` by ``2^alpha`` and queue it for ``drift``, with the ``unscaled`` ones.

    ``leaves`` holds (leaf index, leaf variable, alpha); ``unscaled`` the same for leaves whose
    gradients the backward already unscaled (DDP's, which it all-reduced; accumulated ones),
    queued only. One fused multiply per scale, device and dtype (none where alpha is 0; an update's scale,
    still on the device, multiplies as a tensor, whatever its value). Nothing is
    read: the step's pass over the gradients it uses takes their largest magnitudes, the queued
    ones' included (:meth:`GradientDrift.pending`).
    """
    # an update's scales by identity, unread
    by_alpha: dict[Exponent, list[tuple[int, torch.Tensor, bool]]] = defaultdict(list)
    for queued, to_unscale in ((leaves, True), (unscaled, False)):
        for j, variable, alpha in queued:
            if variable.grad is not None:
                by_alpha[alpha].append((j, variable.grad, to_unscale))
    for alpha, group in by_alpha.items():
        if isinstance(alpha, torch.Tensor) or alpha != 0:
            unscale_(
                [grad for _, grad, to_unscale in group if to_unscale],
                torch.exp2(-alpha) if isinstance(alpha, torch.Tensor) else 2.0**-alpha,
            )
        dense = [(j, grad) for j, grad, _ in group if grad.is_floating_point() and not grad.is_sparse]
        if drift is not None and dense:
            drift.measure(alpha, tuple(j for j, _ in dense), [grad for _, grad in dense], update)


def within_margin(
    analysis: GraphAnalysis, plan: ScalePlan, surprised: Mapping[int, float], highest_total: Callable[[float], int]
) -> bool:
    """Whether every weight gradient above what the last update expected of it (``surprised``: leaf -> its
    largest value) is computed at a scale an update expecting that value would allow (``highest_total`` of
    it, the margin kept above expected maxima included): it then used up none of that margin, and the
    update it would ask for would not lower its layer. ``False`` where a leaf's layer cannot be named.

    The layer is the node that computed the gradient (:func:`overflow_caps`' choice).
    """
    for leaf, value in surprised.items():
        node = computing_node(plan, analysis, leaf) if leaf in analysis.leaf_sources else None
        if node is None or node not in plan.alpha_out or plan.alpha_out[node] > highest_total(value):
            return False
    return True
