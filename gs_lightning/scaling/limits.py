"""What held a scale below the smallest one that meets γ': the reasons an update records per layer.

The rules compare these members, never their text; the text is what :attr:`LayerScale.limited_by
<gs_lightning.scaling.decide.LayerScale.limited_by>` shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple

import torch

_RECENT = "parameter gradients of recent batches"


class Limit(Enum):
    """A reason a scale stayed below the underflow bound (``NONE``: it did not).

    The overflow bounds (:data:`OVERFLOW_BOUNDS`) are each named after the tensor whose overflow it avoids
    (:class:`Bound`); the others are the rules and caps of :data:`RULES`. Members are told apart by these
    named sets, never by their position or text.
    """

    NONE = ""
    INCOMING_GRADIENT = "incoming gradient"
    INPUT_GRADIENT = "gradient of input"  # what a GEMM sends on, bounded from its operands
    WEIGHT_GRADIENT = "weight gradient"  # a GEMM's, bounded by Cauchy–Schwarz (Operator.weight_bound) or measured
    BIAS_GRADIENT = "bias gradient"  # computed exactly: a sum of the incoming gradient
    OUTPUT = "output"  # a sampled node's exact outputs
    # The values a GEMM's weight and bias gradients reached on recent batches
    # (ScalingRecipe.expected_maxima_margin_log2).
    EXPECTED_PARAMETER_GRADIENTS = _RECENT
    # Their level and a share of their spikes, the replays recomputing the rest (ScalingRecipe.recomputed_spike_share).
    RECOMPUTED_SPIKES = f"{_RECENT}, a share of their spikes (the rest recomputed)"
    # Those of the normalisation a recomputable GEMM feeds, which are not recomputed.
    FED_PARAMETER_GRADIENTS = f"{_RECENT} of the layers it feeds"
    # Expected maxima with ScalingRecipe.spike_room_log2 more room, where the outputs still meet γ' against λ_lost.
    SPIKE_ROOM = f"{_RECENT}, with room where only precision is lost"  # shown as "overflow of the ...", as the others
    KEPT_DOWNSTREAM = "scale the layers it feeds keep"  # the GEMMs it feeds are capped lower (update.kept_downstream)
    LAYER_CAP = "max_layer_scale"
    TOTAL_CAP = "accumulated-scale cap"  # max_total_scale, or the back-off after an overflow no layer was named for
    BACKOFF = "back-off of this layer"  # its gradients overflowed (ScalingRecipe.backoff_bits)
    # Its incoming gradient was all zeros: the replaced plan's scale (ScalingRecipe.keep_scale_on_zero_gradient).
    KEPT_ON_ZERO_GRADIENT = "the last plan's scale: its incoming gradient was all zeros"

    @property
    def is_overflow_bound(self) -> bool:
        """Whether it bounds the overflow of a tensor (and is shown as ``"overflow of the <tensor>"``)."""
        return self in OVERFLOW_BOUNDS

    @property
    def exact(self) -> bool:
        """Whether the bound is exact on the update iteration (it keeps ScalingRecipe.replay_headroom_log2);
        the others bound loosely, or keep a margin of their own."""
        return self in _EXACT

    @property
    def expected(self) -> bool:
        """Whether it comes from the parameter gradients of recent batches (spike room included)."""
        return self in _EXPECTED


OVERFLOW_BOUNDS = frozenset(
    {
        Limit.INCOMING_GRADIENT,
        Limit.INPUT_GRADIENT,
        Limit.WEIGHT_GRADIENT,
        Limit.BIAS_GRADIENT,
        Limit.OUTPUT,
        Limit.EXPECTED_PARAMETER_GRADIENTS,
        Limit.RECOMPUTED_SPIKES,
        Limit.FED_PARAMETER_GRADIENTS,
        Limit.SPIKE_ROOM,
    }
)
"""The limits that bound the overflow of a tensor (:attr:`Limit.is_overflow_bound`): a decision's own bounds."""
_EXACT = frozenset({Limit.INCOMING_GRADIENT, Limit.BIAS_GRADIENT, Limit.OUTPUT})
_EXPECTED = frozenset(
    {Limit.EXPECTED_PARAMETER_GRADIENTS, Limit.RECOMPUTED_SPIKES, Limit.FED_PARAMETER_GRADIENTS, Limit.SPIKE_ROOM}
)


class Bound(NamedTuple):
    """One overflow bound of a decision: its kind, and which input or output where a node has several."""

    limit: Limit
    index: int | None = None

    def __str__(self) -> str:
        return self.limit.value if self.index is None else f"{self.limit.value} {self.index}"


def describe(limit: Limit, index: int | None = None) -> str:
    """The text of a reason, as :attr:`LayerScale.limited_by` shows it: ``"overflow of the gradient of input 1"``,
    ``"max_layer_scale"``."""
    return f"overflow of the {Bound(limit, index)}" if limit.is_overflow_bound else limit.value


def parse(text: str) -> tuple[Limit, int | None]:
    """The reason :func:`describe` wrote as ``text`` (reading a checkpoint saved with the text only)."""
    for limit in Limit:
        if describe(limit) == text:
            return limit, None
        head, _, tail = text.rpartition(" ")
        if tail.isdigit() and describe(limit) == head:
            return limit, int(tail)
    raise ValueError(f"unknown scale limit {text!r}; expected one of {[describe(limit) for limit in Limit]}")


# The reasons a decision names besides its own overflow bounds (the scale met γ', spike room, the caps). They open
# every decision's candidates (:func:`candidates`), the device picks a position among those, and each rule's
# position is looked up by its member (:func:`rule_position`): reordering this tuple or Limit relabels nothing.
RULES = (
    Limit.NONE,
    Limit.SPIKE_ROOM,
    Limit.LAYER_CAP,
    Limit.TOTAL_CAP,
    Limit.BACKOFF,
    Limit.KEPT_DOWNSTREAM,
    Limit.KEPT_ON_ZERO_GRADIENT,
)
_RULE_POSITIONS = {limit: k for k, limit in enumerate(RULES)}


def candidates(bounds: Sequence[Bound]) -> tuple[Bound, ...]:
    """What a decision's device-chosen position points into: the :data:`RULES`, then its overflow ``bounds``
    in their order (:func:`bound_position`)."""
    return (*(Bound(limit) for limit in RULES), *bounds)


def rule_position(limit: Limit) -> int:
    """The position of rule ``limit`` in every :func:`candidates`."""
    try:
        return _RULE_POSITIONS[limit]
    except KeyError:
        raise ValueError(f"{limit} is not a rule a decision names; expected one of {RULES}") from None


def bound_position(k: int | torch.Tensor) -> int | torch.Tensor:
    """The position in :func:`candidates` of its ``k``-th overflow bound (a tensor where the device chose ``k``)."""
    return len(RULES) + k


class UnreadBound(NamedTuple):
    """Which of ``candidates`` held a scale down, as chosen on the device (:meth:`ScaleBounds.choose
    <gs_lightning.scaling.bounds.ScaleBounds.choose>`): ``index``, a 0-dim integer tensor, unread, its position
    in ``candidates`` (:func:`candidates`)."""

    candidates: tuple[Bound, ...]
    index: torch.Tensor

    def read(self, index: float) -> Bound:
        """The bound, ``index`` as read."""
        return self.candidates[int(index)]
