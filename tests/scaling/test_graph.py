"""Reading autograd's backward graph: saved tensors, node classification, layer names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gs_lightning.scaling.graph import analyze, saved_tensor, walk
from gs_lightning.scaling.recompute import recomputable
from gs_lightning.scaling.walks import format_bounded_leaves, parameter_leaves, weight_path


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name.rpartition(".")[0] for name, p in model.named_parameters()}


def test_saved_tensors_owned_by_checkpointing_are_not_unpacked() -> None:
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    plain = layer(x).grad_fn
    assert torch.equal(saved_tensor(plain, "mat1"), x) and saved_tensor(plain, "missing") is None
    checkpointed = checkpoint(layer, x, use_reentrant=False)
    assert saved_tensor(checkpointed.grad_fn, "mat1") is None
    checkpointed.sum().backward()  # the node's own unpack still works: nothing was unpacked before it
    assert x.grad is not None


def test_nodes_are_classified_and_named_after_their_modules() -> None:
    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g

    model = nn.ModuleDict(
        {
            "attention": nn.MultiheadAttention(8, 2, batch_first=True),
            "rnn": nn.LSTM(8, 8, batch_first=True),
            "head": nn.Linear(8, 2),
        }
    )
    x = torch.randn(2, 5, 8, requires_grad=True)
    h, _ = model["attention"](x, x, x, need_weights=False)
    h, _ = model["rnn"](Function.apply(h))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model["head"](h[:, -1])
    loss = F.cross_entropy(logits.float(), torch.tensor([0, 1]))
    graph = walk(loss.grad_fn)
    analysis = analyze(graph, _module_names(model))
    names = {analysis.layer_names[i]: graph.names[i] for i in analysis.layer_names}
    assert names["head"] == "AddmmBackward0" and names["head.cast"] == "ToCopyBackward0"
    assert names["attention.attention"].startswith("ScaledDotProduct") and names["rnn"] == "MkldnnRnnLayerBackward0"
    assert analysis.fused.keys() == {
        i for i, name in analysis.layer_names.items() if name in ("attention.attention", "rnn")
    }
    assert {graph.names[i] for i in analysis.opaque} == {"FunctionBackward"}
    assert all(graph.names[j] == "AccumulateGrad" for j in analysis.leaf_sources)
    assert {id(graph.nodes[j].variable) for j in analysis.leaf_sources} == {id(p) for p in model.parameters()} | {id(x)}


def test_reentrant_checkpoint_is_recognised() -> None:
    layer = nn.Linear(4, 4)
    out = checkpoint(layer, torch.randn(2, 4, requires_grad=True), use_reentrant=True)
    graph = walk(out.sum().grad_fn)
    analysis = analyze(graph, {})
    assert [graph.names[i] for i in analysis.reentrant] == ["CheckpointFunctionBackward"] and not analysis.opaque


def test_one_walk_leads_from_a_gemm_edge_to_its_parameter() -> None:
    """Layer names and weight edges (the analysis), the parameter leaves the drift statistic expects maxima
    of, and the fp32 recompute take the same walk; the recompute declines a broadcast weight, whose
    gradient autograd sums back, and leaves its overflow to the step's skip."""
    linear, shared = nn.Linear(4, 3), nn.Parameter(torch.randn(4, 3))
    x = torch.randn(2, 5, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = linear(x[0]).sum() + torch.bmm(x, shared.expand(2, 4, 3)).sum()
    graph = walk(loss.grad_fn)
    analysis = analyze(graph, {id(linear.weight): "linear", id(linear.bias): "linear", id(shared): "shared"})
    deferred = frozenset(analysis.leaves)
    found, through = {}, {}
    for i in analysis.gemms:
        leaves = parameter_leaves(graph.names, graph.edges, analysis, i)
        paths = [weight_path(graph.names, graph.edges, graph.edges[i][k][0]) for k in analysis.weight_edges[i]]
        assert [path[-1] for path in paths] == leaves
        name = analysis.layer_names[i]
        found[name] = ({id(graph.nodes[j].variable) for j in leaves}, recomputable(graph, analysis, i, deferred))
        through[name] = {graph.names[n] for path in paths for n in path[:-1]}
    assert found == {"linear": ({id(linear.weight), id(linear.bias)}, True), "shared": ({id(shared)}, False)}
    assert "ExpandBackward0" in through["shared"] and "ExpandBackward0" not in through["linear"]


def test_the_format_bounds_the_parameter_gradients_a_gemm_computes_and_those_kept_in_16_bits() -> None:
    """Under autocast a convolution's weight and bias gradients are computed in fp16 (then cast to fp32): the format
    bounds them. A batch norm's fp32 weight and bias gradients are computed in fp32 from the scaled gradient: no
    scale overflows them. A model kept in fp16 computes every parameter gradient in fp16."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))
    x = torch.randn(2, 3, 8, 8)
    leaves = {}
    for kept in ("fp32, autocast", "fp16"):
        if kept == "fp16":
            model = model.half()
        with torch.autocast("cpu", dtype=torch.float16, enabled=kept != "fp16"):
            loss = model(x.to(next(model.parameters()).dtype)).float().sum()
        graph = walk(loss.grad_fn)
        analysis = analyze(graph, _module_names(model))
        names = {id(p): name for name, p in model.named_parameters()}
        leaves[kept] = {names[id(graph.nodes[j].variable)] for j in format_bounded_leaves(graph, analysis)}
    convolutions = {"0.weight", "0.bias", "3.weight", "3.bias"}
    assert leaves["fp32, autocast"] == convolutions
    assert leaves["fp16"] == convolutions | {"1.weight", "1.bias"}
