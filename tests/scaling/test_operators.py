"""The operator registry: its records are consistent, and every consumer of operator knowledge agrees with it."""

from __future__ import annotations

import math
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

import gs_lightning.scaling as scaling
from gs_lightning.scaling.compiled import _eager_name, _scale_points, _traced_leaf
from gs_lightning.scaling.gains import node_gains
from gs_lightning.scaling.graph import analyze, decision_nodes, saved_tensor, walk
from gs_lightning.scaling.join import join_outputs
from gs_lightning.scaling.limits import Limit
from gs_lightning.scaling.operators import LEAF, Operator, Role, node_types, operator, registry
from gs_lightning.scaling.probes import probe, rnn_probe
from gs_lightning.scaling.recompute import recomputable
from gs_lightning.scaling.walks import parameter_leaves, recomputable_path, transposes, weight_path

GEMMS = node_types(Role.GEMM)


# --- The records -------------------------------------------------------------------------------


def test_every_gemm_has_operands_and_a_probe_and_says_why_it_lacks_a_bound_or_a_recompute() -> None:
    assert {"ConvolutionBackward0", "AddmmBackward0", "MmBackward0", "BmmBackward0", "BaddbmmBackward0"} <= GEMMS
    for name in GEMMS:
        op = operator(name)
        assert op.operands and op.probe is not None, name
        assert op.probed_edges is None and op.layout is None and op.eager_name is None, name
        if op.weight_bound is None or op.recompute is None:
            assert op.note, f"{name}: no weight bound or recompute, and no note saying why"
    assert operator("BmmBackward0").weight_bound is None and "activations" in operator("BmmBackward0").note


def test_a_recomputable_gemm_has_operands_and_a_weight_bound_and_recomputes_only_parameter_edges() -> None:
    recomputed = {name for name, op in registry().items() if op.recompute is not None}
    assert recomputed == {"ConvolutionBackward0", "AddmmBackward0", "MmBackward0"}
    for name in recomputed:
        op = operator(name)
        assert op.role is Role.GEMM and op.operands and op.weight_bound is not None, name
        assert op.recompute.operands, name


def test_only_gemms_carry_gemm_fields_and_each_role_has_its_own() -> None:
    for name, op in registry().items():
        assert isinstance(op, Operator)
        if op.role is not Role.GEMM:
            assert op.operands is None and op.weight_bound is None and op.recompute is None, name
        assert (op.role in (Role.ATTENTION, Role.RNN)) == (op.probed_edges is not None), name
        if op.role in (Role.ATTENTION, Role.RNN):
            assert op.probe is not None, name
        elif op.role is not Role.GEMM:
            assert op.probe is None, name
        assert (op.role is Role.WEIGHT_PATH) == (op.layout is not None), name
        assert (op.role is Role.TRACED_VARIANT) == (op.eager_name is not None), name


def test_every_eager_name_the_compile_path_maps_to_is_registered() -> None:
    for name in node_types(Role.TRACED_VARIANT):
        eager = _eager_name(name)
        assert eager != name and operator(eager) is not None and operator(eager).role is not Role.TRACED_VARIANT
    assert _eager_name("ConvolutionBackward0") == "ConvolutionBackward0"  # eager's own types map to themselves


def test_the_registry_cannot_be_changed() -> None:
    with pytest.raises(TypeError):
        registry()["MmBackward0"] = Operator(Role.GEMM)  # type: ignore[index]
    with pytest.raises(AttributeError):
        operator("MmBackward0").weight_bound = None  # type: ignore[misc]


def test_no_core_module_keeps_a_second_table_of_node_types() -> None:
    """A node type the registry knows is named, as a string in code, nowhere else in the core (the four tables
    this registry replaced were such strings: graph.py's, probes.py's, recompute.py's and compiled.py's)."""
    core = pathlib.Path(scaling.__file__).parent
    for path in sorted(core.glob("*.py")):
        if path.name == "operators.py":
            continue
        source = path.read_text()
        for name in registry():
            literal = rf"(?<!`)[\"']{re.escape(name)}[\"'](?!`)"  # in code, not ``"quoted"`` in a docstring
            assert not re.search(literal, source), f"{path.name} names {name}"


# --- The consumers, on real graphs -------------------------------------------------------------


class Gemms(nn.Module):
    """One node of every eager GEMM type: a convolution, addmm (Linear), mm, bmm and baddbmm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.linear = nn.Linear(12, 6)
        self.mm = nn.Parameter(torch.randn(6, 6) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).flatten(2).transpose(1, 2).reshape(-1, 12)  # (batch·positions/4, 12)
        h = torch.tanh(self.linear(h)) @ self.mm  # addmm, then mm
        h = h.view(2, -1, 6)
        scores = torch.bmm(h, h.transpose(1, 2))  # bmm: two activations
        return torch.baddbmm(h, scores, h).sum()  # baddbmm: three activations


def _graph_of(loss: torch.Tensor, model: nn.Module | None = None):
    graph = walk(loss.grad_fn)
    names = {id(p): n.rpartition(".")[0] or n for n, p in model.named_parameters()} if model is not None else {}
    return graph, analyze(graph, names)


def test_the_analysis_probes_and_recompute_agree_with_the_registry_on_every_gemm() -> None:
    torch.manual_seed(0)
    model = Gemms()
    loss = model(torch.randn(2, 2, 4, 4, requires_grad=True).tanh())  # an activation: the conv sends a gradient on
    graph, analysis = _graph_of(loss, model)
    found = {graph.names[i] for i in analysis.gemms}
    assert found == {"ConvolutionBackward0", "AddmmBackward0", "MmBackward0", "BmmBackward0", "BaddbmmBackward0"}
    deferred = frozenset(analysis.leaves)
    grad_of: dict[int, torch.Tensor] = {}
    for i in analysis.gemms:
        graph.nodes[i].register_prehook(lambda grads, i=i: grad_of.__setitem__(i, grads[0]))
    checks: dict[int, tuple] = {}
    for i in analysis.gemms:
        op, node = operator(graph.names[i]), graph.nodes[i]
        assert set(analysis.gemms[i]) <= op.operands.keys()  # the analysis's data edges are the registry's
        if op.recompute is not None:  # what the recompute reads of the node is saved under the names it gives
            names = {n for edge in analysis.weight_edges[i] for n in op.recompute.operands[edge]}
            assert names and all(saved_tensor(node, n) is not None for n in names), graph.names[i]
        assert recomputable(graph, analysis, i, deferred) == (op.recompute is not None), graph.names[i]
        checks[i] = (op, node)
    loss.backward(retain_graph=True)  # the operands are read from what the nodes saved
    for i, (op, node) in checks.items():
        grad = grad_of[i]
        for k in analysis.gemms[i]:
            operand = op.operands[k](graph, i, grad)
            assert operand.operand is not None and math.isfinite(operand.accumulation_length)
            values = probe(node, grad, k, operand.operand, 64)  # a probe for every edge the analysis decides on
            assert values is not None and values.dtype == torch.float32 and 0 < values.numel() <= 64
        if op.weight_bound is not None and analysis.weight_edges[i]:
            assert Limit.WEIGHT_GRADIENT in op.weight_bound(node, grad, analysis.weight_edges[i])


def test_fused_attention_and_rnn_nodes_are_probed_on_the_registrys_edges() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, requires_grad=True) for _ in range(3))
    lstm = nn.LSTM(4, 3)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        attention = F.scaled_dot_product_attention(q, k, v)
    out, _ = lstm(attention.flatten(0, 1).transpose(0, 1))
    loss = out.square().sum()
    graph, analysis = _graph_of(loss, lstm)
    roles = {operator(graph.names[i]).role for i in analysis.fused}
    assert roles == {Role.ATTENTION, Role.RNN}
    grads: dict[int, tuple] = {}
    for i in analysis.fused:
        assert set(analysis.fused[i]) <= set(operator(graph.names[i]).probed_edges)
        graph.nodes[i].register_prehook(lambda g, i=i: grads.__setitem__(i, g))
    loss.backward(retain_graph=True)  # the probes read what the nodes saved
    for i, edges in analysis.fused.items():
        node, role = graph.nodes[i], operator(graph.names[i]).role
        for edge in edges:
            if role is Role.ATTENTION:
                values = probe(node, grads[i][0], edge, None, 64)
            else:
                values = rnn_probe(node, grads[i], edge, 64)
            assert values is not None and values.dtype == torch.float32, (graph.names[i], edge)


def test_batch_norms_products_weight_paths_pass_throughs_and_checkpoints_are_known_by_role() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(12, 4))
    x = torch.randn(2, 2, 4, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, root = join_outputs([checkpoint(model, x, use_reentrant=True) * 2.0, model(x) * 0.5])
    walked = walk(root)
    analysed = analyze(walked, {})
    assert operator(walked.names[0]).role is Role.PASS_THROUGH and 0 not in analysed.opaque  # join.py's root
    roles = {operator(n).role for n in walked.names if operator(n) is not None}
    assert {Role.BATCH_NORM, Role.PRODUCT, Role.WEIGHT_PATH, Role.LEAF, Role.GEMM} <= roles
    reentrant = {
        i
        for i, n in enumerate(walked.names)
        if operator(n) is not None and operator(n).role is Role.REENTRANT_CHECKPOINT
    }
    assert reentrant and reentrant == analysed.reentrant <= decision_nodes(analysed)
    gains = {walked.names[j] for j, _ in node_gains(walked, analysed)}
    assert gains == {"NativeBatchNormBackward0", "MulBackward0"}  # the gains consumer takes its types from the registry
    for i in analysed.gemms:  # every walk to a parameter crosses only weight-path nodes, and says how it lays it out
        for k in analysed.weight_edges[i]:
            path = weight_path(walked.names, walked.edges, walked.edges[i][k][0])
            assert walked.names[path[-1]] == LEAF
            assert all(operator(walked.names[n]).role is Role.WEIGHT_PATH for n in path[:-1])
            assert recomputable_path(walked.names, path)
        assert len(parameter_leaves(walked.names, walked.edges, analysed, i)) == len(analysed.weight_edges[i])


def test_a_linear_weight_reaches_addmm_transposed_once() -> None:
    layer = nn.Linear(3, 2)
    graph, analysis = _graph_of(layer(torch.randn(4, 3)).sum(), layer)
    (i,) = analysis.gemms
    (k,) = [k for k in analysis.weight_edges[i] if graph.names[graph.edges[i][k][0]] != LEAF]
    path = weight_path(graph.names, graph.edges, graph.edges[i][k][0])
    assert [graph.names[n] for n in path] == ["TBackward0", LEAF] and transposes(graph, path) == 1


def test_the_compile_path_stops_at_the_registrys_leaves_and_hooks_the_shared_decision_nodes() -> None:
    torch.manual_seed(0)
    model = Gemms()
    graph, analysis = _graph_of(model(torch.randn(2, 2, 4, 4)), model)
    for j in analysis.leaves:
        assert _traced_leaf(graph.nodes[j])
    assert not _traced_leaf(graph.nodes[0])
    points = _scale_points(graph, analysis, 1, set(analysis.leaves))
    assert {i for kind, i, _ in points if kind == "pre"} == decision_nodes(analysis)
