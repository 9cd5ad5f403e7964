"""Between scale updates: how far the weight gradients drifted, and which layers overflowed.

Both come from per-tensor norms of the deferred weight gradients, taken right after the fused
unscale-and-check pass (one ``_foreach_norm`` per distinct scale, no synchronisation) and read
in the one synchronisation ``step()`` already makes for its found-inf flag.

* **Drift.** The scales an update chose are the smallest that meet γ' for the gradients of that
  iteration. When the gradients of a scale group (the weight gradients that carry one
  accumulated scale) shrink by a binade, the underflow rate of what that group's layers send on
  roughly doubles: :class:`GradientDrift` asks for an update on the next backward, so
  ``update_interval`` is the longest interval, not a fixed period. How far they grew instead is
  kept as the headroom below overflow the next update leaves (:attr:`GradientDrift.headroom_log2`).
* **Overflow.** A non-finite norm names the parameters whose gradient overflowed; with the
  plan's scales :func:`overflow_caps` lowers only the layers that produced it
  (:class:`LayerBackoff`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from gs_lightning.scaling.finite import unscale_and_check_
from gs_lightning.scaling.graph import GraphAnalysis, Slot
from gs_lightning.scaling.plan import ScalePlan

Edges = tuple[tuple[Slot | None, ...], ...]  # a graph's (or a plan's) edges, node by node

# Tolerated shrinkage of a scale group's gradient norm below the update that chose its scale, in
# binades (see the module docstring; README "How it works" has the measurement).
DRIFT_TOLERANCE_LOG2 = 1.0
# Most headroom below overflow that an update keeps for gradients growing between updates, in
# binades (see :attr:`GradientDrift.headroom_log2`).
MAX_HEADROOM_LOG2 = 3.0
# Bits an overflow takes off the accumulated scale of the layers it came from.
BACKOFF_BITS = 2


@dataclass
class DriftReading:
    """What the norms read at a step say.

    Attributes:
        drift_log2: The most binades a scale group's gradient norm fell below its norm at the
            update (negative when every group grew; 0 on an update iteration, NaN when nothing
            was comparable, inf when a group's gradients became all zeros or non-finite).
        non_finite: Leaf indices (in the loss's graph) whose gradient holds inf or NaN.
        measured: Leaf indices whose gradient norms were read.
    """

    drift_log2: float = math.nan
    non_finite: frozenset[int] = frozenset()
    measured: frozenset[int] = frozenset()

    @property
    def some_overflowed(self) -> bool:
        """Whether some measured gradients, not all, were non-finite: layers can be told apart."""
        return bool(self.non_finite) and self.non_finite != self.measured

    @property
    def drifted(self) -> bool:
        """Whether some scale group left the tolerated band (:data:`DRIFT_TOLERANCE_LOG2`)."""
        return self.drift_log2 >= DRIFT_TOLERANCE_LOG2


@dataclass
class GradientDrift:
    """Norms of each scale group's weight gradients, on update iterations and between them.

    Attributes:
        window: How many steps of growth :attr:`headroom_log2` looks back on.
        reference: log2 scale -> (leaf indices, norm of their gradients) measured on the last
            update iteration.
        growth: For each of the last ``window`` steps, the most any scale group's norm grew
            above its reference, in binades.
        last: The reading of the last step.
    """

    window: int = 100
    reference: dict[int, tuple[tuple[int, ...], float]] = field(default_factory=dict)
    growth: list[float] = field(default_factory=list)
    last: DriftReading = field(default_factory=DriftReading)
    _pending: list[tuple[int, tuple[int, ...], list[torch.Tensor]]] = field(default_factory=list, repr=False)
    _update: bool = field(default=False, repr=False)

    def measure(self, alpha: int, leaves: tuple[int, ...], grads: list[torch.Tensor], update: bool) -> None:
        """Queue the norms of one scale group's (already unscaled) gradients; nothing is read yet."""
        self._pending.append((alpha, leaves, list(torch._foreach_norm(grads))))
        self._update = self._update or update

    def pending(self) -> list[torch.Tensor]:
        """The queued norms (0-dim tensors), to read in the step's synchronisation."""
        return [norm for _, _, norms in self._pending for norm in norms]

    def read(self, values: list[float]) -> DriftReading:
        """Consume the queued norms, given their values in :meth:`pending`'s order."""
        groups: dict[int, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
        position, non_finite = 0, set()
        for alpha, leaves, norms in self._pending:
            group_leaves, squares = groups[alpha]
            for leaf, value in zip(leaves, values[position : position + len(norms)]):
                group_leaves.append(leaf)
                squares.append(value * value)
                if not math.isfinite(value):
                    non_finite.add(leaf)
            position += len(norms)
        measured = {alpha: (tuple(sorted(leaves)), math.sqrt(math.fsum(squares))) for alpha, (leaves, squares) in groups.items()}
        if self._update and not non_finite:
            self.reference, drift = measured, 0.0
        else:
            shrinks = [_shrink_log2(norm, self.reference[alpha][1]) for alpha, (leaves, norm) in measured.items()
                       if alpha in self.reference and self.reference[alpha][0] == leaves]
            drift = max(shrinks, default=math.nan)
            growth = max((-x for x in shrinks if math.isfinite(x)), default=None)
            if growth is not None:
                self.growth = [*self.growth, growth][-self.window :]
        self._pending.clear()
        self._update = False
        self.last = DriftReading(drift, frozenset(non_finite), frozenset(j for leaves, _ in measured.values() for j in leaves))
        return self.last

    def discard(self) -> None:
        """Forget queued norms that no step read (the iteration ended without a step)."""
        self._pending.clear()
        self._update = False

    @property
    def headroom_log2(self) -> float:
        """Binades below overflow for an update to keep: how far the gradients grew above an update's
        within the last ``window`` steps (at most :data:`MAX_HEADROOM_LOG2`).

        An update decides from one batch; when batches differ by more than a binade (a converged
        task whose gradients come from a few hard examples) a scale at the edge of one batch's
        range overflows on the next. The growth actually seen is the margin that would have served.
        """
        return min(max(max(self.growth, default=0.0), 0.0), MAX_HEADROOM_LOG2)

    def state_dict(self) -> dict[str, Any]:
        """The reference norms and the recent growth, as plain containers."""
        return {
            "reference": [[alpha, list(leaves), norm] for alpha, (leaves, norm) in sorted(self.reference.items())],
            "growth": list(self.growth),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s reference norms and growth."""
        self.reference = {int(alpha): (tuple(int(j) for j in leaves), float(norm)) for alpha, leaves, norm in state.get("reference", [])}
        self.growth = [float(g) for g in state.get("growth", [])]


def _shrink_log2(norm: float, reference: float) -> float:
    """How many binades a group's norm fell below its reference (negative: it grew)."""
    if not math.isfinite(norm) or norm <= 0.0:
        return math.inf if norm != reference else 0.0  # non-finite, or all zeros now
    if reference <= 0.0:
        return -math.inf  # all zeros at the update
    return math.log2(reference / norm)


def unscale_check_and_measure(
    leaves: Iterable[tuple[int, torch.Tensor, int]], drift: GradientDrift | None, update: bool
) -> list[torch.Tensor]:
    """Divide each leaf's ``.grad`` by ``2^alpha``, flag non-finite values, and queue each group's norms.

    ``leaves`` holds (leaf index, leaf variable, alpha). One fused pass
    (``unscale_and_check_``) per scale, device and dtype, all setting one flag per device: the
    memory traffic of ``GradScaler.unscale_``, so ``step`` needs no second pass; with ``drift``,
    one ``_foreach_norm`` per scale on top. Nothing is synchronised; returns the flags.
    """
    by_alpha: dict[int, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    for j, variable, alpha in leaves:
        if variable.grad is not None:
            by_alpha[alpha].append((j, variable.grad))
    found_inf: dict[torch.device, torch.Tensor] = {}
    for alpha, group in by_alpha.items():
        grads = [grad for _, grad in group]
        unscale_and_check_(grads, 2.0**-alpha, found_inf)
        dense = [(j, grad) for j, grad in group if grad.is_floating_point() and not grad.is_sparse]
        if drift is not None and dense:
            drift.measure(alpha, tuple(j for j, _ in dense), [grad for _, grad in dense], update)
    return list(found_inf.values())


# --- per-layer back-off ----------------------------------------------------------------------


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
        """After an update: once ``interval`` iterations passed since a cap was set or relaxed, relax it by one bit, or drop it if it no longer binds.

        Counted in iterations, not updates, so that updates the drift triggers relax nothing faster.
        """
        for i, (cap, since) in list(self.caps.items()):
            if iteration - since < interval:
                continue
            if alpha_out.get(i, cap - 1) < cap:
                del self.caps[i]
            else:
                self.caps[i] = (cap + 1, iteration)

    def clear(self) -> None:
        """Forget every cap (the graph's structure changed)."""
        self.caps.clear()

    def state_dict(self) -> list[list[int]]:
        """The caps, as plain containers."""
        return [[i, cap, since] for i, (cap, since) in sorted(self.caps.items())]

    def load_state_dict(self, state: list[list[int]]) -> None:
        """Restore :meth:`state_dict`'s caps."""
        self.caps = {int(i): (int(cap), int(since)) for i, cap, since in state}


def overflow_caps(analysis: GraphAnalysis, plan: ScalePlan, non_finite: Iterable[int]) -> dict[int, int]:
    """Node -> log2 cap that lowers the layers an overflow between updates came from, and no other.

    A non-finite weight gradient at a GEMM came from that GEMM (its weight gradient overflowed) or
    from above it (the gradient it received was already non-finite). Of the GEMMs (or other nodes)
    whose weight gradients were non-finite, those with no such node above them are where it
    started; every node on the way from the loss to one of them that sent gradients at the scale
    it received them at, or higher, gets a cap :data:`BACKOFF_BITS` below its own scale. Nodes in other
    branches keep theirs.
    """
    bad = {_consumer(plan.edges, analysis, j) for j in non_finite if j in analysis.leaf_sources}
    if not bad:
        return {}
    parents = _parents(plan.edges)
    ancestors = {i: _ancestors(parents, i) for i in bad}
    caps: dict[int, int] = {}
    for i in bad:
        if ancestors[i] & (bad - {i}):
            continue  # non-finite because a node above it was
        received = max((a for (j, _), a in plan.slot_alpha.items() if j == i), default=plan.alpha_out.get(i, 0))
        for n in ancestors[i] | {i}:
            alpha = plan.alpha_out.get(n)
            if alpha is not None and alpha >= received:
                caps[n] = min(caps.get(n, alpha - BACKOFF_BITS), alpha - BACKOFF_BITS)
    return caps


def _consumer(edges: Edges, analysis: GraphAnalysis, leaf: int) -> int:
    """The node that computed a leaf's gradient: the GEMM behind a weight's cast or transpose, or its source."""
    for i, weight_edges in analysis.weight_edges.items():
        if any(_reaches(edges, edges[i][k], leaf) for k in weight_edges):
            return i
    return analysis.leaf_sources[leaf]


def _reaches(edges: Edges, edge: Slot | None, leaf: int, hops: int = 4) -> bool:
    """Whether ``edge`` leads to ``leaf`` through single-edge nodes (a weight's cast, transpose, view)."""
    for _ in range(hops):
        if edge is None:
            return False
        if edge[0] == leaf:
            return True
        onward = [e for e in edges[edge[0]] if e is not None]
        if len(onward) != 1:
            return False
        edge = onward[0]
    return False


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
