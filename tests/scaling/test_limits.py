"""The reasons a scale stayed below the underflow bound: an enum the rules compare, text for people."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gs_lightning import GradientScaler
from gs_lightning.scaling.decide import LayerScale
from gs_lightning.scaling.limits import (
    OVERFLOW_BOUNDS,
    RULES,
    Bound,
    Limit,
    bound_position,
    candidates,
    describe,
    parse,
    rule_position,
)


@pytest.mark.parametrize("limit", list(Limit))
def test_every_reason_reads_back_from_its_text(limit: Limit) -> None:
    index = 1 if limit in (Limit.INPUT_GRADIENT, Limit.OUTPUT) else None
    assert parse(describe(limit, index)) == (limit, index)


def test_overflow_bounds_name_the_tensor_and_rules_name_themselves() -> None:
    assert describe(Limit.INPUT_GRADIENT, 0) == "overflow of the gradient of input 0"
    assert describe(Limit.WEIGHT_GRADIENT) == "overflow of the weight gradient"
    assert describe(Limit.BACKOFF) == "back-off of this layer" and describe(Limit.NONE) == ""
    # spike room read "overflow of the overflow of the"
    assert all(describe(limit).count("overflow of the") <= 1 for limit in Limit)
    assert {limit for limit in Limit if limit.exact} == {Limit.INCOMING_GRADIENT, Limit.BIAS_GRADIENT, Limit.OUTPUT}


def test_a_layer_saved_with_the_text_only_loads() -> None:
    layer = LayerScale("fc", "gemm", 3, 5, math.nan, None, Limit.OUTPUT, 2)
    state = layer.state_dict()
    assert state["limit"] == "OUTPUT" and LayerScale.from_state_dict(state).limited_by == "overflow of the output 2"
    old = {k: v for k, v in state.items() if k not in ("limit", "limit_index")} | {
        "limited_by": "overflow of the output 2"
    }
    assert LayerScale.from_state_dict(old).limit is Limit.OUTPUT
    with pytest.raises(ValueError, match="unknown scale limit 'too big'"):
        parse("too big")


def test_every_reason_has_one_named_place_in_what_a_decision_chooses_from() -> None:
    """The device picks a position among a decision's candidates; every rule's is found by its member."""
    assert set(RULES) | OVERFLOW_BOUNDS == set(Limit) and len(set(RULES)) == len(RULES)
    assert set(RULES) & OVERFLOW_BOUNDS == {Limit.SPIKE_ROOM}  # a rule that bounds an overflow
    bounds = (Bound(Limit.INCOMING_GRADIENT), Bound(Limit.INPUT_GRADIENT, 0), Bound(Limit.WEIGHT_GRADIENT))
    chosen_from = candidates(bounds)
    assert [chosen_from[rule_position(limit)] for limit in RULES] == [Bound(limit) for limit in RULES]
    assert [chosen_from[bound_position(k)] for k in range(len(bounds))] == list(bounds)
    with pytest.raises(ValueError, match="Limit.OUTPUT is not a rule a decision names"):
        rule_position(Limit.OUTPUT)


@pytest.mark.parametrize(
    ("cap", "limit"), [({"max_layer_scale": 2.0}, Limit.LAYER_CAP), ({"max_total_scale": 4.0}, Limit.TOTAL_CAP)]
)
def test_a_cap_that_holds_a_scale_is_reported_by_name(cap: dict[str, float], limit: Limit) -> None:
    """A loss small enough that every layer asks for more than the cap: each GEMM names the cap."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    scaler = GradientScaler(model, **cap)
    scaler.scale(model(torch.randn(32, 8)).square().mean() * 2.0**-20).backward()
    gemms = [layer for layer in scaler.layers() if layer.kind == "gemm"]
    assert gemms and all(layer.limit is limit for layer in gemms), [(g.name, g.limit) for g in gemms]
    assert gemms[0].limited_by == describe(limit)
