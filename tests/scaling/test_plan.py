"""Replaying an update's scales: the factor on each edge, and what the replay hooks."""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F
from torch import nn

from gs_lightning import GradientScaler
from gs_lightning.scaling.graph import analyze, walk
from gs_lightning.scaling.plan import LeafTargets, ScalePlan, edge_shift


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _loss(model: nn.Module) -> torch.Tensor:
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    h = model[1](model[0](x))
    return F.cross_entropy(model[2](h) + model[2](h * 0.5), torch.arange(32) % 4) * 1e-6  # a branch at h


def test_edge_shift_brings_leaves_to_their_target_and_branches_to_their_scale() -> None:
    graph = walk(_loss(_model()).grad_fn)
    leaf_edges = [(i, e) for i, edges in enumerate(graph.edges) for e in edges if e is not None and graph.names[e[0]] == "AccumulateGrad"]
    branch = next(slot for slot, count in graph.in_counts.items() if count > 1 and graph.names[slot[0]] != "AccumulateGrad")
    _, leaf_edge = leaf_edges[0]
    leaf = leaf_edge[0]
    assert edge_shift(graph, leaf_edge, 5, {}, LeafTargets()) == -5  # a parameter: its true gradient
    assert edge_shift(graph, leaf_edge, 5, {}, LeafTargets(deferred=frozenset({leaf}))) == 0  # unscaled later
    assert edge_shift(graph, leaf_edge, 5, {}, LeafTargets(exits=frozenset({leaf}), exit_alpha=2)) == -3  # handed on at 2^2
    assert edge_shift(graph, branch, 5, {branch: 3}, LeafTargets()) == -2
    assert edge_shift(graph, None, 5, {}, LeafTargets()) == 0


def test_replay_adds_no_hook_for_deferred_leaves_and_stays_exact() -> None:
    model = _model()
    _loss(model).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    scaler = GradientScaler(model, update_interval=10)
    model.zero_grad(set_to_none=True)
    scaler.backward(_loss(model))  # update iteration
    loss = _loss(model)
    graph = walk(loss.grad_fn)
    analysis = analyze(graph, {})
    per_edge = scaler.graphs[-1].plans[()].replay(graph, LeafTargets())
    fused = scaler.graphs[-1].plans[()].replay(graph, LeafTargets(deferred=frozenset(analysis.leaf_sources)))
    assert len(fused) < len(per_edge)
    for handle in per_edge + fused:
        handle.remove()
    model.zero_grad(set_to_none=True)
    scaler.backward(loss)  # replay iteration
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), reference))


def test_plan_state_is_plain_containers_that_load_with_weights_only() -> None:
    model = _model()
    scaler = GradientScaler(model)
    scaler.backward(_loss(model))
    buffer = io.BytesIO()
    torch.save(scaler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    ((path, plan_state),) = state["graphs"][0]["plans"]
    plan = ScalePlan.from_state_dict(plan_state)
    assert path == [] and plan.alpha_out == scaler.graphs[-1].plans[()].alpha_out and plan.slot_alpha == scaler.graphs[-1].plans[()].slot_alpha
    assert plan.matches(walk(_loss(model).grad_fn))
