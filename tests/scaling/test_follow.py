"""The step raises each GEMM's scale as its weight gradients' level falls (ScalingRecipe.follow_gradients)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from test_scaler import CASES, _grads
from torch import nn

from gs_lightning import GradientScaler
from gs_lightning.scaling.follow import shifted_plan
from gs_lightning.scaling.plan import ScalePlan
from gs_lightning.scaling.schedule import UpdateReason


def _diamond() -> ScalePlan:
    """Root 0 feeds GEMMs 1 and 2, whose gradients meet in slot (3, 0) (a branch); 3 feeds leaf 4."""
    names = ("SumBackward0", "MmBackward0", "MmBackward0", "AddBackward0", "AccumulateGrad")
    edges = (((1, 0), (2, 0)), ((3, 0),), ((3, 0),), ((4, 0),), ())
    return ScalePlan(names, edges, {0: 0, 1: 5, 2: 3, 3: 3}, {(0, 0): 0, (1, 0): 0, (2, 0): 0, (3, 0): 3})


def test_a_shift_is_carried_to_the_next_decisions_and_a_branch_takes_its_parts_lowest() -> None:
    plan, decisions = _diamond(), {1, 2}
    shifted = shifted_plan(plan, {1: 2, 2: 1}, decisions)
    assert shifted.alpha_out == {0: 0, 1: 7, 2: 4, 3: 4}
    assert shifted.slot_alpha == {(0, 0): 0, (1, 0): 0, (2, 0): 0, (3, 0): 4}
    # no part reaches the sum by a larger factor than the update's: 2^(3-5) and 2^(3-3) before, 2^(4-7) and 2^0 now
    assert shifted_plan(plan, {1: 2}, decisions).alpha_out == {0: 0, 1: 7, 2: 3, 3: 3}  # GEMM 2 keeps its scale
    assert shifted_plan(plan, {1: 2}, {1, 2, 3}).alpha_out == {0: 0, 1: 7, 2: 3, 3: 3}
    assert shifted_plan(plan, {1: 2, 2: 2}, {1, 2, 3}).alpha_out == {0: 0, 1: 7, 2: 5, 3: 3}  # a decision at 3
    assert shifted_plan(plan, {}, decisions).alpha_out == plan.alpha_out


def _step(scaler: GradientScaler, model: nn.Module, loss: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    scaler.backward(loss)
    assert not scaler.found_inf  # the step's read, which moves the shifts
    scaler.update()


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_gradients_are_bit_exact_on_shifted_replays(case: str) -> None:
    """An update, then gradients 8x (3 binades) smaller: the step shifts the scales, the replays run the shifted plan,
    and every .grad equals plain backward's, bit for bit, with no update."""
    build, loss_fn = CASES[case]
    torch.manual_seed(0)
    model = build()
    factors = (1e-6, 1e-6 / 8, 1e-6 / 8, 1e-6 / 8)
    references = []
    for factor in factors:
        model.zero_grad(set_to_none=True)
        (loss_fn(model) * factor).backward()
        references.append(_grads(model))
    scaler = GradientScaler(model, update_interval=100, follow_gradients=True)
    for iteration, (factor, reference) in enumerate(zip(factors, references)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # opaque and reentrant-checkpoint notices
            _step(scaler, model, loss_fn(model) * factor)
        grads = _grads(model)
        mismatched = [n for n in reference if not torch.equal(grads[n], reference[n])]
        assert grads.keys() == reference.keys() and not mismatched, f"iteration {iteration}: {mismatched}"
    follower = scaler.graphs[-1].follower
    if case in ("ssd_like", "segnet_like", "densenet_like"):  # every GEMM met γ' at the update: each follows
        # the whole binades the level fell (3, less the rounding of the maxima computed at other scales: 2 on one
        # CPU thread), and where values sank below λmin at that, a binade per step more
        assert follower.shifts and min(follower.shifts.values()) >= 2, follower.shifts
        assert sorted(follower.shifts.values())[len(follower.shifts) // 2] >= 3, follower.shifts
        assert scaler.update_iterations == 1
    elif case == "resnet18":  # layer4's scales were held by what they send on: the fall takes an update
        assert not all(follower.rises.values()) and scaler.update_iterations == 2


def _mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    return model, torch.randn(128, 64), torch.randn(128, 64)


def _loss(model: nn.Module, x: torch.Tensor, upstream: torch.Tensor, factor: float) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        return (model(x).float() * upstream).sum() * factor


def test_a_falling_level_raises_the_scales_without_an_update() -> None:
    model, x, upstream = _mlp()
    scaler = GradientScaler(model, update_interval=100, level_steps=1, follow_gradients=True)
    _step(scaler, model, _loss(model, x, upstream, 1e-3))
    graph = scaler.graphs[-1]
    base = dict(graph.plans[()].alpha_out)
    gemms = sorted(graph.follower.reference)
    assert len(gemms) == 2
    _step(scaler, model, _loss(model, x, upstream, 1e-3 / 2**5))  # the level falls 5 binades
    assert graph.follower.shifts == {g: 5 for g in gemms}
    assert all(graph.plans[()].alpha_out[g] == base[g] + 5 for g in gemms)
    assert scaler.raised() == {"0": 5, "2": 5}  # by layer name, as layers() names them
    _step(scaler, model, _loss(model, x, upstream, 1e-3))  # and comes back
    assert graph.plans[()].alpha_out == base
    assert scaler.update_iterations == 1 and scaler.skipped_steps == 0
    assert UpdateReason.DRIFT not in graph.schedule.pending


def test_a_raise_stops_at_the_updates_bound_a_level_above_it_lowers_and_a_spike_holds_it() -> None:
    """The follower's rule on one GEMM: the whole binades its level fell, at most up to the highest scale that keeps
    level + spike the margin below λmax (as the update bounds it) and its cap; lowered to that bound where the level
    or a spike rose above it, as an update expecting them would."""
    model, x, upstream = _mlp()
    scaler = GradientScaler(
        model, update_interval=100, level_steps=3, recompute_weight_gradients=False, follow_gradients=True
    )
    _step(scaler, model, _loss(model, x, upstream, 1e-3))
    follower = scaler.graphs[-1].follower
    assert follower.share == {g: 1.0 for g in follower.reference}  # whole spikes: nothing is recomputed
    g = min(follower.reference)
    (leaf, *_) = follower.leaves[g]
    total, reference, spike = follower.base.alpha_out[g], follower.reference[g], follower.spike[g]

    def raised(*log2_values: float, room: float = 100, cap: int | None = None) -> int:
        """The raise after steps whose largest values are ``2^log2_values``, where the highest scale that keeps the
        update's level and spike below the margin is ``room`` binades above the update's scale."""
        recent = [{leaf: 2.0**v} for v in log2_values]
        highest = lambda v: math.floor(total + room + reference + spike - v)  # noqa: E731
        follower.follow(recent, 3, highest, {g: cap or 100}, scaler.graphs[-1].analyses[()])
        return follower.shifts.get(g, 0)

    assert raised(reference - 2.5, reference - 2.5) == 2  # the whole binades the level fell
    assert raised(reference - 2.5, reference - 2.5, cap=total + 1) == 1  # the back-off cap
    assert raised(reference - 2.5, reference - 2.5, room=-1) == 1  # the update's bound, moved with the level: 1.5
    assert raised(reference + 3, reference + 3, room=0) == -3  # a level above the bound: lowered to it
    assert raised(reference - 4, reference - 4, reference - 4) == 4
    raised(reference, reference, reference + spike + 6)  # a spike 6 binades above any before is remembered
    assert follower.spike[g] >= spike + 6
    assert raised(reference - 4, reference - 4, reference - 4, room=2) == 0  # and holds the raise


def test_a_scale_above_the_bound_of_its_parameter_gradients_is_lowered_at_the_step_without_an_update() -> None:
    """Large gradients (2^14 times the MLP's): the first update had no recent batches to expect spikes from, and
    chose scales above what keeps their parameter gradients the margin below λmax. The next step lowers those
    GEMMs to that bound, as an update expecting the values would, and asks for no update; nothing overflows."""
    model, x, upstream = _mlp()
    scaler = GradientScaler(
        model, update_interval=100, level_steps=1, recompute_weight_gradients=False, follow_gradients=True
    )
    for _ in range(3):
        _step(scaler, model, _loss(model, x, upstream, 2.0**14))
    follower = scaler.graphs[-1].follower
    assert follower.shifts and all(shift < 0 for shift in follower.shifts.values())
    assert all(follower.base.alpha_out[g] + shift <= follower.highest[g] for g, shift in follower.shifts.items())
    assert scaler.update_iterations == 1 and scaler.skipped_steps == 0
    assert not scaler.graphs[-1].schedule.pending


def test_the_paper_recipe_does_not_follow() -> None:
    model, x, upstream = _mlp()
    scaler = GradientScaler(model, "paper", update_interval=100)
    _step(scaler, model, _loss(model, x, upstream, 1e-3))
    plan = scaler.graphs[-1].plans[()]
    _step(scaler, model, _loss(model, x, upstream, 1e-3 / 2**5))
    assert scaler.graphs[-1].plans[()] is plan and not scaler.graphs[-1].follower.shifts


def test_the_shifts_survive_a_checkpoint() -> None:
    model, x, upstream = _mlp()
    scaler = GradientScaler(model, update_interval=100, level_steps=1, follow_gradients=True)
    for factor in (1e-3, 1e-3 / 2**4):
        _step(scaler, model, _loss(model, x, upstream, factor))
    resumed = GradientScaler(model, update_interval=100, level_steps=1, follow_gradients=True)
    resumed.load_state_dict(scaler.state_dict())
    for factor in (1e-3 / 2**6, 1e-3 / 2**2):
        for s in (scaler, resumed):
            _step(s, model, _loss(model, x, upstream, factor))
        assert resumed.state_dict() == scaler.state_dict()
    assert scaler.graphs[-1].follower.shifts
