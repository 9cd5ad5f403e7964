"""Between updates: a weight gradient that overflowed is recomputed in fp32 instead of skipping the step.

A GEMM's weight gradient sums over the whole batch and every position; on a converged task its
largest value jumps by 2^5-2^10 on the batches with a few hard examples (README "How it works").
A scale kept below those spikes costs what the GEMM sends on, which carries the same scale: its
small values underflow (ResNet-8 with e5m2 gradients lost 0.10-0.13% of its GEMM gradients that
way). So the replays keep, for every GEMM whose parameter gradients can be recomputed, the incoming
gradient as the node used it and the operand it saved (references, nothing copied; released at the
step), and an update bounds such a GEMM by the level of its weight gradients and only a share of
their spikes (:data:`~gs_lightning.scaling.update.RECOMPUTED_SPIKE_SHARE`). When a step finds
non-finite gradients and each is a parameter gradient of such a GEMM that received a finite gradient
(it overflowed there, by itself), each is recomputed in fp32 from what was kept, at its true scale,
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

import torch
from torch.autograd.graph import Node

from gs_lightning.scaling.graph import LEAF, AutogradGraph, GraphAnalysis, saved_tensor
from gs_lightning.scaling.plan import ScalePlan

# Nodes between a GEMM and its parameter that only cast or lay out the gradient: called as they are.
_LAYOUT_NODES = frozenset({"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
                           "UnsafeViewBackward0", "ReshapeAliasBackward0"})

EdgeGrads = Callable[[int], torch.Tensor | None]  # edge -> its fp32 gradient, from what a replay kept


def _convolution(node: Node, grad: torch.Tensor, edges: tuple[int, ...]) -> EdgeGrads | None:
    inputs, weight = saved_tensor(node, "input"), saved_tensor(node, "weight")
    if inputs is None or weight is None:
        return None
    args = (node._saved_stride, node._saved_padding, node._saved_dilation, node._saved_transposed,
            node._saved_output_padding, node._saved_groups)

    def compute(edge: int) -> torch.Tensor | None:
        if edge == 1:
            return torch.ops.aten.convolution_backward(grad.float(), inputs.float(), weight.float(), None, *args, [False, True, False])[1]
        if edge == 2:
            return grad.float().sum([d for d in range(grad.dim()) if d != 1])
        return None

    return compute


def _matmul(self_edge: int | None, left_edge: int, right_edge: int, left: str, right: str) -> Callable:
    """For Y = (β·self +) α·left·right."""

    def snapshot(node: Node, grad: torch.Tensor, edges: tuple[int, ...]) -> EdgeGrads | None:
        operands = {name: saved_tensor(node, name) for edge, name in ((right_edge, left), (left_edge, right)) if edge in edges}
        if any(t is None for t in operands.values()):
            return None
        alpha, beta = float(getattr(node, "_saved_alpha", 1.0)), float(getattr(node, "_saved_beta", 1.0))

        def compute(edge: int) -> torch.Tensor | None:
            if edge == self_edge:
                return beta * grad.float()
            if edge == left_edge:
                return alpha * (grad.float() @ operands[right].float().transpose(-1, -2))
            if edge == right_edge:
                return alpha * (operands[left].float().transpose(-1, -2) @ grad.float())
            return None

        return compute

    return snapshot


_SNAPSHOTS: dict[str, Callable[[Node, torch.Tensor, tuple[int, ...]], EdgeGrads | None]] = {
    "ConvolutionBackward0": _convolution,
    "AddmmBackward0": _matmul(0, 1, 2, "mat1", "mat2"),
    "MmBackward0": _matmul(None, 0, 1, "self", "mat2"),
}


def _parameter_behind(graph: AutogradGraph, i: int, k: int) -> tuple[int, list[int]] | None:
    """The leaf GEMM ``i``'s edge ``k`` leads to through layout nodes, and those nodes in order; ``None`` if it leads elsewhere."""
    chain, edge = [], graph.edges[i][k]
    for _ in range(4):
        if edge is None:
            return None
        if graph.names[edge[0]] == LEAF:
            return edge[0], chain
        if graph.names[edge[0]] not in _LAYOUT_NODES:
            return None
        chain.append(edge[0])
        onward = [e for e in graph.edges[edge[0]] if e is not None]
        if len(onward) != 1:
            return None
        edge = onward[0]
    return None


# The saved operands each parameter edge's gradient is computed from.
_OPERANDS: dict[str, dict[int, tuple[str, ...]]] = {
    "ConvolutionBackward0": {1: ("input", "weight"), 2: ()},
    "AddmmBackward0": {0: (), 1: ("mat2",), 2: ("mat1",)},
    "MmBackward0": {0: ("mat2",), 1: ("self",)},
}


def recomputable(graph: AutogradGraph, analysis: GraphAnalysis, i: int, deferred: frozenset[int]) -> bool:
    """Whether GEMM node ``i``'s parameter gradients can be recomputed after the backward: a known node
    whose every parameter edge leads through layout nodes to a parameter whose gradient is deferred, and
    whose operands can be read (not under non-reentrant checkpointing); call it before the node runs."""
    edges, operands = analysis.weight_edges.get(i, ()), _OPERANDS.get(graph.names[i], {})
    if not edges or any(k not in operands for k in edges):
        return False
    node = graph.nodes[i]
    for k in edges:
        found = _parameter_behind(graph, i, k)
        if found is None or found[0] not in deferred or any(saved_tensor(node, name) is None for name in operands[k]):
            return False
    return True


class WeightGradRecompute:
    """What the replays of the loss's graph keep, and the recomputation it allows (module docstring)."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[EdgeGrads, torch.Tensor]] = {}  # GEMM -> (its edges' gradients, the gradient it received)
        self._replayed: tuple[AutogradGraph, GraphAnalysis, ScalePlan] | None = None

    def register(self, graph: AutogradGraph, analysis: GraphAnalysis, plan: ScalePlan, deferred: frozenset[int]) -> list:
        """Pre-hooks that keep the operands of the plan's recomputable GEMMs; registered after the plan's own,
        so that they see the incoming gradient at the scale the node uses."""
        self.clear()
        self._replayed = (graph, analysis, plan)
        handles = []
        for i in sorted(plan.recomputable):
            if recomputable(graph, analysis, i, deferred):
                handles.append(graph.nodes[i].register_prehook(self._keeper(i, graph.nodes[i], analysis.weight_edges[i])))
        return handles

    def _keeper(self, i: int, node: Node, edges: tuple[int, ...]) -> Callable[[tuple], None]:
        snapshot = _SNAPSHOTS[type(node).__name__]

        def keep(grads: tuple) -> None:
            if grads and grads[0] is not None:
                kept = snapshot(node, grads[0], tuple(edges))
                if kept is not None:
                    self._kept[i] = (kept, grads[0])

        return keep

    def clear(self) -> None:
        """Drop what was kept (the step is done, or another backward begins): the references are all the memory it holds."""
        self._kept.clear()
        self._replayed = None

    def recompute(self, leaves: Iterable[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
        """Leaf index -> (parameter, its true fp32 gradient), for each of ``leaves``, the non-finite gradients of
        the last replay; ``None`` unless each is a parameter gradient of a GEMM that kept its operands and
        received a finite gradient (so that it overflowed there, and what it sent on was computed from
        finite values). Synchronises once, to read the incoming gradients' finiteness."""
        if self._replayed is None:
            return None
        graph, analysis, plan = self._replayed
        edges_of = {}  # leaf -> (GEMM, its edge, the layout nodes between)
        for i in self._kept:
            for k in analysis.weight_edges[i]:
                if (found := _parameter_behind(graph, i, k)) is not None:
                    edges_of[found[0]] = (i, k, found[1])
        leaves = list(leaves)
        if not leaves or any(j not in edges_of for j in leaves):
            return None
        nodes = sorted({edges_of[j][0] for j in leaves})
        received = [self._kept[i][1] for i in nodes]
        if not bool(torch.stack([torch.isfinite(g).all() for g in received]).all()):
            return None
        grads = {}
        with torch.no_grad():
            for j in leaves:
                i, k, chain = edges_of[j]
                grad = self._kept[i][0](k)
                if grad is None:
                    return None
                target = graph.edges[i][k]
                grad = grad.sum_to_size(graph.nodes[target[0]]._input_metadata[target[1]].shape) * 2.0 ** -plan.alpha_out.get(i, 0)
                for n in chain:  # casts and layouts, as autograd applies them (the values are fp32 already)
                    grad = graph.nodes[n](grad)
                    grad = grad[0] if isinstance(grad, tuple) else grad
                grads[j] = (graph.nodes[j].variable, grad)
        return grads


def largest(grads: dict[int, torch.Tensor]) -> dict[int, float]:
    """Leaf -> largest magnitude of its gradient (one synchronisation; NaN reads as inf)."""
    if not grads:
        return {}
    values = torch.stack([g.abs().amax().float() if g.numel() else g.new_zeros((), dtype=torch.float32) for g in grads.values()]).tolist()
    return {leaf: (v if not math.isnan(v) else math.inf) for leaf, v in zip(grads, values)}

