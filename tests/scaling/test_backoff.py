"""The back-off after a skipped step no layer can be named for: exact inputs, exact caps (as torch pins GradScaler's
halving)."""

from __future__ import annotations

import pytest

from gs_lightning.scaling.backoff import SkipBackoff
from gs_lightning.scaling.drift import GradientDrift
from gs_lightning.scaling.graph_scales import GraphScales
from gs_lightning.scaling.plan import ScalePlan
from gs_lightning.scaling.recipe import ScalingRecipe
from gs_lightning.scaling.schedule import UpdateReason


def _structure(alpha_out: dict[int, int]) -> GraphScales:
    """A structure whose last plan sent its gradients at ``alpha_out`` (log2), with no layer named for a skip."""
    scales = GraphScales((), (), GradientDrift(100, 65504.0, 1.0, 8, True))
    scales.plans[()] = ScalePlan((), (), dict(alpha_out), {})
    return scales


@pytest.mark.parametrize("bits", [1, 3])
def test_an_unattributed_skip_caps_every_scale_below_the_largest_that_ran(bits: int) -> None:
    backoff = SkipBackoff(ScalingRecipe(unattributed_backoff_bits=bits, max_log2_total_scale=100))
    scales = _structure({0: 12, 1: 5})
    backoff.skipped([scales])
    assert backoff.cap == 12 - bits and backoff.total_cap() == 12 - bits
    assert UpdateReason.SKIPPED_STEP in scales.schedule.pending
    backoff.skipped([scales])  # a second skip lowers from the cap, not from what ran
    assert backoff.cap == 12 - 2 * bits


def test_the_back_off_stops_at_its_floor() -> None:
    backoff = SkipBackoff(ScalingRecipe(min_backoff_log2=-3))
    scales = _structure({0: -2})
    for _ in range(4):
        backoff.skipped([scales])
    assert backoff.cap == -3


def test_a_bad_back_off_is_an_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="unattributed_backoff_bits must be a positive integer, got 0"):
        ScalingRecipe(unattributed_backoff_bits=0)
