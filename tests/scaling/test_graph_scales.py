"""Graphs that alternate each replay their own plan: update iterations at the single-graph rate.

PyTorch's AMP recipes run more than one graph per iteration: two models with their own losses and
optimizers, or a gradient penalty (``autograd.grad(create_graph=True)``, then the loss's backward
through it). One stored plan, replaced by whichever graph ran last, made every backward an update.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gs_lightning import GradientScaler, ScalingRecipe
from gs_lightning.scaling.decide import LayerScale, UnreadRates
from gs_lightning.scaling.drift import GradientDrift
from gs_lightning.scaling.gradient_stats import DeviceRead
from gs_lightning.scaling.graph_scales import GraphScales
from gs_lightning.scaling.plan import ScalePlan

ITERATIONS, INTERVAL = 60, 10


def _mlp(seed: int, depth: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, 16), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 4))


def _batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(t)
    return torch.randn(32, 8, generator=generator), torch.randint(0, 4, (32,), generator=generator)


def _single_graph_updates() -> int:
    model = _mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradientScaler(model, "paper", update_interval=INTERVAL)  # no drift rule: only the schedule updates
    for t in range(ITERATIONS):
        x, y = _batch(t)
        optimizer.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.step(optimizer)
        scaler.update()
    return scaler.update_iterations


def test_two_models_with_their_own_losses_and_optimizers_each_replay_their_own_plan() -> None:
    """The AMP recipe's "multiple models, losses and optimizers" loop (two graph structures per iteration)."""
    model0, model1 = _mlp(0), _mlp(1, depth=3)
    optimizer0, optimizer1 = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (model0, model1))
    scaler = GradientScaler(nn.ModuleList([model0, model1]), "paper", update_interval=INTERVAL)
    for t in range(ITERATIONS):
        x, y = _batch(t)
        optimizer0.zero_grad()
        optimizer1.zero_grad()
        scaler.scale(F.cross_entropy(model0(x), y)).backward()
        scaler.scale(F.cross_entropy(model1(x), y)).backward()
        scaler.step(optimizer0)
        scaler.step(optimizer1)
        scaler.update()
    single = _single_graph_updates()
    assert single == math.ceil(ITERATIONS / INTERVAL)
    assert len(scaler.graphs) == 2 and scaler.update_iterations == 2 * single  # not 120: every backward
    assert {layer.name for layer in scaler.layers()} >= {"0.0", "0.2", "1.0", "1.4"}  # both models' layers


def test_a_gradient_penalty_replays_both_of_its_graphs() -> None:
    """The AMP recipe's gradient penalty: ``autograd.grad`` of the scaled loss, then the backward through it."""
    model = _mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradientScaler(model, "paper", update_interval=INTERVAL)
    for t in range(ITERATIONS):
        x, y = _batch(t)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
        penalty = sum(g.pow(2).sum() for g in grads).sqrt()
        scaler.scale(loss + penalty).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.skipped_steps == 0 and len(scaler.graphs) == 2
    assert scaler.update_iterations == 2 * _single_graph_updates()


class _Residual(nn.Module):
    """fp16 residual blocks whose two branches carry different scales: their merge's scale is a device tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.inner, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        with torch.no_grad():
            self.inner.weight.mul_(2.0**-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        with torch.autocast("cpu", dtype=torch.float16):
            return self.head(h + self.inner(h)).float()


def test_a_gradient_penalty_through_merges_of_different_scales_replays_both_of_its_graphs() -> None:
    """The first backward records the scaler's products (create_graph=True): a merge's scale, taken on the device,
    is read there, so that the update records the Python-factor products a replay records (a third structure
    and an update more came of the tensor factor's product)."""
    model = _Residual()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradientScaler(model, "paper", update_interval=INTERVAL)
    for t in range(3 * INTERVAL):
        x, _ = _batch(t)
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
        scaler.scale(loss + sum(g.pow(2).sum() for g in grads).sqrt()).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.skipped_steps == 0 and len(scaler.graphs) == 2 and scaler.update_iterations == 2 * 3


def test_the_scales_of_every_graph_survive_a_checkpoint_and_a_copy() -> None:
    model0, model1 = _mlp(0), _mlp(1, depth=3)
    scaler = GradientScaler(nn.ModuleList([model0, model1]), update_interval=INTERVAL)
    x, y = _batch(0)
    for model in (model0, model1):
        scaler.scale(F.cross_entropy(model(x), y) * 1e-6).backward()
    for restored in (GradientScaler(nn.ModuleList([model0, model1]), update_interval=INTERVAL), copy.deepcopy(scaler)):
        if not restored.graphs:
            restored.load_state_dict(scaler.state_dict())
        assert [g.plans[()].alpha_out for g in restored.graphs] == [g.plans[()].alpha_out for g in scaler.graphs]
        assert restored.layers() == scaler.layers()
        before = restored.update_iterations
        for model in (model0, model1):  # each structure replays what it decided
            restored.scale(F.cross_entropy(model(x), y) * 1e-6).backward()
        assert restored.update_iterations == before


def test_a_checkpoint_of_one_plan_loads() -> None:
    """A state saved before the scaler kept one state per structure (one ``plans`` list, one ``drift``)."""
    model = _mlp(0)
    scaler = GradientScaler(model, update_interval=INTERVAL)
    x, y = _batch(0)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    state = scaler.state_dict()
    (graph,) = state.pop("graphs")
    old = {
        **state,
        **{k: graph[k] for k in ("plans", "drift", "layer_backoff", "layers", "first_non_finite", "last_skip")},
        "force_update": False,  # what asked for an update was a bool then
    }
    restored = GradientScaler(model, update_interval=INTERVAL)
    restored.load_state_dict(old)
    assert restored.scales() == scaler.scales()
    restored.scale(F.cross_entropy(model(x), y)).backward()
    assert restored.update_iterations == scaler.update_iterations  # replayed


@pytest.mark.parametrize("max_graphs", [None, 3])
def test_at_most_max_graphs_structures_are_kept(max_graphs: int | None) -> None:
    """ScalingRecipe.max_graphs: the default's, and another."""
    kept = ScalingRecipe().max_graphs if max_graphs is None else max_graphs
    models = [_mlp(k, depth=k + 1) for k in range(kept + 2)]
    scaler = GradientScaler(nn.ModuleList(models), **({} if max_graphs is None else {"max_graphs": max_graphs}))
    x, y = _batch(0)
    for model in models:
        scaler.scale(F.cross_entropy(model(x), y)).backward()
    assert len(scaler.graphs) == kept
    before = scaler.update_iterations
    scaler.scale(F.cross_entropy(models[0](x), y)).backward()  # the least recent went first: decided again
    assert scaler.update_iterations == before + 1


def test_an_updates_unread_rates_go_to_their_layers_where_two_share_a_name() -> None:
    """The rates counted on the device index the update's layers in its order; two layers of one name (the
    by-name view keeps the last) must not shift them onto another layer, nor past the end."""
    scales = GraphScales((), (), GradientDrift(10, 65504.0, 1.0, 8, True))
    layers = [LayerScale(name, "gemm", 0, 0, math.nan) for name in ("a", "a", "b")]
    counts = (torch.tensor(1), torch.tensor(4))  # 1 of 4 nonzero values below λmin
    decisions = SimpleNamespace(
        layers=layers,
        finite_flags=[],
        unread_rates=[UnreadRates(2, (), (counts,), 0.0, False)],
        undecided=set(),
        weight_bound=set(),
        unmeasured=set(),
    )
    run = SimpleNamespace(decisions=decisions, unread=list, read_in=lambda values: None)  # its scales already read
    scales.keep_update(run, ScalePlan((), (), {}, {}))
    read = DeviceRead()
    scales.put_unread(read)
    scales.take_reading(read.read())
    assert scales.layers["b"].underflow_rate == 0.25 and math.isnan(scales.layers["a"].underflow_rate)
