"""What the scaler keeps per backward graph structure: its plans, its schedule, its drift and back-off.

A training loop may run more than one graph: two models or two losses with their own optimizers,
a gradient penalty (``autograd.grad`` with ``create_graph=True``, then the loss's backward through
it), a GAN's generator and discriminator. Each structure keeps its own scales, its own update
schedule and its own statistics, so that graphs which alternate each replay their own plan
(one plan for all made every backward an update iteration: 60 of 60 in the AMP recipe's
multi-model and gradient-penalty loops).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from gs_lightning.scaling.backoff import LayerBackoff
from gs_lightning.scaling.decide import LayerScale, NodeDecisions, UnreadRates
from gs_lightning.scaling.drift import GradientDrift
from gs_lightning.scaling.follow import LevelFollower
from gs_lightning.scaling.gradient_stats import DeviceRead, FiniteFlags, first_non_finite
from gs_lightning.scaling.graph import AutogradGraph, GraphAnalysis
from gs_lightning.scaling.limits import Limit
from gs_lightning.scaling.plan import ScalePlan
from gs_lightning.scaling.schedule import UpdateReason, UpdateSchedule
from gs_lightning.scaling.sent_maxima import SentMaxima
from gs_lightning.scaling.walks import parameter_leaves

if TYPE_CHECKING:
    from gs_lightning.scaling.update import UpdateRun

Path = tuple[int, ...]  # () for the loss's graph; (c,) for the inner graph of its reentrant checkpoint node c, ...


class GraphScales:
    """The scaling state of one backward graph structure (node types and wiring).

    Attributes:
        names: The structure's node types, as :class:`~gs_lightning.scaling.graph.AutogradGraph` has them.
        edges: Its wiring.
        plans: The plans the next replay runs, of the graph (path ``()``; the last update's, shifted by
            :attr:`follower`) and of each reentrant checkpoint's inner graph.
        analyses: Their node classifications (rebuilt after a restore or :meth:`GradientScaler.attach`).
        drift: Its weight gradients' largest values, between updates and at them.
        sent_maxima: The largest input gradients its GEMMs sent on at a scale of their own, replay by replay.
        follower: The GEMMs' shifts from the last update's plan, which the step moves
            (:mod:`~gs_lightning.scaling.follow`; :attr:`plans` holds the shifted plan).
        layer_backoff: Caps on its nodes that overflowed.
        schedule: When its backwards update, what asked for the next update, and why its last one ran (its
            backwards counted there).
        measured_weights: Per path, the GEMMs whose weight gradients its updates compute exactly (where the
            Cauchy–Schwarz bound binds): those where it held the scale on an earlier update, every GEMM before the
            first (no entry). A GEMM joins as its bound first holds; unmeasured then, the next backward updates.
    """

    def __init__(self, names: tuple[str, ...], edges: tuple, drift: GradientDrift) -> None:
        self.names = names
        self.edges = edges
        self.plans: dict[Path, ScalePlan] = {}
        self.analyses: dict[Path, GraphAnalysis] = {}
        self.drift = drift
        self.sent_maxima = SentMaxima(drift.window)
        self.follower = LevelFollower()
        self.layer_backoff = LayerBackoff()
        self._layers: dict[str, LayerScale] = {}
        self._updated: list[LayerScale] = []  # the last update's layers in its order, which its unread rates index
        self._first_non_finite: str | None = None
        self._unread: tuple[FiniteFlags, list[UnreadRates]] | None = None  # what the last update left on the device
        self._undecided: set[int] = set()  # positions in _updated of layers that did not decide: no rates applied
        # updates whose scales are unread
        self._runs: list[tuple[UpdateRun, ScalePlan, Path, Callable[[], None] | None]] = []
        self.measured_weights: dict[Path, frozenset[int]] = {}
        self.schedule = UpdateSchedule()

    @property
    def layers(self) -> dict[str, LayerScale]:
        """What its last update chose, layer by layer, in backward order (reads what that update left on the device,
        if the step has not: one synchronisation)."""
        self._read_update()
        return self._layers

    @layers.setter
    def layers(self, layers: dict[str, LayerScale]) -> None:
        self._layers, self._unread = layers, None

    @property
    def first_non_finite(self) -> str | None:
        """The first layer, in backward order, whose gradient was non-finite on its last update (reads as
        :attr:`layers`)."""
        self._read_update()
        return self._first_non_finite

    def kept_on_zero_gradient(self) -> frozenset[int]:
        """The parameter leaves of the GEMMs whose last update kept the replaced plan's scale, their incoming gradient
        all zeros (:attr:`ScalingRecipe.keep_scale_on_zero_gradient`; reads as :attr:`layers`)."""
        plan, analysis = self.plans.get(()), self.analyses.get(())
        if plan is None or analysis is None:
            return frozenset()
        kept = {name for name, layer in self.layers.items() if layer.limit is Limit.KEPT_ON_ZERO_GRADIENT}
        return frozenset(
            j
            for g, name in analysis.layer_names.items()
            if name in kept and g in analysis.gemms
            for j in parameter_leaves(plan.names, plan.edges, analysis, g)
        )

    def keep_update(self, run: UpdateRun, plan: ScalePlan, after_read: Callable[[], None] | None = None) -> None:
        """An update's plan, layers, finiteness flags and underflow counts (on the device), read with the step's
        (:meth:`unread`);
        ``after_read``: what needs their values then. The plan reads them all if asked for first."""
        self.keep_scales(run, plan, (), after_read)
        self._updated = run.decisions.layers  # filled in as read
        self._first_non_finite, self._unread = (
            None,
            (list(run.decisions.finite_flags), list(run.decisions.unread_rates)),
        )
        self._undecided = run.decisions.undecided

    def keep_scales(
        self, run: UpdateRun, plan: ScalePlan, path: Path, after_read: Callable[[], None] | None = None
    ) -> None:
        """A run's plan (a reentrant checkpoint's inner graph's, at ``path``, too), its scales read with the step's
        (:meth:`unread`)."""
        plan.settle = self._read_update
        self._runs.append((run, plan, path, after_read))

    def put_unread(self, read: DeviceRead) -> None:
        """Put what the last update left on the device into ``read``, under this structure's keys: its scales and
        decisions, its finiteness flags, its underflow counts (:meth:`take_reading` takes them back)."""
        read.put((self, "scales"), self._unread_scales())
        self.sent_maxima.put(read, (self, "sent"))
        if self._unread is None:
            return
        flags, rates = self._unread
        for k, (_, flag) in enumerate(flags):
            read.put((self, "finite", k), flag)
        for k, r in enumerate(rates):
            read.put((self, "rates", k), r.tensors())

    def take_reading(self, values: Mapping[Hashable, list[float]]) -> None:
        """:meth:`put_unread`'s tensors as read (``values``, by key): the scales and decisions, the first
        non-finite layer, the layers' underflow rates."""
        self.sent_maxima.take(values[self, "sent"])
        if not self._runs and self._unread is None:
            return  # nothing was left on the device
        known = dict(zip(self._unread_scales(), values[self, "scales"]))
        runs, self._runs = self._runs, []
        for run, plan, path, _ in runs:
            run.read_in(known)
            plan.read_in(known)
            self._measure_weights(path, run.decisions)
        self.drift.read_in(known)  # the scales of the gradients it queued
        for _, _, _, after_read in runs:
            if after_read is not None:
                after_read()
        if self._unread is None:
            return
        (flags, rates), layers = self._unread, self._updated
        self._first_non_finite = first_non_finite(flags, values, (self, "finite"))
        for k, r in enumerate(rates):
            if r.index not in self._undecided:
                layers[r.index] = r.applied_to(layers[r.index], iter(values[self, "rates", k]))
        self.layers = {layer.name: layer for layer in layers}

    def _measure_weights(self, path: Path, decisions: NodeDecisions) -> None:
        """The GEMMs whose weight-gradient bound held on an update join :attr:`measured_weights`; where it held
        unmeasured, the next backward updates (:attr:`UpdateReason.UNMEASURED_WEIGHT_BOUND
        <gs_lightning.scaling.schedule.UpdateReason.UNMEASURED_WEIGHT_BOUND>`)."""
        self.measured_weights[path] = self.measured_weights.get(path, frozenset()) | decisions.weight_bound
        if decisions.weight_bound & decisions.unmeasured:
            self.schedule.ask(UpdateReason.UNMEASURED_WEIGHT_BOUND)

    def _unread_scales(self) -> list[torch.Tensor]:
        """The scales and decisions of the runs kept unread, each tensor once."""
        return list({id(t): t for run, _, _, _ in self._runs for t in run.unread()}.values())

    def _read_update(self) -> None:
        """Read what the last update left on the device, where the step has not (one synchronisation)."""
        if self._unread is not None or self._runs:
            read = DeviceRead()
            self.put_unread(read)
            self.take_reading(read.read())

    def matches(self, graph: AutogradGraph) -> bool:
        """Whether ``graph`` has this structure."""
        return graph.same_structure(self.names, self.edges)

    def update_reasons(self, interval: int) -> frozenset[UpdateReason]:
        """Why its next backward is an update iteration (empty: it replays): asked for, due (every ``interval``-th), or
        never decided (:meth:`UpdateSchedule.reasons <gs_lightning.scaling.schedule.UpdateSchedule.reasons>`)."""
        return self.schedule.reasons(interval, () in self.plans)

    def state_dict(self) -> dict[str, Any]:
        """Plain containers only (checkpoints are loaded with ``weights_only=True``)."""
        return {
            "names": list(self.names),
            "edges": [[list(e) if e is not None else None for e in edges] for edges in self.edges],
            "plans": [[list(path), plan.state_dict()] for path, plan in self.plans.items()],
            "drift": self.drift.state_dict(),
            "sent_maxima": self.sent_maxima.state_dict(),
            "follower": self.follower.state_dict(),
            "layer_backoff": self.layer_backoff.state_dict(),
            "layers": [layer.state_dict() for layer in self.layers.values()],
            "first_non_finite": self.first_non_finite,
            **self.schedule.state_dict(),
            "measured_weights": [[list(path), sorted(nodes)] for path, nodes in self.measured_weights.items()],
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], drift: GradientDrift) -> GraphScales:
        """Rebuild what :meth:`state_dict` saved; ``drift``: a fresh monitor with the scaler's settings."""
        edges = tuple(tuple(tuple(e) if e is not None else None for e in node) for node in state["edges"])
        graph = cls(tuple(state["names"]), edges, drift)
        graph.plans = {tuple(path): ScalePlan.from_state_dict(plan) for path, plan in state["plans"]}
        graph.drift.load_state_dict(state.get("drift", {}))
        graph.sent_maxima.load_state_dict(state.get("sent_maxima", {}))
        graph.follower.load_state_dict(state.get("follower", {}))
        graph.layer_backoff.load_state_dict(state.get("layer_backoff", []))
        graph.layers = {layer["name"]: LayerScale.from_state_dict(layer) for layer in state.get("layers", [])}
        graph._first_non_finite = state.get("first_non_finite")
        graph.schedule.load_state_dict(state)
        graph.measured_weights = {tuple(path): frozenset(nodes) for path, nodes in state.get("measured_weights", [])}
        return graph

    # Pickled (copy.deepcopy) as its state: the analyses hold autograd nodes, the plans cached hooks.
    def __getstate__(self) -> dict[str, Any]:
        return {"state": self.state_dict(), "drift": self.drift}

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        drift = pickled["drift"]
        self.__dict__.update(GraphScales.from_state_dict(pickled["state"], drift).__dict__)


class GraphRegistry:
    """The :class:`GraphScales` of each structure the scaler ran, least recently run first (at most
    :attr:`~gs_lightning.scaling.recipe.ScalingRecipe.max_graphs`)."""

    def __init__(self) -> None:
        self._graphs: list[GraphScales] = []

    def __iter__(self) -> Iterator[GraphScales]:
        return iter(self._graphs)

    def __len__(self) -> int:
        return len(self._graphs)

    @property
    def current(self) -> GraphScales | None:
        """The structure that ran last (``None`` before the first backward)."""
        return self._graphs[-1] if self._graphs else None

    def of(self, graph: AutogradGraph, new_drift: GradientDrift, max_graphs: int, keep_others: bool) -> GraphScales:
        """``graph``'s structure's state, made the current one; a new one (with ``new_drift``) if it never ran, the
        least recently run going where more than ``max_graphs`` would be kept.

        ``keep_others=False``: a new structure replaces every other (compiled modules replay one plan).
        """
        for k in range(len(self._graphs) - 1, -1, -1):  # the current one first: usually it
            if self._graphs[k].matches(graph):
                found = self._graphs.pop(k)
                self._graphs.append(found)
                return found
        found = GraphScales(tuple(graph.names), tuple(graph.edges), new_drift)
        self._graphs = [*self._graphs, found][-max_graphs:] if keep_others else [found]
        return found

    def clear_analyses(self) -> None:
        """Forget every analysis (layer names are decided with them: a model was attached)."""
        for graph in self._graphs:
            graph.analyses.clear()

    def layers(self) -> dict[str, LayerScale]:
        """Layer name -> what the last update of its structure chose, least recently run structure first (a layer
        in two keeps the later one's)."""
        merged: dict[str, LayerScale] = {}
        for graph in self._graphs:
            merged.update(graph.layers)
        return merged

    def state_dict(self) -> list[dict[str, Any]]:
        return [graph.state_dict() for graph in self._graphs]

    def load_state_dict(self, state: list[dict[str, Any]], new_drift: Any) -> None:
        """Restore :meth:`state_dict`; ``new_drift()`` makes each structure's monitor."""
        self._graphs = [GraphScales.from_state_dict(graph, new_drift()) for graph in state]


def one_graph_state(state: dict[str, Any]) -> list[dict[str, Any]]:
    """A scaler's state saved before it kept one state per graph structure, as :meth:`GraphRegistry.state_dict`
    has it."""
    # saved before nested plans: one
    plans = state["plans"] if "plans" in state else [[[], state["plan"]]] if state.get("plan") else []
    root = next((plan for path, plan in plans if not path), None)
    if root is None:
        return []
    return [
        {
            "names": root["names"],
            "edges": root["edges"],
            "plans": plans,
            "drift": state.get("drift", {}),
            "layer_backoff": state.get("layer_backoff", []),
            "layers": state["layers"],
            "first_non_finite": state.get("first_non_finite"),
            "backwards": state["iteration"],
            "last_skip": state.get("last_skip", 0),
            "force_update": state.get("force_update", False),
        }
    ]
