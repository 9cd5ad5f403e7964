"""One update iteration: Algorithm 1 decided node by node, in hooks, as autograd runs the backward.

Each decision reads a few statistics of the gradient at hand (the update iteration's only
host-device synchronisations). What the run decides becomes a :class:`~gs_lightning.scaling.plan.ScalePlan`
that the iterations in between replay as constant factors.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch.autograd.graph import Node
from torch.utils._python_dispatch import _disable_current_modes

from gs_lightning.scaling.drift import parameter_leaves
from gs_lightning.scaling.formats import FORMATS
from gs_lightning.scaling.graph import (
    BATCH_NORM_NODES,
    GEMM_OPERANDS,
    RNN_NODES,
    WEIGHT_GRAD_BOUNDS,
    AutogradGraph,
    GraphAnalysis,
    Slot,
    batch_norm_gain,
    saved_tensor,
)
from gs_lightning.scaling.limits import Bound, Limit, describe, parse
from gs_lightning.scaling.plan import LeafTargets, ScalePlan, edge_shift, times_pow2
from gs_lightning.scaling.probes import detached, probe, rnn_probe, weight_probe_elements
from gs_lightning.scaling.recipe import ScalingRecipe
from gs_lightning.scaling.recompute import recomputable
from gs_lightning.scaling.underflow import (
    ExactSample,
    branch_log2_scale,
    cast_min_log2_scale,
    cast_underflow_rate,
    choose_log2_scale,
    gemm_min_log2_scale,
    gemm_sigma,
    gemm_underflow_rate,
    overflow_max_log2_scale,
)


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
        level_maxima: Leaf index -> its gradient's level, without the spikes
            (:meth:`GradientDrift.expect`): with ``recompute``, what bounds a recomputable GEMM,
            with :attr:`ScalingRecipe.recomputed_spike_share` of the spikes.
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
    level_maxima: Mapping[int, float] = field(default_factory=dict)
    recipe: ScalingRecipe = field(default_factory=ScalingRecipe)


@dataclass(frozen=True)
class LayerScale:
    """What the last update chose for one decision point of the backward graph.

    Attributes:
        name: Layer name (qualified module name where known, ``".cast"`` appended for casts).
        kind: ``"gemm"``, ``"cast"``, ``"attention"``, ``"rnn"`` or ``"opaque"`` (a custom Function
            or a compiled region, scaled as one unit: see :meth:`UpdateRun._settle_opaque`).
        log2_scale: log2 of the local scale β.
        log2_total: log2 of the accumulated scale its outgoing gradients carry.
        underflow_rate: The estimated underflow rate of its output at that scale (NaN where no
            model applies).
        measured_underflow: The largest fraction of the exact fp32 probe values of its outputs
            (what it sends on and its weight gradient; a cast's own gradient) left below λmin at
            that scale, measured on the update iteration (``None`` where nothing was probed).
        limit: Why the scale is below the smallest that meets γ' (:class:`~gs_lightning.scaling.limits.Limit`):
            ``NONE`` where it is not; an overflow bound (the tensor it keeps from overflowing), a rule
            beyond the paper, or a cap.
        limit_index: Which input (``INPUT_GRADIENT``) or output (``OUTPUT``) the bound is on, where the
            node has several.
    """

    name: str
    kind: str
    log2_scale: int
    log2_total: int
    underflow_rate: float
    measured_underflow: float | None = None
    limit: Limit = Limit.NONE
    limit_index: int | None = None

    @property
    def limited_by(self) -> str:
        """:attr:`limit` as text: empty, ``"overflow of the gradient of input 1"``, ``"back-off of this layer"``, ..."""
        return describe(self.limit, self.limit_index)

    def state_dict(self) -> dict[str, Any]:
        """Plain containers only: the limit by its name."""
        return {**asdict(self), "limit": self.limit.name}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> LayerScale:
        """Rebuild :meth:`state_dict`'s layer (or one saved with the limit's text, ``limited_by``)."""
        fields = {k: v for k, v in state.items() if k not in ("limit", "limited_by")}
        if "limit" in state:
            return cls(**fields, limit=Limit[state["limit"]])
        limit, index = parse(state.get("limited_by", ""))
        return cls(**{**fields, "limit_index": index}, limit=limit)


def stats(*values: torch.Tensor) -> list[float]:
    """Statistics to the host in one synchronisation."""
    return torch.stack([v.float() for v in values]).tolist()


OrderStatistics = tuple[float, list[float]]  # an ExactSample's nonzero count and smallest values, read


def stats_and_samples(values: list[torch.Tensor], samples: list[ExactSample], target: float) -> tuple[list[float], list[OrderStatistics]]:
    """:func:`stats` of ``values``, and what :meth:`ExactSample.min_log2_scale` reads of each sample, in one synchronisation."""
    smallest = [v.smallest(target) for v in samples]
    scalars = torch.stack([v.float() for v in (*values, *(v.nonzero_count for v in samples))])
    read = torch.cat([scalars, *smallest]).tolist() if smallest else scalars.tolist()
    counts, position, orders = read[len(values) : len(values) + len(samples)], len(values) + len(samples), []
    for count, tail in zip(counts, smallest):
        orders.append((count, read[position : position + tail.numel()]))
        position += tail.numel()
    return read[: len(values)], orders


def rms(t: torch.Tensor) -> torch.Tensor:
    """Root mean square, accumulated in fp32."""
    return torch.linalg.vector_norm(t, dtype=torch.float32) / math.sqrt(max(t.numel(), 1))


Extremes = tuple[torch.Tensor, torch.Tensor]  # (smallest, largest) element of a tensor, on its device


def extremes(t: torch.Tensor) -> Extremes:
    """The smallest and largest element, in one kernel: both finite iff every element is, NaN if one is.

    Through ``aminmax`` (on a CPU ``vector_norm(ord=inf)`` measured 12-20x slower); the largest
    magnitude is taken on the host (:func:`magnitudes`), which saves two kernels per tensor.
    """
    if t.numel() == 0:
        zero = torch.zeros((), device=t.device)
        return zero, zero
    low, high = torch.aminmax(memory_order(detached(t)))
    return low, high


def magnitude(low: float, high: float) -> float:
    """The largest magnitude, from :func:`extremes` read to the host (NaN if either is)."""
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


def magnitudes(pairs: list[Extremes]) -> list[float]:
    """:func:`magnitude` of each pair of :func:`extremes`, in one synchronisation."""
    values = stats(*(v for pair in pairs for v in pair)) if pairs else []
    return [magnitude(values[2 * k], values[2 * k + 1]) for k in range(len(pairs))]


def memory_order(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its dimensions in memory order, a free view, where that makes it contiguous (a transposed
    weight and its gradient): a reduction over a transposed view measured 15x slower on a CPU."""
    if t.is_contiguous():
        return t
    permuted = t.permute(sorted(range(t.dim()), key=t.stride, reverse=True))
    return permuted if permuted.is_contiguous() else t


Warn = Callable[[str, str], None]

# Accumulated scales stay at or below 2^MAX_LOG2_TOTAL, where fp32 (the arithmetic that applies a
# factor, and the scalar it is given as) represents every factor and its inverse as a normal
# number: beyond 2^127 a factor is inf (gradients of 1e-42 in fp32 asked for 2^140 and came back
# NaN). Gradients needing more lie far below every low-precision format's range anyway.
MAX_LOG2_TOTAL = 100
def expected_total(expected: float, lambda_max: float, margin_log2: float) -> int:
    """The highest accumulated scale that keeps a parameter gradient expected to reach ``expected``
    ``margin_log2`` binades (:attr:`ScalingRecipe.expected_maxima_margin_log2`) below ``lambda_max``."""
    return math.ceil(overflow_max_log2_scale(expected * 2.0**margin_log2, lambda_max)) - 1


def kept_downstream(graph: AutogradGraph, analysis: GraphAnalysis, gemm_totals: Mapping[int, int]) -> dict[int, int]:
    """Node -> the highest accumulated scale at which any of the gradients it sends on is still used as sent.

    A GEMM whose parameter gradients cap its accumulated scale (``gemm_totals``) scales what it
    receives down to that cap before computing anything: scale sent to it above the cap protects
    no value (the multiply by 2^-k loses what the lower scale would have) and is exposed to
    overflow on every batch in between (ResNet-8's logits gradient, scaled for its smallest values
    of a converged batch, overflowed on a hard one although the layer it feeds sat 2^5 lower). A
    gradient reaching a leaf or an uncapped GEMM keeps any scale. Nodes without a finite bound are
    left out.
    """
    kept: dict[int, float] = {}

    def received(node: int) -> float:  # the highest scale a gradient arriving at ``node`` is used at
        if node in analysis.leaves:
            return math.inf
        if node in gemm_totals:
            return gemm_totals[node]
        return kept[node]

    def targets(node: int) -> list[int]:
        return [edge[0] for edge in graph.edges[node] if edge is not None]

    for node in post_order(len(graph.nodes), targets, analysis.leaves):
        kept[node] = max((received(t) for t in targets(node)), default=math.inf)
    return {node: int(value) for node, value in kept.items() if math.isfinite(value)}


def post_order(count: int, targets: Callable[[int], list[int]], stops: Container[int]) -> Iterator[int]:
    """Nodes ``0..count-1`` but ``stops``, each after every node it sends to (``targets``), without
    recursion: for values that a node takes from those of the nodes downstream in the backward."""
    done: set[int] = set()
    stack = [(root, False) for root in range(count)]
    while stack:
        node, ready = stack.pop()
        if node in done or node in stops:
            continue
        if ready:
            done.add(node)
            yield node
            continue
        stack.append((node, True))
        stack.extend((t, False) for t in targets(node) if t not in done)


def constant_factor(node: Node) -> torch.Tensor | None:
    """|c| of a product by a constant scalar c (``MulBackward0`` whose saved factor is 0-dim), as a 0-dim tensor, else ``None``.

    Its backward multiplies the gradient by c. Under ``create_graph=True`` the scaler's own factors
    are such products, recorded in the first backward's graph: a second backward through it (a
    gradient penalty) meets them as gains of 2^β that no decision sees.
    """
    factor = saved_tensor(node, "other")
    if factor is None or factor.dim() != 0 or not factor.is_floating_point():
        return None
    # A Python scalar is saved as a wrapped-number tensor, which a dispatch mode (the fp16 emulation, a
    # FLOP counter) receives as a float and cannot run ops on: read it outside the modes (a CPU scalar).
    with _disable_current_modes():
        return factor.detach().abs().float()


SAVED_GRADIENTS = ("grad_output", "grad_out")


def saved_gradient_gain(node: Node) -> torch.Tensor | None:
    """max|g| of the gradient an elementwise node of a first backward's graph saved (``GeluBackwardBackward0``,
    ``TanhBackwardBackward0``, ... under ``create_graph=True``), else ``None``: a second backward through it
    multiplies its gradient by g, which carries the scales of the first backward."""
    if "BackwardBackward" not in node.name() and "BackwardDataBackward" not in node.name():
        return None
    for name in SAVED_GRADIENTS:
        g = saved_tensor(node, name)
        if g is not None and g.is_floating_point() and g.numel():
            return g.detach().abs().amax().float()
    return None


def node_gain(node: Node, name: str) -> torch.Tensor | None:
    """How much ``node`` can multiply the gradient it passes on, where that is known: a batch norm's gain
    (:func:`~gs_lightning.scaling.graph.batch_norm_gain`), a product by a constant (:func:`constant_factor`),
    a saved first-order gradient (:func:`saved_gradient_gain`)."""
    if name in BATCH_NORM_NODES:
        return batch_norm_gain(node)
    if name == "MulBackward0":
        return constant_factor(node)
    return saved_gradient_gain(node)


def node_gains(graph: AutogradGraph) -> dict[int, float]:
    """Node -> its gain above 1 (:func:`node_gain`), read in one synchronisation; empty, and nothing read, without any."""
    found = [(j, gain) for j, name in enumerate(graph.names) if (gain := node_gain(graph.nodes[j], name)) is not None]
    values = stats(*(gain for _, gain in found)) if found else []
    return {j: v for (j, _), v in zip(found, values) if 1.0 < v < math.inf}


def gains_after(graph: AutogradGraph, analysis: GraphAnalysis, gains: Mapping[int, float]) -> dict[int, float]:
    """Node -> how much the gradient it receives can grow before the next decision point, branch or
    leaf sees it: the product of the batch-norm ``gains`` on the way (the node's own included), the
    largest over the paths. Nodes where that is 1 are left out."""
    if not gains:
        return {}

    def targets(node: int) -> list[int]:  # a branch bounds its sum again
        return [edge[0] for edge in graph.edges[node] if edge is not None and edge not in analysis.branch_slots]

    grown: dict[int, float] = {}
    for node in post_order(len(graph.nodes), targets, analysis.leaves | analysis.layer_names.keys()):
        gain = gains.get(node, 1.0) * max((grown.get(t, 1.0) for t in targets(node)), default=1.0)
        if gain > 1.0:
            grown[node] = gain
    return grown


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
        root_alpha: int = 0,
    ) -> None:
        self.graph = graph
        self.analysis = analysis
        self.settings = settings
        self.leaves = leaves
        self._warn = warn
        self.alpha_out: dict[int, int] = {}
        self.slot_alpha: dict[Slot, int] = {(0, s): root_alpha for s in analysis.slots[0]}
        self.layers: list[LayerScale] = []
        self._pass_through: list[int] = []  # nodes that send gradients on at the scale they received, without a hook
        self._every_node_tracked = False
        self._stash: dict[Slot, list[tuple[torch.Tensor, int]]] = defaultdict(list)
        self._arrived: dict[Slot, int] = defaultdict(int)
        self._finite_flags: list[tuple[str, tuple[torch.Tensor, ...]]] = []  # layer, values finite iff its gradient is
        self._opaque_probes: dict[int, tuple[int, float]] = {}  # opaque node -> (probe scale, overflow bound of its input)
        self._recomputable: set[int] = set()  # GEMMs whose weight gradients the replays recompute if they overflow
        self._fed_maxima: dict[int, float] = {}  # such a GEMM -> expected maxima of the parameter gradients it feeds
        self._expected = self._expected_maxima()
        self._kept_downstream = kept_downstream(graph, analysis, {i: self._expected_total(i) for i in self._expected})
        self._gains_after = gains_after(graph, analysis, node_gains(graph))

    def register(self) -> list:
        """Register the run's hooks on the graph; returns their handles.

        Pass-through nodes (no decision, no weight gradient, no edge into a branch or an undeferred
        leaf) get no hook: the scale they forward is looked up when a hooked node needs it
        (:meth:`_slot_scale`) and filled in by :meth:`complete`. A backward that may skip nodes
        calls :meth:`track_every_node` instead of relying on that.
        """
        a = self.analysis
        decides = self._decision_nodes()
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
        """After the backward: the scales the pass-through nodes forwarded, into :attr:`alpha_out` and :attr:`slot_alpha`."""
        if self._every_node_tracked:
            return
        for i in self._pass_through:
            alpha = self._node_scale(i)
            for edge in self.graph.edges[i]:
                if edge is not None and edge[0] not in self.analysis.leaves:
                    self.slot_alpha[edge] = alpha

    def _decision_nodes(self) -> set[int]:
        a = self.analysis
        return a.gemms.keys() | a.fused.keys() | a.casts | a.merge_nodes | a.reentrant | a.opaque

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

    def plan(self) -> ScalePlan:
        """The decided scales, to replay on the iterations until the next update."""
        return ScalePlan(tuple(self.graph.names), tuple(self.graph.edges), dict(self.alpha_out), dict(self.slot_alpha), frozenset(self._recomputable))

    def absorb(self, inner: UpdateRun) -> None:
        """Take over what the run of a reentrant checkpoint's inner graph decided, in backward order.

        A module run in several checkpointed blocks gets ``#2``, ``#3``... as in one graph.
        """
        taken = {layer.name for layer in self.layers}
        for layer in inner.layers:
            name, k = layer.name, 1
            while name in taken:
                k += 1
                name = f"{layer.name}#{k}"
            taken.add(name)
            self.layers.append(replace(layer, name=name))
        self._finite_flags += inner._finite_flags

    def first_non_finite(self) -> str | None:
        """The first layer, in backward order, whose incoming or weight gradient was non-finite."""
        if not self._finite_flags:
            return None
        values = [v for _, flag in self._finite_flags for v in flag]
        finite = torch.isfinite(torch.stack([v.float().to(values[0].device) for v in values])).tolist() if values else []
        position = 0
        for name, flag in self._finite_flags:  # a flag is finite iff all its values are
            if not all(finite[position : position + len(flag)]):
                return name
            position += len(flag)
        return None

    # Pre-hook: merge the incoming slots to one scale, then apply the node's local scale.
    def _pre(self, i: int, grad_outputs: tuple) -> tuple:
        a = self.analysis
        present = [(s, g) for s, g in enumerate(grad_outputs) if g is not None]
        parts = [(g, self._slot_scale((i, s))) for s, g in present]
        alpha = self._common(parts, i) if parts else 0
        grads = list(grad_outputs)
        for (s, g), (_, a_s) in zip(present, parts):
            grads[s] = times_pow2(g, alpha - a_s)
        beta = 0
        if present and i in a.layer_names:
            grad = grads[present[0][0]]
            grad_extremes = extremes(grad)  # the decision's statistic, and its finiteness flag
            self._finite_flags.append((a.layer_names[i], grad_extremes))
            beta = self._decide(i, grad, grad_extremes, [g for _, g in present], alpha)
            grads = [times_pow2(g, beta) for g in grads]
        self.alpha_out[i] = alpha + beta
        return tuple(grads)

    def _decide(self, i: int, grad: torch.Tensor, grad_extremes: Extremes, grads: list[torch.Tensor], alpha: int) -> int:
        a = self.analysis
        if i in a.opaque:
            return self._opaque_probe(i, grad_extremes, alpha)
        try:
            if i in a.gemms:
                return self._gemm_scale(i, grad, grad_extremes, alpha)
            if i in a.fused:
                return self._fused_scale(i, grad, grad_extremes, alpha, grads)
            return self._cast_scale(i, grad, grad_extremes, alpha)
        except Exception as error:  # noqa: BLE001 - never crash training: this node passes its scale through
            node_type = self.graph.names[i]
            self._warn(
                f"stats:{node_type}",
                f"GradientScaler: could not compute a scale at {node_type} ({error!r}); its gradients pass through unscaled.",
            )
            return 0

    # Post-hook: unscale what reaches a leaf, gather what meets at a branch, pass the rest on.
    def _post(self, i: int, grad_inputs: tuple, grad_outputs: tuple) -> tuple:
        alpha = self._node_scale(i)
        out = list(grad_inputs)
        if i in self._opaque_probes:
            alpha = self._settle_opaque(i, out, alpha)
        for k in self.analysis.weight_edges.get(i, ()):
            if out[k] is not None:  # the weight gradients a GEMM computed from a finite ∇Y may still overflow
                self._finite_flags.append((self.analysis.layer_names[i], extremes(out[k])))
        for k, edge in enumerate(self.graph.edges[i]):
            if edge is None:
                continue
            if edge[0] in self.analysis.leaves:
                out[k] = times_pow2(out[k], edge_shift(self.graph, edge, alpha, self.slot_alpha, self.leaves))
            elif edge in self.analysis.branch_slots:
                out[k] = self._arrive(edge, out[k], alpha)
            else:
                self.slot_alpha[edge] = alpha
        return tuple(out)

    def _node_scale(self, i: int) -> int:
        """The scale node ``i``'s outgoing gradients carry (once it ran): decided in its pre-hook, or the one it received."""
        alpha = self.alpha_out.get(i)
        if alpha is None:
            (slot,) = self.analysis.slots.get(i, (0,))  # nodes without a pre-hook have one slot
            alpha = self.alpha_out[i] = self._slot_scale((i, slot))
        return alpha

    def _slot_scale(self, slot: Slot) -> int:
        """The scale of the gradient arriving in ``slot``, once its feeders ran.

        Set where it was decided (a branch's sum, the root); otherwise the scale its one feeder
        sends, which a pass-through feeder (no hook) received in turn: looked up along the chain of
        them, and recorded for each on the way.
        """
        chain: list[tuple[Slot, int]] = []
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

    def _arrive(self, slot: Slot, grad: torch.Tensor | None, alpha: int) -> torch.Tensor | None:
        """Keep a branch contribution aside; the last one applies the common scale and sends the sum."""
        self._arrived[slot] += 1
        if grad is not None:
            self._stash[slot].append((grad, alpha))
        if self._arrived[slot] < self.graph.in_counts[slot]:
            return None
        parts = self._stash.pop(slot, [])
        common = self.slot_alpha[slot] = self._common(parts, slot[0], summed=True) if parts else alpha
        total = None
        for part, a in parts:  # in arrival order, as autograd itself would sum them
            term = times_pow2(part, common - a)
            total = term if total is None else total + term
        return total

    def _common(self, parts: list[tuple[torch.Tensor, int]], i: int, summed: bool = False) -> int:
        """Algorithm 1, line 17: one scale for gradients that carry different ones.

        ``summed``: the parts are added (a branch), so the bound is on their sum, Σ max|∇X_i| / α_i,
        not on each part; it is checked even when they share a scale if the sum is taken in a low
        precision, where it can overflow though every part is finite (a weight used three times
        under autocast). Either bound keeps :attr:`ScalingRecipe.replay_headroom_log2`.

        A sum taken in a wider format than the gradients' (fp32 under autocast: a Transformer's
        residual stream around its LayerNorms) gets the smallest incoming scale
        (:attr:`ScalingRecipe.wide_branch_scale`, the default): shifting the other
        parts down to it is exact there, and the casts and GEMMs below raise it as far as their own
        values need. The largest that fits would leave everything below one binade under overflow,
        carried there by the part that needed most (a BERT's key projection's 2^25 went down its
        whole residual stream, and the next batch's bias gradients overflowed).
        """
        alphas = [a for _, a in parts]
        low_precision = any(g.dtype in FORMATS for g, _ in parts)
        if summed and not low_precision and self.settings.recipe.wide_branch_scale == "smallest":
            return self._capped(min(alphas), i)
        low_precision_sum = summed and len(parts) > 1 and low_precision
        if len(set(alphas)) == 1 and not low_precision_sum:
            return alphas[0]
        maxima = magnitudes([extremes(g) for g, _ in parts])
        true_maxima = [m * 2.0**-a for m, a in zip(maxima, alphas)]
        largest = (sum(true_maxima) if summed else max(true_maxima)) * self._gains_after.get(i, 1.0)
        headroom = self.settings.recipe.replay_headroom_log2
        return self._capped(branch_log2_scale(alphas, largest * 2.0**headroom, self.settings.lambda_max), i)

    def _gain_into(self, edge: Slot | None) -> float:
        """How much a gradient sent along ``edge`` can grow in batch norms before anything bounds it again (:func:`gains_after`)."""
        return 1.0 if edge is None or edge in self.analysis.branch_slots else self._gains_after.get(edge[0], 1.0)

    def _expected_maxima(self) -> dict[int, float]:
        """GEMM node -> the largest value its parameter gradients are expected to reach (where known);
        where the replays can recompute them, their level and :attr:`ScalingRecipe.recomputed_spike_share` of the spikes."""
        maxima, decides = {}, self._decision_nodes()
        for i in self.analysis.gemms:
            leaves = parameter_leaves(self.graph.edges, self.analysis, i)
            expected = max((self.settings.expected_maxima.get(j, 0.0) for j in leaves), default=0.0)
            level = max((self.settings.level_maxima.get(j, 0.0) for j in leaves), default=0.0)
            if self.settings.recompute and recomputable(self.graph, self.analysis, i, self.leaves.deferred):
                self._recomputable.add(i)
            if i in self._recomputable and expected > 0.0 and level > 0.0:
                maxima[i] = level * (expected / level) ** self.settings.recipe.recomputed_spike_share
                fed = max((self.settings.expected_maxima.get(j, 0.0) for j in self._fed_leaves(i, decides)), default=0.0)
                if fed > 0.0:
                    self._fed_maxima[i] = fed
            elif expected > 0.0:
                maxima[i] = expected
        return maxima

    def _fed_leaves(self, i: int, decides: set[int]) -> set[int]:
        """The parameters whose gradients GEMM ``i``'s outgoing gradient reaches before the next decision
        (a normalisation's weight and bias): computed at the scale ``i`` chose, and not recomputed."""
        a, found = self.analysis, set()
        # a branch's sum is brought to a common scale: the scale i chose ends there too
        frontier = [e[0] for k, e in enumerate(self.graph.edges[i]) if e is not None and k not in a.weight_edges[i] and e not in a.branch_slots]
        seen = set(frontier)
        while frontier:
            n = frontier.pop()
            if n in a.leaves:
                found.add(n)
                continue
            if n in decides:
                continue
            for edge in self.graph.edges[n]:
                if edge is not None and edge[0] not in seen and edge not in a.branch_slots:
                    seen.add(edge[0])
                    frontier.append(edge[0])
        return found

    def _expected_total(self, i: int) -> int:
        """The highest accumulated scale GEMM node ``i`` can keep under its expected maxima (as :meth:`_gemm_scale` bounds it)."""
        return expected_total(self._expected[i], self.settings.lambda_max, self._expected_margin())

    def _expected_margin(self) -> float:
        """:attr:`ScalingRecipe.expected_maxima_margin_log2` (there are expected maxima only where the rule is on)."""
        margin = self.settings.recipe.expected_maxima_margin_log2
        return 0.0 if margin is None else margin

    def _total_cap(self, i: int) -> int | None:
        caps = [c for c in (self.settings.total_cap, self.settings.node_caps.get(i), self._kept_downstream.get(i)) if c is not None]
        return min(caps) if caps else None

    def _capped(self, exponent: int, i: int) -> int:
        cap = self._total_cap(i)
        return exponent if cap is None else min(exponent, cap)

    def _choose(self, i: int, alpha: int, lower: float, limits: dict[Bound, float]) -> tuple[int, Bound]:
        """The scale from the underflow bound ``lower`` and the overflow bounds ``limits``, and what held it below ``lower``.

        Under expected parameter-gradient maxima, :attr:`ScalingRecipe.spike_room_log2` may lower the scale as far
        as the same bound against :attr:`Settings.lambda_lost` allows.
        """
        s, recipe = self.settings, self.settings.recipe
        # Exact bounds keep at least the replay headroom; the others are loose already.
        limits = {bound: value - (recipe.replay_headroom_log2 if bound.limit.exact else 0.0) for bound, value in limits.items()}
        upper_bound, upper = min(limits.items(), key=lambda item: item[1], default=(Bound(Limit.NONE), math.inf))
        caps = {Limit.LAYER_CAP: s.layer_cap}
        if s.total_cap is not None:
            caps[Limit.TOTAL_CAP] = s.total_cap - alpha
        if i in s.node_caps:
            caps[Limit.BACKOFF] = s.node_caps[i] - alpha
        if i in self._kept_downstream:
            caps[Limit.KEPT_DOWNSTREAM] = self._kept_downstream[i] - alpha
        caps = {limit: cap for limit, cap in caps.items() if cap is not None}
        ceiling = min(caps.values(), default=None)
        beta = choose_log2_scale(lower, upper, ceiling)
        expected = any(bound.limit.expected for bound in limits)
        if recipe.spike_room_log2 > 0.0 and expected and math.isfinite(lower) and s.lambda_lost < s.lambda_min:
            lost_lower = lower - math.log2(s.lambda_min / s.lambda_lost)  # both bounds are log2(λ / the same order statistic)
            roomy = min(value - (recipe.spike_room_log2 if bound.limit.expected else 0.0) for bound, value in limits.items())
            with_room = max(choose_log2_scale(lower, roomy, ceiling), min(beta, math.ceil(lost_lower)))
            if with_room < beta:
                return with_room, Bound(Limit.SPIKE_ROOM)
        if not math.isfinite(lower) or beta >= math.ceil(lower):
            return beta, Bound(Limit.NONE)
        binding = next((limit for limit, cap in caps.items() if beta == cap), None)
        if binding is not None and (not math.isfinite(upper) or beta < math.ceil(upper) - 1):
            return beta, Bound(binding)
        return beta, upper_bound

    def _gemm_scale(self, i: int, grad: torch.Tensor, grad_extremes: Extremes, alpha: int) -> int:
        """Theorem 1 (exact for small N) and the probed outputs (what it sends on, its weight gradient): the largest scale.

        The first layer sends no activation gradient on: its weight gradients alone decide its scale.
        """
        s, name = self.settings, self.graph.names[i]
        operand_of = GEMM_OPERANDS[name]
        operands = [(k, operand_of[k](self.graph, i, grad)) for k in self.analysis.gemms[i]]
        operands = [(k, op) for k, op in operands if op.operand is not None]
        node = self.graph.nodes[i]
        weight_bounds = WEIGHT_GRAD_BOUNDS[name](node, grad, self.analysis.weight_edges[i]) if name in WEIGHT_GRAD_BOUNDS else {}
        if not operands and self.analysis.gemms[i] and not weight_bounds:  # operands unreadable (two activations under checkpointing)
            return self._non_finite(i, "gemm", alpha)
        if not operands and not weight_bounds:  # operands unreadable (checkpointed), or nothing to send on
            return 0
        recipe = s.recipe
        sent = [v for v in (probe(node, grad, k, op.operand, recipe.probe_elements) for k, op in operands) if v is not None] if recipe.exact_probes else []
        samples = [ExactSample(v) for v in (*sent, *self._weight_samples(i, grad))] if recipe.exact_probes else []
        (grad_rms, *values), orders = stats_and_samples(
            [rms(grad), *grad_extremes, *(v for _, op in operands for v in (rms(op.operand), *extremes(op.operand))), *weight_bounds.values()],
            samples,
            s.underflow_rate,
        )
        grad_max = magnitude(*values[:2])
        if not math.isfinite(grad_max):  # the step will be skipped whatever the scale
            return self._non_finite(i, "gemm", alpha)
        operand_values, weight_values = values[2 : 2 + 3 * len(operands)], values[2 + 3 * len(operands) :]
        operand_stats = [v for k in range(len(operands)) for v in (operand_values[3 * k], magnitude(*operand_values[3 * k + 1 : 3 * k + 3]))]
        if not all(map(math.isfinite, (*operand_stats, *weight_values))):  # a non-finite forward: skipped whatever the scale
            return self._non_finite(i, "gemm", alpha)
        weight_stats = dict(zip(weight_bounds, weight_values))
        lengths = [s.relu_factor * op.accumulation_length for _, op in operands]
        sigmas = [gemm_sigma(n, grad_rms, operand_stats[2 * k]) for k, n in enumerate(lengths)]
        lower = max(
            [gemm_min_log2_scale(sigma, s.lambda_min, s.underflow_rate, n) for sigma, n in zip(sigmas, lengths)]
            + [v.min_log2_scale(s.lambda_min, s.underflow_rate, read) for v, read in zip(samples, orders)],
            default=-math.inf,
        )
        limits = {
            Bound(Limit.INCOMING_GRADIENT): overflow_max_log2_scale(grad_max, s.lambda_max),
            **{
                Bound(Limit.INPUT_GRADIENT, k): overflow_max_log2_scale(
                    op.accumulation_length * grad_max * operand_stats[2 * j + 1] * self._gain_into(self.graph.edges[i][k]), s.lambda_max
                )
                for j, (k, op) in enumerate(operands)
            },
            **{Bound(Limit(tensor)): overflow_max_log2_scale(bound, s.lambda_max) for tensor, bound in weight_stats.items()},
        }
        expected = self._expected.get(i, 0.0)
        if expected > 0.0:  # unscaled: the bound on the local scale leaves room for the α it receives
            kind = Limit.RECOMPUTED_SPIKES if i in self._recomputable else Limit.EXPECTED_PARAMETER_GRADIENTS
            limits[Bound(kind)] = overflow_max_log2_scale(expected * 2.0 ** (self._expected_margin() + alpha), s.lambda_max)
        if i in self._fed_maxima:
            limits[Bound(Limit.FED_PARAMETER_GRADIENTS)] = overflow_max_log2_scale(self._fed_maxima[i] * 2.0 ** (self._expected_margin() + alpha), s.lambda_max)
        wanted = max(lower, 0.0)  # β is never below 0 unless an overflow bound forces it
        weight = Bound(Limit.WEIGHT_GRADIENT)
        if limits.get(weight, math.inf) < wanted and min(limits.values()) == limits[weight]:
            limits[weight] = max(limits[weight], self._measured_weight_limit(i, grad))
        beta, limit = self._choose(i, alpha, lower, limits)
        measured = [v.underflow_rate(beta, s.lambda_min) for v in samples]
        rate = max([gemm_underflow_rate(beta, sigma, s.lambda_min, n) for sigma, n in zip(sigmas, lengths)] + measured, default=0.0)
        self.layers.append(
            LayerScale(self.analysis.layer_names[i], "gemm", beta, alpha + beta, rate, max(measured) if measured else None, *limit)
        )
        return beta

    def _weight_samples(self, i: int, grad: torch.Tensor, elements: int | None = None) -> list[torch.Tensor]:
        """Exact fp32 values of a slice of each weight gradient GEMM node ``i`` outputs from ``grad``.

        What the node sends on does not show a weight gradient's small values: on SSD300's heads and
        extra layers, few positions and sparse ∇Y leave them 17-28 binades below the largest (README
        "How it works"). At most ``elements`` values each (default :func:`weight_probe_elements` with the
        recipe's budgets); none where the node's input is unreadable (non-reentrant checkpointing).
        """
        recipe = self.settings.recipe
        node, elements = self.graph.nodes[i], elements or weight_probe_elements(grad, recipe.weight_probe_elements, recipe.weight_probe_macs)
        return [values for k in self.analysis.weight_edges[i] if (values := probe(node, grad, k, None, elements)) is not None]

    def _measured_weight_limit(self, i: int, grad: torch.Tensor) -> float:
        """The overflow bound from the weight gradient itself, computed in fp32, with :attr:`ScalingRecipe.weight_grad_margin_log2` to spare.

        Only where the Cauchy–Schwarz bound is what keeps a scale from meeting γ' (one more GEMM
        on such layers, on update iterations only), with exact probes.
        """
        exact = self._weight_samples(i, grad, elements=sys.maxsize) if self.settings.recipe.exact_probes else []
        if not exact:
            return math.inf
        largest = max(magnitudes([extremes(values) for values in exact]))
        return overflow_max_log2_scale(largest * 2.0**self.settings.recipe.weight_grad_margin_log2, self.settings.lambda_max)

    def _cast_scale(self, i: int, grad: torch.Tensor, grad_extremes: Extremes, alpha: int) -> int:
        """An order statistic of the fp32 gradient itself (Theorem 2's log-normal model misjudges others);
        Theorem 2 where the recipe has no exact probes."""
        if not self.settings.recipe.exact_probes:
            return self._log_normal_cast_scale(i, grad, grad_extremes, alpha)
        return self._sampled_scale(i, "cast", [grad], grad_extremes, alpha)

    def _log_normal_cast_scale(self, i: int, grad: torch.Tensor, grad_extremes: Extremes, alpha: int) -> int:
        """Theorem 2: ln|∇y| over the nonzero elements taken as N(μ, σ²), the paper's model of a cast."""
        s = self.settings
        magnitudes_ = detached(grad).float().abs()
        nonzero = magnitudes_ > 0.0
        count = nonzero.sum()
        logs = torch.where(nonzero, magnitudes_.clamp_min(torch.finfo(torch.float32).tiny).log(), 0.0)
        mean = logs.sum() / count.clamp_min(1)
        variance = torch.where(nonzero, (logs - mean) ** 2, 0.0).sum() / count.clamp_min(1)
        low, high, log_mean, log_variance, nonzero_count = stats(*grad_extremes, mean, variance, count)
        grad_max = magnitude(low, high)
        if not math.isfinite(grad_max) or nonzero_count == 0:
            return self._non_finite(i, "cast", alpha)
        log_std = math.sqrt(max(log_variance, 0.0))
        lower = cast_min_log2_scale(log_mean, log_std, s.lambda_min, s.underflow_rate)
        beta, limit = self._choose(i, alpha, lower, {Bound(Limit.INCOMING_GRADIENT): overflow_max_log2_scale(grad_max, s.lambda_max)})
        rate = cast_underflow_rate(beta, log_mean, log_std, s.lambda_min)
        self.layers.append(LayerScale(self.analysis.layer_names[i], "cast", beta, alpha + beta, rate, None, *limit))
        return beta

    def _fused_scale(self, i: int, grad: torch.Tensor, grad_extremes: Extremes, alpha: int, grads: list[torch.Tensor]) -> int:
        """Fused attention or RNN: exact fp32 probes of what it sends on (none under checkpointing)."""
        node, name = self.graph.nodes[i], self.graph.names[i]
        if name in RNN_NODES:
            kind, samples = "rnn", [rnn_probe(node, grads, k, self.settings.recipe.probe_elements) for k in self.analysis.fused[i]]
        else:
            kind, samples = "attention", [probe(node, grad, k, None, self.settings.recipe.probe_elements) for k in self.analysis.fused[i]]
        return self._sampled_scale(i, kind, [v for v in samples if v is not None], grad_extremes, alpha)

    def _opaque_probe(self, i: int, grad_extremes: Extremes, alpha: int) -> int:
        """An opaque region's scale on its update iteration: its incoming gradient :attr:`ScalingRecipe.opaque_probe_headroom_log2` below λmax."""
        (grad_max,) = magnitudes([grad_extremes])
        upper = overflow_max_log2_scale(grad_max, self.settings.lambda_max)
        beta = math.ceil(upper) - 1 - self.settings.recipe.opaque_probe_headroom_log2 if math.isfinite(upper) else 0
        ceiling = self._opaque_ceiling(i, alpha)
        beta = beta if ceiling is None else min(beta, ceiling)
        self._opaque_probes[i] = (beta, upper)
        return beta

    def _settle_opaque(self, i: int, out: list[torch.Tensor | None], alpha: int) -> int:
        """Scale an opaque region as a dynamic loss scale would: one binade below the overflow of what entered or left it.

        What left it was computed at the probe scale; it is shifted (exactly, a power of two) to the
        scale chosen, which the iterations until the next update replay. Returns the scale its
        outgoing gradients carry; ``out`` is shifted in place.
        """
        probe, upper_in = self._opaque_probes.pop(i)
        alpha_in, name = alpha - probe, self.analysis.layer_names[i]
        grads = [g for g in out if g is not None and g.is_floating_point()]
        pairs = [extremes(g) for g in grads]
        if pairs:
            self._finite_flags.append((name, tuple(v for pair in pairs for v in pair)))
        maxima = magnitudes(pairs)
        if not all(map(math.isfinite, maxima)):  # the step is skipped; the back-off lowers the probe
            self.layers.append(LayerScale(name, "opaque", probe, alpha, math.nan))
            return alpha
        upper = min([upper_in] + [probe + overflow_max_log2_scale(m, self.settings.lambda_max) for m in maxima])
        beta = math.ceil(upper) - 2 if math.isfinite(upper) else 0  # one binade of margin below the largest
        ceiling = self._opaque_ceiling(i, alpha_in)
        beta = beta if ceiling is None else min(beta, ceiling)
        for k, g in enumerate(out):
            out[k] = times_pow2(g, beta - probe) if g is not None and g.is_floating_point() else g
        rate = max((ExactSample(g).underflow_rate(beta - probe, self.settings.lambda_min) for g in grads if g.numel()), default=math.nan)
        self.layers.append(LayerScale(name, "opaque", beta, alpha_in + beta, rate, measured_underflow=rate))
        self.alpha_out[i] = alpha_in + beta
        return alpha_in + beta

    def _opaque_ceiling(self, i: int, alpha: int) -> int | None:
        total = self._total_cap(i)
        caps = [c for c in (self.settings.layer_cap, None if total is None else total - alpha) if c is not None]
        return min(caps, default=None)

    def _non_finite(self, i: int, kind: str, alpha: int) -> int:
        """No decision (no finite statistics, or none readable, to decide on): the scale passes through."""
        self.layers.append(LayerScale(self.analysis.layer_names[i], kind, 0, alpha, math.nan))
        return 0

    def _sampled_scale(self, i: int, kind: str, samples: list[torch.Tensor], grad_extremes: Extremes, alpha: int) -> int:
        s = self.settings
        if not samples:
            return self._non_finite(i, kind, alpha)
        exact = [ExactSample(v) for v in samples]
        pairs = [grad_extremes, *(extremes(v) for v in samples)]
        values, orders = stats_and_samples([v for pair in pairs for v in pair], exact, s.underflow_rate)
        (grad_max, *sample_max) = [magnitude(values[2 * k], values[2 * k + 1]) for k in range(len(pairs))]
        if not all(map(math.isfinite, (grad_max, *sample_max))):
            return self._non_finite(i, kind, alpha)
        lower = max(v.min_log2_scale(s.lambda_min, s.underflow_rate, read) for v, read in zip(exact, orders))
        limits = {Bound(Limit.INCOMING_GRADIENT): overflow_max_log2_scale(grad_max, s.lambda_max)}
        gain = max((self._gain_into(edge) for edge in self.graph.edges[i]), default=1.0)  # whichever edge a sample left by
        for k, m in enumerate(sample_max):
            limits[Bound(Limit.OUTPUT, k if len(sample_max) > 1 else None)] = overflow_max_log2_scale(m * gain, s.lambda_max)
        beta, limit = self._choose(i, alpha, lower, limits)
        rate = max(v.underflow_rate(beta, s.lambda_min) for v in exact)
        self.layers.append(LayerScale(self.analysis.layer_names[i], kind, beta, alpha + beta, rate, rate, *limit))
        return beta
