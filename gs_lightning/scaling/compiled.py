"""Per-layer scales inside ``torch.compile``d modules.

On update iterations a compiled module runs the graph dynamo captured eagerly, so Algorithm 1
decides every scale on a real autograd graph with the compiled program's structure, as for any
eager model. The iterations in between run the compiled graph, and the scales are inside it: the
scaler compiles the module with its own backend around the user's (:class:`ScalingBackend`), which
traces a multiply by one element of a **scale vector** into the backward at every place where a
replayed scale can act (each slot of a decision point, each edge into a branch, into a region
input or into a parameter fed by several edges). The vector is an input of the compiled graph, so
new scales are a copy into it: no recompilation, no Python hook in the compiled backward and no
host-device synchronisation between updates.

How the multiplies get there: AOTAutograd traces the backward by running autograd on the
forward it traced, and hooks registered on that autograd graph run as it does, so their
multiplies become nodes of the backward graph. The autograd graph of that trace has the
structure of the eager one below the module (same operators, same wiring); the scaler matches
the two structurally and writes into the vector the factors the eager plan applies at each place
(:class:`CompiledModule`). Around the compiled region, the eager nodes of the loss's graph get the
eager plan's factors as hooks, and the weight gradients leaving the region at their scales are
unscaled after the backward as for any model (:func:`replay_hooks`).

Where they cannot be matched (a graph break, a module called twice per iteration) the module runs
its original forward eagerly on every iteration, with a warning: per-layer scales, without
compilation.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node

from gs_lightning.scaling.graph import LEAF, AutogradGraph, GraphAnalysis, analyze, decision_nodes, walk_from
from gs_lightning.scaling.operators import Role, node_types, operator
from gs_lightning.scaling.plan import LeafTargets, ScalePlan, _post_hook, _pre_hook
from gs_lightning.scaling.walks import leaf_variables

# (kind, node, index): "pre" multiplies the gradient arriving in slot ``index`` of ``node``;
# "post" the one ``node`` sends on its edge ``index``.
ScalePoint = tuple[str, int, int]


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of nested lists, tuples and dicts, depth first."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _flat_tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _flat_tensors(item)]
    return []


def _input_edges(inputs: list[torch.Tensor]) -> dict[tuple[Node, int], int]:
    """(node, output number) receiving the gradient of each non-leaf input -> its position.

    Leaves (parameters) are matched by identity instead: asking for a leaf's node creates a view.
    """
    return {(t.grad_fn, t.output_nr): a for a, t in enumerate(inputs) if t.grad_fn is not None}


def _region_roots(outputs: list[torch.Tensor]) -> list[Node]:
    return [t.grad_fn for t in outputs if t.grad_fn is not None]


def _traced_leaf(node: Node) -> bool:
    """Where a walk of a traced region stops: a parameter, or a region input (the registry's
    :attr:`~gs_lightning.scaling.operators.Role.TRACED_INPUT`, where eager has ``AccumulateGrad``)."""
    return type(node).__name__ in node_types(Role.LEAF, Role.TRACED_INPUT)


def _compiled_region(name: str) -> bool:
    """Whether a node of the loss's graph is a compiled region
    (:attr:`~gs_lightning.scaling.operators.Role.COMPILED_REGION`)."""
    return name.startswith(tuple(node_types(Role.COMPILED_REGION)))


def _eager_name(name: str) -> str:
    """The type eager autograd records for the operator AOTAutograd's trace records as ``name``
    (:attr:`~gs_lightning.scaling.operators.Operator.eager_name`): ``name`` itself but for a traced variant."""
    op = operator(name)
    return name if op is None or op.eager_name is None else op.eager_name


def _times(grad: torch.Tensor | None, factor: torch.Tensor) -> torch.Tensor | None:
    """``grad · factor`` computed in the factor's precision (fp32), as eager scaling multiplies by a Python float."""
    if grad is None:
        return None
    if grad.dtype == factor.dtype:
        return grad * factor
    return (grad.to(factor.dtype) * factor).to(grad.dtype)


class ScaledGraph:
    """One graph the scaling backend compiled: where its backward multiplies by the scale vector.

    Args:
        names: Node types of the region's autograd graph, inputs named ``AccumulateGrad``.
        edges: Its wiring (:class:`~gs_lightning.scaling.graph.AutogradGraph`).
        points: The places the vector's elements act, in vector order.
        device: Where the vector lives.
    """

    def __init__(self, names: list[str], edges: list, points: list[ScalePoint], device: torch.device) -> None:
        self.names = names
        self.edges = edges
        self.points = points
        self.ones = torch.ones(len(points), device=device)  # the vector of a call outside any scaled iteration
        self.traced = True  # whether every trace of the backward found the structure the points refer to

    def install(self, outputs: tuple, scales: torch.Tensor) -> tuple:
        """Runs inside the traced forward: hooks the multiplies onto the graph AOTAutograd will differentiate."""
        roots = _region_roots(_flat_tensors(outputs))
        if not roots or not torch.is_grad_enabled():
            return outputs
        graph = walk_from(roots, _traced_leaf)
        if _as_eager(graph.names, graph.edges) != _as_eager(self.names, self.edges):
            self.traced = False
            return outputs
        pre: dict[int, list[tuple[int, int]]] = {}
        post: dict[int, list[tuple[int, int]]] = {}
        for p, (kind, i, k) in enumerate(self.points):
            (pre if kind == "pre" else post).setdefault(i, []).append((k, p))
        for i, slots in pre.items():
            graph.nodes[i].register_prehook(_traced_multiplies(slots, scales))
        for i, edges in post.items():
            multiply = _traced_multiplies(edges, scales)
            graph.nodes[i].register_hook(lambda grad_inputs, grad_outputs, multiply=multiply: multiply(grad_inputs))
        return outputs


def _as_eager(names: list[str], edges: list) -> tuple[list[str], list]:
    """A region's structure as eager would record it: names as :func:`_eager_name` has them, no trailing edges without
    gradient."""
    trimmed = []
    for out in edges:
        out = list(out)
        while out and out[-1] is None:
            out.pop()
        trimmed.append(out)
    return [_eager_name(name) for name in names], trimmed


def _traced_multiplies(places: list[tuple[int, int]], scales: torch.Tensor) -> Callable[[tuple], tuple]:
    def multiply(grads: tuple) -> tuple:
        out = list(grads)
        for k, p in places:
            if k < len(out):
                out[k] = _times(out[k], scales[p])
        return tuple(out)

    return multiply


def _scale_points(
    graph: AutogradGraph, analysis: GraphAnalysis, roots: int, parameter_leaves: set[int]
) -> list[ScalePoint]:
    """Every place of a region's backward where a replayed eager plan can apply a factor other than 1.

    The first ``roots`` nodes produce the region's outputs: all their slots receive from outside.

    Decision points scale what arrives in each of their slots; edges into a branch are brought to
    its common scale; edges into a region input may meet the input's uses outside the region (a
    branch there), and a parameter fed by several edges is unscaled edge by edge. A parameter fed
    by one edge is unscaled after the backward, outside the graph.
    """
    decides = decision_nodes(analysis)
    points: list[ScalePoint] = []
    for i, edges in enumerate(graph.edges):
        if graph.names[i] == LEAF:
            continue
        if i in decides:
            slots = set(analysis.slots.get(i, ())) | (
                set(range(len(graph.nodes[i]._input_metadata))) if i < roots else set()
            )
            points += [("pre", i, s) for s in sorted(slots)]
        for k, edge in enumerate(edges):
            if edge is None:
                continue
            into_leaf = graph.names[edge[0]] == LEAF
            if graph.in_counts[edge] > 1 or (into_leaf and edge[0] not in parameter_leaves):
                points.append(("post", i, k))
    return points


class ScalingBackend:
    """A ``torch.compile`` backend that compiles with ``inner`` after adding the scale vector (module docstring)."""

    def __init__(self, inner: Callable) -> None:
        self.inner = inner

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        scaled = self._analyse(gm, example_inputs)
        if scaled is None:
            return self.inner(gm, example_inputs)
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        example = fake_mode.from_tensor(scaled.ones) if fake_mode is not None else scaled.ones
        compiled = self.inner(_with_scale_vector(gm, scaled, example), [*example_inputs, example])

        def run(*args: Any) -> Any:
            module = CompiledModule.running()
            if module is None:  # no backward under the scaler follows (no_grad, evaluation, a scaler disabled)
                return compiled(*args, scaled.ones)
            return module.call(scaled, gm, compiled, args)

        return run

    @staticmethod
    def _analyse(gm: torch.fx.GraphModule, example_inputs: list) -> ScaledGraph | None:
        """The region's autograd graph, from running ``gm`` once on fake copies of its inputs."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        output = next(n for n in gm.graph.nodes if n.op == "output")
        if not isinstance(output.args[0], (tuple, list)) or not any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
        ):
            return None
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        if fake_mode is not None:  # dynamo hands the parameters over as they are
            example_inputs = [_fake(fake_mode, t) for t in example_inputs]
        with fake_mode if fake_mode is not None else contextlib.nullcontext(), torch.enable_grad():
            inputs = [
                t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                for t in example_inputs
            ]
            outputs = gm(*inputs)
        roots = _region_roots(_flat_tensors(outputs))
        if not roots:
            return None
        graph = walk_from(roots, _traced_leaf)
        parameters = {
            id(inputs[p])
            for p, node in enumerate(placeholders)
            if isinstance(getattr(node.meta.get("grapharg"), "example", None), nn.Parameter)
        }
        parameter_leaves = {j for j, variable in leaf_variables(graph) if id(variable) in parameters}
        points = _scale_points(graph, analyze(graph, {}), len(dict.fromkeys(roots)), parameter_leaves)
        device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
        return ScaledGraph(graph.names, graph.edges, points, device)


def _with_scale_vector(gm: torch.fx.GraphModule, scaled: ScaledGraph, example: torch.Tensor) -> torch.fx.GraphModule:
    """A copy of dynamo's graph (dynamo keeps reading its own) taking the scale vector last and installing its
    multiplies."""
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    outputs = graph.graph_copy(gm.graph, copies)
    for node, copy in copies.items():
        if node.op == "placeholder":
            copy._dynamo_source = getattr(node, "_dynamo_source", None)
    scales = graph.placeholder("gs_scales")
    scales._dynamo_source = None  # an input of the backend's, not of the user's code (as DDP's graph splits have)
    scales.meta["example_value"] = example
    installed = graph.call_function(scaled.install, (outputs, scales))
    graph.output(tuple(graph.call_function(_item, (installed, k)) for k in range(len(outputs))))
    scaled_gm = torch.fx.GraphModule(gm, graph)
    for name, value in vars(gm).items():  # dynamo's metadata (compile id, parameter sources) that AOTAutograd reads
        scaled_gm.__dict__.setdefault(name, value)
    return scaled_gm


def _fake(fake_mode: Any, value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor):
        return fake_mode.from_tensor(value)
    return value


def _item(values: tuple, k: int) -> Any:
    return values[k]


def inner_backend(ctx: Any) -> Callable:
    """The backend of a dynamo context (``torch.compile``'s, for a name or inductor's with its mode and options)."""
    backend = ctx.callback
    while hasattr(backend, "_torchdynamo_orig_backend"):
        backend = backend._torchdynamo_orig_backend
    return backend


@dataclass
class _Region:
    """A compiled module's forward on the last update iteration, located in that iteration's graph.

    Attributes:
        names, edges: The region's structure, region inputs and parameters named ``AccumulateGrad``.
        nodes: Region node -> index in the update's graph.
        inside: Indices (update's graph) of the region's own nodes.
        leaves: ``id(parameter)`` -> its leaf index in the update's graph.
        inputs: Position among the forward's tensor arguments -> (node index, output number) of the
            argument's gradient edge in the update's graph.
    """

    names: list[str]
    edges: list
    nodes: list[int]
    inside: set[int]
    leaves: dict[int, int]
    inputs: dict[int, tuple[int, int]]


class EagerPlan:
    """What the last update decided, in the terms the compiled replays need.

    Args:
        version: Identifies the update (its iteration); a module's scale vector is rewritten once per version.
        plan: The update's plan.
        analysis: The update's graph analysis.
        graph: The update's graph.
    """

    def __init__(self, version: int, plan: ScalePlan, analysis: GraphAnalysis, graph: AutogradGraph) -> None:
        self.version = version
        self.plan = plan
        self.analysis = analysis
        # no nodes: they die with the iteration
        self.structure = AutogradGraph([], graph.names, graph.edges, graph.in_counts)
        self._factors: dict[frozenset[int], dict[int, tuple[tuple | None, tuple | None]]] = {}
        self._replayed: tuple[tuple, GraphAnalysis] | None = None

    def factors(self, deferred: frozenset[int]) -> dict[int, tuple[tuple | None, tuple | None]]:
        """Node -> (pre-hook, post-hook) factors of the eager replay with these leaves deferred."""
        if deferred not in self._factors:
            self._factors[deferred] = {
                i: (pre, post) for i, pre, post in self.plan.hook_factors(self.structure, LeafTargets(deferred))
            }
        return self._factors[deferred]

    def inside_factors(self) -> dict[int, tuple[tuple | None, tuple | None]]:
        """The factors inside compiled regions: every leaf fed by one edge is unscaled outside them."""
        return self.factors(frozenset(self.analysis.leaf_sources))

    def leaf_alpha(self, leaf: int) -> int:
        """The scale a leaf's gradient arrives at when the leaf is deferred (its single source's)."""
        source = self.analysis.leaf_sources.get(leaf)
        return self.plan.alpha_out.get(source, 0) if source is not None else 0

    def analysis_of(self, graph: AutogradGraph, module_names: dict[int, str]) -> GraphAnalysis:
        """The analysis of a replayed graph (compiled nodes in it), kept for the iterations that replay this plan."""
        key = (tuple(graph.names), tuple(graph.edges))
        if self._replayed is None or self._replayed[0] != key:
            self._replayed = (key, analyze(graph, module_names))
        return self._replayed[1]


class CompiledModule:
    """A ``torch.compile``d module (or a compiled method) under a :class:`~gs_lightning.scaling.GradientScaler`.

    Compiles it again with :class:`ScalingBackend` around its own backend (same ``fullgraph`` and
    ``dynamic``) and routes its calls: the captured graphs run eagerly on update iterations, compiled
    with this module's scale vector otherwise. Build it with :meth:`of` or :meth:`of_method`.

    Args:
        owner: The object whose ``attribute`` is called (the compiled module, or the model of a compiled method).
        attribute: ``"forward"``, or the compiled method's name.
        compiled: The callable compiled with :class:`ScalingBackend`.
        original: The same computation uncompiled, for a module that runs eagerly for good.
    """

    _active: list[CompiledModule] = []  # the modules whose compiled forward is running, innermost last

    def __init__(
        self, owner: object, attribute: str, compiled: Callable, original: Callable, modules: CompiledModules
    ) -> None:
        self.owner, self.attribute = owner, attribute
        self.compiled_forward, self.original = compiled, original
        setattr(owner, attribute, self.forward)
        self.serve(modules)

    @property
    def name(self) -> str:
        """What warnings call it."""
        owner = self.owner._orig_mod if isinstance(self.owner, torch._dynamo.eval_frame.OptimizedModule) else self.owner
        return type(owner).__name__ + ("" if self.attribute == "forward" else f".{self.attribute}")

    @classmethod
    def of(cls, module: torch._dynamo.eval_frame.OptimizedModule, modules: CompiledModules) -> CompiledModule:
        """``module`` among ``modules``: compiled again the first time, taken over from the scaler it served before."""
        served = getattr(module.forward, "__self__", None)
        if isinstance(served, CompiledModule):
            served.serve(modules)
            return served
        ctx = module.dynamo_ctx
        rewrapped = torch.compile(
            module._orig_mod, backend=ScalingBackend(inner_backend(ctx)), fullgraph=ctx.fullgraph, dynamic=ctx._dynamic
        )
        module.dynamo_ctx = rewrapped.dynamo_ctx
        module._initialize()  # its forward, as torch.compile wraps it, with the scaling backend
        return cls(module, "forward", module.forward, module._orig_mod, modules)

    @classmethod
    def of_method(
        cls, owner: nn.Module, attribute: str, original: Callable, ctx: Any, modules: CompiledModules
    ) -> CompiledModule:
        """``owner.attribute``, which ``ctx`` (a dynamo context) compiled from ``original``, among ``modules``."""
        served = getattr(getattr(owner, attribute), "__self__", None)
        if isinstance(served, CompiledModule):
            served.serve(modules)
            return served
        compiled = torch.compile(
            original, backend=ScalingBackend(inner_backend(ctx)), fullgraph=ctx.fullgraph, dynamic=ctx._dynamic
        )
        return cls(owner, attribute, compiled, original, modules)

    def serve(self, modules: CompiledModules) -> None:
        """Scale for the scaler that ``modules`` belong to from now on, from its first update (a resumed scaler, a
        new run on the same model)."""
        self._served = weakref.ref(modules)
        self.eager_reason: str | None = None  # set once the compiled graph cannot carry the eager plan
        self.updating = True  # whether this iteration's forward runs its graphs eagerly
        self.graph_calls = 0  # graphs this iteration's forwards ran
        self.region: _Region | None = None
        self.unmatched = False  # this iteration's compiled call ran with the unit vector
        self._eager_call: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # (inputs, outputs) on an update
        self.compiled_inputs: list[torch.Tensor] | None = None  # of this iteration's compiled call
        self._vectors: dict[ScaledGraph, tuple[int, torch.Tensor]] = {}

    @classmethod
    def running(cls) -> CompiledModule | None:
        """The module whose forward is running under a scaler, innermost first."""
        return cls._active[-1] if cls._active else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The compiled forward, whose graphs run eagerly on an update iteration; the original module's for good
        once :attr:`eager_reason` is set."""
        served = self._served()
        if served is None or not served.enabled() or not torch.is_grad_enabled():
            return self.compiled_forward(*args, **kwargs)
        if self.eager_reason is not None:
            return self.original(*args, **kwargs)
        self.updating = self.region is None or served.updates_next()
        CompiledModule._active.append(self)
        try:
            return self.compiled_forward(*args, **kwargs)
        finally:
            CompiledModule._active.pop()

    def call(self, graph: ScaledGraph, captured: torch.fx.GraphModule, compiled: Callable, args: tuple) -> Any:
        """Run one graph of this module's forward: dynamo's captured graph eagerly on an update iteration (Algorithm 1
        then decides on the program that was compiled), else the compiled graph with this module's scale vector."""
        self.graph_calls += 1
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        if self.updating:
            outputs = captured(*args)
            self._eager_call = (inputs, _flat_tensors(outputs))
            return outputs
        if self.graph_calls > 1:  # the update saw one graph: what this one would need is unknown
            raise RuntimeError(
                f"GradientScaler: the compiled {self.name} ran more graphs in this iteration than on the last update "
                "iteration (a new graph break, or a second call); its scales cannot be replayed."
            )
        self.compiled_inputs = inputs
        return compiled(*args, self.vector(graph))

    def vector(self, graph: ScaledGraph) -> torch.Tensor:
        """This module's scale vector for ``graph``, holding the last update's factors."""
        served = self._served()
        eager = served.eager_plan if served is not None else None
        cached = self._vectors.get(graph)
        if eager is not None and cached is not None and cached[0] == eager.version:
            return cached[1]
        factors = self._factors(graph, eager) if eager is not None else None
        if factors is None:
            self.unmatched = True
            return graph.ones
        vector = cached[1] if cached is not None else torch.empty_like(graph.ones)
        # in place: the compiled graph keeps reading this tensor
        vector.copy_(torch.tensor(factors, dtype=vector.dtype))
        self._vectors[graph] = (eager.version, vector)
        return vector

    def _factors(self, graph: ScaledGraph, eager: EagerPlan) -> list[float] | None:
        """The eager plan's factor at each of ``graph``'s scale points; ``None`` unless they carry all of them."""
        region = self.region
        if region is None or not graph.traced or graph.names != region.names or graph.edges != region.edges:
            return None
        wanted = {}
        inside = eager.inside_factors()
        for r, e in enumerate(region.nodes):
            pre, post = inside.get(e, (None, None)) if e in region.inside else (None, None)
            wanted.update({("pre", r, s): f for s, f in enumerate(pre or ()) if f is not None})
            wanted.update({("post", r, k): f for k, f in enumerate(post or ()) if f is not None})
        if not wanted.keys() <= set(graph.points):
            return None
        return [wanted.get(point, 1.0) for point in graph.points]

    @property
    def ran_eagerly(self) -> bool:
        """Whether this iteration's forward ran the captured graph eagerly."""
        return self._eager_call is not None

    def end_iteration(self) -> None:
        """Forget this iteration's forward."""
        self._eager_call, self.compiled_inputs, self.unmatched, self.graph_calls = None, None, False, 0

    def locate(self, graph: AutogradGraph) -> None:
        """Locate this iteration's eager forward in the update's ``graph``; the next compiled calls replay it."""
        if self._eager_call is None:
            return
        if self.graph_calls > 1:
            self.run_eagerly(
                f"it ran {self.graph_calls} compiled graphs in one iteration (graph breaks, or more than one call), "
                "and one scale vector is matched to one graph"
            )
            return
        inputs, outputs = self._eager_call
        index = {node: i for i, node in enumerate(graph.nodes)}
        boundary = {t.grad_fn for t in inputs if t.grad_fn is not None}  # leaves stop the walk by name
        region = walk_from(_region_roots(outputs), lambda node: node in boundary or type(node).__name__ == LEAF)
        nodes = [index.get(node) for node in region.nodes]
        if not region.nodes or None in nodes:
            self.run_eagerly("its outputs do not reach the loss through autograd")
            return
        leaves = {id(variable): j for j, variable in leaf_variables(graph)}
        edges = {a: edge for edge, a in _input_edges(inputs).items()}
        self.region = _Region(
            region.names,
            region.edges,
            nodes,
            {e for r, e in enumerate(nodes) if region.names[r] != LEAF},
            leaves,
            {a: (index[node], nr) for a, (node, nr) in edges.items() if node in index},
        )

    def run_eagerly(self, reason: str) -> None:
        """Give up compiled replays for this module: it runs eagerly under scaling from now on."""
        served = self._served()
        self.eager_reason = reason
        if served is not None:
            served.warn_once(
                f"compiled:{id(self)}",
                f"GradientScaler: the compiled {self.name} runs eagerly from now on, with "
                f"per-layer scales, because {reason}.",
            )


class CompiledModules:
    """The ``torch.compile``d modules of a scaler's models, and the eager update their compiled replays read.

    Args:
        enabled: Whether the scaler is on now (a disabled one's modules run as compiled, with no scale).
        updates_next: Whether the next backward is an update iteration (the forwards then run their
            captured graphs eagerly).
        warn_once: Warns with a message once per key.
    """

    def __init__(
        self, enabled: Callable[[], bool], updates_next: Callable[[], bool], warn_once: Callable[[str, str], None]
    ) -> None:
        self.enabled, self.updates_next, self.warn_once = enabled, updates_next, warn_once
        self.modules: list[CompiledModule] = []
        self.eager_plan: EagerPlan | None = None  # the last eager update, as the compiled replays read it

    def __iter__(self) -> Iterator[CompiledModule]:
        return iter(self.modules)

    def __bool__(self) -> bool:
        return bool(self.modules)

    def add(self, model: nn.Module) -> None:
        """Take over the ``torch.compile``d modules in ``model`` (``model`` itself included).

        A LightningModule that Lightning compiled whole (``trainer.fit(torch.compile(model))``) holds
        no compiled module: Lightning wraps its methods with the dynamo context instead and keeps the
        originals in ``_compiler_ctx``; its ``training_step``, where the loss and its backward come
        from, is compiled again with the scaling backend (the other steps run no backward).
        """
        known = {id(m) for m in self.modules}
        for module in model.modules():
            if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
                found = CompiledModule.of(module, self)
            else:
                lightning = getattr(module, "_compiler_ctx", None)
                if not (isinstance(lightning, dict) and lightning.get("compiler") == "dynamo"):
                    continue
                found = CompiledModule.of_method(
                    module, "training_step", lightning["original_training_step"], lightning["dynamo_ctx"], self
                )
            if id(found) not in known:
                known.add(id(found))
                self.modules.append(found)

    def ran_compiled(self) -> list[CompiledModule]:
        """The modules whose forward ran their compiled graph in this iteration."""
        return [m for m in self.modules if m.compiled_inputs is not None]

    def ran_eagerly(self) -> bool:
        """Whether a module's forward ran its captured graph eagerly in this iteration."""
        return any(m.ran_eagerly for m in self.modules)

    def stale(self) -> bool:
        """Whether a module ran compiled without the last update's scales (no update yet, or its graph did not
        match, after which it runs eagerly for good): the backward is then scaled as any graph with opaque nodes,
        and the next one must update."""
        unmatched = [m for m in self.ran_compiled() if m.unmatched]
        for module in unmatched:
            module.run_eagerly("its compiled graph does not have the structure of its eager forward")
        return self.eager_plan is None or bool(unmatched)

    def replay(
        self, graph: AutogradGraph, module_names: dict[int, str], deferred: Callable[[GraphAnalysis], frozenset[int]]
    ) -> tuple[GraphAnalysis, CompiledReplay]:
        """The replay of the backward ``graph`` through the modules that ran compiled with the last update's scales.

        Args:
            graph: The loss's backward graph, with the compiled regions as opaque nodes.
            module_names: Parameter id -> module name, which names its layers.
            deferred: The leaves of ``graph``'s analysis whose gradients can wait for the unscale after the backward.

        Raises:
            RuntimeError: where the eager code around the regions changed since the update.
        """
        analysis = self.eager_plan.analysis_of(graph, module_names)
        replay = replay_hooks(graph, analysis, self.eager_plan, self.ran_compiled(), deferred(analysis))
        if replay is None:  # the region carried this plan's scales: a plain backward would leave scaled gradients
            raise RuntimeError(
                "GradientScaler: the backward graph around a torch.compile'd module changed since the last update "
                "(other eager operators or another wiring), so the scales its compiled graph applied cannot be "
                "matched; compile the whole model, or keep the eager code around the compiled module the same "
                "from one iteration to the next."
            )
        return analysis, replay

    def locate(self, graph: AutogradGraph, plan: ScalePlan, analysis: GraphAnalysis, version: int) -> bool:
        """After an update of ``graph``: locate each module's eager forward in it, for the compiled replays; false
        where a region ran compiled without this plan (the next backward must update)."""
        if self.ran_compiled():
            self.eager_plan = None
            return False
        for module in self.modules:
            module.locate(graph)
        self.eager_plan = EagerPlan(version, plan, analysis, graph)
        return True

    def end_iteration(self) -> None:
        """Forget this iteration's forwards."""
        for module in self.modules:
            module.end_iteration()


@dataclass
class CompiledReplay:
    """What a replay through compiled regions hooks, and unscales afterwards.

    Attributes:
        hooks: (node, ``"pre"`` or ``"post"``, hook) on the eager nodes around the regions.
        deferred: (leaf index in the replayed graph, leaf index in the update's graph, scale) of
            the leaves unscaled after the backward.
    """

    hooks: list[tuple[Node, str, Callable]]
    deferred: list[tuple[int, int, int]]

    def register(self) -> list:
        """Register :attr:`hooks`; returns their handles."""
        return [
            node.register_prehook(hook) if kind == "pre" else node.register_hook(hook)
            for node, kind, hook in self.hooks
        ]


def replay_hooks(
    graph: AutogradGraph,
    analysis: GraphAnalysis,
    eager: EagerPlan,
    modules: list[CompiledModule],
    deferrable: frozenset[int],
) -> CompiledReplay | None:
    """Hook the eager plan's factors onto the nodes of ``graph`` outside its compiled regions.

    ``graph`` is the eager update's graph with each region contracted into one compiled node.
    Walked side by side with the update's graph from the root, every eager node gets its
    counterpart; a compiled node's edges lead to parameters (matched by identity) and to the
    region's inputs (matched by argument position). ``None`` where the two do not correspond.
    """
    structure = eager.structure
    counterpart: dict[int, int] = {0: 0}
    region_of: dict[int, CompiledModule] = {}
    queue = [0]
    while queue:
        i = queue.pop()
        e = counterpart[i]
        if _compiled_region(graph.names[i]):
            module = next(
                (m for m in modules if m.region is not None and e in m.region.inside and m.compiled_inputs is not None),
                None,
            )
            if module is None or region_of.setdefault(i, module) is not module:
                return None
            targets = _region_exits(graph, i, module)
            if targets is None:
                return None
        else:
            if graph.names[i] != structure.names[e] or len(graph.edges[i]) != len(structure.edges[e]):
                return None
            targets = [(edge, other) for edge, other in zip(graph.edges[i], structure.edges[e])]
        for edge, other in targets:
            if (edge is None) != (other is None):
                return None
            if edge is None:
                continue
            (j, s), (f, t) = edge, other
            compiled_target = _compiled_region(graph.names[j])
            if not compiled_target and s != t:
                return None
            if j in counterpart:
                if not compiled_target and counterpart[j] != f:
                    return None
                continue
            counterpart[j] = f
            queue.append(j)
    if len(counterpart) != len(graph.nodes):
        return None
    return _hooks(graph, analysis, eager, counterpart, region_of, deferrable)


def _region_exits(graph: AutogradGraph, c: int, module: CompiledModule) -> list[tuple[Any, Any]] | None:
    """(edge of the compiled node, its counterpart in the update's graph) for each gradient leaving the region."""
    region = module.region
    inputs = _input_edges(module.compiled_inputs)
    exits = []
    for edge in graph.edges[c]:
        if edge is None:
            continue
        j, s = edge
        if graph.names[j] == LEAF:
            leaf = region.leaves.get(id(graph.nodes[j].variable))
            if leaf is None:
                return None
            exits.append((edge, (leaf, s)))
            continue
        a = inputs.get((graph.nodes[j], s))
        if a is None or a not in region.inputs:
            return None
        exits.append((edge, region.inputs[a]))
    return exits


def _hooks(
    graph: AutogradGraph,
    analysis: GraphAnalysis,
    eager: EagerPlan,
    counterpart: dict[int, int],
    region_of: dict[int, CompiledModule],
    deferrable: frozenset[int],
) -> CompiledReplay:
    # A leaf the eager update fed by several edges was unscaled edge by edge, inside the region or by its hooks.
    deferred = [(j, counterpart[j]) for j in sorted(deferrable) if counterpart[j] in eager.analysis.leaf_sources]
    factors = eager.factors(frozenset(e for _, e in deferred))
    hooks: list[tuple[Node, str, Callable]] = []
    for i, node in enumerate(graph.nodes):
        if i in region_of or graph.names[i] == LEAF:
            continue
        pre, post = factors.get(counterpart[i], (None, None))
        if pre is not None:
            hooks.append((node, "pre", _pre_hook(pre)))
        if post is not None:
            hooks.append((node, "post", _post_hook(post)))
    deferred_leaves = {j for j, _ in deferred}
    for c in region_of:  # gradients the region sends a parameter at its scale, when nothing unscales them later
        for edge in graph.edges[c]:
            if edge is None or graph.names[edge[0]] != LEAF or edge[0] in deferred_leaves:
                continue
            alpha = eager.leaf_alpha(counterpart[edge[0]])
            if alpha:
                hooks.append((graph.nodes[edge[0]], "pre", _pre_hook((2.0**-alpha,))))
    return CompiledReplay(hooks, [(j, e, eager.leaf_alpha(e)) for j, e in deferred])
