"""The largest input gradients GEMMs sent on between updates: what bounds a scale of their own against spikes.

Where a GEMM sends on at a scale of its own, above the one its parameter gradients allow
(:attr:`~gs_lightning.scaling.recipe.ScalingRecipe.own_input_gradient_scale`), nothing else keeps that gradient
clear of a hard batch's spike: its weight gradients' spikes do not tell (on ResNet-8 with e5m2 gradients, a
hard batch lifted an input gradient, after the batch norm it reaches, 2^5 more than the weight gradients of
its GEMM). So every replay takes each such GEMM's largest input gradient (one reduction per gradient, on the
device, read with the step's read), and an update bounds the GEMM's own scale by the largest of the last
``window`` of them, as it bounds its parameter gradients by theirs
(:attr:`~gs_lightning.scaling.recipe.ScalingRecipe.expected_maxima_margin_log2`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Mapping
from functools import partial
from typing import Any

import torch

from gs_lightning.scaling.gradient_stats import DeviceRead, extremes, magnitude
from gs_lightning.scaling.graph import AutogradGraph
from gs_lightning.scaling.plan import ScalePlan


class SentMaxima:
    """Per GEMM of one graph structure: the largest values it sent on, at their true scale, backward by backward.

    Args:
        window: How many backwards each GEMM's expected maximum looks back over (the recipe's
            :attr:`~gs_lightning.scaling.recipe.ScalingRecipe.update_interval`).
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self._history: dict[int, deque[float]] = {}
        self._pending: list[tuple[int, torch.Tensor]] = []  # (GEMM, its largest true value), unread

    def register(self, graph: AutogradGraph, plan: ScalePlan) -> list:
        """Before a replay: a post-hook on each GEMM the plan lets send on at a scale of its own, registered before
        the plan's hooks (it sees what the node sent, at :meth:`ScalePlan.edge_alpha`). Returns the handles."""
        return [
            graph.nodes[i].register_hook(partial(self._record, i, edges, plan.edge_alpha(i, edges[0])))
            for i, (edges, _) in plan.input_shift.items()
        ]

    def _record(self, i: int, edges: tuple[int, ...], log2_scale: int, grad_inputs: tuple, grad_outputs: tuple) -> None:
        sent = [grad_inputs[k] for k in edges if grad_inputs[k] is not None]
        if sent:
            maxima = [magnitude(extremes(g)) for g in sent]
            largest = maxima[0] if len(maxima) == 1 else torch.stack(maxima).amax()
            self._pending.append((i, largest * 2.0**-log2_scale))

    def put(self, read: DeviceRead, key: Hashable) -> None:
        """What the replays since the last read took, into ``read`` under ``key``."""
        read.put(key, [value for _, value in self._pending])

    def take(self, values: list[float]) -> None:
        """:meth:`put`'s values as read: each GEMM's history grows by one (a non-finite value skips its step and is
        not kept)."""
        for (i, _), value in zip(self._pending, values):
            if math.isfinite(value):
                self._history.setdefault(i, deque(maxlen=self.window)).append(value)
        self._pending = []

    def expected(self) -> dict[int, float]:
        """GEMM -> the largest value it sent on in the last ``window`` backwards (those it has any of)."""
        return {i: max(history) for i, history in self._history.items() if history}

    def state_dict(self) -> dict[str, Any]:
        """Plain containers only."""
        return {"window": self.window, "history": [[i, list(h)] for i, h in sorted(self._history.items())]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s histories (none in a checkpoint from before it was kept)."""
        self._history = {
            int(i): deque((float(v) for v in values), maxlen=self.window) for i, values in state.get("history", [])
        }
        self._pending = []
