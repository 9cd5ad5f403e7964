"""Between updates: a weight gradient that overflowed is recomputed in fp32 instead of skipping the step.

A GEMM's weight gradient sums over the whole batch and every position; on a converged task its
largest value jumps by 2^5-2^10 on the batches with a few hard examples.
A scale kept below those spikes costs what the GEMM sends on, which carries the same scale: its
small values underflow (ResNet-8 with e5m2 gradients lost 0.10-0.13% of its GEMM gradients that
way). So the replays keep, for every GEMM whose parameter gradients can be recomputed, the incoming
gradient as the node used it and the operand it saved (references, nothing copied; released at the
step), and an update bounds such a GEMM by the level of its weight gradients and only a share of
their spikes (:attr:`~gs_lightning.scaling.recipe.ScalingRecipe.recomputed_spike_share`). When a step finds
non-finite gradients and each is a parameter gradient of such a GEMM that received a finite gradient
and whose value at the scale it carried exceeds λmax (it overflowed there, by itself, not in user
code that edited ``.grad``), each is recomputed in fp32 from what was kept, at its true scale,
and the step goes on; anything else (a gradient computed from a non-finite one, anywhere) skips it
as before. What the GEMM sent on came from the finite incoming gradient and stands.

Only on the loss's graph between updates, for parameters whose gradient waits for the fused unscale
(no DDP, no accumulation into an existing ``.grad``, no hooks: ``GradientScaler._deferred_leaves``),
for convolutions and ``addmm``/``mm`` whose parameters lie behind casts, transposes and views, in a
format that overflows, and not where a ``torch.compile``'d module replays the scales in its graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
from torch.autograd.graph import Node

from gs_lightning.scaling.graph import AutogradGraph, GraphAnalysis, saved_tensor
from gs_lightning.scaling.operators import operator
from gs_lightning.scaling.plan import ScalePlan
from gs_lightning.scaling.walks import recomputable_path, weight_path

# A parameter edge's fp32 gradient from the node, its fp32 incoming gradient, its fp32 saved operands and the edge.
EdgeGradient = Callable[[Node, torch.Tensor, dict[str, torch.Tensor], int], torch.Tensor]


def _convolution(node: Node, grad: torch.Tensor, operands: dict[str, torch.Tensor], edge: int) -> torch.Tensor:
    if edge == 2:  # the bias: a sum over everything but the channels
        return grad.sum([d for d in range(grad.dim()) if d != 1])
    args = (
        node._saved_stride,
        node._saved_padding,
        node._saved_dilation,
        node._saved_transposed,
        node._saved_output_padding,
        node._saved_groups,
    )
    return torch.ops.aten.convolution_backward(
        grad, operands["input"], operands["weight"], None, *args, [False, True, False]
    )[1]


def _matmul(self_edge: int | None, left_edge: int, left: str, right: str) -> EdgeGradient:
    """For Y = (β·self +) α·left·right."""

    def gradient(node: Node, grad: torch.Tensor, operands: dict[str, torch.Tensor], edge: int) -> torch.Tensor:
        if edge == self_edge:
            return float(node._saved_beta) * grad
        alpha = float(getattr(node, "_saved_alpha", 1.0))
        if edge == left_edge:
            return alpha * (grad @ operands[right].transpose(-1, -2))
        return alpha * (operands[left].transpose(-1, -2) @ grad)

    return gradient


def _recompute_operands(name: str) -> dict[int, tuple[str, ...]]:
    """Parameter edge -> the saved operands its gradient is recomputed from, for GEMM type ``name`` (the registry's
    :attr:`~gs_lightning.scaling.operators.Operator.recompute`; empty where it has none)."""
    op = operator(name)
    return {} if op is None or op.recompute is None else dict(op.recompute.operands)


@dataclass(frozen=True)
class _Parameter:
    """A parameter edge ``edge`` of a GEMM, the leaf it leads to and the layout nodes between, in order."""

    edge: int
    leaf: int
    chain: tuple[int, ...]


def _parameter_behind(graph: AutogradGraph, i: int, k: int) -> _Parameter | None:
    edge = graph.edges[i][k]
    path = weight_path(graph.names, graph.edges, edge[0]) if edge is not None else None
    if path is None or not recomputable_path(graph.names, path):  # a broadcast weight: left to the step's skip
        return None
    return _Parameter(k, path[-1], path[:-1])


def _parameters(
    graph: AutogradGraph, analysis: GraphAnalysis, i: int, deferred: frozenset[int]
) -> list[_Parameter] | None:
    """GEMM ``i``'s parameter edges, if it is a known node and each leads through layout nodes to a
    parameter whose gradient is deferred; ``None`` otherwise."""
    edges, operands = analysis.weight_edges.get(i, ()), _recompute_operands(graph.names[i])
    if not edges or any(k not in operands for k in edges):
        return None
    found = [_parameter_behind(graph, i, k) for k in edges]
    return found if all(p is not None and p.leaf in deferred for p in found) else None  # type: ignore[return-value]


def _operand_names(graph: AutogradGraph, i: int, parameters: list[_Parameter]) -> set[str]:
    operands = _recompute_operands(graph.names[i])
    return {name for p in parameters for name in operands[p.edge]}


def recomputable(graph: AutogradGraph, analysis: GraphAnalysis, i: int, deferred: frozenset[int]) -> bool:
    """Whether GEMM node ``i``'s parameter gradients can be recomputed after the backward (:func:`_parameters`),
    its operands readable (not under non-reentrant checkpointing); call it before the node runs."""
    parameters = _parameters(graph, analysis, i, deferred)
    return parameters is not None and all(
        saved_tensor(graph.nodes[i], name) is not None for name in _operand_names(graph, i, parameters)
    )


def _unpacked(node: Node, name: str) -> torch.Tensor | None:
    """:func:`saved_tensor`, or ``None`` where it was modified in place since it was saved: the node's own
    backward then raises autograd's error, not the replay's preparation."""
    try:
        return saved_tensor(node, name)
    except RuntimeError:
        return None


def _keep_grad(grads_of: dict[int, torch.Tensor], i: int, grads: tuple) -> None:
    """Pre-hook of a recomputable GEMM: the gradient it receives, as it uses it."""
    if grads and grads[0] is not None:
        grads_of[i] = grads[0]


# Plans whose recomputable GEMMs are remembered at once: a few graph structures that alternate.
_KEPT_PLANS = 8


@dataclass(frozen=True)
class _Kept:
    """What a replay kept of one GEMM: the gradient it received, as it used it, and its saved operands."""

    grad: torch.Tensor
    operands: dict[str, torch.Tensor]
    parameters: list[_Parameter]


class WeightGradRecompute:
    """What the replays of the loss's graph keep, and the recomputation it allows (module docstring)."""

    def __init__(self, lambda_max: float = math.inf) -> None:
        self.lambda_max = lambda_max  # of the format the GEMMs computed the weight gradients in
        # GEMM -> its operands, parameters
        self._operands: dict[int, tuple[dict[str, torch.Tensor], list[_Parameter]]] = {}
        self._grads: dict[int, torch.Tensor] = {}  # GEMM -> the gradient it received, once it ran
        self._replayed: tuple[AutogradGraph, ScalePlan] | None = None
        # Per plan (by id, the plan kept to tell a reused id) and deferred leaves: the GEMMs to keep, with their
        # parameters and operand names. They depend on the structure only; found once, not on every replay
        # (54 GEMMs of a ResNet-50: 4.6 ms of Python per iteration).
        self._targets: dict[
            tuple[int, frozenset[int]], tuple[ScalePlan, list[tuple[int, list[_Parameter], set[str]]]]
        ] = {}

    def register(
        self, graph: AutogradGraph, analysis: GraphAnalysis, plan: ScalePlan, deferred: frozenset[int]
    ) -> list:
        """Keep the operands of the plan's recomputable GEMMs, and register pre-hooks that keep the gradient each
        receives; registered after the plan's own, so that they see it at the scale the node uses. A GEMM whose
        parameters' gradients are not deferred this backward (accumulation) keeps nothing; one whose operands
        are unreadable neither.

        The operands are taken here, before the backward, not in the hooks: a hook runs between the backward's
        kernels, where the same Python took ~10x longer (a ResNet-50's 54 GEMMs: 2.3 ms per replay in the hooks;
        now 0.2 ms there and 0.5 ms more here).
        """
        self.clear()
        self._replayed = (graph, plan)
        handles = []
        for i, parameters, names in self._targets_of(graph, analysis, plan, deferred):
            node = graph.nodes[i]
            operands = {name: _unpacked(node, name) for name in names}
            if all(t is not None for t in operands.values()):
                self._operands[i] = (operands, parameters)  # type: ignore[assignment]
                handles.append(node.register_prehook(partial(_keep_grad, self._grads, i)))
        return handles

    def _targets_of(
        self, graph: AutogradGraph, analysis: GraphAnalysis, plan: ScalePlan, deferred: frozenset[int]
    ) -> list[tuple[int, list[_Parameter], set[str]]]:
        key = (id(plan), deferred)
        cached = self._targets.get(key)
        if cached is not None and cached[0] is plan:
            return cached[1]
        targets = []
        for i in sorted(plan.recomputable):
            parameters = _parameters(graph, analysis, i, deferred)
            if parameters is not None:
                targets.append((i, parameters, _operand_names(graph, i, parameters)))
        self._targets[key] = (plan, targets)
        while len(self._targets) > _KEPT_PLANS:  # the oldest first: replaced plans, or structures no longer run
            del self._targets[next(iter(self._targets))]
        return targets

    @property
    def held(self) -> int:
        """How many GEMMs' operands the replay holds: the memory it keeps until the step's read."""
        return len(self._operands)

    @property
    def kept(self) -> dict[int, _Kept]:
        """GEMM -> what the replay kept of it, for those that ran."""
        return {i: _Kept(grad, *self._operands[i]) for i, grad in self._grads.items()}

    def clear(self) -> None:
        """Drop what was kept (the step is done, or another backward begins): the references are all the memory it
        holds."""
        self._operands.clear()
        self._grads.clear()
        self._replayed = None

    def recompute(self, leaves: Iterable[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
        """Leaf index -> (parameter, its true fp32 gradient), for each of ``leaves``, the non-finite gradients of
        the last replay; ``None`` unless each is a parameter gradient of a GEMM that kept its operands and
        received a finite gradient (so that it overflowed there, and what it sent on was computed from
        finite values), and whose recomputed value at the scale it carried exceeds ``lambda_max`` (the
        backward's own overflow: an inf written into ``.grad`` by user code is no such thing).
        Synchronises twice: the incoming gradients' finiteness, then the recomputed maxima."""
        if self._replayed is None:
            return None
        graph, plan = self._replayed
        kept_of = self.kept
        owner = {p.leaf: (i, p) for i, kept in kept_of.items() for p in kept.parameters}
        leaves = list(leaves)
        if not leaves or any(j not in owner for j in leaves):
            return None
        received = [kept_of[i].grad for i in {owner[j][0] for j in leaves}]
        if not bool(torch.stack([torch.isfinite(g).all() for g in received]).all()):
            return None
        grads, scaled_maxima = {}, []
        with torch.no_grad():
            for j in leaves:
                i, p = owner[j]
                kept, node = kept_of[i], graph.nodes[i]
                operands = {name: t.float() for name, t in kept.operands.items()}
                grad = operator(graph.names[i]).recompute.gradient(node, kept.grad.float(), operands, p.edge)
                target = graph.edges[i][p.edge]
                grad = grad.sum_to_size(graph.nodes[target[0]]._input_metadata[target[1]].shape)
                scaled_maxima.append(grad.abs().amax() if grad.numel() else grad.new_zeros(()))
                grad = grad * 2.0 ** -plan.alpha_out.get(i, 0)
                for n in p.chain:  # casts and layouts, as autograd applies them (the values are fp32 already)
                    grad = graph.nodes[n](grad)
                    grad = grad[0] if isinstance(grad, tuple) else grad
                grads[j] = (graph.nodes[j].variable, grad)
        if not bool((torch.stack(scaled_maxima) > self.lambda_max).all()):
            return None
        return grads
