"""The decision core: a node's statistics and bounds turned into its power-of-two scale (paper Algorithm 1).

Each kind of decision point has its rule: a GEMM (Theorem 1, with exact probes of what it sends on and of
its weight gradient), a cast (an order statistic of the gradient, or Theorem 2), fused attention and RNNs
(exact probes), an opaque region (a dynamic loss scale's rule), and the merge of gradients that carry
different scales (Algorithm 1, line 17). Every rule measures a few statistics of the tensors at hand, reads
them to the host in one synchronisation, and leaves the choice to :meth:`ScaleBounds.choose
<gs_lightning.scaling.bounds.ScaleBounds.choose>`. What each chose is a :class:`LayerScale`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import torch

from gs_lightning.scaling.bounds import ScaleBounds, Settings
from gs_lightning.scaling.formats import FORMATS
from gs_lightning.scaling.gradient_stats import (
    Extremes,
    FiniteFlags,
    OrderStatistics,
    extremes,
    magnitude,
    magnitudes,
    read,
    rms,
    stats_and_samples,
)
from gs_lightning.scaling.graph import GEMM_OPERANDS, RNN_NODES, WEIGHT_GRAD_BOUNDS, AutogradGraph, GraphAnalysis
from gs_lightning.scaling.limits import Bound, Limit, describe, parse
from gs_lightning.scaling.plan import Exponent, times_pow2
from gs_lightning.scaling.probes import detached, probe, rnn_probe, weight_probe_elements
from gs_lightning.scaling.underflow import (
    ExactSample,
    branch_log2_scale,
    cast_min_log2_scale,
    cast_underflow_rate,
    counted_rate,
    gemm_min_log2_scale,
    gemm_sigma,
    gemm_underflow_rate,
    overflow_max_log2_scale,
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


Rate = float | tuple[torch.Tensor, torch.Tensor]  # an underflow rate, or its counts on the device (ExactSample.underflow_count)


@dataclass(frozen=True)
class UnreadRates:
    """A layer's underflow rates, filled in with the step's read (one synchronisation), not in the backward.

    The modelled rates are evaluated then too (they only report: no decision reads them), outside the hook,
    where host arithmetic runs between no kernels. ``underflow_rate`` is the largest of the modelled and the
    measured rates (``if_none`` without any); ``measured_underflow`` the largest measured one (``None``
    without any), or the same as ``underflow_rate`` where ``measured_is_rate``.
    """

    index: int  # the layer's position in its run's layers
    modelled: tuple[Callable[[], float], ...]  # each evaluates one modelled rate
    measured: tuple[Rate, ...]
    if_none: float
    measured_is_rate: bool

    def tensors(self) -> list[torch.Tensor]:
        """The counts to read, in order."""
        return [t for rate in self.measured if not isinstance(rate, float) for t in rate]

    def applied_to(self, layer: LayerScale, values: Iterator[float]) -> LayerScale:
        """``layer`` with its rates, ``values`` holding :meth:`tensors` as read."""
        measured = [rate if isinstance(rate, float) else counted_rate(next(values), next(values)) for rate in self.measured]
        rate = max([*(model() for model in self.modelled), *measured], default=self.if_none)
        return replace(layer, underflow_rate=rate, measured_underflow=rate if self.measured_is_rate else max(measured, default=None))


class NodeDecisions:
    """The scale of each decision point of one update run (module docstring).

    Args:
        graph: The walked backward graph.
        analysis: Its node classification.
        settings: Targets, ranges and the recipe.
        bounds: The caps and the rules' bounds on each node's scale.

    Attributes:
        layers: What each decision chose, in backward order.
        finite_flags: (layer, values finite iff its gradient is), for :func:`~gs_lightning.scaling.gradient_stats.first_non_finite`.
        opaque_probes: Opaque node -> (probe scale, overflow bound of its input), until its outputs settle it.
        unread_rates: The layers whose rates are filled in with the step's read (modelled, or counted on the device):
            their rates in :attr:`layers` are NaN until :meth:`UnreadRates.applied_to` reads them in.
        read_exponents: Exponents :meth:`common` left on the device -> their values, as the decisions below read them.
    """

    def __init__(self, graph: AutogradGraph, analysis: GraphAnalysis, settings: Settings, bounds: ScaleBounds) -> None:
        self.graph, self.analysis, self.settings, self.bounds = graph, analysis, settings, bounds
        self.layers: list[LayerScale] = []
        self.finite_flags: FiniteFlags = []
        self.opaque_probes: dict[int, tuple[int, float]] = {}
        self.unread_rates: list[UnreadRates] = []
        self.read_exponents: dict[torch.Tensor, int] = {}  # exponents merges left on the device, as decisions read them

    def decide(self, i: int, grad: torch.Tensor, grad_extremes: Extremes, grads: list[torch.Tensor], alpha: Exponent) -> int:
        """The local log2 scale β of GEMM, fused or cast node ``i``, whose incoming gradient ``grad`` (of ``grads``,
        the present ones) carries the accumulated scale ``alpha``; recorded in :attr:`layers`."""
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
        under autocast). Either bound keeps :attr:`ScalingRecipe.replay_headroom_log2`. Taken on the
        parts' device: the scale is returned there, unread (the next decision reads it with its own statistics).

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
        if summed and not low_precision and self.settings.recipe.wide_branch_scale == "smallest":
            return self.bounds.capped(_stacked(alphas, parts[0][0].device).amin() if on_device else min(alphas), i)
        low_precision_sum = summed and len(parts) > 1 and low_precision
        known_equal = all(a is alphas[0] for a in alphas) or (not on_device and len(set(alphas)) == 1)
        if known_equal and not low_precision_sum:
            return alphas[0]
        exponents = _stacked(alphas, parts[0][0].device)
        low_high = torch.stack([v.double() for g, _ in parts for v in extremes(g)]).view(-1, 2)  # parts of several dtypes
        true_maxima = torch.maximum(-low_high[:, 0], low_high[:, 1]) * torch.exp2(-exponents)  # NaN where a part holds one
        largest = (true_maxima.sum() if summed else true_maxima.amax()) * self.bounds.gains_after.get(i, 1.0)
        headroom = self.settings.recipe.replay_headroom_log2
        chosen = self.bounds.capped(branch_log2_scale(exponents, largest * 2.0**headroom, self.settings.lambda_max), i)
        return chosen if low_precision_sum else torch.where((exponents == exponents[0]).all(), exponents[0], chosen)

    def gemm_scale(self, i: int, grad: torch.Tensor, grad_extremes: Extremes, alpha: Exponent) -> int:
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
            return self.non_finite(i, "gemm", alpha)
        if not operands and not weight_bounds:  # operands unreadable (checkpointed), or nothing to send on
            return 0
        recipe = s.recipe
        sent = [v for v in (probe(node, grad, k, op.operand, recipe.probe_elements) for k, op in operands) if v is not None] if recipe.exact_probes else []
        samples = [ExactSample(v) for v in (*sent, *self._weight_samples(i, grad))] if recipe.exact_probes else []
        (grad_rms, *values), orders, alpha = self._read(
            [rms(grad), *grad_extremes, *(v for _, op in operands for v in (rms(op.operand), *extremes(op.operand))), *weight_bounds.values()],
            samples,
            alpha,
        )
        grad_max = magnitude(*values[:2])
        if not math.isfinite(grad_max):  # the step will be skipped whatever the scale
            return self.non_finite(i, "gemm", alpha)
        operand_values, weight_values = values[2 : 2 + 3 * len(operands)], values[2 + 3 * len(operands) :]
        operand_stats = [v for k in range(len(operands)) for v in (operand_values[3 * k], magnitude(*operand_values[3 * k + 1 : 3 * k + 3]))]
        if not all(map(math.isfinite, (*operand_stats, *weight_values))):  # a non-finite forward: skipped whatever the scale
            return self.non_finite(i, "gemm", alpha)
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
                    op.accumulation_length * grad_max * operand_stats[2 * j + 1] * self.bounds.gain_into(self.graph.edges[i][k]), s.lambda_max
                )
                for j, (k, op) in enumerate(operands)
            },
            **{Bound(Limit(tensor)): overflow_max_log2_scale(bound, s.lambda_max) for tensor, bound in weight_stats.items()},
        }
        limits.update(self.bounds.expected_limits(i, alpha))
        wanted = max(lower, 0.0)  # β is never below 0 unless an overflow bound forces it
        weight = Bound(Limit.WEIGHT_GRADIENT)
        if limits.get(weight, math.inf) < wanted and min(limits.values()) == limits[weight]:
            limits[weight] = max(limits[weight], self._measured_weight_limit(i, grad))
        beta, limit = self.bounds.choose(i, alpha, lower, limits)
        modelled = [partial(gemm_underflow_rate, beta, sigma, s.lambda_min, n) for sigma, n in zip(sigmas, lengths)]
        measured = [v.underflow_count(beta, s.lambda_min) for v in samples]
        self._add(LayerScale(self.analysis.layer_names[i], "gemm", beta, alpha + beta, math.nan, None, *limit), modelled, measured)
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

    def cast_scale(self, i: int, grad: torch.Tensor, grad_extremes: Extremes, alpha: Exponent) -> int:
        """An order statistic of the fp32 gradient itself (Theorem 2's log-normal model misjudges others);
        Theorem 2 where the recipe has no exact probes."""
        if not self.settings.recipe.exact_probes:
            return self._log_normal_cast_scale(i, grad, grad_extremes, alpha)
        return self._sampled_scale(i, "cast", [grad], grad_extremes, alpha)

    def _log_normal_cast_scale(self, i: int, grad: torch.Tensor, grad_extremes: Extremes, alpha: Exponent) -> int:
        """Theorem 2: ln|∇y| over the nonzero elements taken as N(μ, σ²), the paper's model of a cast."""
        s = self.settings
        magnitudes_ = detached(grad).float().abs()
        nonzero = magnitudes_ > 0.0
        count = nonzero.sum()
        logs = torch.where(nonzero, magnitudes_.clamp_min(torch.finfo(torch.float32).tiny).log(), 0.0)
        mean = logs.sum() / count.clamp_min(1)
        variance = torch.where(nonzero, (logs - mean) ** 2, 0.0).sum() / count.clamp_min(1)
        (low, high, log_mean, log_variance, nonzero_count), _, alpha = self._read([*grad_extremes, mean, variance, count], [], alpha)
        grad_max = magnitude(low, high)
        if not math.isfinite(grad_max) or nonzero_count == 0:
            return self.non_finite(i, "cast", alpha)
        log_std = math.sqrt(max(log_variance, 0.0))
        lower = cast_min_log2_scale(log_mean, log_std, s.lambda_min, s.underflow_rate)
        beta, limit = self.bounds.choose(i, alpha, lower, {Bound(Limit.INCOMING_GRADIENT): overflow_max_log2_scale(grad_max, s.lambda_max)})
        rate = cast_underflow_rate(beta, log_mean, log_std, s.lambda_min)
        self.layers.append(LayerScale(self.analysis.layer_names[i], "cast", beta, alpha + beta, rate, None, *limit))
        return beta

    def fused_scale(self, i: int, grad: torch.Tensor, grad_extremes: Extremes, alpha: Exponent, grads: list[torch.Tensor]) -> int:
        """Fused attention or RNN: exact fp32 probes of what it sends on (none under checkpointing)."""
        node, name = self.graph.nodes[i], self.graph.names[i]
        if name in RNN_NODES:
            kind, samples = "rnn", [rnn_probe(node, grads, k, self.settings.recipe.probe_elements) for k in self.analysis.fused[i]]
        else:
            kind, samples = "attention", [probe(node, grad, k, None, self.settings.recipe.probe_elements) for k in self.analysis.fused[i]]
        return self._sampled_scale(i, kind, [v for v in samples if v is not None], grad_extremes, alpha)

    def _sampled_scale(self, i: int, kind: str, samples: list[torch.Tensor], grad_extremes: Extremes, alpha: Exponent) -> int:
        s = self.settings
        if not samples:
            return self.non_finite(i, kind, alpha)
        exact = [ExactSample(v) for v in samples]
        pairs = [grad_extremes, *(extremes(v) for v in samples)]
        values, orders, alpha = self._read([v for pair in pairs for v in pair], exact, alpha)
        (grad_max, *sample_max) = [magnitude(values[2 * k], values[2 * k + 1]) for k in range(len(pairs))]
        if not all(map(math.isfinite, (grad_max, *sample_max))):
            return self.non_finite(i, kind, alpha)
        lower = max(v.min_log2_scale(s.lambda_min, s.underflow_rate, read) for v, read in zip(exact, orders))
        limits = {Bound(Limit.INCOMING_GRADIENT): overflow_max_log2_scale(grad_max, s.lambda_max)}
        gain = max((self.bounds.gain_into(edge) for edge in self.graph.edges[i]), default=1.0)  # whichever edge a sample left by
        for k, m in enumerate(sample_max):
            limits[Bound(Limit.OUTPUT, k if len(sample_max) > 1 else None)] = overflow_max_log2_scale(m * gain, s.lambda_max)
        beta, limit = self.bounds.choose(i, alpha, lower, limits)
        measured = [v.underflow_count(beta, s.lambda_min) for v in exact]
        self._add(LayerScale(self.analysis.layer_names[i], kind, beta, alpha + beta, math.nan, None, *limit), [], measured, measured_is_rate=True)
        return beta

    def opaque_probe(self, i: int, grad_extremes: Extremes, alpha: Exponent) -> int:
        """An opaque region's scale on its update iteration: its incoming gradient :attr:`ScalingRecipe.opaque_probe_headroom_log2` below λmax."""
        (low, high), _, alpha = self._read(list(grad_extremes), [], alpha)
        grad_max = magnitude(low, high)
        upper = overflow_max_log2_scale(grad_max, self.settings.lambda_max)
        beta = math.ceil(upper) - 1 - self.settings.recipe.opaque_probe_headroom_log2 if math.isfinite(upper) else 0
        ceiling = self.bounds.ceiling(i, alpha)
        beta = beta if ceiling is None else min(beta, ceiling)
        self.opaque_probes[i] = (beta, upper)
        return beta

    def settle_opaque(self, i: int, out: list[torch.Tensor | None], alpha: int) -> int:
        """Scale an opaque region as a dynamic loss scale would: one binade below the overflow of what entered or left it.

        What left it was computed at the probe scale; it is shifted (exactly, a power of two) to the
        scale chosen, which the iterations until the next update replay. Returns the scale its
        outgoing gradients carry; ``out`` is shifted in place.
        """
        probe, upper_in = self.opaque_probes.pop(i)
        alpha_in, name = alpha - probe, self.analysis.layer_names[i]
        grads = [g for g in out if g is not None and g.is_floating_point()]
        pairs = [extremes(g) for g in grads]
        if pairs:
            self.finite_flags.append((name, tuple(v for pair in pairs for v in pair)))
        maxima = magnitudes(pairs)
        if not all(map(math.isfinite, maxima)):  # the step is skipped; the back-off lowers the probe
            self.layers.append(LayerScale(name, "opaque", probe, alpha, math.nan))
            return alpha
        upper = min([upper_in] + [probe + overflow_max_log2_scale(m, self.settings.lambda_max) for m in maxima])
        beta = math.ceil(upper) - 2 if math.isfinite(upper) else 0  # one binade of margin below the largest
        ceiling = self.bounds.ceiling(i, alpha_in)
        beta = beta if ceiling is None else min(beta, ceiling)
        for k, g in enumerate(out):
            out[k] = times_pow2(g, beta - probe) if g is not None and g.is_floating_point() else g
        measured = [ExactSample(g).underflow_count(beta - probe, self.settings.lambda_min) for g in grads if g.numel()]
        self._add(LayerScale(name, "opaque", beta, alpha_in + beta, math.nan), [], measured, if_none=math.nan, measured_is_rate=True)
        return alpha_in + beta

    def _add(
        self, layer: LayerScale, modelled: list[Callable[[], float]], measured: list[Rate], if_none: float = 0.0, measured_is_rate: bool = False
    ) -> None:
        """Record ``layer``, its underflow rates filled in with the step's read (:class:`UnreadRates`); now where there is nothing to fill in."""
        rates = UnreadRates(len(self.layers), tuple(modelled), tuple(measured), if_none, measured_is_rate)
        if rates.modelled or rates.tensors():
            self.layers.append(layer)
            self.unread_rates.append(rates)
        else:
            self.layers.append(rates.applied_to(layer, iter(())))

    def non_finite(self, i: int, kind: str, alpha: Exponent) -> int:
        """No decision (no finite statistics, or none readable, to decide on): the scale passes through."""
        self.layers.append(LayerScale(self.analysis.layer_names[i], kind, 0, self._host(alpha), math.nan))
        return 0

    def _read(self, values: list[torch.Tensor], samples: list[ExactSample], alpha: Exponent) -> tuple[list[float], list[OrderStatistics], int]:
        """:func:`~gs_lightning.scaling.gradient_stats.stats_and_samples` of a decision's statistics, with the scale
        ``alpha`` its gradient carries where a merge left it on the device, and the gains no decision read yet
        (:meth:`ScaleBounds.unread_gains`): one synchronisation."""
        unread, gains = isinstance(alpha, torch.Tensor), [g.to(values[0].device) for g in self.bounds.unread_gains()]  # a model over devices
        read_values, orders = stats_and_samples([*values, *gains, *([alpha] if unread else [])], samples, self.settings.underflow_rate)
        if unread:
            self.read_exponents[alpha] = int(read_values.pop())
            alpha = self.read_exponents[alpha]
        if gains:
            self.bounds.take_gains(read_values[len(values) :])
        return read_values[: len(values)], orders, alpha

    def _host(self, alpha: Exponent) -> int:
        """The value of ``alpha``: as a decision read it, or read now (one synchronisation) where none did."""
        if not isinstance(alpha, torch.Tensor):
            return alpha
        if alpha not in self.read_exponents:
            self.read_exponents[alpha] = int(read([alpha])[0])
        return self.read_exponents[alpha]


def _stacked(exponents: list[Exponent], device: torch.device) -> torch.Tensor:
    """``exponents`` as one float64 vector on ``device``; a Python int is filled in there, not copied from the host."""
    return torch.stack([e.to(device) if isinstance(e, torch.Tensor) else torch.full((), e, dtype=torch.float64, device=device) for e in exponents])
