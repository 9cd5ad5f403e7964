"""The scaling recipe: one validated config for every setting and rule, a paper preset, saved with the state."""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_drift import self_labelling_run
from test_opaque import _loss, make_model
from test_zoo_patterns import BranchesAfterBatchNorm, ReusedLinear, _fp16_loss
from torch import nn

from gs_lightning import GradientScaler, ScalingRecipe
from gs_lightning.scaling.underflow import cast_min_log2_scale


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("underflow_rate", 0.5, "a number in (0, 0.5)"),
        ("update_interval", 0, "a positive integer"),
        ("update_interval", 2.5, "a positive integer"),
        ("lambda_min", "tiny", "'normal' or 'subnormal'"),
        ("max_total_scale", 0.5, "None or a number >= 1"),
        ("drift_tolerance_log2", 0.0, "None (the rule off) or a positive number of binades"),
        ("recompute_weight_gradients", "yes", "True or False"),
        ("spike_room_log2", -1.0, "a number >= 0 (binades)"),
        ("recomputed_spike_share", 2.0, "a number in [0, 1]"),
        ("min_backoff_log2", 3, "an integer <= 0"),
    ],
)
def test_a_bad_value_names_its_field_and_what_was_expected(field: str, value: object, expected: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"ScalingRecipe: {field} must be {expected}, got {value!r}")):
        ScalingRecipe(**{field: value})
    with pytest.raises(ValueError, match=f"ScalingRecipe: {field} must be"):  # the scaler validates through the recipe
        GradientScaler(nn.Linear(2, 2), **{field: value})


def test_an_unknown_field_or_preset_names_the_nearest() -> None:
    with pytest.raises(TypeError, match=r"no field 'update_intervall' \(did you mean 'update_interval'\?\)"):
        GradientScaler(nn.Linear(2, 2), update_intervall=3)
    with pytest.raises(ValueError, match=r"no preset named 'papers'; expected one of \['default', 'paper'\]"):
        GradientScaler(nn.Linear(2, 2), "papers")


def test_fields_given_as_keywords_change_the_named_preset() -> None:
    scaler = GradientScaler(nn.Linear(2, 2), "paper", update_interval=7)
    assert scaler.recipe == ScalingRecipe.paper().replace(update_interval=7)
    assert scaler.recipe.lambda_min == "subnormal" and scaler.recipe.drift_tolerance_log2 is None
    assert GradientScaler().recipe == ScalingRecipe() == ScalingRecipe.default()


def _shrinking_loss_run(recipe: str | ScalingRecipe) -> GradientScaler:
    """100 steps whose gradients shrink 100x (test_drift's loop): the default recipe's drift rule updates on the way."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    x, upstream = torch.randn(128, 64), torch.randn(128, 64)
    scaler, optimizer = GradientScaler(model, recipe), torch.optim.SGD(model.parameters(), lr=0.0)
    for t in range(100):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(x).float() * upstream).sum() * (1e-3 * 100.0 ** (-t / 99))
        optimizer.zero_grad(set_to_none=True)
        scaler.backward(loss)
        assert scaler.step(optimizer)
        scaler.update()
    return scaler


def test_the_paper_recipe_updates_on_schedule_only() -> None:
    """Algorithm 1 recomputes the scales every update_interval iterations and replays them unchanged in between; the
    default's drift rule updates on the way, and the opt-in follower raises the scales instead."""
    paper = _shrinking_loss_run("paper")
    assert paper.update_iterations == 1 and not paper.graphs[-1].follower.shifts
    assert _shrinking_loss_run("default").update_iterations > 1
    follows = _shrinking_loss_run(ScalingRecipe(follow_gradients=True))
    assert follows.update_iterations == 1 and follows.graphs[-1].follower.shifts


def test_the_paper_recipe_decides_a_cast_by_theorem_2() -> None:
    """ln|∇y| over the nonzero elements as N(μ, σ²): the scale is Theorem 2's bound rounded up, and no probe is
    measured."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    scaler = GradientScaler(model, "paper")
    captured: list[torch.Tensor] = []
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(x)
    logits32 = logits.float()  # the cast autocast leaves before the loss: a decision point
    logits32.register_hook(captured.append)
    scaler.backward(F.cross_entropy(logits32, y) * 1e-6)
    (cast,) = [layer for layer in scaler.layers() if layer.kind == "cast"]
    logs = captured[0].abs()[captured[0] != 0].double().log()
    lower = cast_min_log2_scale(
        float(logs.mean()), float(logs.std(unbiased=False)), scaler.lambda_min_value, scaler.recipe.underflow_rate
    )
    assert cast.log2_scale == max(math.ceil(lower), 0) and cast.measured_underflow is None
    assert cast.underflow_rate <= scaler.recipe.underflow_rate
    assert all(layer.measured_underflow is None for layer in scaler.layers())  # no exact probes anywhere


def test_fp32_gradients_stay_bit_exact_under_the_paper_recipe() -> None:
    """Power-of-two scales in fp32 compute change no bit, whichever recipe chose them (a branch included)."""
    torch.manual_seed(0)
    trunk, left, right = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)
    params = [*trunk.parameters(), *left.parameters(), *right.parameters()]
    x = torch.randn(5, 8)

    def loss() -> torch.Tensor:
        h = torch.relu(trunk(x))
        return (left(h) * right(h)).sum() * 1e-7

    loss().backward()
    plain = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    scaler = GradientScaler(nn.ModuleList([trunk, left, right]), "paper")
    scaler.backward(loss())
    assert any(scale != 1.0 for scale in scaler.scales().values())
    assert all(torch.equal(p.grad, g) for p, g in zip(params, plain))


def test_the_recipe_is_saved_and_a_resume_restores_it_naming_what_differed() -> None:
    """As GradScaler restores its settings: the checkpoint's recipe decides from then on; one warning names
    each field where the recipe the scaler was built with differed."""
    model = nn.Linear(4, 4)
    saved = GradientScaler(model, "paper").state_dict()
    assert ScalingRecipe.from_state_dict(saved["recipe"]) == ScalingRecipe.paper()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradientScaler(model, "paper").load_state_dict(saved)  # the same recipe: nothing to say
    resumed = GradientScaler(model, "paper", update_interval=50, backoff_bits=3)
    with pytest.warns(RuntimeWarning) as said:
        resumed.load_state_dict(saved)
    assert len(said) == 1
    assert "update_interval=100 (built with 50), backoff_bits=2 (built with 3)" in str(said[0].message)
    assert resumed.recipe == ScalingRecipe.paper()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(saved)  # now the checkpoint's: nothing more to say


# The fields as the class docstring groups them; the paper preset changes exactly the last group and the
# two paper settings the default departs from.
ALGORITHM_1 = {"underflow_rate", "update_interval", "lambda_min", "relu_factor", "max_layer_scale", "max_total_scale"}
MEASUREMENT = {"exact_probes", "probe_elements", "weight_probe_elements", "weight_probe_macs"}
PAPER_SILENT = {
    "weight_grad_bounds",
    "branch_sum_bound",
    "gain_bounds",
    "opaque_probe_headroom_log2",
    "opaque_margin_log2",
    "backoff_bits",
    "unattributed_backoff_bits",
    "min_backoff_log2",
    "max_log2_total_scale",
    "max_graphs",
}
BEYOND_PAPER = {
    "replay_headroom_log2",
    "weight_grad_margin_log2",
    "wide_branch_scale",
    "drift_tolerance_log2",
    "update_after_zero_gradient",
    "keep_scale_on_zero_gradient",
    "level_steps",
    "expected_maxima_margin_log2",
    "kept_downstream_cap",
    "expect_surprise_within_margin",
    "spike_room_log2",
    "retry_overflowed_steps",
    "recomputed_spike_share",
}
OPT_IN = {"recompute_weight_gradients", "own_input_gradient_scale", "follow_gradients"}  # off in both presets


def test_the_paper_preset_differs_from_the_default_in_exactly_the_rules_beyond_the_paper() -> None:
    fields = [f.name for f in dataclasses.fields(ScalingRecipe)]
    groups = [ALGORITHM_1, MEASUREMENT, PAPER_SILENT, BEYOND_PAPER, OPT_IN]
    assert sorted(fields) == sorted(set().union(*groups)) and len(fields) == sum(map(len, groups))
    differs = set(ScalingRecipe.paper().differences(ScalingRecipe()))
    assert differs == BEYOND_PAPER | {"lambda_min"} | {"exact_probes"}
    docstring = ScalingRecipe.__doc__
    for field in fields:  # each field documented in its group, in that order
        assert re.search(rf"^        {field}: ", docstring, re.MULTILINE), field
    heads = [
        "Algorithm 1's settings",
        "How a decision measures",
        "Where the paper is silent",
        "Rules beyond the paper",
        "Opt-in rules",
    ]
    starts = [docstring.index(head) for head in heads] + [len(docstring)]
    for group, start, end in zip(groups, starts, starts[1:]):
        assert {f for f in fields if re.search(rf"^        {f}: ", docstring[start:end], re.MULTILINE)} == group


def test_a_field_without_effect_is_named_with_the_field_that_turns_it_off() -> None:
    """Each pair decided once: at its default or its paper value it is stated (inert_fields), at any other an
    error naming both fields."""
    assert ScalingRecipe().inert_fields() == {}
    assert set(ScalingRecipe.paper().inert_fields()) == {
        "weight_grad_margin_log2",
        "weight_probe_elements",
        "weight_probe_macs",
        "update_after_zero_gradient",
        "level_steps",
        "kept_downstream_cap",
        "expect_surprise_within_margin",
        "spike_room_log2",
        "recomputed_spike_share",
    }
    inert = ScalingRecipe(retry_overflowed_steps=False).inert_fields()
    assert (
        list(inert) == ["recomputed_spike_share"] and "retry_overflowed_steps=False" in inert["recomputed_spike_share"]
    )
    assert ScalingRecipe(retry_overflowed_steps=False, recompute_weight_gradients=True).inert_fields() == {}
    refused = [
        (
            {"expected_maxima_margin_log2": None, "spike_room_log2": 2.0},
            "spike_room_log2",
            "expected_maxima_margin_log2",
        ),
        ({"lambda_min": "subnormal", "spike_room_log2": 1.0}, "spike_room_log2", "lambda_min"),
        (
            {"retry_overflowed_steps": False, "recomputed_spike_share": 0.25},
            "recomputed_spike_share",
            "retry_overflowed_steps",
        ),
        ({"exact_probes": False, "weight_grad_margin_log2": 1.0}, "weight_grad_margin_log2", "exact_probes"),
        (
            {"weight_grad_bounds": False, "weight_grad_margin_log2": 1.0},
            "weight_grad_margin_log2",
            "weight_grad_bounds",
        ),
        ({"exact_probes": False, "weight_probe_macs": 2**20}, "weight_probe_macs", "exact_probes"),
        (
            {"drift_tolerance_log2": None, "expected_maxima_margin_log2": None, "level_steps": 4},
            "level_steps",
            "drift_tolerance_log2",
        ),
        ({"max_total_scale": 2.0**100}, "max_total_scale", "max_log2_total_scale"),
    ]
    for fields, field, turned_off_by in refused:
        with pytest.raises(ValueError, match=rf"ScalingRecipe: {field}=.*{turned_off_by}="):
            ScalingRecipe(**fields)
    with pytest.raises(ValueError, match=r"spike_room_log2=2.0 has no effect.*expected_maxima_margin_log2=None"):
        ScalingRecipe.paper().replace(spike_room_log2=2.0)
    stated = ScalingRecipe(drift_tolerance_log2=None, update_after_zero_gradient=False).inert_fields()
    assert "drift_tolerance_log2=None" in stated["update_after_zero_gradient"]


def test_the_paper_preset_decides_as_its_rules_off_alone_would() -> None:
    """The paper preset's explicit off values of rules its switches already turn off change no decision: a run
    with them at the default's values (where allowed) decides the same scales, step for step."""
    relaxed = ScalingRecipe.paper().replace(level_steps=8, weight_grad_margin_log2=0.5, recomputed_spike_share=0.5)
    assert relaxed.inert_fields().keys() == ScalingRecipe.paper().inert_fields().keys()
    runs = []
    for recipe in (ScalingRecipe.paper(), relaxed):
        scaler = _shrinking_loss_run(recipe)
        runs.append((scaler.update_iterations, scaler.scales()))
    assert runs[0] == runs[1]


# --- rules with a switch, each turned off by its field: the case that needed it fails without it ---------------


def test_weight_grad_bounds_keep_a_weight_gradient_summed_over_many_rows_finite() -> None:
    """test_scaler's case: at the scales that keep ∇X above λmin, a weight gradient summed over 4096 rows
    overflows fp16 without its bound."""

    def found_inf(**fields: object) -> bool:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        scaler = GradientScaler(model, **fields)
        with torch.autocast("cpu", dtype=torch.float16):
            x, upstream = torch.randn(4096, 64) * 30, torch.exp(-10 + 3 * torch.randn(4096, 64))
            loss = (model(x).float() * upstream).sum()
        scaler.backward(loss)
        return scaler.found_inf

    assert not found_inf() and found_inf(weight_grad_bounds=False)


def _steps(model: nn.Module, loss: torch.Tensor, **fields: object) -> bool:
    scaler = GradientScaler(model, **fields)
    scaler.backward(loss)
    return scaler.step(torch.optim.SGD(model.parameters(), lr=0.0))


def test_branch_sum_bound_keeps_a_weight_used_three_times_from_overflowing_its_fp16_sum() -> None:
    def steps(**fields: object) -> bool:
        torch.manual_seed(0)
        model = ReusedLinear()
        return _steps(model, _fp16_loss(model, [1.0 + 0.01 * torch.randn(1, 16) for _ in range(3)]), **fields)

    assert steps() and not steps(branch_sum_bound=False)


def test_gain_bounds_leave_room_for_a_batch_norm_after_a_branch_sum() -> None:
    def steps(**fields: object) -> bool:
        torch.manual_seed(0)
        model, x = BranchesAfterBatchNorm(), torch.randn(64, 16)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean() * 1e-3
        return _steps(model, loss, **fields)

    assert steps() and not steps(gain_bounds=False)


def test_kept_downstream_cap_keeps_a_cast_from_overflowing_what_its_layer_scales_down() -> None:
    """test_drift's self-labelling classifier: without the cap its cast overflows at step 18."""
    assert self_labelling_run()[0] == [] and self_labelling_run(kept_downstream_cap=False)[0] == [18]


def test_opaque_margin_is_what_an_opaque_region_keeps_below_its_overflow() -> None:
    settled = {}
    for margin in (1, 3):
        model = make_model()
        scaler = GradientScaler(model, opaque_margin_log2=margin)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the opaque region's warning
            scaler.backward(_loss(model, fp16=True))
        (opaque,) = [layer for layer in scaler.layers() if layer.kind == "opaque"]
        settled[margin] = opaque.log2_scale
    assert settled[1] - settled[3] == 2


def test_max_log2_total_scale_caps_every_accumulated_scale() -> None:
    """fp32 gradients of 1e-38 ask for more than 2^100: capped at the field's value."""

    def highest(**fields: object) -> int:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        scaler = GradientScaler(model, **fields)
        scaler.backward(model(torch.randn(4, 8)).sum() * 1e-38)
        return max(layer.log2_total for layer in scaler.layers())

    assert highest() == 100 and highest(max_log2_total_scale=50) == 50
