"""How much a gradient can grow between two decisions: gains that no decision sees (batch norms, constant
factors, a first backward's saved gradients under a second), and the scales the GEMMs downstream keep."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Container, Iterator, Mapping

import torch
from torch.autograd.graph import Node
from torch.utils._python_dispatch import _disable_current_modes

from gs_lightning.scaling.graph import (
    AutogradGraph,
    GraphAnalysis,
    batch_norm_gain_operands,
    batch_norm_gains,
    saved_tensor,
)
from gs_lightning.scaling.operators import Role, node_types
from gs_lightning.scaling.underflow import finite, where_or


def kept_downstream(graph: AutogradGraph, analysis: GraphAnalysis, gemm_totals: Mapping[int, int]) -> dict[int, int]:
    """Node -> the highest accumulated scale at which any of the gradients it sends on is still used as sent.

    A GEMM whose parameter gradients cap its accumulated scale (``gemm_totals``) scales what it
    receives down to that cap before computing anything: scale sent to it above the cap protects
    no value (the multiply by 2^-k loses what the lower scale would have) and is exposed to
    overflow on every batch in between (ResNet-8's logits gradient, scaled for its smallest values
    of a converged batch, overflowed on a hard one although the layer it feeds sat 2^5 lower). A
    gradient reaching a leaf or an uncapped GEMM keeps any scale. Nodes without a finite bound are
    left out. Applied where :attr:`~gs_lightning.scaling.recipe.ScalingRecipe.kept_downstream_cap` is on.
    """
    kept: dict[int, float] = {}

    def received(node: int) -> float:  # the highest scale a gradient arriving at ``node`` is used at
        if node in analysis.leaves:
            return math.inf
        if node in gemm_totals:
            return gemm_totals[node]
        return kept[node]

    targets = analysis.derive("targets", lambda: [[e[0] for e in edges if e is not None] for edges in graph.edges])
    order = analysis.derive(
        "kept_downstream order", lambda: list(post_order(len(graph.nodes), targets.__getitem__, analysis.leaves))
    )
    for node in order:
        kept[node] = max((received(t) for t in targets[node]), default=math.inf)
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
    """|c| of a product by a constant scalar c (``MulBackward0`` whose saved factor is 0-dim), as a 0-dim tensor, else
    ``None``.

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
    if not _saves_first_order_gradient(node.name()):
        return None
    for name in SAVED_GRADIENTS:
        g = saved_tensor(node, name)
        if g is not None and g.is_floating_point() and g.numel():
            return g.detach().abs().amax().float()
    return None


def node_gains(graph: AutogradGraph, analysis: GraphAnalysis) -> list[tuple[int, torch.Tensor]]:
    """(node, how much it can multiply the gradient it passes on) where that is known, 0-dim tensors on the device,
    unread (:func:`bounded_gains` bounds them; taken where
    :attr:`~gs_lightning.scaling.recipe.ScalingRecipe.gain_bounds` is on): a batch norm's gain
    (:func:`~gs_lightning.scaling.graph.batch_norm_gains`, all computed together), a product by a constant
    (:func:`constant_factor`), a saved first-order gradient (:func:`saved_gradient_gain`)."""
    candidates = analysis.derive(
        "gain nodes", lambda: [j for j, name in enumerate(graph.names) if _may_have_gain(name)]
    )
    norms = [
        (j, operands)
        for j in candidates
        if graph.names[j] in node_types(Role.BATCH_NORM)
        and (operands := batch_norm_gain_operands(graph.nodes[j])) is not None
    ]
    found = list(zip([j for j, _ in norms], batch_norm_gains([operands for _, operands in norms])))
    for j in candidates:
        name = graph.names[j]
        gain = (
            None
            if name in node_types(Role.BATCH_NORM)
            else constant_factor(graph.nodes[j])
            if name in node_types(Role.PRODUCT)
            else saved_gradient_gain(graph.nodes[j])
        )
        if gain is not None:
            found.append((j, gain))
    return found


def bounded_gains(found: list[tuple[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Node -> its gain (:func:`node_gains`), float64 on its device, unread: 1 where it is at most 1 or not finite
    (a gain below 1 protects nothing downstream; an infinite one bounds nothing). Bounded together, a few kernels per
    device and dtype, not a few per gain."""
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
    for j, gain in found:
        groups.setdefault((gain.device, gain.dtype), []).append((j, gain))
    bounded: dict[int, torch.Tensor] = {}
    for pairs in groups.values():
        gains = torch.stack([gain for _, gain in pairs])
        kept = where_or((gains > 1.0) & finite(gains), gains.double(), 1.0)
        bounded.update(zip([j for j, _ in pairs], kept.unbind()))
    return bounded


def _saves_first_order_gradient(name: str) -> bool:
    """Whether a node of this type belongs to a first backward's graph and saved a gradient (double backward)."""
    return "BackwardBackward" in name or "BackwardDataBackward" in name


def _may_have_gain(name: str) -> bool:
    """Whether a node of this type can have a gain :func:`node_gains` knows (the types it looks at)."""
    return name in node_types(Role.BATCH_NORM, Role.PRODUCT) or _saves_first_order_gradient(name)


def gains_after(
    graph: AutogradGraph, analysis: GraphAnalysis, gains: Mapping[int, torch.Tensor]
) -> dict[int, torch.Tensor]:
    """Node -> how much the gradient it receives can grow before the next decision point, branch or
    leaf sees it: the product of the batch-norm ``gains`` on the way (the node's own included), the
    largest over the paths; 0-dim tensors on the gains' device, unread. Nodes no gain reaches are left out."""
    if not gains:
        return {}

    targets = analysis.derive(  # a branch bounds its sum again
        "targets before a branch",
        lambda: [[e[0] for e in edges if e is not None and e not in analysis.branch_slots] for edges in graph.edges],
    )
    order = analysis.derive(  # a decision bounds it again too, and a leaf takes it
        "gains_after order",
        lambda: list(post_order(len(graph.nodes), targets.__getitem__, analysis.leaves | analysis.layer_names.keys())),
    )
    grown: dict[int, torch.Tensor] = {}
    for node in order:
        downstream = [grown[t] for t in targets[node] if t in grown]  # each at least 1
        own = gains.get(node)
        if own is None and not downstream:
            continue
        largest = functools.reduce(torch.maximum, downstream) if downstream else None
        grown[node] = largest if own is None else own if largest is None else own * largest
    return grown
