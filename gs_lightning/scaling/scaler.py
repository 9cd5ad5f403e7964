"""GradientScaler: per-gradient power-of-two scales on PyTorch's autograd graph (paper Algorithm 1).

How it runs, in brief:

* Every backward walks the new autograd graph (a few hundred nodes: well under a millisecond).
* Each graph structure keeps its own plan and schedule (:mod:`~gs_lightning.scaling.graph_scales`):
  graphs that alternate (two losses with their own optimizers, a gradient penalty) replay their own.
* On an **update** iteration (a structure's first, after a skipped step, when the gradients drifted a binade below the last update's or a weight gradient rose
  above what the last update expected of it by more than its layer's margin, and at the latest every
  ``update_interval``-th) hooks decide every scale as autograd executes
  (:mod:`~gs_lightning.scaling.update`); each decision reads a few statistics of the gradient
  at hand: that is the only host-device synchronisation.
* On the iterations in between, the decisions are replayed as constant power-of-two factors
  (:mod:`~gs_lightning.scaling.plan`): no hook at all where the factor is 1, and no
  synchronisation of their own; the weight gradients are unscaled in one fused multiply per scale,
  device and dtype after the backward.
* ``step()`` reads every ``.grad`` its optimizer will use, whoever wrote it and however (``.data``,
  numpy, a kernel: writes that no version counter sees): one pass that takes each one's largest
  magnitude (non-finite exactly where the gradient is), the weight gradients the drift statistic
  wants among them, and one synchronisation.
* A weight gradient that overflows between updates, computed from a finite incoming gradient, is
  recomputed in fp32 from operands the replay kept, and the step goes on
  (:mod:`~gs_lightning.scaling.recompute`); any other non-finite gradient skips the step.
* Gradients reaching a parameter are divided by the scale they carry in the parameter's own
  precision (fp32 master weights): after the backward, in one fused kernel per device and dtype,
  where nothing can observe ``.grad`` in between; otherwise (DDP, accumulation into an existing
  ``.grad``, hooks on the parameter, a parameter fed by several edges) before autograd
  accumulates them. Either way ``.grad``, DDP's all-reduce and the optimizer only see true
  gradients.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node

from gs_lightning.scaling.attached import AttachedModels
from gs_lightning.scaling.checkpointing import intercept_recomputation
from gs_lightning.scaling.compiled import CompiledModule, CompiledReplay, EagerPlan, compiled_modules, replay_hooks
from gs_lightning.scaling.drift import (
    DriftReading,
    GradientDrift,
    overflow_caps,
    overflow_leaves,
    unscale_and_measure,
)
from gs_lightning.scaling.formats import float_format
from gs_lightning.scaling.graph import LEAF, AutogradGraph, GraphAnalysis, analyze, walk
from gs_lightning.scaling.graph_scales import GraphRegistry, GraphScales, Path
from gs_lightning.scaling.join import join_outputs
from gs_lightning.scaling.plan import LeafTargets, ScalePlan, times_pow2
from gs_lightning.scaling.recipe import ScalingRecipe, resolve_recipe
from gs_lightning.scaling.recompute import WeightGradRecompute
from gs_lightning.scaling.step_read import StepRead
from gs_lightning.scaling.update import MAX_LOG2_TOTAL, LayerScale, Settings, UpdateRun



Outputs = Any  # a tensor, or lists and tuples of them, nested as GradScaler.scale takes them


class _PreparedBackward:
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
        parent: _PreparedBackward | None,
        scales: GraphScales,
    ) -> None:
        self.graph = graph
        self.scales = scales  # the state of the loss graph's structure, which inner graphs share
        self.analysis = analysis
        self.leaves = leaves
        self.run = run
        self.path = path
        self.parent = parent
        self.handles: list = []
        self.inner: list[_PreparedBackward] = []
        self.compiled: CompiledReplay | None = None  # a replay through compiled regions (graph indices differ from the plan's)

    def leaf_ids(self) -> set[int]:
        """Ids of this graph's leaf variables and those of every graph it is nested in."""
        own = {id(self.graph.nodes[j].variable) for j in self.analysis.leaves}
        return own | (self.parent.leaf_ids() if self.parent is not None else set())

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class GradientScaler:
    """Per-layer gradient scaling for mixed precision training (Zhao et al., IJCAI 2020).

    Gives every backpropagated gradient its own power-of-two scale, chosen on the fly from a
    statistical model of underflow, on any model and with no change to the model::

        scaler = GradientScaler(model)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = criterion(model(x), y)
        scaler.backward(loss)     # afterwards every .grad is the true gradient
        scaler.step(optimizer)    # skipped if a gradient was non-finite

    It is also a drop-in for ``torch.amp.GradScaler`` in an existing AMP loop
    (``scaler.scale(loss).backward()``, ``unscale_``, ``step``, ``update``).

    Args:
        model: Optional; names layers after their modules (``"layer1.0.conv1"``) and lets a
            skipped step restore the model's buffers (BatchNorm running statistics), which the
            skipped iteration's forward already changed.
        recipe: The scaling recipe (:class:`~gs_lightning.scaling.recipe.ScalingRecipe`): γ', the
            update interval, λmin, caps, and every rule beyond the paper, validated once. A preset by
            name: ``"default"`` or ``"paper"`` (Algorithm 1 as published). ``None``: the default.
        dtype: The low-precision format whose range the scales protect.
        max_consecutive_skips: ``step`` raises once more than this many steps in a row were
            skipped for non-finite gradients (a diverged run); ``None`` never raises.
        enabled: If false, ``backward`` is plain ``loss.backward()`` and ``step`` always steps.
        **recipe_fields: Fields of the recipe to change, as keywords
            (``GradientScaler(model, update_interval=50)``, ``GradientScaler(model, "paper",
            underflow_rate=1e-4)``); an unknown one is an error naming the nearest field.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        recipe: ScalingRecipe | str | None = None,
        *,
        dtype: torch.dtype = torch.float16,
        max_consecutive_skips: int | None = 100,
        enabled: bool = True,
        **recipe_fields: Any,
    ) -> None:
        if max_consecutive_skips is not None and (not isinstance(max_consecutive_skips, int) or max_consecutive_skips < 1):
            raise ValueError(f"GradientScaler: max_consecutive_skips must be None or a positive integer, got {max_consecutive_skips!r}")
        self.recipe = resolve_recipe(recipe, **recipe_fields)
        self.format = float_format(dtype)
        self.max_consecutive_skips = max_consecutive_skips
        self.enabled = enabled
        self._attached = AttachedModels()

        self._iteration = 0
        self._skipped_steps = 0
        self._consecutive_skips = 0
        self._graphs = GraphRegistry()  # plans, schedule, drift and back-off of each graph structure run
        self._ran: list[GraphScales] = []  # the structures whose backward ran since the last update()
        self._backoff: int | None = None
        self._read = self._new_read()
        self._update_iterations = 0
        self._prepared: _PreparedBackward | None = None
        self._written: dict[int, torch.Tensor] = {}  # leaves the backwards since the last step reached
        self._optimizer_stage: dict[int, str] = {}  # GradScaler's per-optimizer "unscaled" / "stepped"
        self._optimizer_found_inf: dict[int, bool] = {}
        self._skipped_this_iteration = False
        self._warned: set[str] = set()
        self._compiled: list[CompiledModule] = []  # the attached models' torch.compile'd modules
        self._compiled_plan: EagerPlan | None = None  # the last eager update, as their compiled replays read it
        if model is not None:
            self.attach(model)

    def _new_read(self) -> StepRead:
        # Keeps what the replay needs to recompute weight gradients that overflow.
        return StepRead(WeightGradRecompute(self.format.max), self.format.max, self.recipe.expected_maxima_margin_log2)

    def _new_drift(self) -> GradientDrift:
        recipe = self.recipe
        return GradientDrift(recipe.update_interval, self.format.max, recipe.drift_tolerance_log2, recipe.level_steps)

    def _measures_drift(self) -> bool:
        """Whether a rule reads the weight gradients' largest values between updates (none in the paper's recipe)."""
        r = self.recipe
        return r.drift_tolerance_log2 is not None or r.expected_maxima_margin_log2 is not None or r.recompute_weight_gradients

    # --- public API ------------------------------------------------------------------------

    @property
    def lambda_min_value(self) -> float:
        """λmin used by the underflow model."""
        return self.format.normal_min if self.recipe.lambda_min == "normal" else self.format.subnormal_min

    @property
    def lambda_lost_value(self) -> float:
        """Below this a gradient's value is lost, not only less precise: the smallest subnormal, raised
        by the drift tolerated between updates (what spike room keeps γ' against)."""
        return self.format.subnormal_min * 2.0 ** (self.recipe.drift_tolerance_log2 or 0.0)

    @property
    def iteration(self) -> int:
        """Number of backward passes run through this scaler."""
        return self._iteration

    @property
    def skipped_steps(self) -> int:
        """Number of optimizer steps skipped because a gradient was non-finite."""
        return self._skipped_steps

    @property
    def recomputed_steps(self) -> int:
        """Steps taken although a weight gradient overflowed: it was recomputed in fp32 (:mod:`~gs_lightning.scaling.recompute`)."""
        return self._read.recomputed_steps

    @property
    def update_iterations(self) -> int:
        """Backward passes that decided scales (the first, every ``update_interval``-th, and those the drift,
        a skipped step or a new graph structure asked for); the others replayed them. What an update
        costs against a plain backward: README "Overhead on the backward pass"."""
        return self._update_iterations

    @property
    def consecutive_skips(self) -> int:
        """Optimizer steps skipped in a row up to the last one (0 once a step is taken)."""
        return self._consecutive_skips

    @property
    def first_non_finite(self) -> str | None:
        """The first layer, in backward order, whose incoming or weight gradient was non-finite on the
        last update iteration of the graph that ran last (``None`` if every one was finite)."""
        current = self._graphs.current
        return current.first_non_finite if current is not None else None

    @property
    def graphs(self) -> tuple[GraphScales, ...]:
        """What the scaler keeps per backward graph structure (plans, schedule, drift, back-off), least
        recently run first: one for a single loss; one each for graphs that alternate (two losses with their
        own optimizers, a gradient penalty, a GAN), which replay their own plans."""
        return tuple(self._graphs)

    @property
    def models(self) -> tuple[nn.Module, ...]:
        """The attached models (none after unpickling until :meth:`attach`)."""
        return tuple(self._attached.models)

    def attach(self, model: nn.Module) -> None:
        """Name layers after ``model``'s modules and restore its buffers on a skipped step.

        ``GradientScaler(model)`` attaches ``model``. Attach each further model trained with this
        scaler (a GAN's generator and discriminator), and the model again after unpickling a scaler,
        whose pickled state holds no model.
        """
        if not self._attached.attach(model):
            return
        self._graphs.clear_analyses()  # layer names are decided with the analysis
        instrumented = {id(m) for m in self._compiled}
        self._compiled += [m for m in compiled_modules(model, self) if id(m) not in instrumented]

    def is_enabled(self) -> bool:
        """Whether scaling is on (``GradScaler``'s name)."""
        return self.enabled

    def get_scale(self) -> float:
        """``GradScaler``'s loss scale: always 1, since the scales are per layer (see :meth:`scales`)."""
        return 1.0

    def scale(self, outputs: Outputs) -> Outputs:
        """Prepare the per-layer scaled backward of ``outputs``; returns what to call backward on.

        ``scaler.scale(loss).backward()`` is :meth:`backward`, as in a ``torch.amp.GradScaler``
        loop. As ``GradScaler.scale``, ``outputs`` is a tensor or nested lists/tuples of tensors
        (several losses, or outputs backpropagated with explicit gradients); the same structure
        comes back, and one backward over all of them (``torch.autograd.backward(outputs, grads)``)
        runs scaled. A single tensor comes back as it is. The gradients that backward leaves, in
        ``.grad`` or returned by ``torch.autograd.grad``, are true gradients. The hooks live on
        this graph only and go away when its backward ends.
        """
        tensors = _flatten(outputs, "GradientScaler.scale")
        self._begin_iteration()
        if not self.enabled:
            return outputs
        self._attached.refuse_fp16_communication()
        joined, root = join_outputs(tensors)
        if root is None:
            return outputs
        self._prepared = self._prepare(root, ())
        return outputs if len(tensors) == 1 else _unflatten(outputs, iter(joined))

    def backward(self, loss: torch.Tensor, retain_graph: bool | None = None) -> None:
        """Backpropagate ``loss`` with per-gradient scaling; leaves true gradients in ``.grad``."""
        try:
            self.scale(loss).backward(retain_graph=retain_graph)
        except BaseException:
            self._abandon()
            raise

    @property
    def found_inf(self) -> bool:
        """Whether a gradient that a backward since the last step reached is non-finite now.

        Reads every such ``.grad`` and synchronises once (twice after a recompute).
        """
        return self._read.non_finite([v.grad for v in self._written.values() if v.grad is not None], self._attached.sharded)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """``GradScaler.unscale_``: the gradients are already true, so this only checks them.

        Kept so that an AMP loop (unscale, clip, step, update) runs unchanged; as with
        ``GradScaler``, the check decides the next :meth:`step` of this optimizer, and a second
        call for the same optimizer before :meth:`update` is an error.
        """
        if not self.enabled:
            return
        stage = self._optimizer_stage.get(id(optimizer))
        if stage == "unscaled":
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if stage == "stepped":
            raise RuntimeError("unscale_() is being called after step().")
        self._optimizer_stage[id(optimizer)] = "unscaled"
        self._optimizer_found_inf[id(optimizer)] = self._non_finite(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> bool:
        """``optimizer.step()`` unless one of its gradients is non-finite; returns whether it stepped.

        As ``GradScaler``, each optimizer is judged by the gradients it is about to use (as they
        were at :meth:`unscale_`, if that was called): every ``.grad`` it holds is read (each one's
        largest magnitude, one fused kernel per device on a GPU), whoever wrote it and however
        (through ``.data`` or numpy too). Synchronises once, reading those with the drift statistic
        of the iteration's backwards (twice where an overflowed weight gradient was recomputed). A skipped step leaves the weights untouched, restores the attached
        models' buffers to their values before the iteration, and makes the next backward
        recompute the scales, with the accumulated scale capped below the one that overflowed.

        Raises:
            RuntimeError: after more than ``max_consecutive_skips`` skipped steps in a row, naming
                the first layer whose gradient was non-finite.
        """
        if not self.enabled:
            optimizer.step(*args, **kwargs)
            return True
        if self._optimizer_stage.get(id(optimizer)) == "stepped":
            raise RuntimeError("step() has already been called since the last update().")
        overflow = self._optimizer_found_inf.pop(id(optimizer), None)
        if overflow is None:
            overflow = self._non_finite(optimizer)
        self._optimizer_stage[id(optimizer)] = "stepped"
        if overflow:
            if not self._skipped_this_iteration:
                self._skip()
            return False
        optimizer.step(*args, **kwargs)
        if not self._skipped_this_iteration:
            self._consecutive_skips = 0
            self._attached.save_buffers()
        return True

    def _non_finite(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether one of ``optimizer``'s gradients is non-finite, every one read."""
        return self._read.non_finite([p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None], self._attached.sharded)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration (``GradScaler.update``); the next backward starts a new one.

        Optional for :meth:`backward` loops: a backward after a step starts a new iteration too.

        Raises:
            ValueError: if ``new_scale`` is given: there is no one scale to set (``GradScaler``'s
                ``update(new_scale)``); the scales are per layer and chosen by the scaler.
        """
        if new_scale is not None:
            raise ValueError(
                f"GradientScaler.update: new_scale={new_scale!r} has nothing to set; the scales are per layer and "
                "chosen on update iterations (see scales()). Use update() without an argument."
            )
        self._optimizer_stage.clear()
        self._optimizer_found_inf.clear()
        self._read.discard()
        self._ran = []
        self._written.clear()
        self._skipped_this_iteration = False

    def scales(self) -> dict[str, float]:
        """{layer name: local scale β last chosen}, for every decision point."""
        return {name: 2.0**layer.log2_scale for name, layer in self._layers().items()}

    def underflow_rates(self) -> dict[str, float]:
        """{layer name: the estimated underflow rate at the chosen scale} (NaN where no model applies)."""
        return {name: layer.underflow_rate for name, layer in self._layers().items()}

    def layers(self) -> list[LayerScale]:
        """Everything the last update chose, layer by layer, in backward order (of each graph structure,
        least recently run first, where several alternate; a layer in two keeps the later one's)."""
        return list(self._layers().values())

    def _layers(self) -> dict[str, LayerScale]:
        merged: dict[str, LayerScale] = {}
        for graph in self._graphs:
            merged.update(graph.layers)
        return merged

    @property
    def drift(self) -> DriftReading:
        """What the last step read of the gradients between updates: by how many binades a scale
        group's gradients shrank below the update that chose its scale (≥ 1 makes the next backward
        an update), by how many a weight gradient rose above what that update expected of it
        (> 0 does too), and which gradients were non-finite, for the graph that ran last. Read in the step's
        one synchronisation."""
        current = self._graphs.current
        return current.drift.last if current is not None else DriftReading()

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state: counters, back-off and, per graph structure, every scale of its last update (plain containers)."""
        return {
            "recipe": self.recipe.state_dict(),
            "iteration": self._iteration,
            "skipped_steps": self._skipped_steps,
            "recomputed_steps": self._read.recomputed_steps,
            "update_iterations": self._update_iterations,
            "consecutive_skips": self._consecutive_skips,
            "backoff": self._backoff,
            "graphs": self._graphs.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`: the next backwards reuse the saved scales."""
        missing = {"iteration", "skipped_steps", "backoff"} - state.keys()
        if missing or not {"graphs", "layers"} & state.keys():
            raise ValueError(
                f"GradientScaler.load_state_dict: not a GradientScaler state (missing {sorted(missing or {'graphs'})}; got keys "
                f"{sorted(state)}). A torch.amp.GradScaler's state has no per-layer scales to restore: start the "
                "GradientScaler fresh, it decides its scales on its first backward."
            )
        if "recipe" in state:  # this scaler's recipe applies; say where the checkpoint's differed
            changed = self.recipe.differences(ScalingRecipe.from_state_dict(state["recipe"]))
            if changed:
                warnings.warn(
                    "GradientScaler.load_state_dict: resuming with this scaler's recipe, which differs from the "
                    "checkpoint's in " + ", ".join(f"{k}={now!r} (was {was!r})" for k, (now, was) in changed.items()),
                    RuntimeWarning,
                    stacklevel=2,
                )
        self._iteration = int(state["iteration"])
        self._skipped_steps = int(state["skipped_steps"])
        self._read.recomputed_steps = int(state.get("recomputed_steps", 0))
        self._update_iterations = int(state.get("update_iterations", 0))
        self._consecutive_skips = int(state.get("consecutive_skips", 0))
        self._backoff = state["backoff"]
        self._graphs.load_state_dict(state["graphs"] if "graphs" in state else _one_graph_state(state), self._new_drift)

    # Pickling and copy.deepcopy: settings, counters and scales; no model, no state of an iteration in progress.
    _UNPICKLED = ("_attached", "_prepared", "_ran", "_read", "_written", "_optimizer_stage", "_optimizer_found_inf", "_compiled", "_compiled_plan")

    def __getstate__(self) -> dict[str, Any]:
        """What a copy keeps. Without the models it names no layers and restores no buffers until :meth:`attach`."""
        return {**{k: v for k, v in self.__dict__.items() if k not in self._UNPICKLED}, "_recomputed_steps": self._read.recomputed_steps}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._attached = AttachedModels()
        self._prepared, self._ran = None, []
        self._written = {}
        self._optimizer_stage, self._optimizer_found_inf = {}, {}
        self._compiled, self._compiled_plan = [], None
        self._read = self._new_read()
        self._read.recomputed_steps = state["_recomputed_steps"]

    # --- one backward ------------------------------------------------------------------------

    def _begin_iteration(self) -> None:
        self._abandon()  # a scale() whose backward never ran, or failed
        if self._optimizer_stage and "stepped" in self._optimizer_stage.values():
            self.update()

    def _abandon(self) -> None:
        """Drop a prepared backward that did not finish: its hooks, and any still-scaled gradient."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            self._read.recompute.clear()
        pending = [prepared] if prepared is not None else []
        while pending:
            prepared = pending.pop()
            pending += prepared.inner
            prepared.remove_hooks()
            for j in prepared.leaves.deferred:  # they had no .grad before; a partial, scaled one must not stay
                prepared.graph.nodes[j].variable.grad = None

    def _updates_next(self) -> bool:
        """Whether the next backward is an update iteration (compiled modules then run their forward eagerly)."""
        current = self._graphs.current
        return current is None or current.updates_next(self.recipe.update_interval)

    def _prepare_compiled_replay(self, root: Node, graph: AutogradGraph) -> _PreparedBackward | None:
        """The replay of a backward through compiled modules that carry the last update's scales in their graphs.

        ``None`` where no compiled module ran with them (their graphs then hold scale 1, as plain
        compiled regions: the backward is scaled as any graph with opaque nodes, and the next one updates).
        """
        ran = [m for m in self._compiled if m.compiled_inputs is not None]
        eager = self._compiled_plan
        if not ran:
            return None
        if eager is None or any(m.unmatched for m in ran):
            for module in ran:
                if module.unmatched:
                    module.run_eagerly("its compiled graph does not have the structure of its eager forward")
            if self._graphs.current is not None:
                self._graphs.current.force_update = True
            return None
        analysis = eager.analysis_of(graph, self._attached.module_names)
        replay = replay_hooks(graph, analysis, eager, ran, self._deferred_leaves(graph, analysis, frozenset(), set()))
        if replay is None:  # the region carried this plan's scales: a plain backward would leave scaled gradients
            raise RuntimeError(
                "GradientScaler: the backward graph around a torch.compile'd module changed since the last update "
                "(other eager operators or another wiring), so the scales its compiled graph applied cannot be "
                "matched; compile the whole model, or keep the eager code around the compiled module the same "
                "from one iteration to the next."
            )
        leaves = LeafTargets(frozenset(j for j, _, _ in replay.deferred))
        prepared = _PreparedBackward(graph, analysis, leaves, None, (), None, self._graphs.current)
        prepared.compiled = replay
        prepared.handles.append(root.register_prehook(partial(self._queue_finish, prepared)))  # first, as in _prepare
        prepared.handles += replay.register()
        return prepared

    def _locate_compiled(self, graph: AutogradGraph, scales: GraphScales) -> None:
        """After an update: locate each compiled module's eager forward in ``graph``, for the compiled replays."""
        if not self._compiled:
            return
        if any(m.compiled_inputs is not None for m in self._compiled):  # a region ran compiled, without this plan
            self._compiled_plan = None
            scales.force_update = True
            return
        for module in self._compiled:
            module.locate(graph)
        self._compiled_plan = EagerPlan(self._iteration, scales.plans[()], scales.analyses[()], graph)

    def _prepare(
        self, root: Node, path: Path, parent: _PreparedBackward | None = None, root_alpha: int = 0, exits: frozenset[int] = frozenset()
    ) -> _PreparedBackward:
        """Register the hooks of an update run, or of the plan's replay, on the graph below ``root``.

        The loss's graph (``path`` ``()``) finds the state of its structure (:class:`GraphScales`), whose
        schedule says whether this backward updates; a reentrant checkpoint's inner graph shares its parent's.
        """
        graph = walk(root)
        if parent is None:
            if self._compiled and not self._updates_next():
                prepared = self._prepare_compiled_replay(root, graph)
                if prepared is not None:
                    return prepared
            scales = self._graphs.of(graph, self._new_drift(), keep_others=not self._compiled)  # compiled modules replay one plan
            update = scales.updates_next(self.recipe.update_interval)
        else:
            scales, update = parent.scales, parent.run is not None
        plan, analysis = scales.plans.get(path), scales.analyses.get(path)
        known = plan is not None and plan.matches(graph)
        exit_leaves = frozenset(j for j, name in enumerate(graph.names) if name == LEAF and id(graph.nodes[j].variable) in exits)
        if analysis is None or not known:
            analysis = scales.analyses[path] = analyze(graph, self._attached.module_names, exit_leaves)
            self._attached.check_parameters(graph, exit_leaves)
            self._warn_unhandled(graph, analysis)
        excluded = parent.leaf_ids() if parent is not None else set()
        leaves = LeafTargets(self._deferred_leaves(graph, analysis, exit_leaves, excluded), exit_leaves, root_alpha)
        run = UpdateRun(graph, analysis, self._settings(path, scales), leaves, self._warn_once, root_alpha) if update or not known else None
        prepared = _PreparedBackward(graph, analysis, leaves, run, path, parent, scales)
        # Registered first, so it runs first: the engine calls _finish once this graph's backward is done.
        prepared.handles.append(root.register_prehook(partial(self._queue_finish, prepared)))
        prepared.handles += run.register() if run is not None else plan.replay(graph, leaves)
        if not path:  # after the replay's own hooks: what is kept is what the nodes use
            self._read.recompute.clear()
            self._read.recompute_graph = scales
            if run is None and plan.recomputable:
                prepared.handles += self._read.recompute.register(graph, analysis, plan, leaves.deferred)
        for c in sorted(analysis.reentrant):  # after the run's own pre-hook, which merges c's incoming scales
            prepared.handles.append(graph.nodes[c].register_prehook(partial(self._enter_checkpoint, prepared, c)))
        return prepared

    def _enter_checkpoint(self, prepared: _PreparedBackward, c: int, grad_outputs: tuple) -> None:
        """Pre-hook of a reentrant checkpoint node: scale its block's inner backward too."""
        alpha_out = prepared.run.alpha_out if prepared.run is not None else prepared.scales.plans[prepared.path].alpha_out
        alpha = alpha_out.get(c, 0)

        def prepare_inner(root: Node, inputs: tuple[Any, ...]) -> None:
            exits = frozenset(id(t) for t in inputs if isinstance(t, torch.Tensor))
            prepared.inner.append(self._prepare(root, (*prepared.path, c), prepared, alpha, exits))

        intercept_recomputation(prepared.graph.nodes[c], prepare_inner)

    def _queue_finish(self, prepared: _PreparedBackward, grad_outputs: tuple) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(partial(self._finish, prepared))
        prepared.handles += self._unscale_captured(prepared)

    def _unscale_captured(self, prepared: _PreparedBackward) -> list:
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
        handles = prepared.run.track_every_node() if prepared.run is not None else []  # before the hooks below, which read it
        targets = {j for j in prepared.leaves.deferred if runs[j] is None}
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
                    handles.append(graph.nodes[i].register_hook(partial(_divide_edge, graph, source, i, k)))
        return handles

    def _finish(self, prepared: _PreparedBackward) -> None:
        """Run by the autograd engine once a prepared graph's backward is done."""
        prepared.remove_hooks()
        graph, analysis, run = prepared.graph, prepared.analysis, prepared.run
        if run is not None:
            run.complete()
        deferred, scales = prepared.leaves.deferred, prepared.scales
        already: list[tuple[int, torch.Tensor, int]] = []  # unscaled as they accumulated: measured, not unscaled again
        if prepared.compiled is not None:  # leaf indices and scales of the eager update, which the drift compares with
            unscaled = [(e, graph.nodes[j].variable, alpha) for j, e, alpha in prepared.compiled.deferred]
        else:
            alpha_out = run.alpha_out if run is not None else scales.plans[prepared.path].alpha_out
            unscaled = [(j, graph.nodes[j].variable, alpha_out.get(analysis.leaf_sources[j], 0)) for j in deferred]
            already = [(j, graph.nodes[j].variable, alpha_out.get(source, 0)) for j, source in analysis.leaf_sources.items() if j not in deferred | prepared.leaves.exits]
        unscale_and_measure(unscaled, scales.drift if not prepared.path and self._measures_drift() else None, run is not None, already)
        for j in analysis.leaves - prepared.leaves.exits:  # an inner graph's exits hand their gradient on
            variable = graph.nodes[j].variable
            self._written[id(variable)] = variable
        if prepared.parent is not None:  # an inner graph: its outer backward goes on
            if run is not None:
                scales.plans[prepared.path] = run.plan()
                if prepared.parent.run is not None:
                    prepared.parent.run.absorb(run)
            return
        self._prepared = None
        self._read.queue(scales)
        if scales not in self._ran:
            self._ran.append(scales)
        if run is not None:
            self._finish_update(run, scales)
        if run is not None or any(m.ran_eagerly for m in self._compiled):  # a replay too: after load_state_dict
            self._locate_compiled(graph, scales)
        for module in self._compiled:
            module.end_iteration()
        self._iteration += 1
        scales.backwards += 1

    def _deferred_leaves(self, graph: AutogradGraph, analysis: GraphAnalysis, exits: frozenset[int], excluded: set[int]) -> frozenset[int]:
        """Leaves whose gradient can wait for the fused unscale after the backward.

        Nobody may see ``.grad`` before then: no DDP (it all-reduces during the backward), no
        hooks on the parameter, no existing ``.grad`` to accumulate into, one incoming edge, and
        no inner backward (a reentrant checkpoint's) that could add to it, in either direction.
        """
        if analysis.reentrant or (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return frozenset()
        deferred = []
        for j in analysis.leaf_sources.keys() - exits:
            variable = graph.nodes[j].variable
            if (
                variable.grad is None
                and id(variable) not in excluded
                and not variable._backward_hooks
                and not getattr(variable, "_post_accumulate_grad_hooks", None)
            ):
                deferred.append(j)
        return frozenset(deferred)

    def _settings(self, path: Path, scales: GraphScales) -> Settings:
        # Not where a compiled module replays the scales (its graph keeps nothing to recompute from),
        # nor in a format that saturates instead of overflowing.
        recipe = self.recipe
        recompute = recipe.recompute_weight_gradients and not (self.format.saturates or path or self._compiled)
        caps = [c for c in (self._backoff, _log2_floor(recipe.max_total_scale), MAX_LOG2_TOTAL) if c is not None]
        # Expected maxima keep the batches to come from skipping; a saturating format clips a rare spike
        # instead. Keyed by the loss graph's leaves: not for a reentrant checkpoint's inner graph (path).
        expected, levels = ({}, {}) if self.format.saturates or path or recipe.expected_maxima_margin_log2 is None else scales.drift.expect()
        return Settings(
            underflow_rate=recipe.underflow_rate,
            lambda_min=self.lambda_min_value,
            lambda_lost=self.lambda_lost_value,
            lambda_max=self.format.max,
            relu_factor=recipe.relu_factor,
            layer_cap=_log2_floor(recipe.max_layer_scale),
            total_cap=min(caps) if caps else None,
            node_caps=scales.layer_backoff.node_caps() if not path else {},
            expected_maxima=expected,
            recompute=recompute,
            level_maxima=levels if recompute else {},
            recipe=recipe,
        )

    def _finish_update(self, run: UpdateRun, scales: GraphScales) -> None:
        # Relax the cap only after a full interval without a skipped step (update_interval=1 included).
        interval, backwards = self.recipe.update_interval, scales.backwards
        scheduled = backwards % interval == 0 and backwards - scales.last_skip >= interval
        self._update_iterations += 1
        scales.plans[()] = run.plan()
        scales.layers = {layer.name: layer for layer in run.layers}
        scales.first_non_finite = run.first_non_finite()
        scales.force_update = False
        scales.layer_backoff.relax(run.alpha_out, backwards, interval)
        if self._backoff is not None and scheduled:
            largest = max(run.alpha_out.values(), default=0)
            # One bit per clean interval; drop the cap once it no longer binds.
            self._backoff = None if largest < self._backoff else self._backoff + 1

    # --- skipped steps -----------------------------------------------------------------------

    def _skip(self) -> None:
        self._skipped_this_iteration = True
        self._skipped_steps += 1
        self._consecutive_skips += 1
        ran = self._ran or ([self._graphs.current] if self._graphs.current is not None else [])
        named = False
        for scales in ran:  # the structures whose gradients this step would have used
            plan, analysis, reading = scales.plans.get(()), scales.analyses.get(()), scales.drift.last
            known = plan is not None and analysis is not None and reading.some_overflowed
            caps = overflow_caps(analysis, plan, reading.non_finite, self.recipe.backoff_bits) if known else {}
            scales.drift.keep_overflows_of(overflow_leaves(analysis, plan, reading.non_finite) if known else frozenset())
            if caps:  # the overflowing layers are known: lower those only
                scales.layer_backoff.lower(caps, scales.backwards, self.recipe.min_backoff_log2)
                named = True
            scales.last_skip = scales.backwards
            scales.force_update = True
        if not named:
            largest = max((a for scales in ran for plan in scales.plans.values() for a in plan.alpha_out.values()), default=0)
            cap = largest - 1 if self._backoff is None else min(self._backoff, largest) - 1
            self._backoff = max(cap, self.recipe.min_backoff_log2)
        non_finite = self._attached.restore_buffers()
        if non_finite:
            self._warn_once(
                "buffers",
                f"GradientScaler: a skipped step's forward had left {non_finite} non-finite buffer(s) (e.g. BatchNorm "
                "running statistics); all buffers were restored to their values before that iteration.",
            )
        if self.max_consecutive_skips is not None and self._consecutive_skips > self.max_consecutive_skips:
            first = next((scales.first_non_finite for scales in ran if scales.first_non_finite), None)
            where = f"layer {first!r}" if first else "the loss (no layer had a non-finite gradient)"
            raise RuntimeError(
                f"GradientScaler: {self._consecutive_skips} optimizer steps in a row were skipped for non-finite "
                f"gradients (max_consecutive_skips={self.max_consecutive_skips}); the first non-finite gradient in "
                f"backward order on the last update iteration was at {where}. The run has diverged or its forward "
                "produces inf/NaN: lower the learning rate or check the inputs."
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _warn_unhandled(self, graph: AutogradGraph, analysis: GraphAnalysis) -> None:
        opaque = sorted({graph.names[i] for i in analysis.opaque} - self._warned)
        if opaque:
            self._warned.update(opaque)
            warnings.warn(
                f"GradientScaler: the backward graph contains {', '.join(opaque)} (custom autograd Functions or "
                "compiled regions); scaling cannot see inside, so each is scaled as one unit, as a dynamic loss scale "
                "would scale it: one binade below the overflow of the gradients entering and leaving it (kind 'opaque' "
                "in layers()).",
                RuntimeWarning,
                stacklevel=3,
            )
        if not analysis.gemms and not analysis.casts:
            self._warn_once("no-gemm", "GradientScaler: no GEMM or cast found in the backward graph; nothing is scaled.")


def _will_execute(node: Node) -> bool | None:
    """Whether the running backward will run ``node``; ``None`` for a leaf whose gradient ``autograd.grad`` captures.

    torch refuses to answer for such a leaf, and its refusal is the answer.
    """
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return None


def _divide_edge(graph: AutogradGraph, source: UpdateRun | ScalePlan, i: int, k: int, grad_inputs: tuple, grad_outputs: tuple) -> tuple:
    """Post-hook of node ``i``: its gradient on edge ``k``, whose target ``autograd.grad`` captures, unscaled."""
    grad = grad_inputs[k]
    if grad is None:  # a branch contribution the update run keeps aside: the last one carries the sum
        return grad_inputs
    edge = graph.edges[i][k]
    carried = source.slot_alpha[edge] if graph.in_counts[edge] > 1 else source.alpha_out.get(i, 0)
    return (*grad_inputs[:k], times_pow2(grad, -carried), *grad_inputs[k + 1 :])


def _flatten(outputs: Outputs, where: str) -> list[torch.Tensor]:
    """The tensors of ``outputs``, depth first."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (list, tuple)):
        return [t for item in outputs for t in _flatten(item, where)]
    raise TypeError(f"{where}: expected a tensor or (nested) lists/tuples of tensors, got {type(outputs).__name__}")


def _unflatten(outputs: Outputs, tensors: Iterator[torch.Tensor]) -> Outputs:
    """``outputs`` with its tensors replaced, in :func:`_flatten`'s order, by ``tensors``."""
    if isinstance(outputs, torch.Tensor):
        return next(tensors)
    return type(outputs)(_unflatten(item, tensors) for item in outputs)


def _one_graph_state(state: dict[str, Any]) -> list[dict[str, Any]]:
    """A state saved before the scaler kept one state per graph structure, as :meth:`GraphRegistry.state_dict` has it."""
    plans = state["plans"] if "plans" in state else [[[], state["plan"]]] if state.get("plan") else []  # saved before nested plans: one
    root = next((plan for path, plan in plans if not path), None)
    if root is None:
        return []
    return [{
        "names": root["names"], "edges": root["edges"], "plans": plans, "drift": state.get("drift", {}),
        "layer_backoff": state.get("layer_backoff", []), "layers": state["layers"], "first_non_finite": state.get("first_non_finite"),
        "backwards": state["iteration"], "last_skip": state.get("last_skip", 0), "force_update": state.get("force_update", False),
    }]


def _log2_floor(value: float | None) -> int | None:
    return None if value is None else math.floor(math.log2(value))
