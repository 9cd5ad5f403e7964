"""One update iteration: Algorithm 1 decided node by node, in hooks, as autograd runs the backward.

The run walks the scales through the graph (merging the scales that meet at a node or a branch, passing
them on through the nodes that decide nothing); the decision core (:mod:`~gs_lightning.scaling.decide`)
chooses each decision point's scale from a few statistics of the gradient at hand, on the device: every
scale stays there, unread, and multiplies the gradients as a 0-dim tensor. The step's read takes them with
the gradients' (:meth:`UpdateRun.unread`); what the run decided becomes a
:class:`~gs_lightning.scaling.plan.ScalePlan` that the iterations in between replay as constant factors.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial

import torch

from gs_lightning.scaling.bounds import ScaleBounds, Settings
from gs_lightning.scaling.decide import LayerScale, NodeDecisions
from gs_lightning.scaling.gradient_stats import Extremes, extremes
from gs_lightning.scaling.graph import AutogradGraph, GraphAnalysis, Slot, decision_nodes
from gs_lightning.scaling.modes import outside_low_precision_modes
from gs_lightning.scaling.plan import (
    Exponent,
    LeafTargets,
    ScalePlan,
    as_read,
    edge_shift,
    shift,
    shift_sent_operands,
    times_pow2,
)
from gs_lightning.scaling.profiled import profiled

Warn = Callable[[str, str], None]


class UpdateRun:
    """Hooks of one update iteration on one graph; afterwards, what they decided.

    Args:
        graph: The walked backward graph.
        analysis: Its node classification.
        settings: Targets, ranges and caps.
        leaves: The scale each leaf receives its gradient at, and which leaves are deferred.
        warn: ``warn(key, message)``, called at most once per key by the scaler.
        root_alpha: log2 of the scale the gradients arriving at the root carry (0 for a loss; a
            reentrant checkpoint's inner graph starts at its node's scale).
    """

    def __init__(
        self,
        graph: AutogradGraph,
        analysis: GraphAnalysis,
        settings: Settings,
        leaves: LeafTargets,
        warn: Warn,
        root_alpha: Exponent = 0,
    ) -> None:
        self.graph = graph
        self.analysis = analysis
        self.settings = settings
        self.leaves = leaves
        self._warn = warn
        self.alpha_out: dict[int, Exponent] = {}  # Python ints once the backward is complete
        self.slot_alpha: dict[Slot, Exponent] = {(0, s): root_alpha for s in analysis.slots[0]}
        self._pass_through: list[int] = []  # nodes that send gradients on at the scale they received, without a hook
        self._every_node_tracked = False
        self._stash: dict[Slot, list[tuple[torch.Tensor, Exponent]]] = defaultdict(list)
        self._arrived: dict[Slot, int] = defaultdict(int)
        self.bounds = ScaleBounds(graph, analysis, settings, leaves)
        self.decisions = NodeDecisions(graph, analysis, settings, self.bounds)

    def register(self) -> list:
        """Register the run's hooks on the graph; returns their handles.

        Pass-through nodes (no decision, no weight gradient, no edge into a branch or an undeferred
        leaf) get no hook: the scale they forward is looked up when a hooked node needs it
        (:meth:`_slot_scale`) and filled in by :meth:`complete`. A backward that may skip nodes
        calls :meth:`track_every_node` instead of relying on that.
        """
        a = self.analysis
        decides = decision_nodes(a)
        handles = []
        for i, node in enumerate(self.graph.nodes):
            if i in a.leaves:
                continue
            if i in decides:
                handles.append(node.register_prehook(partial(self._pre, i)))
            if self._needs_post_hook(i):
                handles.append(node.register_hook(partial(self._post, i)))
            elif any(e is not None for e in self.graph.edges[i]):
                self._pass_through.append(i)
        return handles

    def track_every_node(self) -> list:
        """Post-hooks on the pass-through nodes too, for a backward that does not run every node
        (``torch.autograd.grad``, ``backward(inputs=...)``): what they forward is recorded as they run,
        and :meth:`complete` then adds nothing for the nodes that did not. Returns their handles."""
        self._every_node_tracked = True
        return [self.graph.nodes[i].register_hook(partial(self._post, i)) for i in self._pass_through]

    def complete(self) -> None:
        """After the backward: the scales the pass-through nodes forwarded, into :attr:`alpha_out` and
        :attr:`slot_alpha`.
        Nothing is read: the scales and the decisions stay on the device until :meth:`read_in`."""
        if not self._every_node_tracked:
            for i in self._pass_through:
                alpha = self._node_scale(i)
                for edge in self.graph.edges[i]:
                    if edge is not None and edge[0] not in self.analysis.leaves:
                        self.slot_alpha[edge] = alpha

    def unread(self) -> list[torch.Tensor]:
        """What :meth:`read_in` needs read: the scales left on the device, and the decisions."""
        values = [*self.alpha_out.values(), *self.slot_alpha.values(), *self.decisions.unread()]
        return list({id(v): v for v in values if isinstance(v, torch.Tensor)}.values())

    def read_in(self, values: Mapping[torch.Tensor, float]) -> None:
        """:meth:`unread` as read (``values``): every scale a Python int, every decision a :class:`LayerScale`."""
        self.alpha_out, self.slot_alpha = as_read(self.alpha_out, values), as_read(self.slot_alpha, values)
        self.decisions.read_in(values)

    def _needs_post_hook(self, i: int) -> bool:
        """Whether node ``i``'s outgoing gradients need more than the scale it received: an opaque region's
        settling, a weight gradient's finiteness flag, the factor into a leaf, a branch's sum."""
        a, deferred = self.analysis, self.leaves.deferred
        if i in a.opaque or a.weight_edges.get(i):
            return True
        return any(
            edge is not None and (edge[0] not in deferred if edge[0] in a.leaves else edge in a.branch_slots)
            for edge in self.graph.edges[i]
        )

    @property
    def layers(self) -> list[LayerScale]:
        """What the run decided, layer by layer, in backward order."""
        return self.decisions.layers

    def plan(self) -> ScalePlan:
        """The decided scales, to replay on the iterations until the next update (left on the device until read:
        :meth:`ScalePlan.read_in`)."""
        return ScalePlan(
            tuple(self.graph.names),
            tuple(self.graph.edges),
            dict(self.alpha_out),
            dict(self.slot_alpha),
            frozenset(self.bounds.recomputable),
            dict(self.decisions.input_shifts),
        )

    def absorb(self, inner: UpdateRun) -> None:
        """Take over what the run of a reentrant checkpoint's inner graph decided, in backward order.

        A module run in several checkpointed blocks gets ``#2``, ``#3``... as in one graph.
        """
        taken, offset = {layer.name for layer in self.layers}, len(self.layers)
        for layer in inner.layers:
            name, k = layer.name, 1
            while name in taken:
                k += 1
                name = f"{layer.name}#{k}"
            taken.add(name)
            self.layers.append(replace(layer, name=name))
        self.decisions.finite_flags += inner.decisions.finite_flags
        self.decisions.unread_rates += [
            replace(rates, index=rates.index + offset) for rates in inner.decisions.unread_rates
        ]

    # Pre-hook: merge the incoming slots to one scale, then apply the node's local scale.
    @outside_low_precision_modes
    def _pre(self, i: int, grad_outputs: tuple) -> tuple:
        a = self.analysis
        present = [(s, g) for s, g in enumerate(grad_outputs) if g is not None]
        parts = [(g, self._slot_scale((i, s))) for s, g in present]
        alpha = self.decisions.common(parts, i) if parts else 0
        grads = list(grad_outputs)
        for (s, g), (_, a_s) in zip(present, parts):
            grads[s] = times_pow2(g, shift(alpha, a_s))
        beta = 0
        if present and i in a.layer_names:
            grad = grads[present[0][0]]
            grad_extremes = extremes(grad)  # the decision's statistic, and its finiteness flag
            self.decisions.finite_flags.append((a.layer_names[i], grad_extremes))
            beta = self._decide(i, grad, grad_extremes, [g for _, g in present], alpha)
            grads = [times_pow2(g, beta) for g in grads]
            edges, own = self.decisions.input_shifts.get(i, ((), 0))
            if isinstance(own, torch.Tensor) or own:
                shift_sent_operands(self.graph.nodes[i], edges, own)
        self.alpha_out[i] = alpha + beta
        return tuple(grads)

    def _decide(
        self, i: int, grad: torch.Tensor, grad_extremes: Extremes, grads: list[torch.Tensor], alpha: Exponent
    ) -> Exponent:
        with profiled("GradientScaler.decide", self.analysis.layer_names[i]):
            return self._decision(i, grad, grad_extremes, grads, alpha)

    def _decision(
        self, i: int, grad: torch.Tensor, grad_extremes: Extremes, grads: list[torch.Tensor], alpha: Exponent
    ) -> Exponent:
        if i in self.analysis.opaque:
            return self.decisions.opaque_probe(i, grad_extremes, alpha)
        try:
            return self.decisions.decide(i, grad, grad_extremes, grads, alpha)
        except Exception as error:  # noqa: BLE001 - never crash training: this node passes its scale through
            node_type = self.graph.names[i]
            self._warn(
                f"stats:{node_type}",
                f"GradientScaler: could not compute a scale at {node_type} ({error!r}); "
                "its gradients pass through unscaled.",
            )
            return 0

    # Post-hook: unscale what reaches a leaf, gather what meets at a branch, pass the rest on.
    @outside_low_precision_modes
    def _post(self, i: int, grad_inputs: tuple, grad_outputs: tuple) -> tuple:
        alpha = self._node_scale(i)
        out = list(grad_inputs)
        if i in self.decisions.opaque_probes:
            alpha = self.alpha_out[i] = self.decisions.settle_opaque(i, out, alpha)
        for k in self.analysis.weight_edges.get(i, ()):
            if out[k] is not None:  # the weight gradients a GEMM computed from a finite ∇Y may still overflow
                self.decisions.finite_flags.append((self.analysis.layer_names[i], extremes(out[k])))
        shifted_edges, own = self.decisions.input_shifts.get(i, ((), 0))
        for k, edge in enumerate(self.graph.edges[i]):
            if edge is None:
                continue
            carried = alpha + own if k in shifted_edges else alpha  # what a GEMM sends on may carry its own scale
            if edge[0] in self.analysis.leaves:
                out[k] = times_pow2(out[k], edge_shift(self.graph, edge, carried, self.slot_alpha, self.leaves))
            elif edge in self.analysis.branch_slots:
                out[k] = self._arrive(edge, out[k], carried)
            else:
                self.slot_alpha[edge] = carried
        return tuple(out)

    def _node_scale(self, i: int) -> Exponent:
        """The scale node ``i``'s outgoing gradients carry (once it ran): decided in its pre-hook, or the one it
        received."""
        alpha = self.alpha_out.get(i)
        if alpha is None:
            (slot,) = self.analysis.slots.get(i, (0,))  # nodes without a pre-hook have one slot
            alpha = self.alpha_out[i] = self._slot_scale((i, slot))
        return alpha

    def _slot_scale(self, slot: Slot) -> Exponent:
        """The scale of the gradient arriving in ``slot``, once its feeders ran.

        Set where it was decided (a branch's sum, the root); otherwise the scale its one feeder
        sends, which a pass-through feeder (no hook) received in turn: looked up along the chain of
        them, and recorded for each on the way.
        """
        chain: list[tuple[Slot, int]] = []  # (slot, its feeder)
        alpha = self.slot_alpha.get(slot)
        while alpha is None:
            feeder = self.analysis.feeders.get(slot)
            if feeder is None:
                alpha = 0
                break
            chain.append((slot, feeder))
            alpha = self.alpha_out.get(feeder)
            if alpha is None:
                (feeder_slot,) = self.analysis.slots.get(feeder, (0,))  # nodes without a pre-hook have one slot
                slot = (feeder, feeder_slot)
                alpha = self.slot_alpha.get(slot)
        for slot, feeder in chain:
            self.slot_alpha[slot] = self.alpha_out.setdefault(feeder, alpha)
        return alpha

    def _arrive(self, slot: Slot, grad: torch.Tensor | None, alpha: Exponent) -> torch.Tensor | None:
        """Keep a branch contribution aside; the last one applies the common scale and sends the sum."""
        self._arrived[slot] += 1
        if grad is not None:
            self._stash[slot].append((grad, alpha))
        if self._arrived[slot] < self.graph.in_counts[slot]:
            return None
        parts = self._stash.pop(slot, [])
        common = self.slot_alpha[slot] = self.decisions.common(parts, slot[0], summed=True) if parts else alpha
        total = None
        for part, a in parts:  # in arrival order, as autograd itself would sum them
            term = times_pow2(part, shift(common, a))
            total = term if total is None else total + term
        return total
