"""Replaying an update's scales: the factor on each edge, and what the replay hooks."""

from __future__ import annotations

import io
from collections.abc import Callable

import torch
import torch.nn.functional as F
from nets import TiedLM
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

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
    leaf_edges = [
        (i, e)
        for i, edges in enumerate(graph.edges)
        for e in edges
        if e is not None and graph.names[e[0]] == "AccumulateGrad"
    ]
    branch = next(
        slot for slot, count in graph.in_counts.items() if count > 1 and graph.names[slot[0]] != "AccumulateGrad"
    )
    _, leaf_edge = leaf_edges[0]
    leaf = leaf_edge[0]
    assert edge_shift(graph, leaf_edge, 5, {}, LeafTargets()) == -5  # a parameter: its true gradient
    assert edge_shift(graph, leaf_edge, 5, {}, LeafTargets(deferred=frozenset({leaf}))) == 0  # unscaled later
    # handed on at 2^2
    assert edge_shift(graph, leaf_edge, 5, {}, LeafTargets(exits=frozenset({leaf}), exit_alpha=2)) == -3
    assert edge_shift(graph, branch, 5, {branch: 3}, LeafTargets()) == -2
    assert edge_shift(graph, None, 5, {}, LeafTargets()) == 0


def _plain_grads_then_an_update(
    model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor]
) -> tuple[list[torch.Tensor], GradientScaler]:
    """``model``'s gradients from a plain backward, and a scaler that has run its update on the same loss (the next
    backwards replay)."""
    loss_of(model).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    scaler = GradientScaler(model, update_interval=100)
    model.zero_grad(set_to_none=True)
    scaler.backward(loss_of(model))
    return reference, scaler


def test_replay_adds_no_hook_for_deferred_leaves_and_stays_exact() -> None:
    model = _model()
    reference, scaler = _plain_grads_then_an_update(model, _loss)
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
    assert (
        path == []
        and plan.alpha_out == scaler.graphs[-1].plans[()].alpha_out
        and plan.slot_alpha == scaler.graphs[-1].plans[()].slot_alpha
    )
    assert plan.matches(walk(_loss(model).grad_fn))


def _tied_loss(model: nn.Module) -> torch.Tensor:
    return F.cross_entropy(model(torch.tensor([[1, 2, 3], [4, 5, 6]])).flatten(0, 1), torch.arange(1, 7)) * 1e-4


class _WeightShapedProducts(TorchDispatchMode):
    """Counts the products (one tensor each, or each tensor of a foreach product) shaped like ``weight``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.shape, self.count = weight.shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mul, torch.ops.aten._foreach_mul_):
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [out]
            self.count += sum(t.shape == self.shape for t in tensors)
        return out


def test_a_weight_used_several_times_is_unscaled_once_on_a_replay_and_stays_exact() -> None:
    """A tied weight gets a gradient from each use, each at its GEMM's scale. On a replay they are brought to the
    scale most of them carry and summed there, and the sum is divided once after the backward: fewer products
    of a whole weight gradient than uses, and the same ``.grad`` as a plain backward, bit for bit."""
    torch.manual_seed(0)
    model = TiedLM()
    reference, scaler = _plain_grads_then_an_update(model, _tied_loss)
    graph = walk(_tied_loss(model).grad_fn)
    tied = next(
        j
        for j, node in enumerate(graph.nodes)
        if graph.names[j] == "AccumulateGrad" and node.variable is model.embed.weight
    )
    carried = [
        scaler.graphs[-1].plans[()].alpha_out[i]
        for i, edges in enumerate(graph.edges)
        for e in edges
        if e is not None and e[0] == tied
    ]
    assert len(carried) == 4 and len(set(carried)) > 1  # four uses, at different scales
    model.zero_grad(set_to_none=True)
    loss = _tied_loss(model)
    with _WeightShapedProducts(model.embed.weight) as products:
        scaler.backward(loss)  # a replay
    assert products.count < len(carried)
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), reference))
    # captured, not accumulated: true too
    (got,) = torch.autograd.grad(scaler.scale(_tied_loss(model)), [model.embed.weight])
    assert torch.equal(got, reference[0])
