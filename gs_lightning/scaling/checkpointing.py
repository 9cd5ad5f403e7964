"""Scaling inside reentrant activation checkpoints (``torch.utils.checkpoint(use_reentrant=True)``).

The checkpoint's backward node recomputes its block with ``ctx.run_function`` and then runs a
second backward, ``torch.autograd.backward(outputs, grads)``, over the block's fresh graph: a
graph the scaler's walk of the loss never saw, which accumulates straight into the parameters'
``.grad``. A pre-hook on the checkpoint node wraps ``run_function`` so that, once the block is
recomputed, its outputs meet in one node (:class:`~gs_lightning.scaling.join.JoinOutputs`, the inner graph's root)
and the scaler prepares that graph as it prepares a loss's, before the inner backward starts. The
registry (:mod:`~gs_lightning.scaling.operators`) knows the node as a reentrant checkpoint: a decision
node of the outer graph, whose inner graph is scaled on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import Node

from gs_lightning.scaling.join import join_outputs


def intercept_recomputation(node: Node, prepare: Callable[[Node, tuple[Any, ...]], None]) -> None:
    """Make a ``CheckpointFunctionBackward`` node call ``prepare(root, inputs)`` once its block is recomputed.

    ``root`` is the inner graph's root; ``inputs`` are the block's (detached) inputs, whose
    ``.grad`` the checkpoint hands back to the outer graph.
    """
    original = node.run_function

    def run_function(*inputs: Any) -> Any:
        node.run_function = original
        outputs = original(*inputs)
        items, root = join_outputs([outputs] if isinstance(outputs, torch.Tensor) else list(outputs))
        if root is None:
            return outputs
        prepare(root, inputs)
        return items[0] if isinstance(outputs, torch.Tensor) else tuple(items)

    node.run_function = run_function
