"""Between updates: each GEMM's scale follows its weight gradients' level and spikes, all decided at the step.

An update decides every scale from one batch; the gradients then shrink as a run converges, and the values
the update kept above λmin sink towards it. The drift rule answered that with another update (the costly
iteration: every decision again, exact probes included). Instead, the step raises each GEMM's accumulated
scale by the whole binades its parameter gradients' level fell, from what its one read already holds (the
largest magnitude of each weight gradient, :mod:`~gs_lightning.scaling.drift`). For a GEMM whose update
chose the accumulated scale ``T`` when its parameter gradients were at level ``r`` (log2):

* the raise is ``floor(r - L)``, where ``L`` is their level now (the median of the last ``level_steps``
  steps' largest values): each value then sits as far above λmin as the update left it;
* it stops where the update's own bound on those gradients would: the highest scale that keeps ``L`` and
  the largest spike seen above the level (since the update, or that it expected) the recipe's margin below
  λmax (:func:`~gs_lightning.scaling.bounds.expected_total`), the share of the spikes where the gradients are
  recomputed, the layer's back-off cap, ``max_log2_total_scale``, and what the GEMMs it feeds keep
  (:func:`~gs_lightning.scaling.gains.kept_downstream`);
* the largest value can fall slower than the small ones (a few hard examples dominate it): where more than
  γ' of a weight gradient's nonzero values sit below λmin at its scale (counted at the step with the largest
  magnitudes, :meth:`LevelFollower.tail_shares`), the GEMM gets one binade more on top of its level's fall,
  kept until the next update;
* where the level or a spike rose above that bound, the GEMM is lowered to it, as an update expecting those
  values would lower it: the rise above what the update expected then asks for no update
  (:meth:`LevelFollower.bounds`);
* only a GEMM whose scale met γ' at the update, or was held by its own parameter gradients, follows them: where
  another bound held it (what it sends on, a cap), a level a binade lower asks for an update, as the drift
  rule does (:attr:`LevelFollower.unfollowed`).

The raises are carried through the graph on the host (:func:`shifted_plan`): the nodes between a GEMM and the
next decisions receive its gradients at its new scale, a branch sums at the lowest of its parts' raises, and
every other decision keeps its accumulated scale (its local scale takes up the difference). The plan this
gives is replayed from the next backward on, as the update's was: the backward runs the same constant
power-of-two factors and computes no statistic of its own.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from gs_lightning.scaling.gains import kept_downstream
from gs_lightning.scaling.graph import GraphAnalysis, Slot, decision_nodes
from gs_lightning.scaling.limits import Limit
from gs_lightning.scaling.plan import ScalePlan
from gs_lightning.scaling.walks import fed_leaves, parameter_leaves

# Values of each followed weight gradient its share of sunk values is counted on (strided): ResNet-50's step()
# (64x64, batch 2, one CPU thread) took 70 ms counting every value, 22 ms on these, 13 ms not following.
TAIL_SAMPLE = 2**14

# What :meth:`LevelFollower.state_dict` keeps per GEMM node, each a dict of the follower's.
_PER_NODE = ("leaves", "reference", "spike", "share", "rises", "extra", "shifts")


@dataclass
class LevelFollower:
    """The shifts of one graph structure's GEMMs from the last update's plan (module docstring).

    Attributes:
        eligible: Whether the last update's plan may be shifted: not where compiled modules replay the scales
            located at the update, nor where reentrant checkpoints' inner graphs have plans of their own.
        base: The last update's plan (``None`` until an update's step read it with finite gradients, and after a
            skipped step).
        leaves: GEMM node -> the leaves whose gradients it computes at its scale: its parameters' (weight, bias) and
            those its outgoing gradient reaches before the next decision (a normalisation's weight and bias).
        reference: GEMM node -> log2 of its parameter gradients' level at the update.
        spike: GEMM node -> binades above their level that its parameter gradients reached or were expected to.
        share: GEMM node -> the share of :attr:`spike` that bounds it (less than 1 where they are recomputed).
        rises: GEMM node -> whether it follows its level (its scale met γ' or was held by its parameter gradients).
        extra: GEMM node -> binades added to its level's fall where its weight gradients' values sank below λmin.
        shifts: GEMM node -> binades its accumulated scale is moved by now (0 left out): raised as its level fell,
            lowered where a spike took its parameter gradients above the update's bound on them.
        highest: GEMM node -> the highest accumulated scale the last step's :meth:`follow` left it (the update's
            bound on its parameter gradients at their level and spikes, within its caps).
        unfollowed: Whether the last step found the level of a GEMM that does not follow it a binade lower.
    """

    eligible: bool = False
    base: ScalePlan | None = None
    leaves: dict[int, tuple[int, ...]] = field(default_factory=dict)
    reference: dict[int, float] = field(default_factory=dict)
    spike: dict[int, float] = field(default_factory=dict)
    share: dict[int, float] = field(default_factory=dict)
    rises: dict[int, bool] = field(default_factory=dict)
    extra: dict[int, int] = field(default_factory=dict)
    shifts: dict[int, int] = field(default_factory=dict)
    unfollowed: bool = False
    highest: dict[int, int] = field(default_factory=dict)
    _kept: tuple[tuple, dict[int, int]] | None = field(default=None, repr=False)

    def rebase(
        self,
        plan: ScalePlan,
        analysis: GraphAnalysis,
        recent: list[Mapping[int, float]],
        expected: Mapping[int, float],
        level_steps: int,
        recomputed_spike_share: float,
        limits: Mapping[int, Limit],
    ) -> None:
        """An update's plan, read at its step: the levels its scales were chosen at become the references.

        ``recent``: the largest magnitude of each weight gradient, leaf -> value, over the last steps (the
        update's last); ``expected``: leaf -> the largest value the update expected (its expected maxima);
        ``recomputed_spike_share``: the share of the spikes that bounds a GEMM whose weight gradients are
        recomputed; ``limits``: node -> what held its scale at the update (:attr:`LayerScale.limit
        <gs_lightning.scaling.decide.LayerScale.limit>`).
        """
        self.base, self.shifts, self.unfollowed, self._kept = plan, {}, False, None
        self.reference, self.spike, self.share, self.rises, self.extra = {}, {}, {}, {}, {}
        decides = analysis.derive("decision nodes", lambda: decision_nodes(analysis))
        computed = {
            g: {*parameter_leaves(plan.names, plan.edges, analysis, g), *fed_leaves(plan.edges, analysis, g, decides)}
            for g in analysis.weight_edges
        }
        self.leaves = {g: tuple(sorted(leaves)) for g, leaves in computed.items() if leaves}
        for g, leaves in self.leaves.items():
            largest = _node_largest(recent[-1], leaves) if recent else 0.0
            level = _level(recent, leaves, level_steps)
            reference = min(largest, level) if level > 0.0 else largest
            if reference <= 0.0:
                continue  # nothing measured, or all zeros: the update's own rules deal with it
            self.reference[g] = math.log2(reference)
            peak = max([expected.get(j, 0.0) for j in leaves] + [largest])
            self.spike[g] = max(math.log2(peak) - self.reference[g], 0.0)
            self.share[g] = recomputed_spike_share if g in plan.recomputable else 1.0
            limit = limits.get(g, Limit.NONE)
            self.rises[g] = limit is Limit.NONE or limit.expected or limit is Limit.WEIGHT_GRADIENT

    def follow(
        self,
        recent: list[Mapping[int, float]],
        level_steps: int,
        highest_total: Callable[[float], int],
        caps: Mapping[int, int],
        analysis: GraphAnalysis,
        kept_downstream_cap: bool = True,
        tolerance_log2: float | None = None,
        tails: Mapping[int, float] | None = None,
        underflow_rate: float = 1e-3,
    ) -> ScalePlan | None:
        """The plan for the next backwards where this step's maxima (``recent[-1]``) change a raise; else ``None``.

        ``highest_total(log2 value)``: the highest accumulated scale that keeps a parameter gradient reaching
        ``2^value`` the margin below λmax; ``caps``: node -> the highest accumulated scale it may take (its
        back-off, ``max_log2_total_scale``); ``analysis``: the structure's; ``kept_downstream_cap``: no GEMM is
        raised above what the GEMMs its gradients reach keep for their own parameter gradients. Sets
        :attr:`unfollowed` where the level of a GEMM that does not follow it fell ``tolerance_log2`` binades or
        more. ``tails``: leaf -> the share of its gradient's nonzero values below λmin at the scale it was
        computed at (:meth:`tail_shares`, as read); a GEMM with one above ``underflow_rate`` gets one binade
        more (:attr:`extra`) on top of its level's fall, kept until the next update.
        """
        self.highest = {}
        if self.base is None or not recent:
            return None
        totals, highest, moves, self.unfollowed = self.base.alpha_out, {}, {}, False
        for g, reference in self.reference.items():
            leaves, total = self.leaves[g], totals.get(g)
            largest, level = _node_largest(recent[-1], leaves), _level(recent, leaves, level_steps)
            if largest <= 0.0 or level <= 0.0 or total is None:
                if g in self.shifts:
                    moves[g] = self.shifts[g]  # nothing to follow this step
                continue
            log2_level = math.log2(level)
            self.spike[g] = max(self.spike[g], math.log2(largest) - log2_level)
            highest[g] = min(highest_total(log2_level + self.share[g] * self.spike[g]), caps.get(g, math.inf))
            fell, room = max(math.floor(reference - log2_level), 0), highest[g] - total
            if not self.rises[g]:
                self.unfollowed |= tolerance_log2 is not None and fell >= tolerance_log2
                if room < 0:  # a spike above the bound: lowered to it, as an update expecting it would
                    moves[g] = room
                continue
            extra = self.extra.get(g, 0)
            # values that sank although the level stayed (a fall explains its own: the raise below takes it in)
            settled = fell <= self.shifts.get(g, 0) - extra
            if settled and fell < room and max((tails or {}).get(j, 0.0) for j in leaves) > underflow_rate:
                self.extra[g] = min(extra + 1, room - fell)  # stays until the next update
            moves[g] = min(fell + self.extra.get(g, 0), room)
        if kept_downstream_cap and any(move > 0 for move in moves.values()):
            kept = self._kept_downstream(analysis, highest)
            moves = {g: min(m, kept.get(g, math.inf) - totals[g]) if m > 0 else m for g, m in moves.items()}
        self.highest = highest
        shifts = {g: int(m) for g, m in moves.items() if m != 0}
        if shifts == self.shifts:
            return None
        self.shifts = shifts
        return shifted_plan(self.base, shifts, analysis.derive("decision nodes", lambda: decision_nodes(analysis)))

    def bounds(self, leaf: int) -> bool:
        """Whether the last :meth:`follow` bounded every GEMM that computes ``leaf``'s gradient by its level and
        spikes, this step's largest value included: a rise above what the last update expected of it is taken in
        by the shifts, as the update it would ask for would lower those GEMMs to that bound (``False`` where no
        followed GEMM computes it: a normalisation's weight behind a branch's sum)."""
        totals = self.base.alpha_out if self.base is not None else {}
        gemms = [g for g, leaves in self.leaves.items() if leaf in leaves]
        return bool(gemms) and all(
            g in self.highest and totals[g] + self.shifts.get(g, 0) <= self.highest[g] for g in gemms
        )

    def tail_shares(
        self, pending: list[tuple[int | torch.Tensor, tuple[int, ...], list[torch.Tensor]]], lambda_min: float
    ) -> tuple[list[int], torch.Tensor] | None:
        """The leaves the followed GEMMs compute of ``pending`` (the drift monitor's queued (scale, leaves,
        gradients), unscaled), and per leaf the share of its gradient's nonzero values below ``lambda_min`` at the
        scale it was computed at (on a strided sample of at most :data:`TAIL_SAMPLE` values), stacked on the device,
        unread (the step reads them with the rest): the values that sank to λmin although the largest did not fall,
        where a few examples dominate (SSD300's heads). ``None`` where there is nothing to follow, or the scales are
        an update's (on the device)."""
        if self.base is None:
            return None
        followed = {j for g, leaves in self.leaves.items() if self.rises.get(g) for j in leaves}
        items = [
            (j, grad, alpha)
            for alpha, leaves, grads in pending
            if not isinstance(alpha, torch.Tensor)
            for j, grad in zip(leaves, grads)
            if j in followed
        ]
        if not items:
            return None
        shares = []
        for _, grad, alpha in items:
            values = grad.reshape(-1)[:: math.ceil(grad.numel() / TAIL_SAMPLE) or 1]
            nonzero = values != 0
            small = nonzero & (values.abs() < lambda_min * 2.0**-alpha)
            shares.append(small.sum() / nonzero.sum().clamp(min=1))
        return [j for j, _, _ in items], torch.stack(shares).float()

    def _kept_downstream(self, analysis: GraphAnalysis, highest: dict[int, int]) -> dict[int, int]:
        """:func:`~gs_lightning.scaling.gains.kept_downstream` of ``highest``, walked again only where it changed
        (the bounds move by whole binades: most steps repeat the last one's)."""
        key = tuple(sorted(highest.items()))
        if self._kept is None or self._kept[0] != key:
            self._kept = (key, kept_downstream(_Structure(self.base), analysis, highest))
        return self._kept[1]

    def forget(self) -> None:
        """No raises until the next update (a skipped step; a structure whose plan may not be shifted)."""
        self.base, self.shifts, self.unfollowed = None, {}, False

    def state_dict(self) -> dict[str, Any]:
        """Plain containers: the base plan, and per GEMM node what :meth:`rebase` found and its raise."""
        return {
            "eligible": self.eligible,
            "unfollowed": self.unfollowed,
            "base": None if self.base is None else self.base.state_dict(),
            "nodes": [
                {"node": g, **{k: getattr(self, k).get(g, 0) for k in _PER_NODE}} for g in sorted(self.reference)
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.eligible, self.unfollowed = bool(state.get("eligible", False)), bool(state.get("unfollowed", False))
        self.base = None if state.get("base") is None else ScalePlan.from_state_dict(state["base"])
        nodes = {int(node["node"]): node for node in state.get("nodes", [])}
        self.leaves = {g: tuple(int(j) for j in node["leaves"]) for g, node in nodes.items()}
        self.reference = {g: float(node["reference"]) for g, node in nodes.items()}
        self.spike = {g: float(node["spike"]) for g, node in nodes.items()}
        self.share = {g: float(node["share"]) for g, node in nodes.items()}
        self.rises = {g: bool(node["rises"]) for g, node in nodes.items()}
        self.extra = {g: int(node.get("extra", 0)) for g, node in nodes.items() if node.get("extra")}
        self.shifts = {g: int(node["shifts"]) for g, node in nodes.items() if node["shifts"]}


class _Structure:
    """A plan's wiring where :func:`~gs_lightning.scaling.gains.kept_downstream` takes a graph's."""

    def __init__(self, plan: ScalePlan) -> None:
        self.edges, self.nodes = plan.edges, plan.names


def shifted_plan(plan: ScalePlan, shifts: Mapping[int, int], decisions: Collection[int]) -> ScalePlan:
    """``plan`` with the accumulated scale of each node of ``shifts`` moved by its shift, carried to the next decisions.

    In topological order from the root: a node of ``shifts`` sends its gradients at its scale plus its
    shift; any other decision node (``decisions``) at its own scale, its local scale taking up what it
    receives shifted; any other node at what it received plus the lowest shift of its incoming slots (the
    local scale it applies is kept). A slot fed by several edges (a branch's sum) takes the lowest shift of
    its parts, so that no part is brought to its sum by a larger factor than the update's. Leaves receive
    their gradients unscaled as before (their factors follow from the shifted scales).
    """
    slot_shift: dict[Slot, int] = {}
    alpha_out, slot_alpha = dict(plan.alpha_out), dict(plan.slot_alpha)
    incoming: dict[int, list[int]] = defaultdict(list)
    for i in _topological_order(plan.edges):
        shift = shifts.get(i, 0) if i in decisions else min(incoming[i], default=0)
        if i in alpha_out:
            alpha_out[i] += shift
        for edge in plan.edges[i]:
            if edge is None or edge not in slot_alpha:
                continue  # a leaf's edge (its factor follows from alpha_out), or a slot no gradient reached
            slot_shift[edge] = min(slot_shift.get(edge, shift), shift)
            incoming[edge[0]].append(slot_shift[edge])
    for slot, shift in slot_shift.items():
        slot_alpha[slot] += shift
    return ScalePlan(plan.names, plan.edges, alpha_out, slot_alpha, plan.recomputable, dict(plan.input_shift))


def _topological_order(edges: tuple[tuple[Slot | None, ...], ...]) -> list[int]:
    """Node indices, each after every node with an edge into it (the root, 0, first)."""
    pending = [0] * len(edges)
    for node_edges in edges:
        for edge in node_edges:
            if edge is not None:
                pending[edge[0]] += 1
    order, ready = [], [i for i, n in enumerate(pending) if n == 0]
    while ready:
        i = ready.pop()
        order.append(i)
        for edge in edges[i]:
            if edge is not None:
                pending[edge[0]] -= 1
                if pending[edge[0]] == 0:
                    ready.append(edge[0])
    return order


def _node_largest(step: Mapping[int, float], leaves: tuple[int, ...]) -> float:
    return max((step.get(j, 0.0) for j in leaves), default=0.0)


def _level(recent: list[Mapping[int, float]], leaves: tuple[int, ...], level_steps: int) -> float:
    """The median of a node's largest parameter gradient over the last ``level_steps`` steps (0 without any)."""
    values = [_node_largest(step, leaves) for step in recent[-level_steps:]]
    return statistics.median_low(values) if values else 0.0
