"""The scales one update iteration decided, and their replay as constant factors in between.

Exponents are log2 of power-of-two scales throughout. ``alpha_out[i]`` is the scale node ``i``'s
outgoing gradients carry; ``slot_alpha[(i, s)]`` the scale of the gradient arriving in slot ``s``
of node ``i``. The factor applied on an edge is given by :func:`edge_shift`, which both the update
run (as it decides) and the replay (from a saved plan) use. An update's exponents are 0-dim tensors on the
gradients' device (:data:`Exponent`) until the step's read; a plan holds Python ints from then on.
"""

from __future__ import annotations

import weakref
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

import torch
from torch.autograd.graph import Node

from gs_lightning.scaling.formats import widened
from gs_lightning.scaling.graph import LEAF, AutogradGraph, Slot
from gs_lightning.scaling.operators import operator

# log2 of a power-of-two scale: a Python int, or (during an update, until read) a 0-dim float64 tensor on the device.
Exponent = int | torch.Tensor
# A GEMM's own scale for what it sends on: the input edges it shifts, and by how many binades beyond the node's scale.
InputShift = tuple[tuple[int, ...], Exponent]


@dataclass(frozen=True)
class LeafTargets:
    """The scale each leaf of a graph must receive its gradient at.

    Attributes:
        deferred: Leaves left scaled during the backward; the scaler divides their ``.grad``
            afterwards, all in one fused kernel per device and dtype.
        exits: Leaves that hand their gradient on instead of keeping it (the inputs of a
            reentrant checkpoint's inner graph): they receive it at ``exit_alpha``, the scale the
            outer graph expects from the checkpoint node. Every other leaf receives it at 2^0.
        exit_alpha: log2 of that scale (during an update, possibly still on the device).
        shared: (leaf, log2 scale) for leaves fed by several edges that are left scaled too, on a replay:
            each edge's gradient arrives at that one scale (:meth:`ScalePlan.shared_leaf_scales`), autograd
            sums them, and the scaler divides the sum afterwards, as for ``deferred``.
    """

    deferred: frozenset[int] = frozenset()
    exits: frozenset[int] = frozenset()
    exit_alpha: Exponent = 0
    shared: tuple[tuple[int, int], ...] = ()

    @property
    def shared_leaves(self) -> frozenset[int]:
        """The leaves of :attr:`shared`."""
        return frozenset(j for j, _ in self.shared)

    def shared_scale(self, leaf: int) -> int | None:
        """The scale the edges into ``leaf`` bring its gradients to, where it is one of :attr:`shared`."""
        return next((alpha for j, alpha in self.shared if j == leaf), None)


def exponent_vector(exponents: list[Exponent], device: torch.device) -> torch.Tensor:
    """``exponents`` as one float64 vector on ``device``; a Python int is filled in there, not copied from the host."""
    return torch.stack(
        [
            e.to(device, torch.float64)
            if isinstance(e, torch.Tensor)
            else torch.full((), e, dtype=torch.float64, device=device)
            for e in exponents
        ]
    )


def as_read(exponents: dict[Any, Exponent], values: Mapping[torch.Tensor, float]) -> dict[Any, int]:
    """``exponents`` with those left on the device as read (``values``): Python ints."""
    return {key: int(values[e]) if isinstance(e, torch.Tensor) else e for key, e in exponents.items()}


def edge_shift(
    graph: AutogradGraph, edge: Slot | None, alpha: Exponent, slot_alpha: dict[Slot, Exponent], leaves: LeafTargets
) -> Exponent:
    """log2 of the factor a gradient sent with scale ``2^alpha`` gets on ``edge``.

    * into a leaf: to the leaf's target scale (2^0, a parameter's true gradient, in the leaf's own
      precision before autograd accumulates it), unless the leaf is deferred; to its shared scale
      where it is one of :attr:`LeafTargets.shared`;
    * into a branch (a slot fed by several edges): to the branch's common scale;
    * anywhere else: unchanged.
    """
    if edge is None:
        return 0
    if graph.names[edge[0]] == LEAF:
        if edge[0] in leaves.deferred:
            return 0
        common = leaves.shared_scale(edge[0]) if leaves.shared else None
        if common is not None:
            return common - alpha
        return (leaves.exit_alpha if edge[0] in leaves.exits else 0) - alpha
    if graph.in_counts[edge] > 1:
        return slot_alpha[edge] - alpha
    return 0


def shift(target: Exponent, carried: Exponent) -> Exponent:
    """log2 of the factor taking a gradient from scale ``2^carried`` to ``2^target`` (0 where both are one exponent)."""
    return 0 if target is carried else target - carried


def times_pow2(grad: torch.Tensor | None, exponent: Exponent) -> torch.Tensor | None:
    """``grad · 2^exponent`` (exact in binary floating point, barring under/overflow), laid out as ``grad``.

    An exponent on the device is not read: the product is taken whatever its value (0 included). In a
    backward that records a graph (``create_graph=True``) it is read (a synchronisation), so that the graph
    holds the products a replay records, by Python factors, and none for 2^0.
    """
    if isinstance(exponent, torch.Tensor) and torch.is_grad_enabled():
        exponent = int(exponent)
    if grad is None or (not isinstance(exponent, torch.Tensor) and not exponent):
        return grad
    return times_factor(grad, torch.exp2(exponent) if isinstance(exponent, torch.Tensor) else 2.0**exponent)


def times_factor(grad: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    """``grad · factor`` with ``grad``'s strides, so that what reads it next sums in the same order.

    A gradient that is a view (a slice of a concatenated head output's gradient, an expanded
    sum's) is not dense; a plain product would be, and a reduction over it (a bias gradient)
    would then sum in another order than it does over the unscaled gradient. The product runs
    over the memory span the view covers, and the result views that span as ``grad`` does.
    """
    if grad.layout != torch.strided or grad.is_contiguous() or grad.numel() == 0:
        return _product(grad, factor)
    span = 1 + sum((size - 1) * stride for size, stride in zip(grad.shape, grad.stride()))
    flat = grad.as_strided((span,), (1,), grad.storage_offset())
    return _product(flat, factor).as_strided(grad.shape, grad.stride())


def _product(values: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    """``values · factor``, rounded once to ``values``' dtype. A 0-dim tensor factor would be cast to that dtype
    first (2^20 is inf in fp16): it multiplies in fp32 at least, as a Python factor does."""
    if not isinstance(factor, torch.Tensor):
        return values * factor
    wide = widened(values.dtype)
    if wide == values.dtype:  # a 0-dim factor takes the values' dtype in the product's one kernel
        return values * factor
    return (values.to(wide) * factor.to(wide)).to(values.dtype)


def shift_sent_operands(node: Node, edges: tuple[int, ...], exponent: Exponent) -> None:
    """Give the gradients GEMM ``node`` sends along ``edges`` ``2^exponent`` more scale than the node's, and no
    other gradient of it: each edge's saved operand (:attr:`~gs_lightning.scaling.operators.Operator.sent_operands`,
    a weight) is multiplied by ``2^exponent`` as the backward unpacks it. Exact (a power of two) where the product
    stays finite, which the update's choice keeps; the weight and bias gradients are computed from the other
    operand and the incoming gradient, at the node's scale. Registered on this graph's saved tensors: once per
    backward, before the node runs (after what reads them first, the recompute's keepers).
    """
    names = operator(type(node).__name__).sent_operands
    for edge in edges:
        saved = getattr(node, f"_raw_saved_{names[edge]}")
        if saved.unpack_hook is not None:  # the update found none: the scales downstream expect the shift
            raise RuntimeError(
                f"GradientScaler: own_input_gradient_scale multiplies the {names[edge]!r} that {type(node).__name__} "
                "saved, but on this backward a saved-tensor hook of another owns it (torch.autograd.graph."
                "saved_tensors_hooks, or checkpointing turned on since the last update); keep such hooks on every "
                "iteration or on none, or turn own_input_gradient_scale off."
            )
        saved.register_hooks(_as_saved, _unpacked_times_pow2(exponent))


def _as_saved(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _unpacked_times_pow2(exponent: Exponent) -> Callable[[torch.Tensor], torch.Tensor]:
    """An unpack hook: the saved tensor times ``2^exponent``, the same tensor while it lives (the emulation's
    hardware path tells a node's saved operands from gradients by their storage, unpacking them again)."""
    last: list[weakref.ref] = []

    def unpack(saved: torch.Tensor) -> torch.Tensor:
        shifted = last[0]() if last else None
        if shifted is None:
            shifted = times_pow2(saved, exponent)
            last[:] = [weakref.ref(shifted)]
        return shifted

    return unpack


def _factor_hook(factors: tuple[float | None, ...]) -> Callable[[tuple], tuple]:
    """``grads -> grads`` with each gradient times its factor (``None``: unchanged).

    The common case, one factor on one gradient, gets a hook of its own: between updates these
    run for every scaled node of every iteration, so their Python overhead counts.
    """
    scaled = [k for k, f in enumerate(factors) if f is not None]
    if len(scaled) == 1:
        k, factor = scaled[0], factors[scaled[0]]

        def scale_one(grads: tuple) -> tuple:
            grad = grads[k] if k < len(grads) else None
            return grads if grad is None else (*grads[:k], times_factor(grad, factor), *grads[k + 1 :])

        return scale_one

    def scale_each(grads: tuple) -> tuple:
        return tuple(g if f is None or g is None else times_factor(g, f) for g, f in zip_longest(grads, factors))

    return scale_each


def _pre_hook(factors: tuple[float | None, ...]) -> Callable[[tuple], tuple]:
    """Node pre-hook between updates: constant factors per incoming slot."""
    return _factor_hook(factors)


def _post_hook(factors: tuple[float | None, ...]) -> Callable[[tuple, tuple], tuple]:
    """Node post-hook between updates: constant factors per outgoing edge."""
    scale = _factor_hook(factors)

    def post(grad_inputs: tuple, grad_outputs: tuple) -> tuple:
        return scale(grad_inputs)

    return post


@dataclass
class ScalePlan:
    """Every scale decided on the last update iteration, for one graph structure.

    ``recomputable``: the GEMM nodes whose parameter gradients the replays can recompute if they
    overflow, keeping their operands until the step (:mod:`~gs_lightning.scaling.recompute`).
    ``decided_input_shift``: GEMM -> the input edges whose gradients carry a scale of their own, and how many binades
    above ``alpha_out`` (:func:`shift_sent_operands`); its other edges, weights' and biases', carry ``alpha_out``.
    An update leaves its exponents on the device: ``settle`` reads them (with the step's read, or
    as :attr:`alpha_out` or :attr:`slot_alpha` is first asked for), after which they are ints.
    """

    names: tuple[str, ...]
    edges: tuple[tuple[Slot | None, ...], ...]
    decided_alpha_out: dict[int, Exponent]
    decided_slot_alpha: dict[Slot, Exponent]
    recomputable: frozenset[int] = frozenset()
    decided_input_shift: dict[int, InputShift] = field(default_factory=dict)
    # reads the update that decided it, until it did
    settle: Callable[[], None] | None = field(default=None, repr=False)
    _hooks: dict[LeafTargets, list[tuple[int, Callable | None, Callable | None]]] = field(
        default_factory=dict, repr=False
    )
    _shared: dict[frozenset[int], tuple[tuple[int, int], ...]] = field(default_factory=dict, repr=False)

    @property
    def alpha_out(self) -> dict[int, int]:
        """Node -> the scale its outgoing gradients carry (read first where the update left them on the device)."""
        self._settled()
        return self.decided_alpha_out

    @property
    def slot_alpha(self) -> dict[Slot, int]:
        """(node, slot) -> the scale of the gradient arriving there (read first as :attr:`alpha_out`)."""
        self._settled()
        return self.decided_slot_alpha

    @property
    def input_shift(self) -> dict[int, tuple[tuple[int, ...], int]]:
        """GEMM -> (edges, binades): what it sends along those edges carries ``alpha_out`` plus the binades (read
        first as :attr:`alpha_out`)."""
        self._settled()
        return self.decided_input_shift  # type: ignore[return-value]

    def edge_alpha(self, i: int, edge: int) -> int:
        """The scale node ``i``'s gradient along its input edge ``edge`` carries."""
        shifted = self.input_shift.get(i)
        return self.alpha_out[i] + (shifted[1] if shifted is not None and edge in shifted[0] else 0)

    def shift_sent_operands(self, graph: AutogradGraph) -> None:
        """On a replay: the saved-tensor hooks of the GEMMs whose input gradients carry a scale of their own."""
        for i, (edges, exponent) in self.input_shift.items():
            if exponent:
                shift_sent_operands(graph.nodes[i], edges, exponent)

    def _settled(self) -> None:
        if self.settle is not None:
            self.settle()  # calls read_in

    def read_in(self, values: Mapping[torch.Tensor, float]) -> None:
        """The exponents the update left on the device, as read (``values``): Python ints from now on."""
        self.decided_alpha_out, self.decided_slot_alpha = (
            as_read(self.decided_alpha_out, values),
            as_read(self.decided_slot_alpha, values),
        )
        shifts = as_read({i: exponent for i, (_, exponent) in self.decided_input_shift.items()}, values)
        self.decided_input_shift = {i: (edges, shifts[i]) for i, (edges, _) in self.decided_input_shift.items()}
        self.settle = None

    def matches(self, graph: AutogradGraph) -> bool:
        """Whether ``graph`` has the structure this plan was decided for."""
        return graph.same_structure(self.names, self.edges)

    def replay(self, graph: AutogradGraph, leaves: LeafTargets) -> list:
        """Register the constant-factor hooks of this plan on ``graph``; returns their handles."""
        handles = []
        for i, pre, post in self._hooks_for(graph, leaves):
            node = graph.nodes[i]
            if pre is not None:
                handles.append(node.register_prehook(pre))
            if post is not None:
                handles.append(node.register_hook(post))
        return handles

    def _hooks_for(
        self, graph: AutogradGraph, leaves: LeafTargets
    ) -> list[tuple[int, Callable | None, Callable | None]]:
        """(node, pre-hook, post-hook) for the nodes whose gradients change; built once per leaf targets."""
        hooks = self._hooks.get(leaves)
        if hooks is None:
            hooks = self._hooks[leaves] = [
                (i, _pre_hook(pre) if pre else None, _post_hook(post) if post else None)
                for i, pre, post in self.hook_factors(graph, leaves)
            ]
        return hooks

    def shared_leaf_scales(self, graph: AutogradGraph, leaves: frozenset[int]) -> tuple[tuple[int, int], ...]:
        """(leaf, log2 scale) for ``leaves``, each fed by several edges: the scale most of its edges carry.

        Autograd sums a leaf's incoming gradients before it accumulates them; brought to one scale (exact:
        powers of two), the sum can be divided once after the backward, with the other deferred
        gradients. Only the edges at another scale then need a factor: none where every use of a weight
        carries one scale (an unrolled RNN's steps, a tied embedding), where each edge would otherwise
        multiply a whole weight gradient. Found once per plan and set of leaves.
        """
        found = self._shared.get(leaves)
        if found is None:
            carried: dict[int, list[int]] = defaultdict(list)
            for i, edges in enumerate(graph.edges):
                for edge in edges:
                    if edge is not None and edge[0] in leaves:
                        carried[edge[0]].append(self.alpha_out.get(i, 0))
            found = self._shared[leaves] = tuple(
                sorted((j, Counter(alphas).most_common(1)[0][0]) for j, alphas in carried.items())
            )
        return found

    def hook_factors(self, graph: AutogradGraph, leaves: LeafTargets) -> list[tuple[int, tuple | None, tuple | None]]:
        """(node, pre-hook factors, post-hook factors) for the nodes whose gradients change."""
        slots_of: dict[int, list[int]] = defaultdict(list)
        for j, s in self.slot_alpha:
            slots_of[j].append(s)
        hooks = []
        for i, edges in enumerate(graph.edges):
            alpha = self.alpha_out.get(i)
            if alpha is None or graph.names[i] == LEAF:
                continue
            pre: list[float | None] = [None] * (max(slots_of[i], default=-1) + 1)
            for s in slots_of[i]:
                shift = alpha - self.slot_alpha[(i, s)]
                pre[s] = 2.0**shift if shift else None
            post = [
                edge_shift(graph, edge, self.edge_alpha(i, k), self.slot_alpha, leaves) for k, edge in enumerate(edges)
            ]
            pre_t = tuple(pre) if any(f is not None for f in pre) else None
            post_t = tuple(2.0**s if s else None for s in post) if any(post) else None
            if pre_t or post_t:
                hooks.append((i, pre_t, post_t))
        return hooks

    def state_dict(self) -> dict[str, Any]:
        """Plain containers only (checkpoints are loaded with ``weights_only=True``)."""
        return {
            "names": list(self.names),
            "edges": [[list(e) if e is not None else None for e in edges] for edges in self.edges],
            "alpha_out": sorted(self.alpha_out.items()),
            "slot_alpha": sorted((j, s, a) for (j, s), a in self.slot_alpha.items()),
            "recomputable": sorted(self.recomputable),
            "input_shift": sorted((i, list(edges), k) for i, (edges, k) in self.input_shift.items()),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> ScalePlan:
        """Rebuild a plan saved by :meth:`state_dict`."""
        return cls(
            names=tuple(state["names"]),
            edges=tuple(tuple(tuple(e) if e is not None else None for e in edges) for edges in state["edges"]),
            decided_alpha_out={int(i): int(a) for i, a in state["alpha_out"]},
            decided_slot_alpha={(int(j), int(s)): int(a) for j, s, a in state["slot_alpha"]},
            recomputable=frozenset(int(i) for i in state.get("recomputable", [])),
            decided_input_shift={
                int(i): (tuple(int(e) for e in edges), int(k)) for i, edges, k in state.get("input_shift", [])
            },
        )
