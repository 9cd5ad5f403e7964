"""The scaling recipe: one validated config for every setting and rule, a paper preset, saved with the state."""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
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


def _shrinking_loss_run(recipe: str) -> GradientScaler:
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
    """Algorithm 1 recomputes the scales every update_interval iterations; the drift rule is the default's."""
    assert _shrinking_loss_run("paper").update_iterations == 1
    assert _shrinking_loss_run("default").update_iterations > 1


def test_the_paper_recipe_decides_a_cast_by_theorem_2() -> None:
    """ln|∇y| over the nonzero elements as N(μ, σ²): the scale is Theorem 2's bound rounded up, and no probe is measured."""
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


def test_the_recipe_is_saved_and_a_resume_with_another_names_what_differs() -> None:
    model = nn.Linear(4, 4)
    saved = GradientScaler(model, "paper").state_dict()
    assert ScalingRecipe.from_state_dict(saved["recipe"]) == ScalingRecipe.paper()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradientScaler(model, "paper").load_state_dict(saved)  # the same recipe: nothing to say
    with pytest.warns(RuntimeWarning, match=r"update_interval=50 \(was 100\)"):
        GradientScaler(model, "paper", update_interval=50).load_state_dict(saved)
