"""The backward DAG of Algorithm 1, read off PyTorch's autograd graph.

The graph hanging off ``loss.grad_fn`` *is* the paper's DAG of backward operators: a node per
operator, an edge per gradient. :func:`walk` records it (cheap: it runs every iteration, since
autograd builds a new graph each forward); :func:`analyze` classifies its nodes (GEMM, cast,
branch, leaf; by their types' records in :mod:`~gs_lightning.scaling.operators`) and names the layers,
once per distinct graph structure.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import Node

from gs_lightning.scaling.limits import Limit
from gs_lightning.scaling.operators import LEAF, Role, operator
from gs_lightning.scaling.walks import parameter_leaf, transposes, weight_path

Slot = tuple[int, int]  # (node index, input slot of that node)


@dataclass
class AutogradGraph:
    """One backward graph, in breadth-first order from the root (index 0).

    Attributes:
        nodes: The autograd nodes.
        names: Their type names, e.g. ``"ConvolutionBackward0"``; parallel to ``nodes``.
        edges: Per node, per outgoing gradient: the ``(node index, slot)`` it flows into, or
            ``None`` where no gradient is needed.
        in_counts: How many edges flow into each slot. A slot fed by several edges is a branch:
            autograd sums those gradients before the receiving node runs.
    """

    nodes: list[Node]
    names: list[str]
    edges: list[tuple[Slot | None, ...]]
    in_counts: dict[Slot, int]

    def same_structure(self, names: tuple[str, ...] | list[str], edges: tuple | list) -> bool:
        """Whether this graph has exactly the given node types and wiring."""
        return len(names) == len(self.names) and tuple(names) == tuple(self.names) and tuple(edges) == tuple(self.edges)


def walk(root: Node) -> AutogradGraph:
    """Record the graph reachable from ``root`` through ``next_functions``."""
    return walk_from((root,))


def walk_from(roots: Sequence[Node], is_leaf: Callable[[Node], bool] | None = None) -> AutogradGraph:
    """Record the graph reachable from ``roots`` (indices ``0..len(roots)-1``, breadth first).

    Nodes for which ``is_leaf`` holds are named :data:`LEAF` and not followed: the inputs of a
    compiled region, whose gradients leave it there.
    """
    index: dict[Node, int] = {}
    nodes: list[Node] = []
    names: list[str] = []

    def visit(node: Node) -> int:
        index[node] = len(nodes)
        nodes.append(node)
        names.append(LEAF if is_leaf is not None and is_leaf(node) else type(node).__name__)
        return index[node]

    for root in roots:
        if root not in index:
            visit(root)
    edges: list[tuple[Slot | None, ...]] = []
    in_counts: dict[Slot, int] = {}
    # Every backward walks its graph: the loop is written for speed (a third less than with a visit
    # call per edge, on ResNet-50's 339 nodes). The list iterators see the nodes appended as they go.
    for node, name in zip(nodes, names):
        if is_leaf is not None and name == LEAF:
            edges.append(())
            continue
        out: list[Slot | None] = []
        for nxt, slot in node.next_functions:
            if nxt is None:
                out.append(None)
                continue
            j = index.get(nxt)
            edge = (j if j is not None else visit(nxt), slot)
            out.append(edge)
            in_counts[edge] = in_counts.get(edge, 0) + 1
        edges.append(tuple(out))
    return AutogradGraph(nodes, names, edges, in_counts)


# --- Operators -------------------------------------------------------------------------------


def saved_function_tensor(node: Node, index: int) -> torch.Tensor | None:
    """The ``index``-th tensor a Python-defined backward (``ctx.save_for_backward``) saved, as :func:`saved_tensor`."""
    raw = getattr(node, "_raw_saved_tensors", None)
    if raw is None or index >= len(raw) or any(r.unpack_hook is not None for r in raw):
        return None
    return node.saved_tensors[index]


def batch_norm_gain_operands(node: Node) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """(γ, invstd) of a batch-norm backward node, whose gain is max_c |γ_c|·invstd_c (γ ``None`` without an
    affine weight: max_c invstd_c), or ``None`` where its saved tensors are unreadable (checkpointing;
    FSDP2's resharded weight). Nothing is computed but, in evaluation mode, invstd from the running variance."""
    with torch.no_grad():
        invstd = saved_tensor(node, "result2")
        if invstd is None or invstd.numel() == 0:  # evaluation mode: the running variance normalised
            variance = saved_tensor(node, "running_var")
            if variance is None:
                return None
            invstd = (variance + getattr(node, "_saved_eps", 1e-5)).rsqrt()
        weight = saved_tensor(node, "weight")  # None as well without an affine weight
        if weight is None:
            raw = getattr(node, "_raw_saved_weight", None)
            # a weight, unreadable now
            if raw is not None and raw.unpack_hook is None and node._saved_weight is not None:
                return None
        return weight, invstd


def batch_norm_gains(operands: list[tuple[torch.Tensor | None, torch.Tensor]]) -> list[torch.Tensor]:
    """max_c |γ_c|·invstd_c of each of :func:`batch_norm_gain_operands`' pairs, 0-dim tensors (nothing read):
    three foreach kernels per device for all the affine ones, not three kernels each."""
    gains: list[torch.Tensor | None] = [None] * len(operands)
    affine: dict[torch.device, list[int]] = {}
    for k, (weight, invstd) in enumerate(operands):
        if weight is None:
            gains[k] = invstd.amax()
        else:
            affine.setdefault(weight.device, []).append(k)
    with torch.no_grad():
        for ks in affine.values():
            products = torch._foreach_mul(
                torch._foreach_abs([operands[k][0] for k in ks]), [operands[k][1] for k in ks]
            )
            for k, gain in zip(ks, torch._foreach_max(products)):
                gains[k] = gain
    return gains  # type: ignore[return-value]


def saved_tensor(node: Node, name: str) -> torch.Tensor | None:
    """The tensor ``node`` saved as ``name`` (e.g. ``"weight"``), or ``None`` if reading it could harm.

    A saved tensor with an unpack hook (non-reentrant activation checkpointing, CPU offloading) may
    be unpacked only once: checkpointing recomputes it for the node and then forgets it. Reading it
    here first would make the node's own backward fail, so such tensors are left alone, and so are
    those whose storage is freed until the backward (FSDP2's resharded parameters).
    """
    raw = getattr(node, f"_raw_saved_{name}", None)
    if raw is None or raw.unpack_hook is not None:
        return None
    tensor = getattr(node, f"_saved_{name}")
    return None if isinstance(tensor, torch.Tensor) and _storage_freed(tensor) else tensor


def _storage_freed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage was freed under it (FSDP2 reshards a parameter after the forward by
    resizing its storage to 0 until the backward gathers it again): reading it would crash the process."""
    try:
        return tensor.numel() > 0 and tensor.untyped_storage().nbytes() == 0
    except (RuntimeError, NotImplementedError):  # no storage of its own (a tensor subclass): not ours to judge
        return False


@dataclass(frozen=True)
class GemmOperand:
    """One gradient a GEMM node sends on: ∇X = fG(∇Y, other operand), each element a sum of N products.

    ``operand`` is ``None`` when it cannot be read (saved under checkpointing, not a parameter).
    """

    accumulation_length: float
    operand: torch.Tensor | None


def _parameter_operand(graph: AutogradGraph, i: int, edge: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The parameter an edge of node ``i`` carries the gradient of, as the GEMM saw it (its dtype)."""
    target = graph.edges[i][edge]
    leaf = parameter_leaf(graph.names, graph.edges, target[0]) if target is not None else None
    return graph.nodes[leaf].variable.detach().to(dtype) if leaf is not None else None


def _conv_input(graph: AutogradGraph, i: int, grad: torch.Tensor) -> GemmOperand:
    node = graph.nodes[i]
    weight = saved_tensor(node, "weight")
    if weight is None:
        weight = _parameter_operand(graph, i, 1, grad.dtype)
    if weight is None:
        return GemmOperand(math.nan, None)
    kernel = weight.shape[2:]
    if node._saved_transposed:
        # Backward of a transposed conv is a conv: each ∇X element sums C_out/g · Πk products.
        return GemmOperand(weight.shape[1] * math.prod(kernel), weight)
    # Each input position is covered by about Πk/Πstride output positions per output channel.
    overlap = math.prod(max(1.0, k / s) for k, s in zip(kernel, node._saved_stride))
    return GemmOperand(weight.shape[0] // node._saved_groups * overlap, weight)


def _parameter_as_saved(
    graph: AutogradGraph, i: int, edge: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor | None:
    """The parameter behind a matrix operand that cannot be read (checkpointing), laid out as the node saw it.

    The layout comes from the node, not from the module: transposed once per transpose on the
    path to the parameter (:func:`~gs_lightning.scaling.walks.transposes`: ``Linear``'s weight reaches
    ``addmm`` as ``W.t()``; GPT-2's ``Conv1D`` stores its weight (in, out) and passes it as it is);
    ``None`` unless the shape then fits.
    """
    target = graph.edges[i][edge]
    weight = _parameter_operand(graph, i, edge, dtype)
    if target is None or weight is None or weight.dim() != 2:
        return None
    weight = weight.t() if transposes(graph, weight_path(graph.names, graph.edges, target[0])) % 2 else weight
    return weight if tuple(weight.shape) == tuple(shape) else None


def _addmm_mat1(graph: AutogradGraph, i: int, grad: torch.Tensor) -> GemmOperand:
    node = graph.nodes[i]
    mat2 = saved_tensor(node, "mat2")
    if mat2 is None:
        mat2 = _parameter_as_saved(graph, i, 2, grad.dtype, tuple(node._saved_mat2_sym_sizes))
    return GemmOperand(node._saved_mat2_sym_sizes[1], mat2)


def _deform_conv_input(graph: AutogradGraph, i: int, grad: torch.Tensor) -> GemmOperand:
    """torchvision's ``deform_conv2d``: ∇input = a convolution's ∇X, each element taken from Πk sampled positions."""
    node = graph.nodes[i]
    weight = saved_function_tensor(node, 1)
    if weight is None:
        weight = _parameter_operand(graph, i, 1, grad.dtype)
    if weight is None:
        return GemmOperand(math.nan, None)
    kernel = weight.shape[2:]
    overlap = math.prod(max(1.0, k / s) for k, s in zip(kernel, (node.stride_h, node.stride_w)))
    return GemmOperand(weight.shape[0] // node.groups * overlap, weight)


def _saved_operand(
    name: str, length: Callable[[torch.Tensor], int]
) -> Callable[[AutogradGraph, int, torch.Tensor], GemmOperand]:
    def operand(graph: AutogradGraph, i: int, grad: torch.Tensor) -> GemmOperand:
        tensor = saved_tensor(graph.nodes[i], name)
        return GemmOperand(length(tensor) if tensor is not None else math.nan, tensor)

    return operand


# A GEMM's weight-gradient bounds (the registry's ``Operator.weight_bound``): upper bounds on the largest weight
# (and bias) gradient it outputs from the incoming ∇Y, for its inputs that are parameters, by what they bound.
# The paper bounds only ∇X; but a weight gradient sums over batch × positions, so at scales that keep ∇X above
# λmin it is the first to overflow fp16 (seen on SSD). These bounds are strict, so such steps are not lost
# (ScalingRecipe.weight_grad_bounds; bench/weight_grad_overflow.py runs without them).
# Under activation checkpointing the input is not readable: the bound is left out and an overflow
# skips the step.


def _channel_norm_max(t: torch.Tensor) -> torch.Tensor:
    """The largest L2 norm (fp32) of one channel's values, channels on dim 1.

    Reduced the way the values lie: each sample's positions first, then the samples. One norm over
    every dim but the channel's measured 3-9x slower on a CPU at batch 8-64.
    """
    if t.dim() > 2:
        per_sample = torch.linalg.vector_norm(t.flatten(2), dim=2, dtype=torch.float32)
        return torch.linalg.vector_norm(per_sample, dim=0).max()
    return t.float().square().sum(0).max().sqrt()  # rows: their squares summed, not a norm across them


def _sum_max(grad: torch.Tensor, channel_dim: int) -> torch.Tensor:
    return grad.float().sum([d for d in range(grad.dim()) if d != channel_dim]).abs().max()


def _conv_weight_grad_bounds(
    node: Node, grad: torch.Tensor, weight_edges: tuple[int, ...]
) -> dict[Limit, torch.Tensor]:
    bounds = {}
    inputs = saved_tensor(node, "input")
    if 1 in weight_edges and inputs is not None:  # ∇W[o, i, k] = Σ_{n,h,w} ∇Y[n,o,h,w]·X[n,i,h+k]: Cauchy–Schwarz
        bounds[Limit.WEIGHT_GRADIENT] = _channel_norm_max(grad) * _channel_norm_max(inputs)
    if 2 in weight_edges:  # the bias gradient is computed exactly: it is a sum of ∇Y
        bounds[Limit.BIAS_GRADIENT] = _sum_max(grad, 1)
    return bounds


def _addmm_weight_grad_bounds(
    node: Node, grad: torch.Tensor, weight_edges: tuple[int, ...]
) -> dict[Limit, torch.Tensor]:
    bounds = {}
    mat1 = saved_tensor(node, "mat1")
    if 2 in weight_edges and mat1 is not None:  # ∇W = Xᵀ·∇Y summed over the rows
        bounds[Limit.WEIGHT_GRADIENT] = _channel_norm_max(grad) * _channel_norm_max(mat1)
    if 0 in weight_edges:
        bounds[Limit.BIAS_GRADIENT] = _sum_max(grad, 1)
    return bounds


def _mm_weight_grad_bounds(node: Node, grad: torch.Tensor, weight_edges: tuple[int, ...]) -> dict[Limit, torch.Tensor]:
    left = saved_tensor(node, "self")
    if 1 not in weight_edges or left is None:
        return {}
    return {Limit.WEIGHT_GRADIENT: _channel_norm_max(grad) * _channel_norm_max(left)}


_LOW_PRECISION = {torch.float16, torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn}


# --- Analysis --------------------------------------------------------------------------------


@dataclass
class GraphAnalysis:
    """What each node of one graph structure is, for Algorithm 1.

    Attributes:
        gemms: Node index -> the GEMM's input edges that carry activation gradients (not weights).
        weight_edges: Node index -> the GEMM's input edges that carry parameter gradients.
        casts: Indices of nodes whose fp32 incoming gradient leaves them in a lower precision.
        branch_slots: Slots fed by more than one edge (leaves excluded).
        merge_nodes: Nodes with more than one input slot (split, unbind, multi-output Functions).
        slots: Node index -> the input slots that receive gradients.
        leaves: Indices of ``AccumulateGrad`` nodes.
        layer_names: Name of every GEMM, cast, fused and opaque node, for reporting.
        fused: Node index -> the probed edges of a fused attention or RNN node (the registry's ``probed_edges``).
        reentrant: Reentrant activation checkpoints, whose inner graphs are scaled on their own.
        opaque: Nodes this walk cannot see into (custom autograd Functions, compiled regions):
            their gradients pass through with the scale they carry.
        leaf_sources: Leaf index -> the node whose single edge feeds it (leaves fed by one edge).
        feeders: Slot -> the node whose single edge feeds it (slots of non-leaves fed by one edge).
        derived: What :meth:`derive` computed from the structure alone (traversal orders), kept for the
            structure's later graphs: update iterations do not walk it again.
    """

    gemms: dict[int, tuple[int, ...]] = field(default_factory=dict)
    weight_edges: dict[int, tuple[int, ...]] = field(default_factory=dict)
    casts: set[int] = field(default_factory=set)
    branch_slots: set[Slot] = field(default_factory=set)
    merge_nodes: set[int] = field(default_factory=set)
    slots: dict[int, set[int]] = field(default_factory=dict)
    leaves: set[int] = field(default_factory=set)
    layer_names: dict[int, str] = field(default_factory=dict)
    fused: dict[int, tuple[int, ...]] = field(default_factory=dict)
    reentrant: set[int] = field(default_factory=set)
    opaque: set[int] = field(default_factory=set)
    leaf_sources: dict[int, int] = field(default_factory=dict)
    feeders: dict[Slot, int] = field(default_factory=dict)
    derived: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def derive(self, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, once per structure: a value that depends on this structure only, never on a graph's values."""
        if key not in self.derived:
            self.derived[key] = compute()
        return self.derived[key]


def decision_nodes(analysis: GraphAnalysis) -> set[int]:
    """The nodes an update decides a scale at, or merges incoming scales at: where its pre-hooks run, and where a
    compiled region's replay multiplies what arrives (a traced region holds no reentrant checkpoint: dynamo
    traces ``checkpoint`` as a non-reentrant one)."""
    a = analysis
    return a.gemms.keys() | a.fused.keys() | a.casts | a.merge_nodes | a.reentrant | a.opaque


def _is_cast(graph: AutogradGraph, i: int) -> bool:
    node = graph.nodes[i]
    metadata = node._input_metadata
    if len(metadata) != 1 or metadata[0].dtype not in (torch.float32, torch.float64):
        return False
    for edge in graph.edges[i]:
        if edge is None or graph.names[edge[0]] == LEAF:
            continue
        target, slot = edge
        if graph.nodes[target]._input_metadata[slot].dtype in _LOW_PRECISION:
            return True
    return False


def _is_opaque(node: Node, name: str) -> bool:
    """A node whose backward runs code this walk cannot see: a custom Function or a compiled region."""
    op = operator(name)
    if op is not None and op.role is Role.PASS_THROUGH:
        return False
    return isinstance(node, torch.autograd.function.BackwardCFunction) or "CompiledFunction" in name


def analyze(
    graph: AutogradGraph, module_names: dict[int, str], data_leaves: frozenset[int] = frozenset()
) -> GraphAnalysis:
    """Classify the nodes of ``graph`` and name its layers.

    Args:
        graph: A walked backward graph.
        module_names: ``id(parameter)`` -> qualified name of the module owning it, used to name
            GEMMs after their layer (``"layer1.0.conv1"``); unnamed GEMMs get ``"<Op><k>"``.
        data_leaves: Leaves that hold activations, not weights (a reentrant checkpoint's inputs
            in its inner graph): the gradients GEMMs send them are activation gradients.
    """

    def weight_leaf(target: int) -> int | None:
        leaf = parameter_leaf(graph.names, graph.edges, target)
        return None if leaf in data_leaves else leaf

    analysis = GraphAnalysis()
    slots_per_node: dict[int, set[int]] = defaultdict(set)
    for (j, slot), count in graph.in_counts.items():
        if graph.names[j] == LEAF:
            continue
        slots_per_node[j].add(slot)
        if count > 1:
            analysis.branch_slots.add((j, slot))
    slots_per_node[0].update(range(len(graph.nodes[0]._input_metadata)))  # the root receives the loss gradient(s)
    analysis.slots = dict(slots_per_node)
    analysis.merge_nodes = {j for j, slots in slots_per_node.items() if len(slots) > 1}

    seen_names: dict[str, int] = defaultdict(int)

    def unique(name: str) -> str:
        seen_names[name] += 1
        return name if seen_names[name] == 1 else f"{name}#{seen_names[name]}"

    for i, name in enumerate(graph.names):
        op = operator(name)
        role = op.role if op is not None else None
        if name == LEAF:
            analysis.leaves.add(i)
        elif role is Role.GEMM:
            edges = graph.edges[i]
            data_edges = tuple(
                k for k, e in enumerate(edges) if e is not None and k in op.operands and weight_leaf(e[0]) is None
            )
            analysis.gemms[i] = data_edges
            analysis.weight_edges[i] = tuple(
                k for k, e in enumerate(edges) if e is not None and weight_leaf(e[0]) is not None
            )
            analysis.layer_names[i] = unique(_gemm_layer_name(graph, i, module_names) or name.removesuffix("Backward0"))
        elif role in (Role.ATTENTION, Role.RNN):
            edges = graph.edges[i]
            analysis.fused[i] = tuple(k for k in op.probed_edges if k < len(edges) and edges[k] is not None)
            own_name = _gemm_layer_name(graph, i, module_names)  # an RNN's weights; attention has none
            if own_name is not None:
                analysis.layer_names[i] = unique(own_name)
        elif role is Role.REENTRANT_CHECKPOINT:
            analysis.reentrant.add(i)
        elif _is_opaque(graph.nodes[i], name):
            analysis.opaque.add(i)
            analysis.layer_names[i] = unique(name)
        elif _is_cast(graph, i):
            analysis.casts.add(i)
    for i, edges in enumerate(graph.edges):
        for edge in edges:
            if edge is not None and graph.in_counts[edge] == 1:
                if edge[0] in analysis.leaves:
                    analysis.leaf_sources[edge[0]] = i
                else:
                    analysis.feeders[edge] = i
    for i in sorted(analysis.fused.keys() - analysis.layer_names.keys()):
        producer = _nearest_gemm(graph, i, analysis)  # attention is named after its input projection
        analysis.layer_names[i] = unique(
            f"{analysis.layer_names[producer]}.attention" if producer is not None else "attention"
        )
    for i in sorted(analysis.casts):
        producer = _nearest_gemm(graph, i, analysis)
        analysis.layer_names[i] = unique(f"{analysis.layer_names[producer]}.cast" if producer is not None else "cast")
    return analysis


def _gemm_layer_name(graph: AutogradGraph, i: int, module_names: dict[int, str]) -> str | None:
    for edge in graph.edges[i]:
        if edge is None:
            continue
        leaf = parameter_leaf(graph.names, graph.edges, edge[0])
        if leaf is not None:
            name = module_names.get(id(graph.nodes[leaf].variable))
            if name is not None:
                return name
    return None


def _nearest_gemm(graph: AutogradGraph, start: int, analysis: GraphAnalysis, limit: int = 64) -> int | None:
    """The first GEMM upstream in the forward (downstream in backward) of a cast: the layer it casts."""
    frontier, visited = [start], {start}
    while frontier and len(visited) < limit:
        nxt = []
        for i in frontier:
            for edge in graph.edges[i]:
                if edge is None or edge[0] in visited:
                    continue
                if edge[0] in analysis.gemms or edge[0] in analysis.fused:
                    return edge[0]
                visited.add(edge[0])
                nxt.append(edge[0])
        frontier = nxt
    return None
