"""The reasons a scale stayed below the underflow bound: an enum the rules compare, text for people."""

from __future__ import annotations

import math

import pytest

from gs_lightning.scaling.decide import LayerScale
from gs_lightning.scaling.limits import Limit, describe, parse


@pytest.mark.parametrize("limit", list(Limit))
def test_every_reason_reads_back_from_its_text(limit: Limit) -> None:
    index = 1 if limit in (Limit.INPUT_GRADIENT, Limit.OUTPUT) else None
    assert parse(describe(limit, index)) == (limit, index)


def test_overflow_bounds_name_the_tensor_and_rules_name_themselves() -> None:
    assert describe(Limit.INPUT_GRADIENT, 0) == "overflow of the gradient of input 0"
    assert describe(Limit.WEIGHT_GRADIENT) == "overflow of the weight gradient"
    assert describe(Limit.BACKOFF) == "back-off of this layer" and describe(Limit.NONE) == ""
    assert all(
        describe(limit).count("overflow of the") <= 1 for limit in Limit
    )  # spike room read "overflow of the overflow of the"
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
