"""One root for a backward over several tensors.

A backward over several outputs (``torch.autograd.backward([a, b], grads)``, or a reentrant
checkpoint's inner backward over its block's outputs) has no single root node the scaler could
walk from. :func:`join_outputs` passes the outputs through one identity node, :class:`JoinOutputs`,
that becomes that root; the graph below it is the union of the outputs' graphs. The registry
(:mod:`~gs_lightning.scaling.operators`) knows its node as a pass-through: the gradients keep their scale.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import Node


class JoinOutputs(torch.autograd.Function):
    """Identity on several tensors that need a gradient: one node where their backward starts."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # an output left out of the backward stays None, not zeros
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return grads


def join_outputs(items: list[Any]) -> tuple[list[Any], Node | None]:
    """``items`` with every tensor that has a ``grad_fn`` routed through one :class:`JoinOutputs` node.

    Returns the new items (other entries unchanged) and the root to walk from: that node; the one
    tensor's own ``grad_fn`` where only one has any; ``None`` where none has.
    """
    positions = [k for k, item in enumerate(items) if isinstance(item, torch.Tensor) and item.grad_fn is not None]
    if len(positions) <= 1:
        return items, items[positions[0]].grad_fn if positions else None
    joined = JoinOutputs.apply(*(items[k] for k in positions))
    items = list(items)
    for k, tensor in zip(positions, joined):
        items[k] = tensor
    return items, joined[0].grad_fn
