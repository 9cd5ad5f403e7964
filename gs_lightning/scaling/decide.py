"""The decision core: a node's statistics and bounds turned into its power-of-two scale (paper Algorithm 1).

Each kind of decision point has its rule: a GEMM (Theorem 1, with exact probes of what it sends on and of
its weight gradient), a cast (an order statistic of the gradient, or Theorem 2), fused attention and RNNs
(exact probes), an opaque region (a dynamic loss scale's rule), and the merge of gradients that carry
different scales (Algorithm 1, line 17). Every rule measures a few statistics of the tensors at hand and
leaves the choice to :meth:`ScaleBounds.choose <gs_lightning.scaling.bounds.ScaleBounds.choose>`, all on
the gradients' device: no value is read to the host during the backward. A decision is an
:class:`UnreadLayer` until the step's read takes every decision at once (:meth:`NodeDecisions.read_in`),
and a :class:`LayerScale` after.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from functools import lru_cache, partial
from typing import Any

import torch

from gs_lightning.scaling.bounds import ScaleBounds, Settings
from gs_lightning.scaling.formats import FORMATS
from gs_lightning.scaling.gradient_stats import Extremes, FiniteFlags, all_finite, extremes, magnitude, rms
from gs_lightning.scaling.graph import AutogradGraph, GraphAnalysis, saved_tensor
from gs_lightning.scaling.limits import Bound, Limit, UnreadBound, describe, parse, rule_position
from gs_lightning.scaling.operators import Role, operator
from gs_lightning.scaling.plan import Exponent, exponent_vector, times_pow2
from gs_lightning.scaling.probes import detached, probe, rnn_probe, weight_probe_elements
from gs_lightning.scaling.underflow import (
    ExactSample,
    as_float64,
    branch_log2_scale,
    cast_min_log2_scale,
    cast_underflow_rate,
    constant,
    counted_rate,
    finite,
    gemm_min_log2_scale,
    gemm_sigma,
    gemm_underflow_rate,
    overflow_max_log2_scale,
    underflow_counts,
    where_or,
)


@dataclass(frozen=True)
class LayerScale:
    """What the last update chose for one decision point of the backward graph.

    Attributes:
        name: Layer name (qualified module name where known, ``".cast"`` appended for casts).
        kind: ``"gemm"``, ``"cast"``, ``"attention"``, ``"rnn"`` or ``"opaque"`` (a custom Function
            or a compiled region, scaled as one unit: see :meth:`NodeDecisions.settle_opaque`).
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
        input_gradient_shift: A GEMM's: the binades above ``log2_total`` what it sends on carries, where the recipe
            gives it a scale of its own (:attr:`~gs_lightning.scaling.recipe.ScalingRecipe.own_input_gradient_scale`);
            its weight and bias gradients carry ``log2_total``. 0 elsewhere.
    """

    name: str
    kind: str
    log2_scale: int
    log2_total: int
    underflow_rate: float
    measured_underflow: float | None = None
    limit: Limit = Limit.NONE
    limit_index: int | None = None
    input_gradient_shift: int = 0

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


@dataclass(frozen=True)
class UnreadLayer:
    """A decision as taken on the device: what its :class:`LayerScale` records, before the read that fills it in.

    ``decided`` is false where the statistics were not finite (the step will be skipped whatever the scale):
    the scale ``log2_scale`` passes through then, and no rate is recorded.
    """

    name: str
    kind: str
    log2_scale: Exponent
    alpha: Exponent  # the scale the node received
    bound: UnreadBound | None = None
    decided: bool | torch.Tensor = True
    input_shift: Exponent = 0

    def tensors(self) -> list[torch.Tensor]:
        """What to read."""
        index = None if self.bound is None else self.bound.index
        scalars = (self.log2_scale, self.alpha, index, self.decided, self.input_shift)
        return [t for t in scalars if isinstance(t, torch.Tensor)]

    def read(self, values: Mapping[torch.Tensor, float]) -> tuple[LayerScale, bool]:
        """The layer, with ``values`` holding :meth:`tensors` as read; and whether it decided."""
        beta, decided = int(_value(self.log2_scale, values)), bool(_value(self.decided, values))
        total = int(_value(self.alpha, values)) + beta
        if not decided or self.bound is None:
            return LayerScale(self.name, self.kind, beta, total, math.nan), decided
        bound = self.bound.read(values[self.bound.index])
        shift = int(_value(self.input_shift, values))
        return LayerScale(self.name, self.kind, beta, total, math.nan, None, *bound, shift), True


# rate(log2 scale, *statistics as read), its statistics
ModelledRate = tuple[Callable[..., float], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class UnreadRates:
    """A layer's underflow rates, filled in with the step's read (one synchronisation), not in the backward.

    The modelled rates are evaluated then too (they only report: no decision reads them), on the host,
    from their statistics as read. ``underflow_rate`` is the largest of the modelled and the measured
    rates (``if_none`` without any); ``measured_underflow`` the largest measured one (``None`` without
    any), or the same as ``underflow_rate`` where ``measured_is_rate``.
    """

    index: int  # the layer's position in its run's layers
    modelled: tuple[ModelledRate, ...]
    measured: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (below λmin, nonzero) counts: ExactSample.underflow_count
    if_none: float
    measured_is_rate: bool

    def tensors(self) -> list[torch.Tensor]:
        """The statistics and counts to read, in order."""
        return [t for _, statistics in self.modelled for t in statistics] + [
            t for counts in self.measured for t in counts
        ]

    def applied_to(self, layer: LayerScale, values: Iterator[float]) -> LayerScale:
        """``layer`` with its rates, ``values`` holding :meth:`tensors` as read."""
        # the models are of what a node sends on, which carries the GEMM's own scale where it has one
        sent = layer.log2_scale + layer.input_gradient_shift
        modelled = [rate(sent, *(next(values) for _ in statistics)) for rate, statistics in self.modelled]
        measured = [counted_rate(next(values), next(values)) for _ in self.measured]
        rate = max([*modelled, *measured], default=self.if_none)
        return replace(
            layer,
            underflow_rate=rate,
            measured_underflow=rate if self.measured_is_rate else max(measured, default=None),
        )


class NodeDecisions:
    """The scale of each decision point of one update run (module docstring), taken on the device.

    Args:
        graph: The walked backward graph.
        analysis: Its node classification.
        settings: Targets, ranges and the recipe.
        bounds: The caps and the rules' bounds on each node's scale.

    Attributes:
        layers: What each decision chose, in backward order: :class:`UnreadLayer` until :meth:`read_in`.
        finite_flags: (layer, values finite iff its gradient is), for
            :func:`~gs_lightning.scaling.gradient_stats.first_non_finite`.
        opaque_probes: Opaque node -> (probe scale, overflow bound of its input), until its outputs settle it.
        unread_rates: The layers' rates, filled in with the step's read (:meth:`UnreadRates.applied_to`):
            their rates in :attr:`layers` are NaN until then.
        undecided: The positions in :attr:`layers` of decisions that found no finite statistics (once read in).
        weight_binds: GEMM -> whether its Cauchy–Schwarz weight-gradient bound held its scale below γ' (0-dim, unread).
        unmeasured: The GEMMs whose weight gradients were not measured (:attr:`Settings.measured_weight_nodes`).
        weight_bound: The GEMMs of :attr:`weight_binds` where it held (once read in).
    """

    def __init__(self, graph: AutogradGraph, analysis: GraphAnalysis, settings: Settings, bounds: ScaleBounds) -> None:
        self.graph, self.analysis, self.settings, self.bounds = graph, analysis, settings, bounds
        self.layers: list[LayerScale | UnreadLayer] = []
        self.finite_flags: FiniteFlags = []
        self.opaque_probes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.unread_rates: list[UnreadRates] = []
        self.undecided: set[int] = set()  # positions in layers, once read in
        self.weight_binds: dict[int, torch.Tensor] = {}
        self.unmeasured: set[int] = set()
        self.weight_bound: set[int] = set()  # once read in
        self.input_shifts: dict[int, tuple[tuple[int, ...], Exponent]] = {}  # GEMM -> its edges, their own scale

    def decide(
        self, i: int, grad: torch.Tensor, grad_extremes: Extremes, grads: list[torch.Tensor], alpha: Exponent
    ) -> Exponent:
        """The local log2 scale β of GEMM, fused or cast node ``i``, whose incoming gradient ``grad`` (of ``grads``,
        the present ones) carries the accumulated scale ``alpha``; recorded in :attr:`layers`. Unread."""
        if i in self.analysis.gemms:
            return self.gemm_scale(i, grad, grad_extremes, alpha)
        if i in self.analysis.fused:
            return self.fused_scale(i, grad, grad_extremes, alpha, grads)
        return self.cast_scale(i, grad, grad_extremes, alpha)

    def common(self, parts: list[tuple[torch.Tensor, Exponent]], i: int, summed: bool = False) -> Exponent:
        """Algorithm 1, line 17: one scale for gradients that carry different ones.

        ``summed``: the parts are added (a branch), so the bound is on their sum, Σ max|∇X_i| / α_i,
        not on each part; it is checked even when they share a scale if the sum is taken in a low
        precision, where it can overflow though every part is finite (a weight used three times
        under autocast): :attr:`ScalingRecipe.branch_sum_bound`, without which each part is bounded
        alone. Either bound keeps :attr:`ScalingRecipe.replay_headroom_log2`. Taken on the
        parts' device: the scale is returned there, unread.

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
        on_device = any(isinstance(a, torch.Tensor) for a in alphas)
        device = parts[0][0].device
        # the smallest incoming scale, where shifting the others down is exact (a sum in a wider format) or where
        # parts may carry their GEMMs' own scales (raised for the values they hold, not for a sum to share them)
        wide = not low_precision and self.settings.recipe.wide_branch_scale == "smallest"
        if summed and (wide or self.settings.own_input_scale):
            return self.bounds.capped(exponent_vector(alphas, device).amin() if on_device else min(alphas), i)
        sum_bound = summed and self.settings.recipe.branch_sum_bound
        low_precision_sum = sum_bound and len(parts) > 1 and low_precision
        known_equal = all(a is alphas[0] for a in alphas) or (not on_device and len(set(alphas)) == 1)
        if known_equal and not low_precision_sum:
            return alphas[0]
        exponents = exponent_vector(alphas, device)
        pairs = [v for g, _ in parts for v in extremes(g)]
        same_dtype = all(v.dtype == pairs[0].dtype for v in pairs)  # else parts of several dtypes: each widened
        low_high = (torch.stack(pairs).double() if same_dtype else torch.stack([v.double() for v in pairs])).view(-1, 2)
        true_maxima = low_high.abs().amax(dim=1) * torch.exp2(-exponents)  # NaN where a part holds one
        largest = true_maxima.sum() if sum_bound else true_maxima.amax()
        gain = self.bounds.gains_after.get(i)
        largest = largest if gain is None else largest * gain.to(device)
        headroom = self.settings.recipe.replay_headroom_log2
        chosen = self.bounds.capped(branch_log2_scale(exponents, largest * 2.0**headroom, self.settings.lambda_max), i)
        if low_precision_sum:
            return chosen
        first = exponents[0]
        return torch.where((exponents == first).all(), first, chosen)

    def gemm_scale(self, i: int, grad: torch.Tensor, grad_extremes: Extremes, alpha: Exponent) -> Exponent:
        """Theorem 1 (exact for small N) and the probed outputs (what it sends on, its weight gradient): the largest
        scale.

        The first layer sends no activation gradient on: its weight gradients alone decide its scale.
        """
        s, op = self.settings, operator(self.graph.names[i])
        operands = [(k, op.operands[k](self.graph, i, grad)) for k in self.analysis.gemms[i]]
        operands = [(k, op) for k, op in operands if op.operand is not None]
        node = self.graph.nodes[i]
        weight_bounds = (
            op.weight_bound(node, grad, self.analysis.weight_edges[i])
            if op.weight_bound is not None and s.recipe.weight_grad_bounds
            else {}
        )
        # operands unreadable (two activations under checkpointing)
        if not operands and self.analysis.gemms[i] and not weight_bounds:
            return self.non_finite(i, "gemm", alpha)
        if not operands and not weight_bounds:  # operands unreadable (checkpointed), or nothing to send on
            return 0
        recipe, device = s.recipe, grad.device
        sent_values = (
            [
                v
                for v in (probe(node, grad, k, op.operand, recipe.probe_elements) for k, op in operands)
                if v is not None
            ]
            if recipe.exact_probes
            else []
        )
        weight_values = self._weight_samples(i, grad) if recipe.exact_probes else []
        sent, weight_samples = [ExactSample(v) for v in sent_values], [ExactSample(v) for v in weight_values]
        grad_rms, grad_max = rms(grad).double(), magnitude(grad_extremes)
        operand_rms = [rms(op.operand).double() for _, op in operands]
        operand_max = [magnitude(extremes(op.operand)) for _, op in operands]
        weight_stats = {limit: bound.double() for limit, bound in weight_bounds.items()}
        # a non-finite gradient or forward: the step is skipped whatever the scale
        decided = all_finite([grad_max, *operand_rms, *operand_max, *weight_stats.values()])
        lengths = [s.relu_factor * op.accumulation_length for _, op in operands]
        sigmas = [gemm_sigma(n, grad_rms, operand_rms[k]) for k, n in enumerate(lengths)]
        lower_sent = [
            gemm_min_log2_scale(sigma, s.lambda_min, s.underflow_rate, n) for sigma, n in zip(sigmas, lengths)
        ] + [v.min_log2_scale(s.lambda_min, s.underflow_rate) for v in sent]
        lower_weights = [v.min_log2_scale(s.lambda_min, s.underflow_rate) for v in weight_samples]
        lower = largest(lower_sent + lower_weights, device)
        maxima = {
            Bound(Limit.INCOMING_GRADIENT): grad_max,
            **{
                Bound(Limit.INPUT_GRADIENT, k): _grown(
                    op.accumulation_length * grad_max * operand_max[j], self.bounds.gain_into(self.graph.edges[i][k])
                )
                for j, (k, op) in enumerate(operands)
            },
            **{Bound(limit): bound for limit, bound in weight_stats.items()},
            **self.bounds.expected_maxima(i, alpha, device),
        }
        bounds, weight = list(maxima), Bound(Limit.WEIGHT_GRADIENT)
        # Where the steps' reads expect its parameter gradients, that bound (among maxima) covers the weight gradient
        # on the batches to come: the Cauchy–Schwarz one gives way to it, unmeasured. Not on a retried step, whose batch
        # went beyond what was expected. Elsewhere the exact weight gradient, on the GEMMs the settings name (None:
        # every one; every one on a retried step's too).
        expected = not s.retrying and i in self.bounds.expected
        measures = (
            weight in maxima
            and recipe.exact_probes
            and not expected
            and (s.retrying or s.measured_weight_nodes is None or i in s.measured_weight_nodes)
        )
        measured = self._measured_weight_maximum(i, grad) if measures else None
        limits = overflow_max_log2_scale(
            torch.stack([*maxima.values(), *([] if measured is None else [measured])]), s.lambda_max
        )
        # where the Cauchy–Schwarz bound keeps the scale from γ', the measured one (the last limit)
        if weight in maxima:
            w, bounded = bounds.index(weight), limits[: len(bounds)]
            limit = bounded[w]
            binds = (limit < lower.clamp_min(0.0)) & (bounded.amin() == limit)
            if recipe.exact_probes:
                self.weight_binds[i] = binds
            if recipe.exact_probes and not measures and not expected:  # it stands on this update; the next measures it
                self.unmeasured.add(i)
            else:  # none measured (expected; without exact probes, from an unreadable input): it binds nowhere
                relaxed = (
                    constant(math.inf, device, limits.dtype) if measured is None else torch.maximum(limit, limits[-1])
                )
                bounded = torch.where(_one_hot(len(bounds), w, device) & binds, relaxed, bounded)
            limits = bounded
        beta, bound = self.bounds.choose(i, alpha, lower, bounds, limits)
        if i in s.previous_totals:  # all zeros: nothing to decide on, the plan's scale stays
            zero = grad_max == 0.0
            beta = torch.where(zero, as_float64(s.previous_totals[i], device) - as_float64(alpha, device), beta)
            kept = constant(rule_position(Limit.KEPT_ON_ZERO_GRADIENT), device, bound.index.dtype)
            bound = bound._replace(index=torch.where(zero, kept, bound.index))
        beta = where_or(decided, beta, 0.0)
        shift: Exponent = 0
        if s.own_input_scale and self._shiftable(i, operands):
            shift = self._input_shift(
                i, alpha, beta, largest(lower_sent, device), bounds, limits, operands, operand_max
            )
            shift = where_or(decided & (grad_max > 0.0) & finite(shift), shift, 0.0) if shift is not None else 0
            self.input_shifts[i] = (tuple(k for k, _ in operands), shift)
        modelled = [
            (partial(gemm_underflow_rate, lambda_min=s.lambda_min, accumulation_length=n), (sigma,))
            for sigma, n in zip(sigmas, lengths)
        ]
        measured = (
            underflow_counts(sent, beta + shift, s.lambda_min) + underflow_counts(weight_samples, beta, s.lambda_min)
            if isinstance(shift, torch.Tensor)
            else underflow_counts([*sent, *weight_samples], beta, s.lambda_min)
        )
        layer = UnreadLayer(self.analysis.layer_names[i], "gemm", beta, alpha, bound, decided, shift)
        self._add(layer, modelled, measured)
        return beta

    def _input_shift(
        self,
        i: int,
        alpha: Exponent,
        beta: torch.Tensor,
        lower_sent: torch.Tensor,
        bounds: list[Bound],
        limits: torch.Tensor,
        operands: list[tuple[int, Any]],
        operand_max: list[torch.Tensor],
    ) -> torch.Tensor | None:
        """The binades above its scale ``alpha + beta`` that GEMM ``i`` sends on at: what γ' asks of it, within its own
        overflow bounds (``bounds``' of what it sends on), the caps, and the largest it sent on in the recent replays
        (:attr:`Settings.sent_maxima`) with the expected maxima's margin, grown by the batch norms it reaches before
        the next decision, a branch's sum's included; its weight times the factor finite in the weight's own format.
        ``None`` before a replay measured what it sends on (then it sends at the node's scale, and the replays
        measure it). A 0-dim float64 tensor, unread."""
        s, device = self.settings, beta.device
        expected = s.sent_maxima.get(i)
        if expected is None:
            return None
        positions = [k for k, bound in enumerate(bounds) if bound.limit in _SENT_LIMITS]
        beta_sent, _ = self.bounds.choose(
            i,
            alpha,
            lower_sent,
            [bounds[k] for k in positions],
            limits.index_select(0, _positions(tuple(positions), device)),
        )
        edges = self.graph.edges[i]
        gains = [g.to(device) for k, _ in operands if (g := self.bounds.gains_after.get(edges[k][0])) is not None]
        grown = _grown(as_float64(expected, device), largest(gains, device) if gains else None)
        margin = s.recipe.expected_maxima_margin_log2 or 0.0
        # the highest accumulated scale that keeps it the margin below λmax, an integer strictly below
        highest_total = torch.ceil(overflow_max_log2_scale(grown, s.lambda_max) - margin) - 1.0
        ceilings = [
            beta_sent - beta,
            highest_total - (alpha + beta),
            *(
                torch.ceil(overflow_max_log2_scale(largest_value, torch.finfo(op.operand.dtype).max)) - 1.0
                for largest_value, (_, op) in zip(operand_max, operands)
            ),
        ]
        return torch.stack(ceilings).amin().clamp_min(0.0)

    def _shiftable(self, i: int, operands: list[tuple[int, Any]]) -> bool:
        """Whether GEMM ``i`` can send on at a scale of its own: it computes parameter gradients (what holds its
        scale below what it sends on needs), and each edge it sends along has a saved operand of its own to scale
        (:attr:`~gs_lightning.scaling.operators.Operator.sent_operands`), readable (no saved-tensor hooks of
        another's), and leads to a node, not a leaf (whose gradient is unscaled by the node's scale)."""
        names = operator(self.graph.names[i]).sent_operands
        if not operands or not self.analysis.weight_edges.get(i) or names is None:
            return False
        node, edges = self.graph.nodes[i], self.graph.edges[i]
        return all(
            k in names
            and edges[k] is not None
            and edges[k][0] not in self.analysis.leaves
            and saved_tensor(node, names[k]) is not None
            for k, _ in operands
        )

    def _weight_samples(self, i: int, grad: torch.Tensor, elements: int | None = None) -> list[torch.Tensor]:
        """Exact fp32 values of a slice of each weight gradient GEMM node ``i`` outputs from ``grad``.

        What the node sends on does not show a weight gradient's small values: on SSD300's heads and
        extra layers, few positions and sparse ∇Y leave them 17-28 binades below the largest (README
        "How it works"). At most ``elements`` values each (default :func:`weight_probe_elements` with the
        recipe's budgets); none where the node's input is unreadable (non-reentrant checkpointing).
        """
        recipe = self.settings.recipe
        node, elements = (
            self.graph.nodes[i],
            elements or weight_probe_elements(grad, recipe.weight_probe_elements, recipe.weight_probe_macs),
        )
        return [
            values
            for k in self.analysis.weight_edges[i]
            if (values := probe(node, grad, k, None, elements)) is not None
        ]

    def _measured_weight_maximum(self, i: int, grad: torch.Tensor) -> torch.Tensor | None:
        """The largest value of GEMM ``i``'s weight gradients, computed in fp32, times
        :attr:`ScalingRecipe.weight_grad_margin_log2`
        to spare: one more GEMM, on the update iterations of the layers in :attr:`Settings.measured_weight_nodes`.
        ``None`` without exact probes (the Cauchy–Schwarz bound then binds nowhere it would keep the scale from γ')."""
        exact = self._weight_samples(i, grad, elements=sys.maxsize) if self.settings.recipe.exact_probes else []
        if not exact:
            return None
        most = torch.stack([magnitude(extremes(values)) for values in exact]).amax()
        return most * 2.0**self.settings.recipe.weight_grad_margin_log2

    def cast_scale(self, i: int, grad: torch.Tensor, grad_extremes: Extremes, alpha: Exponent) -> Exponent:
        """An order statistic of the fp32 gradient itself (Theorem 2's log-normal model misjudges others);
        Theorem 2 where the recipe has no exact probes."""
        if not self.settings.recipe.exact_probes:
            return self._log_normal_cast_scale(i, grad, grad_extremes, alpha)
        return self._sampled_scale(i, "cast", [grad], grad_extremes, alpha)

    def _log_normal_cast_scale(self, i: int, grad: torch.Tensor, grad_extremes: Extremes, alpha: Exponent) -> Exponent:
        """Theorem 2: ln|∇y| over the nonzero elements taken as N(μ, σ²), the paper's model of a cast."""
        s = self.settings
        magnitudes_ = detached(grad).float().abs()
        nonzero = magnitudes_ > 0.0
        count = nonzero.sum()
        logs = where_or(nonzero, magnitudes_.clamp_min(torch.finfo(torch.float32).tiny).log(), 0.0)
        mean = logs.sum() / count.clamp_min(1)
        variance = where_or(nonzero, (logs - mean) ** 2, 0.0).sum() / count.clamp_min(1)
        grad_max = magnitude(grad_extremes)
        decided = torch.isfinite(grad_max) & (count > 0)
        log_mean, log_std = mean.double(), variance.double().clamp_min(0.0).sqrt()
        lower = cast_min_log2_scale(log_mean, log_std, s.lambda_min, s.underflow_rate)
        beta, bound = self.bounds.choose(
            i, alpha, lower, [Bound(Limit.INCOMING_GRADIENT)], overflow_max_log2_scale(grad_max, s.lambda_max).view(1)
        )
        beta = where_or(decided, beta, 0.0)
        modelled = [(partial(cast_underflow_rate, lambda_min=s.lambda_min), (log_mean, log_std))]
        self._add(UnreadLayer(self.analysis.layer_names[i], "cast", beta, alpha, bound, decided), modelled, [])
        return beta

    def fused_scale(
        self, i: int, grad: torch.Tensor, grad_extremes: Extremes, alpha: Exponent, grads: list[torch.Tensor]
    ) -> Exponent:
        """Fused attention or RNN: exact fp32 probes of what it sends on (none under checkpointing)."""
        node = self.graph.nodes[i]
        if operator(self.graph.names[i]).role is Role.RNN:
            kind, samples = (
                "rnn",
                [rnn_probe(node, grads, k, self.settings.recipe.probe_elements) for k in self.analysis.fused[i]],
            )
        else:
            kind, samples = (
                "attention",
                [probe(node, grad, k, None, self.settings.recipe.probe_elements) for k in self.analysis.fused[i]],
            )
        return self._sampled_scale(i, kind, [v for v in samples if v is not None], grad_extremes, alpha)

    def _sampled_scale(
        self, i: int, kind: str, samples: list[torch.Tensor], grad_extremes: Extremes, alpha: Exponent
    ) -> Exponent:
        s = self.settings
        if not samples:
            return self.non_finite(i, kind, alpha)
        device = grad_extremes[0].device
        exact = [ExactSample(v) for v in samples]
        grad_max, sample_max = magnitude(grad_extremes), [magnitude(extremes(v)) for v in samples]
        decided = all_finite([grad_max, *sample_max])
        lower = largest([v.min_log2_scale(s.lambda_min, s.underflow_rate) for v in exact], device)
        gains = [gain for edge in self.graph.edges[i] if (gain := self.bounds.gain_into(edge)) is not None]
        gain = largest(gains, device) if gains else None  # whichever edge a sample left by
        bounds = [
            Bound(Limit.INCOMING_GRADIENT),
            *(Bound(Limit.OUTPUT, k if len(sample_max) > 1 else None) for k in range(len(sample_max))),
        ]
        limits = overflow_max_log2_scale(torch.stack([grad_max, *(_grown(m, gain) for m in sample_max)]), s.lambda_max)
        beta, bound = self.bounds.choose(i, alpha, lower, bounds, limits)
        beta = where_or(decided, beta, 0.0)
        measured = underflow_counts(exact, beta, s.lambda_min)
        self._add(
            UnreadLayer(self.analysis.layer_names[i], kind, beta, alpha, bound, decided),
            [],
            measured,
            measured_is_rate=True,
        )
        return beta

    def opaque_probe(self, i: int, grad_extremes: Extremes, alpha: Exponent) -> torch.Tensor:
        """An opaque region's scale on its update iteration: its incoming gradient
        :attr:`ScalingRecipe.opaque_probe_headroom_log2` below λmax."""
        device = grad_extremes[0].device
        upper = overflow_max_log2_scale(magnitude(grad_extremes), self.settings.lambda_max)
        # ceil(upper) - 1: the highest scale strictly below the overflow; the headroom below that
        beta = where_or(finite(upper), torch.ceil(upper) - 1.0 - self.settings.recipe.opaque_probe_headroom_log2, 0.0)
        ceiling = self.bounds.ceiling(i, alpha, device)
        beta = beta if ceiling is None else torch.minimum(beta, ceiling)
        self.opaque_probes[i] = (beta, upper)
        return beta

    def settle_opaque(self, i: int, out: list[torch.Tensor | None], alpha: Exponent) -> Exponent:
        """Scale an opaque region as a dynamic loss scale would: :attr:`ScalingRecipe.opaque_margin_log2` binades below
        the overflow of what entered or left it.

        What left it was computed at the probe scale; it is shifted (exactly, a power of two) to the
        scale chosen, which the iterations until the next update replay. Returns the scale its
        outgoing gradients carry; ``out`` is shifted in place. Where those are not finite the step is
        skipped and the back-off lowers the probe: the probe scale stays.
        """
        probe_scale, upper_in = self.opaque_probes.pop(i)
        alpha_in, name, device = alpha - probe_scale, self.analysis.layer_names[i], probe_scale.device
        grads = [g for g in out if g is not None and g.is_floating_point()]
        pairs = [extremes(g) for g in grads]
        if pairs:
            self.finite_flags.append((name, tuple(v for pair in pairs for v in pair)))
        maxima = [magnitude(pair) for pair in pairs]
        decided = all_finite(maxima) if maxima else True
        upper = torch.stack(
            [upper_in, *(probe_scale + overflow_max_log2_scale(m, self.settings.lambda_max) for m in maxima)]
        ).amin()
        # ceil(upper) - 1: the highest scale strictly below the overflow; the margin below that
        beta = where_or(finite(upper), torch.ceil(upper) - (1.0 + self.settings.recipe.opaque_margin_log2), 0.0)
        ceiling = self.bounds.ceiling(i, alpha_in, device)
        beta = beta if ceiling is None else torch.minimum(beta, ceiling)
        beta = torch.where(decided, beta, probe_scale) if maxima else beta
        for k, g in enumerate(out):
            out[k] = times_pow2(g, beta - probe_scale) if g is not None and g.is_floating_point() else g
        exact = [ExactSample(g) for g in grads if g.numel()]
        measured = underflow_counts(exact, beta - probe_scale, self.settings.lambda_min)
        self._add(
            UnreadLayer(name, "opaque", beta, alpha_in, None, decided),
            [],
            measured,
            if_none=math.nan,
            measured_is_rate=True,
        )
        return alpha_in + beta

    def _add(
        self,
        layer: UnreadLayer,
        modelled: list[ModelledRate],
        measured: list[tuple[torch.Tensor, torch.Tensor]],
        if_none: float = 0.0,
        measured_is_rate: bool = False,
    ) -> None:
        """Record ``layer``, its underflow rates filled in with the step's read (:class:`UnreadRates`)."""
        self.unread_rates.append(
            UnreadRates(len(self.layers), tuple(modelled), tuple(measured), if_none, measured_is_rate)
        )
        self.layers.append(layer)

    def non_finite(self, i: int, kind: str, alpha: Exponent) -> int:
        """No decision (no statistics to decide on): the scale passes through."""
        self.layers.append(UnreadLayer(self.analysis.layer_names[i], kind, 0, alpha, None, False))
        return 0

    def unread(self) -> list[torch.Tensor]:
        """What :meth:`read_in` needs read: the decisions' scales, reasons and whether they decided, the weight
        bounds' flags."""
        return [t for layer in self.layers if isinstance(layer, UnreadLayer) for t in layer.tensors()] + list(
            self.weight_binds.values()
        )

    def read_in(self, values: Mapping[torch.Tensor, float]) -> None:
        """Every :class:`UnreadLayer` a :class:`LayerScale`, ``values`` holding :meth:`unread` as read; the layers that
        did not decide into :attr:`undecided` (their rates are not applied: they stay NaN)."""
        self.weight_bound = {i for i, binds in self.weight_binds.items() if values[binds]}
        for k, layer in enumerate(self.layers):
            if isinstance(layer, UnreadLayer):
                self.layers[k], decided = layer.read(values)
                if not decided:
                    self.undecided.add(k)


# The bounds on what a GEMM sends on (and on the gradients it reaches before the next decision): those its own
# scale keeps, where it has one.
_SENT_LIMITS = frozenset({Limit.INPUT_GRADIENT, Limit.FED_PARAMETER_GRADIENTS})


def largest(values: list[torch.Tensor], device: torch.device, default: float = -math.inf) -> torch.Tensor:
    """The largest of the 0-dim float64 ``values`` (``default`` without any, on ``device``); a single one as it is."""
    if len(values) == 1:
        return values[0]
    return torch.stack(values).amax() if values else as_float64(default, device)


@lru_cache(maxsize=256)
def _one_hot(size: int, position: int, device: torch.device) -> torch.Tensor:
    """A bool vector on ``device``, true at ``position`` only: made once per (size, position, device), never written
    to."""
    return torch.arange(size, device=device) == position


@lru_cache(maxsize=256)
def _positions(positions: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``positions`` as an int64 index on ``device``: made once per (positions, device), filled in there (an index
    copied from the host would wait for the device), never written to."""
    index = torch.zeros(len(positions), dtype=torch.int64, device=device)
    for k, position in enumerate(positions):
        index[k] = position
    return index


def _grown(bound: torch.Tensor, gain: torch.Tensor | None) -> torch.Tensor:
    """A float64 ``bound`` on a gradient times the ``gain`` it may still see (:meth:`ScaleBounds.gain_into
    <gs_lightning.scaling.bounds.ScaleBounds.gain_into>`): itself where there is none."""
    return bound if gain is None else bound * gain.to(bound.device, torch.float64)


def _value(value: Exponent | bool, values: Mapping[torch.Tensor, float]) -> float:
    """``value`` as read (in ``values``) where it is a tensor."""
    return values[value] if isinstance(value, torch.Tensor) else value
