"""GradientScaler: per-gradient power-of-two scales on PyTorch's autograd graph (paper Algorithm 1).

How it runs, in brief:

* Every backward walks the new autograd graph (a few hundred nodes: well under a millisecond).
* Each graph structure keeps its own plan and schedule (:mod:`~gs_lightning.scaling.graph_scales`):
  graphs that alternate (two losses with their own optimizers, a gradient penalty) replay their own.
* On an **update** iteration (a structure's first, after a skipped step, when a weight gradient rose
  above what the last update expected of it by more than its layer's margin, when the gradients
  drifted a binade below the last update's (where the scales do not follow them, below), and at the
  latest every ``update_interval``-th) hooks decide every scale as autograd executes
  (:mod:`~gs_lightning.scaling.update`); each decision turns a few statistics of the gradient at
  hand into its scale on the device, unread: the backward never synchronises, and ``step()`` reads
  the scales with the gradients (see :meth:`GradientScaler.backward`).
* On the iterations in between, the decisions are replayed as constant power-of-two factors
  (:mod:`~gs_lightning.scaling.plan`): no hook at all where the factor is 1, and no
  synchronisation of their own; the weight gradients are unscaled in one fused multiply per scale,
  device and dtype after the backward. With ``follow_gradients=True``, after each step's read each
  GEMM's scale is raised by the binades its weight gradients' level fell since the update
  (:mod:`~gs_lightning.scaling.follow`, on the host: no synchronisation of its own), and the replays
  run the raised scales.
* ``step()`` reads every ``.grad`` its optimizer will use, whoever wrote it and however (``.data``,
  numpy, a kernel: writes that no version counter sees): one pass that takes each one's largest
  magnitude (non-finite exactly where the gradient is), the weight gradients the drift statistic
  wants among them, and one synchronisation.
* A step whose gradients overflowed in layers the read names runs its forward and backward again on the same
  batch, those layers backed off, where the caller gives ``step()`` a retry (the Lightning plugin gives its
  closure; :meth:`GradientScaler.prepare_retry`); otherwise, or where the retry overflows too, or the loss itself
  is non-finite, the step is skipped. With ``recompute_weight_gradients=True`` (opt-in: it keeps the forward's
  activations until the step) a weight gradient that overflows between updates, computed from a finite incoming
  gradient, is recomputed in fp32 from operands the replay kept instead (:mod:`~gs_lightning.scaling.recompute`).
* Gradients reaching a parameter are divided by the scale they carry in the parameter's own
  precision (fp32 master weights): after the backward, in one fused kernel per device and dtype,
  where nothing can observe ``.grad`` in between (a parameter used several times too, between updates:
  its gradients summed at one scale); otherwise (DDP, accumulation into an existing ``.grad``, hooks on
  the parameter, on update iterations a parameter used several times) before autograd accumulates
  them. Either way ``.grad``, DDP's all-reduce and the optimizer only see true
  gradients.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn

from gs_lightning.scaling.attached import AttachedModels
from gs_lightning.scaling.backoff import SkipBackoff
from gs_lightning.scaling.backward import ScaledBackwards
from gs_lightning.scaling.compiled import CompiledModule
from gs_lightning.scaling.decide import LayerScale
from gs_lightning.scaling.drift import DriftReading
from gs_lightning.scaling.formats import float_format
from gs_lightning.scaling.graph_scales import GraphScales, one_graph_state
from gs_lightning.scaling.join import join_outputs
from gs_lightning.scaling.recipe import ScalingRecipe, resolve_recipe
from gs_lightning.scaling.recompute import WeightGradRecompute
from gs_lightning.scaling.schedule import UpdateRecord
from gs_lightning.scaling.step_read import StepRead, any_rank
from gs_lightning.scaling.steps import FoundInf, OptimizerSteps, Stage
from gs_lightning.scaling.weak import weakly

Outputs = Any  # a tensor, or lists and tuples of them, nested as GradScaler.scale takes them


class GradientScaler:
    """Per-layer gradient scaling for mixed precision training (Zhao et al., IJCAI 2020).

    Gives every backpropagated gradient its own power-of-two scale, chosen on the fly from a
    statistical model of underflow, on any model and with no change to the model::

        scaler = GradientScaler(model)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = criterion(model(x), y)
        scaler.backward(loss)     # afterwards every .grad is the true gradient
        scaler.step(optimizer)    # skipped if a gradient was non-finite

    Where the loop can run an iteration again, give the step a retry: a step whose gradients overflowed then
    runs again on the same batch, the layers that overflowed backed off, instead of being skipped::

        def forward_backward():
            with torch.autocast("cuda", dtype=torch.float16):
                scaler.backward(criterion(model(x), y))

        forward_backward()
        scaler.step(optimizer, retry=forward_backward)

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
        self._steps = OptimizerSteps(max_consecutive_skips)
        self._retried_steps, self._retrying, self._retry_offered = 0, False, False
        self.recipe = resolve_recipe(recipe, **recipe_fields)
        self.format = float_format(dtype)
        self.enabled = enabled
        self._dtype = dtype
        self._warned: set[str] = set()
        self._attached = AttachedModels()
        self._backoff = SkipBackoff(self.recipe)
        # Keeps what the replay needs to recompute weight gradients that overflow.
        self._read = StepRead(WeightGradRecompute(self.format.max), self.format, self.recipe)
        self._backwards = ScaledBackwards(
            self.recipe,
            self.format,
            self._attached,
            self._read,
            self._backoff,
            weakly(self._warn_once),
            weakly(self.is_enabled),
        )
        if model is not None:
            self.attach(model)

    # --- public API ------------------------------------------------------------------------

    @property
    def lambda_min_value(self) -> float:
        """λmin used by the underflow model."""
        return self._backwards.lambda_min

    @property
    def lambda_lost_value(self) -> float:
        """Below this a gradient's value is lost, not only less precise: the smallest subnormal, raised
        by the drift tolerated between updates (what spike room keeps γ' against)."""
        return self._backwards.lambda_lost

    @property
    def iteration(self) -> int:
        """Number of backward passes run through this scaler."""
        return self._backwards.iteration

    @property
    def max_consecutive_skips(self) -> int | None:
        """``step`` raises once more steps than this were skipped in a row (``None``: never)."""
        return self._steps.max_consecutive_skips

    @max_consecutive_skips.setter
    def max_consecutive_skips(self, value: int | None) -> None:
        self._steps.max_consecutive_skips = value

    @property
    def skipped_steps(self) -> int:
        """Number of optimizer steps skipped because a gradient was non-finite."""
        return self._steps.skipped

    @property
    def recomputed_steps(self) -> int:
        """Steps taken although a weight gradient overflowed: it was recomputed in fp32
        (:mod:`~gs_lightning.scaling.recompute`)."""
        return self._read.recomputed_steps

    @property
    def retried_steps(self) -> int:
        """Steps whose forward and backward ran again after an overflow, instead of being skipped
        (:meth:`prepare_retry`)."""
        return self._retried_steps

    @property
    def update_iterations(self) -> int:
        """Backward passes that decided scales (the first, every ``update_interval``-th, and those the drift,
        a skipped step or a new graph structure asked for); the others replayed them. What an update
        costs against a plain backward: the documentation's results, "Overhead on the backward pass"."""
        return self._backwards.update_iterations

    @property
    def updates(self) -> tuple[UpdateRecord, ...]:
        """The update iterations of the current iteration (of the last one, until a backward starts the next), and
        why each ran: one :class:`~gs_lightning.scaling.schedule.UpdateRecord` per backward that decided the scales,
        its ``reasons`` members of :class:`~gs_lightning.scaling.schedule.UpdateReason` (``INTERVAL``,
        ``SKIPPED_STEP``, ``DRIFT``, ...). Empty where every backward replayed. Host values: no synchronisation."""
        return tuple(self._backwards.updates)

    @property
    def consecutive_skips(self) -> int:
        """Optimizer steps skipped in a row up to the last one (0 once a step is taken)."""
        return self._steps.consecutive

    @property
    def first_non_finite(self) -> str | None:
        """The first layer, in backward order, whose incoming or weight gradient was non-finite on the
        last update iteration of the graph that ran last (``None`` if every one was finite)."""
        current = self._backwards.graphs.current
        return current.first_non_finite if current is not None else None

    @property
    def graphs(self) -> tuple[GraphScales, ...]:
        """What the scaler keeps per backward graph structure (plans, schedule, drift, back-off), least
        recently run first: one for a single loss; one each for graphs that alternate (two losses with their
        own optimizers, a gradient penalty, a GAN), which replay their own plans."""
        return tuple(self._backwards.graphs)

    @property
    def models(self) -> tuple[nn.Module, ...]:
        """The attached models (none after unpickling until :meth:`attach`)."""
        return tuple(self._attached.models)

    @property
    def compiled_modules(self) -> tuple[CompiledModule, ...]:
        """The ``torch.compile``d modules of the attached models, which replay the scales inside their compiled
        graphs."""
        return tuple(self._backwards.compiled)

    def attach(self, model: nn.Module) -> None:
        """Name layers after ``model``'s modules and restore its buffers on a skipped step.

        ``GradientScaler(model)`` attaches ``model``. Attach each further model trained with this
        scaler (a GAN's generator and discriminator), and the model again after unpickling a scaler,
        whose pickled state holds no model.
        """
        if not self._attached.attach(model):
            return
        self._backwards.attach(model)

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
        self._backwards.prepare(root)
        return outputs if len(tensors) == 1 else _unflatten(outputs, iter(joined))

    def backward(self, loss: torch.Tensor, retain_graph: bool | None = None) -> None:
        """Backpropagate ``loss`` with per-gradient scaling; leaves true gradients in ``.grad``.

        Does not synchronise with the device. On an update iteration (:attr:`update_iterations` counts those)
        every decision point (GEMM, cast, fused kernel, opaque region) takes its statistics and its scale on
        the device, and the scales multiply the gradients as tensors; :meth:`step` reads them with the
        gradients, in its one synchronisation (or, before it, the first call that needs them: :meth:`layers`,
        :meth:`scales`, :meth:`state_dict`, or the next backward of a gradient-accumulation loop).
        """
        try:
            self.scale(loss).backward(retain_graph=retain_graph)
        except BaseException:
            self._backwards.abandon()
            raise

    @property
    def found_inf(self) -> bool:
        """Whether a gradient that a backward since the last step reached is non-finite now.

        Reads every such ``.grad`` and synchronises once (twice after a recompute).
        """
        return self._read.non_finite(
            [v.grad for v in self._backwards.written.values() if v.grad is not None], self._attached.sharded
        )

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """``GradScaler.unscale_``: the gradients are already true, so this only checks them.

        Kept so that an AMP loop (unscale, clip, step, update) runs unchanged; as with
        ``GradScaler``, the check decides the next :meth:`step` of this optimizer, and a second
        call for the same optimizer before :meth:`update` is an error.
        """
        if self.enabled:
            self._steps.unscale(optimizer, partial(self._non_finite, optimizer))

    def prepare_retry(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the caller should run this iteration's forward and backward again before stepping ``optimizer``;
        where it should, the scaler is ready for that run (``ScalingRecipe.retry_overflowed_steps``).

        It should where ``optimizer``'s gradients (as :meth:`unscale_` checks them, checked now if it was not
        called) overflowed in layers the read names (not a non-finite loss, which no scale prevents), no other
        optimizer was checked or stepped this iteration, and this iteration is not itself a retry. Then, as a
        skipped step would, the layers that overflowed are backed off and the attached models' buffers restored;
        the iteration ends, and ``optimizer``'s gradients are set to ``None``. The caller's next backward is an
        update iteration that decides the scales on the same batch, and :meth:`step` goes by its gradients.
        Otherwise nothing changes, and :meth:`step` goes by the same check. Counted in :attr:`retried_steps`.

        Synchronises once where :meth:`unscale_` has not read the gradients; in a process group, the ranks agree
        in one reduction more where a gradient overflowed: all retry where one rank's read names layers (each
        reads its own shard under FSDP).
        """
        if not (self.enabled and self.recipe.retry_overflowed_steps):
            return False
        self._retry_offered = True
        if self._retrying:
            return False
        if self._steps.stage(optimizer) is Stage.READY:
            self.unscale_(optimizer)
        if not self._steps.retryable(optimizer):
            return False
        # any rank: under FSDP each reads its own shard, which may hold none of the overflow
        if not any_rank(self._backwards.overflow_named(), _grads(optimizer)[0].device):
            return False
        self._backwards.retry()
        self.update()
        optimizer.zero_grad(set_to_none=True)
        self._retrying = self._retry_offered = True
        self._retried_steps += 1
        return True

    def step(
        self, optimizer: torch.optim.Optimizer, *args: Any, retry: Callable[[], Any] | None = None, **kwargs: Any
    ) -> bool:
        """``optimizer.step()`` unless one of its gradients is non-finite; returns whether it stepped.

        ``retry``: runs the iteration's forward and backward again, through this scaler (``optimizer.step``'s
        closure without the ``zero_grad``: the scaler sets the gradients to ``None`` first). Where the gradients
        overflowed in layers the scaler can name, it backs those off and calls ``retry`` once (:meth:`prepare_retry`)
        instead of skipping the step; the step then goes by the retry's gradients. Give it only where the gradients
        come from this iteration alone (not a gradient-accumulation loop's earlier micro-batches).

        As ``GradScaler``, each optimizer is judged by the gradients it is about to use (as they
        were at :meth:`unscale_`, if that was called): every ``.grad`` it holds is read (each one's
        largest magnitude, one fused kernel per device on a GPU), whoever wrote it and however
        (through ``.data`` or numpy too). Synchronises once, reading those with the drift statistic
        of the iteration's backwards (twice where an overflowed weight gradient was recomputed, or where the step
        was retried: once more after the retry, and a reduction across ranks in a process group). A
        skipped step leaves the weights untouched, restores the attached models' buffers to their
        values before the iteration, and makes the next backward
        recompute the scales, with the accumulated scale capped below the one that overflowed.

        Raises:
            RuntimeError: after more than ``max_consecutive_skips`` skipped steps in a row, naming
                the first layer whose gradient was non-finite.
            AssertionError: if none of the optimizer's parameters has a gradient (no backward reached
                them since they were zeroed), as ``GradScaler`` raises ("No inf checks were recorded").
        """
        if not self.enabled:
            optimizer.step(*args, **kwargs)
            return True
        if retry is not None and self.prepare_retry(optimizer):
            retry()
        if self._steps.overflowed(optimizer, partial(self._non_finite, optimizer)):
            # the iteration's first: cap what overflowed, restore the buffers, stop a diverged run
            if self._steps.skip():
                self._steps.check_diverged(self._backwards.skipped())
            return False
        optimizer.step(*args, **kwargs)
        if self._retrying:
            self._backwards.retried()
        if self._steps.stepped():
            self._attached.save_buffers()
        return True

    def _non_finite(self, optimizer: torch.optim.Optimizer) -> FoundInf:
        """Whether one of ``optimizer``'s gradients is non-finite, every one read: one flag, none if it holds none."""
        grads = _grads(optimizer)
        return [self._read.non_finite(grads, self._attached.sharded)] if grads else []

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
        self._steps.end_iteration()
        self._backwards.end_iteration()
        # the next updates bound the GEMMs as recoverable where this iteration's step could run it again
        self._backwards.retries_offered, self._retry_offered = self._retry_offered, False
        self._retrying = False

    def scales(self) -> dict[str, float]:
        """{layer name: local scale β last chosen}, for every decision point."""
        return {name: 2.0**layer.log2_scale for name, layer in self._backwards.graphs.layers().items()}

    def raised(self) -> dict[str, int]:
        """{layer name: binades its accumulated scale is raised above what the last update chose}, for the GEMMs the
        step raised as their weight gradients' level fell (``follow_gradients``; :mod:`~gs_lightning.scaling.follow`),
        in the graph that ran last; empty right after an update. The replays run the raised scales. Host values:
        no synchronisation."""
        current = self._backwards.graphs.current
        analysis = current.analyses.get(()) if current is not None else None
        if analysis is None:
            return {}
        return {analysis.layer_names[g]: k for g, k in current.follower.shifts.items() if g in analysis.layer_names}

    def underflow_rates(self) -> dict[str, float]:
        """{layer name: the estimated underflow rate at the chosen scale} (NaN where no model applies)."""
        return {name: layer.underflow_rate for name, layer in self._backwards.graphs.layers().items()}

    def layers(self) -> list[LayerScale]:
        """Everything the last update chose, layer by layer, in backward order (of each graph structure,
        least recently run first, where several alternate; a layer in two keeps the later one's).

        Synchronises once where an update's step has not read what it left on the device (its underflow
        counts, its finiteness flags), as do :meth:`scales`, :meth:`underflow_rates`, :attr:`first_non_finite`
        and :meth:`state_dict`; otherwise host values only.
        """
        return list(self._backwards.graphs.layers().values())

    @property
    def drift(self) -> DriftReading:
        """What the last step read of the gradients between updates: by how many binades a scale
        group's gradients shrank below the update that chose its scale (≥ 1 makes the next backward
        an update), by how many a weight gradient rose above what that update expected of it
        (> 0 does too), and which gradients were non-finite, for the graph that ran last. Read in the step's
        one synchronisation."""
        current = self._backwards.graphs.current
        return current.drift.last if current is not None else DriftReading()

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state: counters, back-off and, per graph structure, every scale of its last update (plain
        containers)."""
        backwards = self._backwards
        return {
            "recipe": self.recipe.state_dict(),
            "iteration": backwards.iteration,
            **self._steps.state_dict(),
            "recomputed_steps": self._read.recomputed_steps,
            "retried_steps": self._retried_steps,
            "update_iterations": backwards.update_iterations,
            "backoff": self._backoff.cap,
            "graphs": backwards.graphs.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`: its recipe and scales; the next backwards reuse the saved scales.

        As ``torch.amp.GradScaler.load_state_dict`` restores the scale's settings (growth factor and interval,
        back-off factor) with its value, the checkpoint's :class:`~gs_lightning.scaling.recipe.ScalingRecipe`
        replaces the one this scaler was built with: the scales saved were decided by it, and the run
        goes on as the saved one would. Where the two differ, one ``RuntimeWarning`` names each field that
        changed. A state saved before the recipe was (no ``"recipe"`` key) keeps this scaler's. To resume
        under another recipe, build a scaler with it and do not load the state: it decides its scales
        on its first backward.
        """
        _check_state(state)
        if "recipe" in state:
            self._use_recipe(ScalingRecipe.from_state_dict(state["recipe"]))
        backwards = self._backwards
        backwards.iteration, backwards.update_iterations = (
            int(state["iteration"]),
            int(state.get("update_iterations", 0)),
        )
        self._steps.load_state_dict(state)
        self._read.recomputed_steps = int(state.get("recomputed_steps", 0))
        self._retried_steps = int(state.get("retried_steps", 0))
        self._backoff.cap = state["backoff"]
        backwards.graphs.load_state_dict(
            state["graphs"] if "graphs" in state else one_graph_state(state), backwards.new_drift
        )

    # Pickling and copy.deepcopy keep the settings and the state_dict(): no model, no state of an iteration in progress.

    def __getstate__(self) -> dict[str, Any]:
        """What a copy keeps. Without the models it names no layers and restores no buffers until :meth:`attach`."""
        settings = {"dtype": self._dtype, "max_consecutive_skips": self.max_consecutive_skips, "enabled": self.enabled}
        return {"recipe": self.recipe, "settings": settings, "state": self.state_dict(), "warned": set(self._warned)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(None, state["recipe"], **state["settings"])
        self.load_state_dict(state["state"])
        self._warned = state["warned"]

    # --- one iteration -------------------------------------------------------------------------

    def _begin_iteration(self) -> None:
        self._backwards.abandon()  # a scale() whose backward never ran, or failed
        if self._steps.any_stepped:
            self.update()

    def _use_recipe(self, recipe: ScalingRecipe) -> None:
        """Decide by ``recipe`` from now on (a checkpoint's), saying once which fields it changed."""
        changed = self.recipe.differences(recipe)
        if not changed:
            return
        warnings.warn(
            "GradientScaler.load_state_dict: resuming with the checkpoint's recipe, which differs from the one "
            "this scaler was built with in "
            + ", ".join(f"{k}={now!r} (built with {was!r})" for k, (was, now) in changed.items()),
            RuntimeWarning,
            stacklevel=3,
        )
        self.recipe = recipe
        # Each part reads its recipe when it acts (the graphs' drift monitors are made again as the state loads).
        self._backoff.recipe = self._read.recipe = self._backwards.recipe = recipe

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


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


def _check_state(state: dict[str, Any]) -> None:
    """Refuse what is not a GradientScaler's state."""
    missing = {"iteration", "skipped_steps", "backoff"} - state.keys()
    if missing or not {"graphs", "layers"} & state.keys():
        raise ValueError(
            "GradientScaler.load_state_dict: not a GradientScaler state "
            f"(missing {sorted(missing or {'graphs'})}; got keys "
            f"{sorted(state)}). A torch.amp.GradScaler's state has no per-layer scales to restore: start the "
            "GradientScaler fresh, it decides its scales on its first backward."
        )


def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradients ``optimizer`` holds (its parameters' ``.grad`` that are not ``None``)."""
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
