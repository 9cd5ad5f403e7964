"""GradientScaler: per-gradient power-of-two scales on PyTorch's autograd graph (paper Algorithm 1).

How it runs, in brief:

* Every backward walks the new autograd graph (a few hundred nodes: well under a millisecond).
* On an **update** iteration (the first, every ``update_interval``-th, after a skipped step, or
  when the graph's structure changed) hooks decide every scale in reverse topological order as
  autograd executes: a local scale β at each GEMM (Theorem 1) and each fp32→low-precision cast
  (Theorem 2), a common scale at each branch and split (Algorithm 1, line 17). Each decision
  reads a few statistics of the gradient at hand: that is the only host-device synchronisation.
* On the iterations in between, the decisions are replayed as constant power-of-two factors:
  no statistics, no synchronisation, and no hook at all where the factor is 1.
* Every gradient that reaches a leaf (a parameter) is divided by the scale it carries, in the
  leaf's own precision (fp32 master weights), before autograd accumulates it into ``.grad``.
  So ``.grad``, DDP's all-reduce and the optimizer only ever see true gradients.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from functools import partial
from itertools import zip_longest
from typing import Any, Literal

import torch
from torch import nn

from gs_lightning.scaling.formats import float_format
from gs_lightning.scaling.graph import GEMM_OPERANDS, LEAF, WEIGHT_GRAD_BOUNDS, AutogradGraph, GraphAnalysis, Slot, analyze, walk
from gs_lightning.scaling.underflow import (
    branch_log2_scale,
    cast_min_log2_scale,
    cast_underflow_rate,
    choose_log2_scale,
    gemm_min_log2_scale,
    gemm_sigma,
    gemm_underflow_rate,
    overflow_max_log2_scale,
)

_MIN_BACKOFF = -64  # a non-finite *forward* cannot be fixed by scaling; stop shrinking somewhere


def _times_pow2(grad: torch.Tensor, exponent: int) -> torch.Tensor:
    return grad * (2.0**exponent) if exponent else grad


def _scale_grad_outputs(factors: tuple[float | None, ...], grad_outputs: tuple) -> tuple:
    """Node pre-hook between updates: constant factors per incoming slot."""
    return tuple(g if f is None or g is None else g * f for g, f in zip_longest(grad_outputs, factors))


def _scale_grad_inputs(factors: tuple[float | None, ...], grad_inputs: tuple, grad_outputs: tuple) -> tuple:
    """Node post-hook between updates: constant factors per outgoing edge."""
    return tuple(g if f is None or g is None else g * f for g, f in zip(grad_inputs, factors))


@dataclass
class ScalePlan:
    """Every scale decided on the last update iteration, for one graph structure.

    Exponents are log2 of the scales. ``alpha_out[i]`` is the scale node ``i``'s outgoing
    gradients carry; ``slot_alpha[(i, s)]`` the scale of the gradient arriving in slot ``s``.
    """

    names: tuple[str, ...]
    edges: tuple[tuple[Slot | None, ...], ...]
    alpha_out: dict[int, int]
    slot_alpha: dict[Slot, int]
    hooks: list[tuple[int, tuple | None, tuple | None]] | None = field(default=None, repr=False)

    def hook_factors(self, graph: AutogradGraph) -> list[tuple[int, tuple | None, tuple | None]]:
        """(node, pre-hook factors, post-hook factors) for the nodes whose gradients change."""
        if self.hooks is None:
            self.hooks = self._derive(graph)
        return self.hooks

    def _derive(self, graph: AutogradGraph) -> list[tuple[int, tuple | None, tuple | None]]:
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
            post: list[float | None] = []
            for edge in edges:
                shift = 0
                if edge is not None:
                    if graph.names[edge[0]] == LEAF:
                        shift = -alpha
                    elif graph.in_counts[edge] > 1:
                        shift = self.slot_alpha.get(edge, alpha) - alpha
                post.append(2.0**shift if shift else None)
            pre_t = tuple(pre) if any(f is not None for f in pre) else None
            post_t = tuple(post) if any(f is not None for f in post) else None
            if pre_t or post_t:
                hooks.append((i, pre_t, post_t))
        return hooks

    def state_dict(self) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "edges": [[list(e) if e is not None else None for e in edges] for edges in self.edges],
            "alpha_out": sorted(self.alpha_out.items()),
            "slot_alpha": sorted((j, s, a) for (j, s), a in self.slot_alpha.items()),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> ScalePlan:
        return cls(
            names=tuple(state["names"]),
            edges=tuple(tuple(tuple(e) if e is not None else None for e in edges) for edges in state["edges"]),
            alpha_out={int(i): int(a) for i, a in state["alpha_out"]},
            slot_alpha={(int(j), int(s)): int(a) for j, s, a in state["slot_alpha"]},
        )


@dataclass(frozen=True)
class LayerScale:
    """What the last update chose for one GEMM or cast.

    Attributes:
        name: Layer name (qualified module name where known, ``".cast"`` appended for casts).
        kind: ``"gemm"`` or ``"cast"``.
        log2_scale: log2 of the local scale β.
        log2_total: log2 of the accumulated scale α·β its outgoing gradients carry.
        underflow_rate: The model's estimated underflow rate of its output at that scale.
    """

    name: str
    kind: str
    log2_scale: int
    log2_total: int
    underflow_rate: float


class GradientScaler:
    """Per-layer gradient scaling for mixed precision training (Zhao et al., IJCAI 2020).

    Gives every backpropagated gradient its own power-of-two scale, chosen on the fly from a
    statistical model of underflow, on any model and with no change to the model::

        scaler = GradientScaler(model)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = criterion(model(x), y)
        scaler.backward(loss)     # afterwards every .grad is the true gradient
        scaler.step(optimizer)    # skipped if a gradient was non-finite

    Args:
        model: Optional; used only to name layers after their modules (``"layer1.0.conv1"``).
        underflow_rate: γ', the target fraction of a gradient's elements that may underflow.
        update_interval: Recompute the scales every this many backward passes (the paper: 100).
        dtype: The low-precision format whose range the scales protect.
        lambda_min: Which λmin the underflow model uses: ``"normal"``, the smallest normal number
            (values below it keep fewer significant bits), or ``"subnormal"``, the smallest
            subnormal (the paper's 6e-8 for float16). ``"normal"`` is the default because it
            measured closer to fp32 (README, ``bench/fidelity.py``).
        relu_factor: Multiplies the accumulation length N in Lemma 1. The paper uses 1/2 when a
            ReLU zeroes half of ∇Y; the default 1 fits because σ(∇Y) is measured on the actual
            gradient, zeros included.
        max_layer_scale: Optional cap on each local scale β (the reference code used 16).
        max_total_scale: Optional cap on each accumulated scale (the reference code used 1024).
        enabled: If false, ``backward`` is plain ``loss.backward()`` and ``step`` always steps.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        underflow_rate: float = 1e-3,
        update_interval: int = 100,
        dtype: torch.dtype = torch.float16,
        lambda_min: Literal["normal", "subnormal"] = "normal",
        relu_factor: float = 1.0,
        max_layer_scale: float | None = None,
        max_total_scale: float | None = None,
        enabled: bool = True,
    ) -> None:
        if not 0.0 < underflow_rate < 0.5:
            raise ValueError(f"GradientScaler: underflow_rate must be in (0, 0.5), got {underflow_rate}")
        if not isinstance(update_interval, int) or update_interval < 1:
            raise ValueError(f"GradientScaler: update_interval must be a positive integer, got {update_interval!r}")
        if lambda_min not in ("normal", "subnormal"):
            raise ValueError(f"GradientScaler: lambda_min must be 'normal' or 'subnormal', got {lambda_min!r}")
        if not relu_factor > 0.0:
            raise ValueError(f"GradientScaler: relu_factor must be positive, got {relu_factor}")
        for option, value in (("max_layer_scale", max_layer_scale), ("max_total_scale", max_total_scale)):
            if value is not None and not value >= 1.0:
                raise ValueError(f"GradientScaler: {option} must be None or >= 1, got {value}")
        self.format = float_format(dtype)
        self.underflow_rate = underflow_rate
        self.update_interval = update_interval
        self.lambda_min = lambda_min
        self.relu_factor = relu_factor
        self.max_layer_scale = max_layer_scale
        self.max_total_scale = max_total_scale
        self.enabled = enabled
        self._module_names = _module_names(model) if model is not None else {}

        self._iteration = 0
        self._skipped_steps = 0
        self._plan: ScalePlan | None = None
        self._analysis: GraphAnalysis | None = None
        self._force_update = False
        self._backoff: int | None = None
        self._last_skip = 0  # iteration of the last skipped step
        self._layers: dict[str, LayerScale] = {}
        self._touched: dict[int, torch.Tensor] = {}  # leaves whose .grad a backward wrote since the last step
        self._stepped = False
        self._skipped_this_iteration = False
        self._warned: set[str] = set()

    # --- public API ------------------------------------------------------------------------

    @property
    def lambda_min_value(self) -> float:
        """λmin used by the underflow model."""
        return self.format.normal_min if self.lambda_min == "normal" else self.format.subnormal_min

    @property
    def iteration(self) -> int:
        """Number of backward passes run through this scaler."""
        return self._iteration

    @property
    def skipped_steps(self) -> int:
        """Number of optimizer steps skipped because a gradient was non-finite."""
        return self._skipped_steps

    def backward(self, loss: torch.Tensor, retain_graph: bool | None = None) -> None:
        """Backpropagate ``loss`` with per-gradient scaling; leaves true gradients in ``.grad``."""
        if self._stepped:
            self._touched.clear()
            self._stepped = self._skipped_this_iteration = False
        if not self.enabled or loss.grad_fn is None:
            loss.backward(retain_graph=retain_graph)
            return
        if loss.numel() != 1:
            raise RuntimeError(f"GradientScaler.backward: loss must be a scalar, got shape {tuple(loss.shape)}")
        graph = walk(loss.grad_fn)
        known = self._plan is not None and graph.same_structure(self._plan.names, self._plan.edges)
        update = not known or self._force_update or self._iteration % self.update_interval == 0
        if update:
            if self._analysis is None or not known:
                self._analysis = analyze(graph, self._module_names)
                self._warn_unhandled(self._analysis)
            run = _UpdateRun(self, graph, self._analysis)
            handles = run.register()
        else:
            handles = []
            for i, pre, post in self._plan.hook_factors(graph):
                node = graph.nodes[i]
                if pre is not None:
                    handles.append(node.register_prehook(partial(_scale_grad_outputs, pre)))
                if post is not None:
                    handles.append(node.register_hook(partial(_scale_grad_inputs, post)))
        try:
            torch.autograd.backward(loss, retain_graph=retain_graph)
        finally:
            for handle in handles:
                handle.remove()
        if update:
            self._finish_update(run, graph)
        self._iteration += 1
        self._touched.update((id(v), v) for v in graph.leaf_variables())

    @property
    def found_inf(self) -> bool:
        """Whether a backward since the last step left a non-finite gradient (synchronises)."""
        return _any_non_finite(self._touched.values())

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> bool:
        """``optimizer.step()`` unless one of its gradients is non-finite; returns whether it stepped.

        As ``GradScaler``, each optimizer is judged by its own parameters' gradients (one fused
        check, the only synchronisation of a non-update iteration). A skipped step leaves the
        weights untouched and makes the next backward recompute the scales, with the accumulated
        scale capped below the one that overflowed.
        """
        if not self.enabled:
            optimizer.step(*args, **kwargs)
            return True
        overflow = _any_non_finite(p for group in optimizer.param_groups for p in group["params"])
        if overflow and not self._skipped_this_iteration:
            self._skipped_this_iteration = True
            self._skipped_steps += 1
            self._back_off()
        self._stepped = True
        if overflow:
            return False
        optimizer.step(*args, **kwargs)
        return True

    def scales(self) -> dict[str, float]:
        """{layer name: local scale β last chosen}, for every GEMM and cast."""
        return {name: 2.0**layer.log2_scale for name, layer in self._layers.items()}

    def underflow_rates(self) -> dict[str, float]:
        """{layer name: the model's estimated underflow rate at the chosen scale}."""
        return {name: layer.underflow_rate for name, layer in self._layers.items()}

    def layers(self) -> list[LayerScale]:
        """Everything the last update chose, layer by layer, in backward order."""
        return list(self._layers.values())

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state: iteration counter, skipped steps and every scale of the last update."""
        return {
            "iteration": self._iteration,
            "skipped_steps": self._skipped_steps,
            "force_update": self._force_update,
            "backoff": self._backoff,
            "last_skip": self._last_skip,
            "plan": self._plan.state_dict() if self._plan is not None else None,
            "layers": [asdict(layer) for layer in self._layers.values()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`: the next backwards reuse the saved scales."""
        self._iteration = int(state["iteration"])
        self._skipped_steps = int(state["skipped_steps"])
        self._force_update = bool(state["force_update"])
        self._backoff = state["backoff"]
        self._last_skip = int(state["last_skip"])
        self._plan = ScalePlan.from_state_dict(state["plan"]) if state["plan"] is not None else None
        self._analysis = None
        self._layers = {layer["name"]: LayerScale(**layer) for layer in state["layers"]}

    # --- internals -------------------------------------------------------------------------

    def _total_cap(self) -> int | None:
        caps = [c for c in (self._backoff, _log2_floor(self.max_total_scale)) if c is not None]
        return min(caps) if caps else None

    def _finish_update(self, run: _UpdateRun, graph: AutogradGraph) -> None:
        # Relax the cap only after a full interval without a skipped step (update_interval=1 included).
        scheduled = self._iteration % self.update_interval == 0 and self._iteration - self._last_skip >= self.update_interval
        self._plan = ScalePlan(tuple(graph.names), tuple(graph.edges), run.alpha_out, run.slot_alpha)
        self._layers = {layer.name: layer for layer in run.layers}
        self._force_update = False
        if self._backoff is not None and scheduled:
            largest = max(run.alpha_out.values(), default=0)
            # One bit per clean interval; drop the cap once it no longer binds.
            self._backoff = None if largest < self._backoff else self._backoff + 1

    def _back_off(self) -> None:
        largest = max(self._plan.alpha_out.values(), default=0) if self._plan is not None else 0
        cap = largest - 1 if self._backoff is None else min(self._backoff, largest) - 1
        self._backoff = max(cap, _MIN_BACKOFF)
        self._last_skip = self._iteration
        self._force_update = True

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _warn_unhandled(self, analysis: GraphAnalysis) -> None:
        for name in sorted(analysis.opaque):
            self._warn_once(
                name,
                f"GradientScaler: the backward graph contains {name} (e.g. from torch.compile); "
                "gradients inside it pass through unscaled.",
            )
        if not analysis.gemms and not analysis.casts:
            self._warn_once("no-gemm", "GradientScaler: no GEMM or cast found in the backward graph; nothing is scaled.")


def _module_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for module_name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            names.setdefault(id(param), module_name or type(module).__name__)
    return names


def _log2_floor(value: float | None) -> int | None:
    return None if value is None else math.floor(math.log2(value))


def _any_non_finite(variables: Iterable[torch.Tensor]) -> bool:
    """Whether any ``.grad`` holds inf or NaN: one fused check per (device, dtype), one sync."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for variable in variables:
        if variable.grad is not None and variable.grad.is_floating_point():
            groups[(variable.grad.device, variable.grad.dtype)].append(variable.grad)
    flags = []
    for (device, _), grads in groups.items():
        flag = torch.zeros(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, torch.ones(1, device=device))
        flags.append(flag)
    return any(bool(flag.item()) for flag in flags)


def _stats(*values: torch.Tensor) -> list[float]:
    """Statistics to the host in one synchronisation."""
    return torch.stack([v.float() for v in values]).tolist()


def _rms(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float32) / math.sqrt(max(t.numel(), 1))


def _absmax(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, ord=math.inf, dtype=torch.float32)


class _UpdateRun:
    """Hooks of one update iteration: Algorithm 1, decided node by node as autograd runs."""

    def __init__(self, scaler: GradientScaler, graph: AutogradGraph, analysis: GraphAnalysis) -> None:
        self.scaler = scaler
        self.graph = graph
        self.analysis = analysis
        self.alpha_out: dict[int, int] = {}
        self.slot_alpha: dict[Slot, int] = {(0, 0): 0}
        self.layers: list[LayerScale] = []
        self._stash: dict[Slot, list[tuple[torch.Tensor, int]]] = defaultdict(list)
        self._arrived: dict[Slot, int] = defaultdict(int)
        self._cap = scaler._total_cap()
        self._layer_cap = _log2_floor(scaler.max_layer_scale)
        self._lambda_min = scaler.lambda_min_value
        self._lambda_max = scaler.format.max

    def register(self) -> list:
        a = self.analysis
        decides = a.gemms.keys() | a.casts | a.merge_nodes
        handles = []
        for i, node in enumerate(self.graph.nodes):
            if i in a.leaves:
                continue
            if i in decides:
                handles.append(node.register_prehook(partial(self._pre, i)))
            if any(e is not None for e in self.graph.edges[i]):
                handles.append(node.register_hook(partial(self._post, i)))
        return handles

    # Pre-hook: merge the incoming slots to one scale, then apply the node's local scale.
    def _pre(self, i: int, grad_outputs: tuple) -> tuple:
        grads = list(grad_outputs)
        alphas = {s: self.slot_alpha.get((i, s), 0) for s, g in enumerate(grads) if g is not None}
        alpha = next(iter(alphas.values()), 0)
        if len(set(alphas.values())) > 1:
            maxima = _stats(*(_absmax(grads[s]) for s in alphas))
            largest = max(m * 2.0 ** -alphas[s] for m, s in zip(maxima, alphas))
            alpha = self._capped(branch_log2_scale(list(alphas.values()), largest, self._lambda_max))
            for s, a in alphas.items():
                grads[s] = _times_pow2(grads[s], alpha - a)
        beta = 0
        if alphas and (i in self.analysis.gemms or i in self.analysis.casts):
            grad = grads[next(iter(alphas))]
            try:
                beta = self._gemm_scale(i, grad, alpha) if i in self.analysis.gemms else self._cast_scale(i, grad, alpha)
            except Exception as error:  # never crash training: this node passes its scale through
                self.scaler._warn_once(
                    f"stats:{self.graph.names[i]}",
                    f"GradientScaler: could not compute a scale at {self.graph.names[i]} ({error!r}); "
                    "its gradients pass through unscaled.",
                )
            grads = [_times_pow2(g, beta) if g is not None else None for g in grads]
        self.alpha_out[i] = alpha + beta
        return tuple(grads)

    # Post-hook: unscale what reaches a leaf, gather what meets at a branch, pass the rest on.
    def _post(self, i: int, grad_inputs: tuple, grad_outputs: tuple) -> tuple:
        alpha = self.alpha_out.get(i)
        if alpha is None:
            (slot,) = self.analysis.slots.get(i, (0,))  # nodes without a pre-hook have one slot
            alpha = self.alpha_out[i] = self.slot_alpha.get((i, slot), 0)
        out = list(grad_inputs)
        for k, edge in enumerate(self.graph.edges[i]):
            if edge is None:
                continue
            if edge[0] in self.analysis.leaves:
                if out[k] is not None:
                    out[k] = _times_pow2(out[k], -alpha)
            elif edge in self.analysis.branch_slots:
                out[k] = self._arrive(edge, out[k], alpha)
            else:
                self.slot_alpha[edge] = alpha
        return tuple(out)

    def _arrive(self, slot: Slot, grad: torch.Tensor | None, alpha: int) -> torch.Tensor | None:
        """Keep a branch contribution aside; the last one applies line 17 and sends the sum."""
        self._arrived[slot] += 1
        if grad is not None:
            self._stash[slot].append((grad, alpha))
        if self._arrived[slot] < self.graph.in_counts[slot]:
            return None
        parts = self._stash.pop(slot, [])
        if not parts:
            self.slot_alpha[slot] = alpha
            return None
        alphas = [a for _, a in parts]
        common = alphas[0]
        if len(set(alphas)) > 1:
            maxima = _stats(*(_absmax(g) for g, _ in parts))
            largest = max(m * 2.0**-a for m, a in zip(maxima, alphas))
            common = self._capped(branch_log2_scale(alphas, largest, self._lambda_max))
        total = None
        for grad, a in parts:  # in arrival order, as autograd itself would sum them
            term = _times_pow2(grad, common - a)
            total = term if total is None else total + term
        self.slot_alpha[slot] = common
        return total

    def _capped(self, exponent: int) -> int:
        return exponent if self._cap is None else min(exponent, self._cap)

    def _ceiling(self, alpha: int) -> int | None:
        caps = [c for c in (self._layer_cap, None if self._cap is None else self._cap - alpha) if c is not None]
        return min(caps) if caps else None

    def _gemm_scale(self, i: int, grad: torch.Tensor, alpha: int) -> int:
        name = self.graph.names[i]
        node, operand_of = self.graph.nodes[i], GEMM_OPERANDS[name]
        operands = [operand_of[k](node) for k in self.analysis.gemms[i]]
        if not operands:  # e.g. the first layer: no activation gradient leaves it
            return 0
        weight_bounds = WEIGHT_GRAD_BOUNDS[name](node, grad, self.analysis.weight_edges[i]) if name in WEIGHT_GRAD_BOUNDS else []
        grad_rms, grad_max, *stats = _stats(
            _rms(grad), _absmax(grad), *(f(op.operand) for op in operands for f in (_rms, _absmax)), *weight_bounds
        )
        operand_stats, weight_stats = stats[: 2 * len(operands)], stats[2 * len(operands) :]
        sigmas = [
            gemm_sigma(self.scaler.relu_factor * op.accumulation_length, grad_rms, operand_stats[2 * k])
            for k, op in enumerate(operands)
        ]
        lower = max(gemm_min_log2_scale(s, self._lambda_min, self.scaler.underflow_rate) for s in sigmas)
        upper = min(
            [overflow_max_log2_scale(grad_max, self._lambda_max)]
            + [
                overflow_max_log2_scale(op.accumulation_length * grad_max * operand_stats[2 * k + 1], self._lambda_max)
                for k, op in enumerate(operands)
            ]
            + [overflow_max_log2_scale(bound, self._lambda_max) for bound in weight_stats]
        )
        beta = choose_log2_scale(lower, upper, self._ceiling(alpha))
        rate = max(gemm_underflow_rate(beta, s, self._lambda_min) for s in sigmas)
        self.layers.append(LayerScale(self.analysis.layer_names[i], "gemm", beta, alpha + beta, rate))
        return beta

    def _cast_scale(self, i: int, grad: torch.Tensor, alpha: int) -> int:
        magnitude = grad.detach().abs().float()
        nonzero = magnitude > 0
        count = nonzero.sum()
        logs = torch.where(nonzero, magnitude.log(), 0.0)
        mean = logs.sum() / count.clamp(min=1)
        var = torch.where(nonzero, (logs - mean) ** 2, 0.0).sum() / (count - 1).clamp(min=1)
        n, log_mean, log_var, largest = _stats(count, mean, var, magnitude.max())
        if n < 2:
            return 0
        log_std = math.sqrt(log_var)
        lower = cast_min_log2_scale(log_mean, log_std, self._lambda_min, self.scaler.underflow_rate)
        upper = overflow_max_log2_scale(largest, self._lambda_max)
        beta = choose_log2_scale(lower, upper, self._ceiling(alpha))
        rate = cast_underflow_rate(beta, log_mean, log_std, self._lambda_min)
        self.layers.append(LayerScale(self.analysis.layer_names[i], "cast", beta, alpha + beta, rate))
        return beta
