"""The scaled backward: the hooks one backward runs, from ``scale()`` to the engine's last callback.

A backward's graph is walked, matched to the state of its structure
(:class:`~gs_lightning.scaling.graph_scales.GraphScales`), and hooked either to decide every scale as
autograd executes (an update: :class:`~gs_lightning.scaling.update.UpdateRun`) or to replay the last
update's plan (:class:`~gs_lightning.scaling.plan.ScalePlan`, or the compiled modules' scale vectors).
Once the engine has run the graph, the deferred weight gradients are unscaled in one fused multiply per
scale, device and dtype, and the step's read is queued.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node

from gs_lightning.scaling.attached import AttachedModels
from gs_lightning.scaling.backoff import SkipBackoff, log2_floor
from gs_lightning.scaling.bounds import Settings
from gs_lightning.scaling.checkpointing import intercept_recomputation
from gs_lightning.scaling.compiled import CompiledModules, CompiledReplay
from gs_lightning.scaling.drift import GradientDrift, unscale_and_measure
from gs_lightning.scaling.formats import FloatFormat
from gs_lightning.scaling.graph import AutogradGraph, GraphAnalysis, analyze, walk
from gs_lightning.scaling.graph_scales import GraphRegistry, GraphScales, Path
from gs_lightning.scaling.plan import Exponent, LeafTargets, ScalePlan, times_pow2
from gs_lightning.scaling.profiled import profiled
from gs_lightning.scaling.recipe import ScalingRecipe
from gs_lightning.scaling.schedule import UpdateReason, UpdateRecord
from gs_lightning.scaling.step_read import StepRead
from gs_lightning.scaling.update import UpdateRun
from gs_lightning.scaling.walks import format_bounded_leaves, leaf_variables, summed_leaves
from gs_lightning.scaling.weak import weakly


class PreparedBackward:
    """The hooks registered on one graph, until its backward ends.

    The loss's graph, or (``parent`` set) the inner graph of a reentrant checkpoint, prepared
    while the outer backward runs.
    """

    def __init__(
        self,
        graph: AutogradGraph,
        analysis: GraphAnalysis,
        leaves: LeafTargets,
        run: UpdateRun | None,
        path: Path,
        parent: PreparedBackward | None,
        scales: GraphScales,
        reasons: frozenset[UpdateReason] = frozenset(),
    ) -> None:
        self.graph = graph
        self.scales = scales  # the state of the loss graph's structure, which inner graphs share
        self.analysis = analysis
        self.leaves = leaves
        self.run = run
        self.path = path
        self.parent = parent
        self.reasons = reasons  # why the loss's graph updates (empty for a replay and for inner graphs)
        self.handles: list = []
        self.inner: list[PreparedBackward] = []
        self.compiled: CompiledReplay | None = (
            None  # a replay through compiled regions (graph indices differ from the plan's)
        )

    @property
    def alpha_out(self) -> dict[int, int]:
        """The accumulated log2 scale each node's output gradient carries: the update's, or the replayed plan's."""
        return self.run.alpha_out if self.run is not None else self.scales.plans[self.path].alpha_out

    def leaf_ids(self) -> set[int]:
        """Ids of this graph's leaf variables and those of every graph it is nested in."""
        own = {id(self.graph.nodes[j].variable) for j in self.analysis.leaves}
        return own | (self.parent.leaf_ids() if self.parent is not None else set())

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class ScaledBackwards:
    """Prepares and finishes every scaled backward of one :class:`~gs_lightning.scaling.GradientScaler`.

    Keeps, per graph structure, the plans and schedules (:attr:`graphs`); per iteration, the structures
    that ran, the leaves their backwards reached, whose ``.grad`` the step reads, and the updates that ran
    (:attr:`updates`).

    Args:
        recipe: The scaling recipe.
        fmt: The low-precision format whose range the scales protect.
        attached: The attached models (layer names, parameter checks).
        read: The step's read, which each finished backward queues its structure on.
        backoff: The caps skipped steps left.
        warn_once: Warns with a message once per key.
        enabled: Whether the scaler is on now.
    """

    def __init__(
        self,
        recipe: ScalingRecipe,
        fmt: FloatFormat,
        attached: AttachedModels,
        read: StepRead,
        backoff: SkipBackoff,
        warn_once: Callable[[str, str], None],
        enabled: Callable[[], bool],
    ) -> None:
        self.recipe, self.format = recipe, fmt
        self.attached, self.read, self.backoff, self.warn_once = attached, read, backoff, warn_once
        self.graphs = GraphRegistry()  # plans, schedule, drift and back-off of each graph structure run
        self.compiled = CompiledModules(enabled, weakly(self.updates_next), warn_once)
        self.iteration = 0  # backwards finished
        self.update_iterations = 0
        self.updates: list[UpdateRecord] = []  # this iteration's (the last one's until a backward starts another)
        self._iteration_ended = False
        self.ran: list[GraphScales] = []  # the structures whose backward ran since the last step
        self._caps_before_retry: list[tuple[GraphScales, dict[int, tuple[int, int]]]] = []
        self.retries_offered = False  # whether the last iteration's step could have run it again (prepare_retry)
        self.written: dict[int, torch.Tensor] = {}  # the leaves those backwards reached
        self._prepared: PreparedBackward | None = None
        self._opaque_warned: set[str] = set()

    @property
    def lambda_min(self) -> float:
        """λmin of the underflow model."""
        return self.format.lambda_min(self.recipe.lambda_min)

    @property
    def lambda_lost(self) -> float:
        """Below this a gradient's value is lost: the smallest subnormal, raised by the drift tolerated between
        updates."""
        return self.format.subnormal_min * 2.0 ** (self.recipe.drift_tolerance_log2 or 0.0)

    def new_drift(self) -> GradientDrift:
        """The drift monitor of a new graph structure."""
        recipe = self.recipe
        return GradientDrift(
            recipe.update_interval,
            self.format.max,
            recipe.drift_tolerance_log2,
            recipe.level_steps,
            recipe.update_after_zero_gradient,
        )

    def updates_next(self) -> bool:
        """Whether the next backward is an update iteration (compiled modules then run their forward eagerly)."""
        current = self.graphs.current
        return current is None or bool(current.update_reasons(self.recipe.update_interval))

    def attach(self, model: nn.Module) -> None:
        """Name layers after ``model``'s modules (decided with each analysis) and take over its compiled modules."""
        self.graphs.clear_analyses()
        self.compiled.add(model)

    def prepare(self, root: Node) -> None:
        """Hook the loss's graph below ``root`` (a scale() whose backward never ran is dropped first)."""
        self.abandon()
        if self._iteration_ended:  # the first backward of a new iteration: the last one's updates go
            self.updates, self._iteration_ended = [], False
        with profiled("GradientScaler.prepare"):
            self._prepared = self._prepare(root, ())

    def end_iteration(self) -> None:
        """The step is done: the next backwards start a new iteration."""
        self.read.discard()
        self._iteration_ended = True
        self.ran = []
        self.written.clear()

    def _ran(self) -> list[GraphScales]:
        """The structures whose backwards ran this iteration (the current one where none is recorded)."""
        current = self.graphs.current
        return self.ran or ([current] if current is not None else [])

    def overflow_named(self) -> bool:
        """Whether the step's read named the layers whose gradients overflowed in a structure that ran this iteration
        (some measured gradients non-finite, not all: not a non-finite loss, which no scale can prevent)."""
        return any(scales.drift.last.some_overflowed for scales in self._ran())

    def retry(self) -> None:
        """The iteration runs again after an overflow: its retry decides the scales under the caps a skipped step
        would set, on the same batch; the step's read of the overflowed gradients is not kept (the retry's is)."""
        ran = self._ran()
        self._caps_before_retry = [(scales, dict(scales.layer_backoff.caps)) for scales in ran]
        self.skipped(retried=True)
        for scales in ran:
            scales.drift.forget_step()

    @property
    def retrying(self) -> bool:
        """Whether the backward now running is a retry's (:meth:`retry` ran, and the retried step is not yet taken or
        skipped)."""
        return bool(self._caps_before_retry)

    def retried(self) -> None:
        """The retried step was taken: the caps its overflow set go (the retry's read holds the values that
        overflowed, which the next updates expect)."""
        for scales, caps in self._caps_before_retry:
            scales.layer_backoff.caps = caps
        self._caps_before_retry = []

    def skipped(self, retried: bool = False) -> Callable[[], str | None]:
        """The iteration's first skipped step (or its ``retried`` one): cap the scales that overflowed in the structures
        whose gradients it would have used and restore the attached models' buffers. Returns what finds the first
        non-finite layer among them."""
        ran = self._ran()
        if not retried:  # a skipped retry keeps its caps
            self._caps_before_retry = []
        self.backoff.skipped(ran, retried)
        non_finite = self.attached.restore_buffers()
        if non_finite:
            self.warn_once(
                "buffers",
                f"GradientScaler: a skipped step's forward had left {non_finite} non-finite buffer(s) (e.g. BatchNorm "
                "running statistics); all buffers were restored to their values before that iteration.",
            )
        return lambda: next((scales.first_non_finite for scales in ran if scales.first_non_finite), None)

    def abandon(self) -> None:
        """Drop a prepared backward that did not finish: its hooks, and any still-scaled gradient."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            self.read.recompute.clear()
        pending = [prepared] if prepared is not None else []
        while pending:
            prepared = pending.pop()
            pending += prepared.inner
            prepared.remove_hooks()
            # they had no .grad before; a partial, scaled one must not stay
            for j in prepared.leaves.deferred | prepared.leaves.shared_leaves:
                prepared.graph.nodes[j].variable.grad = None

    # --- before the backward -----------------------------------------------------------------

    def _prepare(
        self,
        root: Node,
        path: Path,
        parent: PreparedBackward | None = None,
        root_alpha: int = 0,
        exits: frozenset[int] = frozenset(),
    ) -> PreparedBackward:
        """Register the hooks of an update run, or of the plan's replay, on the graph below ``root``.

        The loss's graph (``path`` ``()``) finds the state of its structure, whose schedule says whether this
        backward updates; a reentrant checkpoint's inner graph shares its parent's.
        """
        graph = walk(root)
        if parent is None:
            if self.compiled and not self.updates_next():
                prepared = self._prepare_compiled_replay(root, graph)
                if prepared is not None:
                    return prepared
            # compiled modules replay one plan
            scales = self.graphs.of(graph, self.new_drift(), self.recipe.max_graphs, keep_others=not self.compiled)
            reasons = scales.update_reasons(self.recipe.update_interval)
            update = bool(reasons)
        else:
            scales, update, reasons = parent.scales, parent.run is not None, frozenset()
        plan, analysis = scales.plans.get(path), scales.analyses.get(path)
        known = plan is not None and plan.matches(graph)
        exit_leaves = frozenset(j for j, variable in leaf_variables(graph) if id(variable) in exits)
        if analysis is None or not known:
            analysis = scales.analyses[path] = analyze(graph, self.attached.module_names, exit_leaves)
            self.attached.check_parameters(graph, exit_leaves)
            self._warn_unhandled(graph, analysis)
        excluded = parent.leaf_ids() if parent is not None else set()
        deferrable = self._deferrable_leaves(graph, analysis, exit_leaves, excluded)
        deferred = _fed_once(deferrable, analysis)
        replay = not (update or not known)
        # A replay knows every scale before the backward: leaves fed by several edges can wait too, summed at one
        # scale, for fp32 (or wider) master weights; a weight kept in 16 bits is still unscaled edge by edge.
        several = (
            frozenset(j for j in deferrable - deferred if torch.finfo(graph.nodes[j].variable.dtype).bits >= 32)
            if replay and not path
            else ()
        )
        shared = plan.shared_leaf_scales(graph, several) if several else ()
        leaves = LeafTargets(deferred, exit_leaves, root_alpha, shared)
        run = (
            None
            if replay
            else UpdateRun(
                graph, analysis, self._settings(graph, analysis, path, scales), leaves, self.warn_once, root_alpha
            )
        )
        prepared = PreparedBackward(graph, analysis, leaves, run, path, parent, scales, reasons)
        # Registered first, so it runs first: the engine calls _finish once this graph's backward is done.
        prepared.handles.append(root.register_prehook(partial(self._queue_finish, prepared)))
        if run is None and not path:  # before the plan's hooks: what each GEMM sent, at the scale it carries
            prepared.handles += scales.sent_maxima.register(graph, plan)
        prepared.handles += run.register() if run is not None else plan.replay(graph, leaves)
        if not path:  # after the replay's own hooks: what is kept is what the nodes use
            self.read.recompute.clear()
            self.read.recompute_graph = scales
            if run is None and plan.recomputable:
                prepared.handles += self.read.recompute.register(graph, analysis, plan, leaves.deferred)
            if run is None:  # after the keepers, which read the saved weights as they were
                plan.shift_sent_operands(graph)
        for c in sorted(analysis.reentrant):  # after the run's own pre-hook, which merges c's incoming scales
            prepared.handles.append(graph.nodes[c].register_prehook(partial(self._enter_checkpoint, prepared, c)))
        return prepared

    def _prepare_compiled_replay(self, root: Node, graph: AutogradGraph) -> PreparedBackward | None:
        """The replay of a backward through compiled modules that carry the last update's scales in their graphs;
        ``None`` where none ran with them."""
        if not self.compiled.ran_compiled():
            return None
        if self.compiled.stale():
            if self.graphs.current is not None:
                self.graphs.current.schedule.ask(UpdateReason.COMPILED_WITHOUT_SCALES)
            return None
        analysis, replay = self.compiled.replay(
            graph,
            self.attached.module_names,
            lambda analysis: _fed_once(self._deferrable_leaves(graph, analysis, frozenset(), set()), analysis),
        )
        leaves = LeafTargets(frozenset(j for j, _, _ in replay.deferred))
        prepared = PreparedBackward(graph, analysis, leaves, None, (), None, self.graphs.current)
        prepared.compiled = replay
        prepared.handles.append(root.register_prehook(partial(self._queue_finish, prepared)))  # first, as in _prepare
        prepared.handles += replay.register()
        return prepared

    def _deferrable_leaves(
        self, graph: AutogradGraph, analysis: GraphAnalysis, exits: frozenset[int], excluded: set[int]
    ) -> frozenset[int]:
        """Leaves whose gradient can wait for the fused unscale after the backward.

        Nobody may see ``.grad`` before then: no DDP (it all-reduces during the backward), no
        hooks on the parameter, no existing ``.grad`` to accumulate into, and no inner backward (a
        reentrant checkpoint's) that could add to it, in either direction. Those fed by one edge
        are deferred on every backward; those fed by several on replays (:attr:`LeafTargets.shared`).
        """
        if analysis.reentrant or (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return frozenset()
        deferred = []
        for j in analysis.leaves - exits:
            variable = graph.nodes[j].variable
            if (
                variable.grad is None
                and id(variable) not in excluded
                and not variable._backward_hooks
                and not getattr(variable, "_post_accumulate_grad_hooks", None)
            ):
                deferred.append(j)
        return frozenset(deferred)

    def _settings(self, graph: AutogradGraph, analysis: GraphAnalysis, path: Path, scales: GraphScales) -> Settings:
        # Not where a compiled module replays the scales (its graph keeps nothing to recompute from),
        # nor in a format that saturates instead of overflowing.
        recipe = self.recipe
        recompute = recipe.recompute_weight_gradients and not (self.format.saturates or path or self.compiled)
        retry = self.retries_offered and recipe.retry_overflowed_steps and not (self.format.saturates or path)
        # Expected maxima keep the batches to come from skipping; a saturating format clips a rare spike
        # instead. Keyed by the loss graph's leaves: not for a reentrant checkpoint's inner graph (path).
        expected, levels = (
            ({}, {})
            if self.format.saturates or path or recipe.expected_maxima_margin_log2 is None
            else scales.drift.expect(
                analysis.derive("format-bounded leaves", lambda: format_bounded_leaves(graph, analysis))
            )
        )
        # a saved-tensor hook per shifted GEMM: not where a compiled module replays the scales in its graph
        own_input_scale = recipe.own_input_gradient_scale and not (path or self.compiled)
        if recipe.keep_scale_on_zero_gradient and not path:  # a bias all zeros between updates: it received zeros
            scales.drift.summed = analysis.derive("summed leaves", lambda: summed_leaves(graph, analysis))
        return Settings(
            underflow_rate=recipe.underflow_rate,
            lambda_min=self.lambda_min,
            lambda_lost=self.lambda_lost,
            lambda_max=self.format.max,
            relu_factor=recipe.relu_factor,
            layer_cap=log2_floor(recipe.max_layer_scale),
            total_cap=self.backoff.total_cap(),
            node_caps=scales.layer_backoff.node_caps() if not path else {},
            expected_maxima=expected,
            recompute=recompute,
            retry=retry,
            level_maxima=levels if recompute or retry else {},
            previous_totals=_gemm_totals(scales.plans.get(path), analysis)
            if recipe.keep_scale_on_zero_gradient
            else {},
            measured_weight_nodes=scales.measured_weights.get(path),
            retrying=self.retrying,
            own_input_scale=own_input_scale,
            sent_maxima=scales.sent_maxima.expected() if own_input_scale else {},
            recipe=recipe,
        )

    def _warn_unhandled(self, graph: AutogradGraph, analysis: GraphAnalysis) -> None:
        opaque = sorted({graph.names[i] for i in analysis.opaque} - self._opaque_warned)
        if opaque:
            self._opaque_warned.update(opaque)
            self.warn_once(
                "opaque:" + ",".join(opaque),
                f"GradientScaler: the backward graph contains {', '.join(opaque)} (custom autograd Functions or "
                "compiled regions); scaling cannot see inside, so each is scaled as one unit, as a dynamic loss scale "
                "would scale it: one binade below the overflow of the gradients entering and leaving it (kind 'opaque' "
                "in layers()).",
            )
        if not analysis.gemms and not analysis.casts:
            self.warn_once("no-gemm", "GradientScaler: no GEMM or cast found in the backward graph; nothing is scaled.")

    # --- as the backward runs ----------------------------------------------------------------

    def _enter_checkpoint(self, prepared: PreparedBackward, c: int, grad_outputs: tuple) -> None:
        """Pre-hook of a reentrant checkpoint node: scale its block's inner backward too."""
        alpha = prepared.alpha_out.get(c, 0)

        def prepare_inner(root: Node, inputs: tuple[Any, ...]) -> None:
            exits = frozenset(id(t) for t in inputs if isinstance(t, torch.Tensor))
            prepared.inner.append(self._prepare(root, (*prepared.path, c), prepared, alpha, exits))

        intercept_recomputation(prepared.graph.nodes[c], prepare_inner)

    def _queue_finish(self, prepared: PreparedBackward, grad_outputs: tuple) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(partial(self._finish, prepared))
        prepared.handles += _unscale_captured(prepared)

    def _finish(self, prepared: PreparedBackward) -> None:
        """Run by the autograd engine once a prepared graph's backward is done."""
        prepared.remove_hooks()
        graph, analysis, run, scales = prepared.graph, prepared.analysis, prepared.run, prepared.scales
        if run is not None:
            run.complete()
        already: list[tuple[int, torch.Tensor, int]] = []  # unscaled as they accumulated: measured, not unscaled again
        if prepared.compiled is not None:  # leaf indices and scales of the eager update, which the drift compares with
            unscaled = [(e, graph.nodes[j].variable, alpha) for j, e, alpha in prepared.compiled.deferred]
        else:
            alpha_out, deferred = prepared.alpha_out, prepared.leaves.deferred
            unscaled = [(j, graph.nodes[j].variable, alpha_out.get(analysis.leaf_sources[j], 0)) for j in deferred]
            handled = deferred | prepared.leaves.exits  # unscaled below; an inner graph's exits hand theirs on
            already = [
                (j, graph.nodes[j].variable, alpha_out.get(source, 0))
                for j, source in analysis.leaf_sources.items()
                if j not in handled
            ]
        with profiled("GradientScaler.unscale"):
            unscale_and_measure(
                unscaled,
                scales.drift if not prepared.path and self.recipe.measures_drift else None,
                run is not None,
                already,
            )
            # not in the drift statistic, as when unscaled per edge
            unscale_and_measure(
                [(j, graph.nodes[j].variable, alpha) for j, alpha in prepared.leaves.shared], None, False
            )
        for j in analysis.leaves - prepared.leaves.exits:  # an inner graph's exits hand their gradient on
            variable = graph.nodes[j].variable
            self.written[id(variable)] = variable
        if prepared.parent is not None:  # an inner graph: its outer backward goes on
            if run is not None:
                plan = scales.plans[prepared.path] = run.plan()
                scales.keep_scales(run, plan, prepared.path)
                if prepared.parent.run is not None:
                    prepared.parent.run.absorb(run)
            return
        self._prepared = None
        self.read.queue(scales)
        if scales not in self.ran:
            self.ran.append(scales)
        if run is not None:
            self._finish_update(run, scales, prepared.reasons)
        if (run is not None or self.compiled.ran_eagerly()) and self.compiled:  # a replay too: after load_state_dict
            if not self.compiled.locate(graph, scales.plans[()], scales.analyses[()], self.iteration):
                scales.schedule.ask(UpdateReason.COMPILED_WITHOUT_SCALES)
        self.compiled.end_iteration()
        self.iteration += 1
        scales.schedule.backwards += 1

    def _finish_update(self, run: UpdateRun, scales: GraphScales, reasons: frozenset[UpdateReason]) -> None:
        """The update ``reasons`` asked for is done: its plan kept, its scales read with the step's, recorded."""
        self.update_iterations += 1
        plan = scales.plans[()] = run.plan()
        # compiled modules replay the scales located at the update; inner graphs' plans are not shifted
        scales.follower.forget()
        scales.follower.eligible = not self.compiled and set(scales.plans) == {()}
        # once its scales are read
        scales.keep_update(run, plan, partial(self.backoff.updated, run, scales, scales.schedule.backwards))
        self.updates.append(scales.schedule.updated(self.iteration, reasons))


def _fed_once(leaves: frozenset[int], analysis: GraphAnalysis) -> frozenset[int]:
    """Those of ``leaves`` fed by one edge: deferred on every backward, updates included."""
    return frozenset(leaves & analysis.leaf_sources.keys())


def _unscale_captured(prepared: PreparedBackward) -> list:
    """Hooks that make what ``torch.autograd.grad`` returns true gradients; run as the backward starts.

    ``autograd.grad`` (and ``backward(inputs=...)``) captures the gradient arriving at a node
    instead of running it, so a deferred leaf's gradient, which would have been unscaled after
    the backward, and a non-leaf input's, which carries its scale, would come back scaled. The
    engine can tell which nodes it will run: where a node's gradient is captured, the edges
    into it are divided by the scale they carry.
    """
    graph, analysis = prepared.graph, prepared.analysis
    runs = {j: _will_execute(graph.nodes[j]) for j in analysis.leaves}
    if all(r is True for r in runs.values()):  # a plain backward: nothing is captured but leaves that run
        return []
    if prepared.compiled is not None:
        raise RuntimeError(
            "GradientScaler: torch.autograd.grad (or backward(inputs=...)) through a torch.compile'd module is "
            "supported on update iterations only, whose forward runs eagerly; use backward() with a compiled model."
        )
    # before the hooks below, which read it
    handles = prepared.run.track_every_node() if prepared.run is not None else []
    targets = {j for j in prepared.leaves.deferred | prepared.leaves.shared_leaves if runs[j] is None}
    for i in range(len(graph.nodes)):  # a non-leaf node that runs although nothing below it does is captured
        if i in analysis.leaves or not _will_execute(graph.nodes[i]):
            continue
        below = [e[0] for e in graph.edges[i] if e is not None]
        if below and not any(_will_execute(graph.nodes[j]) is not False for j in below):
            targets.add(i)
    source = prepared.run if prepared.run is not None else prepared.scales.plans[prepared.path]
    for i, edges in enumerate(graph.edges):
        for k, edge in enumerate(edges):
            if edge is not None and edge[0] in targets:
                handles.append(
                    graph.nodes[i].register_hook(partial(_divide_edge, graph, source, prepared.leaves, i, k))
                )
    return handles


def _will_execute(node: Node) -> bool | None:
    """Whether the running backward will run ``node``; ``None`` for a leaf whose gradient ``autograd.grad`` captures.

    torch refuses to answer for such a leaf, and its refusal is the answer.
    """
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return None


def _divide_edge(
    graph: AutogradGraph,
    source: UpdateRun | ScalePlan,
    leaves: LeafTargets,
    i: int,
    k: int,
    grad_inputs: tuple,
    grad_outputs: tuple,
) -> tuple:
    """Post-hook of node ``i``: its gradient on edge ``k``, whose target ``autograd.grad`` captures, unscaled."""
    grad = grad_inputs[k]
    if grad is None:  # a branch contribution the update run keeps aside: the last one carries the sum
        return grad_inputs
    edge = graph.edges[i][k]
    shared = leaves.shared_scale(edge[0]) if leaves.shared else None
    if shared is not None:  # the replay's hook brought it to its leaf's shared scale
        carried = shared
    else:
        carried = source.slot_alpha[edge] if graph.in_counts[edge] > 1 else source.alpha_out.get(i, 0)
    return (*grad_inputs[:k], times_pow2(grad, -carried), *grad_inputs[k + 1 :])


def _gemm_totals(plan: ScalePlan | None, analysis: GraphAnalysis) -> dict[int, Exponent]:
    """GEMM node -> its accumulated scale in ``plan`` (none without one: a structure's first update), unread where
    the update that decided it is (a backward before the step's read: gradient accumulation)."""
    if plan is None:
        return {}
    totals = plan.decided_alpha_out
    return {i: totals[i] for i in analysis.gemms if i in totals}
