"""Walks from a node's edge to the parameters its gradients reach, each stopping rule stated once.

Two questions the core asks of a walked graph (:class:`~gs_lightning.scaling.graph.AutogradGraph`), one
walk each:

- **Which parameter does this edge carry the gradient of?** (:func:`weight_path`): through the nodes a
  weight reaches a GEMM by (:attr:`~gs_lightning.scaling.operators.Role.WEIGHT_PATH` in the registry: casts,
  transposes, views, a broadcast), each with one onward edge, at most ``hops`` of them. The analysis's
  weight edges and layer names, the operand a checkpointed GEMM saved, the expected maxima of the drift
  statistic, the overflow attribution and the fp32 recompute all take this walk.
- **Which parameters does a GEMM's outgoing gradient reach at the scale it chose?** (:func:`fed_leaves`):
  through every node that decides nothing, stopping at decision nodes and at branches.

And the leaves themselves (:func:`leaf_variables`), matched by identity where two graphs meet (a compiled
region and the eager graph around it, the attached models' parameters), and those whose gradients the
gradients' format can overflow (:func:`format_bounded_leaves`: what the expected maxima bound).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from gs_lightning.scaling.operators import LEAF, Role, operator

if TYPE_CHECKING:  # graph.py imports this module
    from gs_lightning.scaling.graph import AutogradGraph, GraphAnalysis, Slot

Edges = Sequence[tuple["Slot | None", ...]]


def _on_weight_path(name: str) -> bool:
    op = operator(name)
    return op is not None and op.role is Role.WEIGHT_PATH


def weight_path(names: Sequence[str], edges: Edges, target: int, hops: int = 4) -> tuple[int, ...] | None:
    """The nodes from ``target`` to the leaf it reaches through weight-path nodes with one onward edge each, the
    leaf last, if any: an edge into ``target`` carries that parameter's gradient (module docstring)."""
    path = []
    for _ in range(hops):
        path.append(target)
        if names[target] == LEAF:
            return tuple(path)
        onward = [e for e in edges[target] if e is not None]
        if not _on_weight_path(names[target]) or len(onward) != 1:
            return None
        target = onward[0][0]
    return (*path, target) if names[target] == LEAF else None


def parameter_leaf(names: Sequence[str], edges: Edges, target: int) -> int | None:
    """The leaf :func:`weight_path` reaches from ``target``, if any."""
    path = weight_path(names, edges, target)
    return path[-1] if path is not None else None


def parameter_leaves(names: Sequence[str], edges: Edges, analysis: GraphAnalysis, i: int) -> list[int]:
    """The leaves whose gradients GEMM node ``i`` computes (its weight's and bias's, behind their casts)."""
    paths = (weight_path(names, edges, edges[i][k][0]) for k in analysis.weight_edges.get(i, ()))
    return [path[-1] for path in paths if path is not None]


def format_bounded_leaves(graph: AutogradGraph, analysis: GraphAnalysis) -> frozenset[int]:
    """The leaves whose gradients the gradients' format can overflow: those a GEMM or a fused node computes
    (through a weight path: in that format under autocast, cast to the parameter's after), and those kept in a
    format narrower than fp32's.

    Not a normalisation's fp32 weight and bias: their gradients are computed in fp32 from the scaled gradient
    (under autocast, as cuDNN's and the CPU's batch norm return them), which no scale up to
    :attr:`~gs_lightning.scaling.recipe.ScalingRecipe.max_log2_total_scale` overflows; bounding them by fp16's
    λmax asked ResNet-8 for 13 of its 26 update iterations in 200 steps (fp16, seed 0).
    """
    computing = analysis.gemms.keys() | analysis.fused.keys()
    feeders: dict[int, list[int]] = {j: [] for j in analysis.leaves}
    for i, edges in enumerate(graph.edges):
        for edge in edges:
            if edge is not None and edge[0] in feeders:
                feeders[edge[0]].append(i)

    def bounded(j: int) -> bool:
        narrow = math.log2(torch.finfo(graph.nodes[j].variable.dtype).max) < _FP32_MAX_EXPONENT
        return narrow or any(i in computing or _on_weight_path(graph.names[i]) for i in feeders[j])

    return frozenset(j for j in analysis.leaves if bounded(j))


def summed_leaves(graph: AutogradGraph, analysis: GraphAnalysis) -> frozenset[int]:
    """The parameter leaves of the GEMMs whose gradients are vectors: biases, each a sum of the gradient its GEMM
    receives, all zeros exactly where that gradient is (short of a sum that cancels)."""
    return frozenset(
        j
        for i in analysis.gemms
        for j in parameter_leaves(graph.names, graph.edges, analysis, i)
        if graph.nodes[j].variable.dim() == 1
    )


# log2 of the largest finite value of fp32 (and bfloat16) lies between 127 and 128; fp16's is below 16.
_FP32_MAX_EXPONENT = 127


def transposes(graph: AutogradGraph, path: Sequence[int]) -> int:
    """How many times the nodes of a :func:`weight_path` transpose a 2-D weight on the way to the GEMM
    (:attr:`~gs_lightning.scaling.operators.Layout.transposes`): how the GEMM saw it."""
    return sum(bool(operator(graph.names[n]).layout.transposes(graph.nodes[n])) for n in path[:-1])


def recomputable_path(names: Sequence[str], path: Sequence[int]) -> bool:
    """Whether the fp32 recompute may call every node of a :func:`weight_path` on a recomputed gradient
    (:attr:`~gs_lightning.scaling.operators.Layout.recomputable`)."""
    return all(operator(names[n]).layout.recomputable for n in path[:-1])


def fed_leaves(edges: Edges, analysis: GraphAnalysis, i: int, decides: Collection[int]) -> set[int]:
    """The leaves node ``i``'s outgoing activation gradients reach before a decision (``decides``) or a branch
    (whose sum is brought to a common scale) sees them: parameters (a normalisation's weight and bias) whose
    gradients are computed at the scale ``i`` chose."""
    a, found = analysis, set()
    frontier = [
        e[0] for k, e in enumerate(edges[i]) if e is not None and k not in a.weight_edges[i] and e not in a.branch_slots
    ]
    seen = set(frontier)
    while frontier:
        n = frontier.pop()
        if n in a.leaves:
            found.add(n)
            continue
        if n in decides:
            continue
        for edge in edges[n]:
            if edge is not None and edge[0] not in seen and edge not in a.branch_slots:
                seen.add(edge[0])
                frontier.append(edge[0])
    return found


def leaf_variables(graph: AutogradGraph) -> Iterator[tuple[int, torch.Tensor | None]]:
    """(index, the tensor whose ``.grad`` it accumulates) of each leaf of ``graph``; ``None`` for a leaf that
    holds none (a traced region's input, named a leaf by :func:`~gs_lightning.scaling.graph.walk_from`)."""
    for j, name in enumerate(graph.names):
        if name == LEAF:
            yield j, getattr(graph.nodes[j], "variable", None)
