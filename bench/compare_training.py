"""GS beside every baseline, trained on small versions of the paper's three experiments (issue 11).

Trains each (task, method, seed) from the same initial weights on the same batches, for a fixed
number of steps, under CPU emulation of fp16 (and of fp8 gradients): ``gs_lightning.simulate``. The
methods of one (task, seed) train in lockstep (a step of each in turn, each timed on its own), so that a
method's time over the dynamic loss scale's holds on a shared machine.
Methods, in three settings:

* fp16 gradients: fp32 (reference), bf16 (real CPU kernels), fp16 without scaling, fixed loss
  scale 128 and 4096, dynamic loss scale (``torch.amp.GradScaler``), GS, GS with the paper's
  Algorithm 1 as published (``ScalingRecipe.paper()``: no rule beyond the paper), on request GS's variants
  (:data:`GS_VARIANTS`: following the gradients between updates, recomputing overflowed weight gradients in fp32
  instead of retrying the step, skipping overflowed steps as a loop without a retry does, with GEMMs sending their
  input gradients at scales of their own); GS's steps are given a retry (``GradientScaler.step(retry=...)``);
* fp8 gradients on the fp16 path (every gradient a backward GEMM *produces* rounded to fp8, the
  GEMM writing it itself: no method sees it first): e5m2 without scaling, fixed loss scale 4096,
  dynamic loss scale, Transformer Engine's delayed per-tensor amax scaling, current per-tensor
  scaling (TE's ``Float8CurrentScaling``, torchao), each alone and under a dynamic loss scale, GS, GS
  with the paper's Algorithm 1;
  e4m3fn with MX block scaling (MXFP8) alone and under a dynamic loss scale; optionally GS in e4m3fn;
* fp8 gradients on the hardware path (bf16 between GEMMs, the gradient *entering* each backward
  GEMM cast to fp8 from its bf16 value, as TE and torchao run fp8 training): e5m2 without scaling,
  delayed, current, GS; e4m3fn MX block scaling; optionally e5m2 MX and e4m3fn GS.

Per method it reports the test metric (mean ± std over seeds), the training loss over the last
tenth of the steps, skipped steps, the mean underflow of the gradients the emulation casts
(fraction of nonzero exact values rounded to zero, averaged over tensors and over every step, or
every ``--underflow-every``-th), beside it the per-tensor oracle (the least underflow any
per-tensor power-of-two scale without overflow gives the same tensors, in the same format: a floor
for every per-tensor power-of-two method, not for block scales nor for non-power-of-two scales),
and wall time per run, with its ratio to the dynamic loss scale's of the same gradient format (stepped in
lockstep with it; mean over seeds); it plots the training-loss curves (mean over seeds) per task.

    python bench/compare_training.py --quick            # every method, tiny, < 3 min
    python bench/compare_training.py --tasks segnet --json segnet.json   # one task's runs
    python bench/compare_training.py --tasks deep --methods e5m2-gs --seeds 1 --underflow-by-tensor 3   # worst tensors
    python bench/compare_training.py --report segnet.json resnet.json ssd.json --plots docs
    python bench/compare_training.py --tasks segnet --methods fp16-gs-paper --merge segnet.json   # add rows to a table
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict, TypeVar

import torch
from _training_tasks import BUILDERS, TASKS, Task
from torch import nn

from gs_lightning import GradientScaler
from gs_lightning.simulate import CurrentScaling, DelayedScaling, MXBlockScaling, UnderflowMeter, emulate
from gs_lightning.simulate.methods import (
    DynamicLossScale,
    FixedLossScale,
    NoScaling,
    RecipeScaling,
)

E5M2, E4M3 = torch.float8_e5m2, torch.float8_e4m3fn
# GS with ScalingRecipe.paper(): Algorithm 1 as published, none of the rules beyond the paper (issue 52)
PAPER_LABEL = "GS, paper's Algorithm 1"
# GS with ScalingRecipe.follow_gradients: the step raises the scales as the gradients' level falls (issue 51)
FOLLOW_LABEL = "GS, following the gradients"
# GS recomputing overflowed weight gradients in fp32 from operands kept until the step, not retrying (issue 51)
RECOMPUTE_LABEL = "GS, fp32 recompute"
# GS with retry_overflowed_steps=False: what a loop that gives step() no retry gets (issue 51)
NO_RETRY_LABEL = "GS, no retry"
# GS with ScalingRecipe.own_input_gradient_scale: what a GEMM sends on at a scale of its own (issue 51)
OWN_INPUT_SCALE_LABEL = "GS, own input-gradient scales"
# GS with recipe fields changed, run in fp16 and e5m2 on request: (key suffix, label, fields)
GS_VARIANTS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("follow", FOLLOW_LABEL, {"follow_gradients": True}),
    ("recompute", RECOMPUTE_LABEL, {"recompute_weight_gradients": True, "retry_overflowed_steps": False}),
    ("no-retry", NO_RETRY_LABEL, {"retry_overflowed_steps": False}),
    ("own-input-scale", OWN_INPUT_SCALE_LABEL, {"own_input_gradient_scale": True}),
)
_FORMAT_NAMES = {E5M2: "e5m2", E4M3: "e4m3fn"}


@dataclass(frozen=True)
class Method:
    """One row of the table: how the forward runs and which gradient method backpropagates.

    Attributes:
        key: Command-line name, e.g. ``"e5m2-gs"``.
        grads: Gradient format column: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"e5m2"``, ``"e4m3fn"``
            (GEMM outputs rounded, the fp16 path), ``"bf16 + e5m2 ∇Y"``, ``"bf16 + e4m3fn ∇Y"``
            (the gradient entering each GEMM cast, the hardware path).
        label: What the table prints.
        autocast: Autocast dtype (``None``: plain fp32); also the emulated compute format.
        emulated: Whether the GEMMs run under :class:`~gs_lightning.simulate.emulate`.
        grad_dtype: Format of the backward's gradient casts (emulated methods).
        make: ``model -> training method`` (``backward``, ``step``, ``skipped_steps``).
        grad_rounding: The emulation's ``grad_rounding``: ``"output"`` or ``"entering"``.
    """

    key: str
    grads: str
    label: str
    autocast: torch.dtype | None
    emulated: bool
    grad_dtype: torch.dtype | None
    make: Callable[[nn.Module], Any]
    grad_rounding: Literal["output", "entering"] = "output"


def _methods() -> dict[str, Method]:
    f16, b16 = torch.float16, torch.bfloat16

    def entering(key: str, fmt: torch.dtype, label: str, make: Callable[[nn.Module], Any]) -> Method:
        return Method(key, f"bf16 + {_FORMAT_NAMES[fmt]} ∇Y", label, b16, True, fmt, make, "entering")

    def gs_variants(grads: str, grad_dtype: torch.dtype | None) -> list[Method]:
        """:data:`GS_VARIANTS` with ``grads`` gradients."""
        dtype = {} if grad_dtype is None else {"dtype": grad_dtype}

        def variant(suffix: str, label: str, fields: dict[str, Any]) -> Method:
            def make(model: nn.Module) -> GradientScaler:
                return GradientScaler(model, **dtype, **fields)

            return Method(f"{grads}-gs-{suffix}", grads, label, f16, True, grad_dtype, make)

        return [variant(*v) for v in GS_VARIANTS]

    rows = [
        Method("fp32", "fp32", "fp32 (reference)", None, False, None, lambda m: NoScaling()),
        Method("bf16", "bf16", "bf16 (real CPU kernels)", b16, False, None, lambda m: NoScaling()),
        Method("fp16-none", "fp16", "no scaling", f16, True, None, lambda m: NoScaling()),
        Method("fp16-fixed128", "fp16", "fixed loss scale 128", f16, True, None, lambda m: FixedLossScale(128)),
        Method("fp16-fixed4096", "fp16", "fixed loss scale 4096", f16, True, None, lambda m: FixedLossScale(4096)),
        Method("fp16-dynamic", "fp16", "dynamic loss scale", f16, True, None, lambda m: DynamicLossScale()),
        Method("fp16-gs", "fp16", "GS", f16, True, None, lambda m: GradientScaler(m)),
        Method("fp16-gs-paper", "fp16", PAPER_LABEL, f16, True, None, lambda m: GradientScaler(m, "paper")),
        *gs_variants("fp16", None),
        Method("e5m2-none", "e5m2", "no scaling", f16, True, E5M2, lambda m: NoScaling()),
        Method("e5m2-fixed4096", "e5m2", "fixed loss scale 4096", f16, True, E5M2, lambda m: FixedLossScale(4096)),
        Method("e5m2-dynamic", "e5m2", "dynamic loss scale", f16, True, E5M2, lambda m: DynamicLossScale()),
        Method("e5m2-amax", "e5m2", "per-tensor amax (TE delayed)", f16, True, E5M2, lambda m: RecipeScaling()),
        Method(
            "e5m2-amax-dynamic",
            "e5m2",
            "per-tensor amax + dynamic loss scale",
            f16,
            True,
            E5M2,
            lambda m: DynamicLossScale(grad_scaling=DelayedScaling()),
        ),
        Method(
            "e5m2-current",
            "e5m2",
            "per-tensor current (TE current)",
            f16,
            True,
            E5M2,
            lambda m: RecipeScaling(CurrentScaling()),
        ),
        Method(
            "e5m2-current-dynamic",
            "e5m2",
            "per-tensor current + dynamic loss scale",
            f16,
            True,
            E5M2,
            lambda m: DynamicLossScale(grad_scaling=CurrentScaling()),
        ),
        Method("e5m2-gs", "e5m2", "GS", f16, True, E5M2, lambda m: GradientScaler(m, dtype=E5M2)),
        Method("e5m2-gs-paper", "e5m2", PAPER_LABEL, f16, True, E5M2, lambda m: GradientScaler(m, "paper", dtype=E5M2)),
        *gs_variants("e5m2", E5M2),
        Method(
            "e4m3-mx", "e4m3fn", "MX blocks of 32 (MXFP8)", f16, True, E4M3, lambda m: RecipeScaling(MXBlockScaling())
        ),
        Method(
            "e4m3-mx-dynamic",
            "e4m3fn",
            "MX blocks of 32 + dynamic loss scale",
            f16,
            True,
            E4M3,
            lambda m: DynamicLossScale(grad_scaling=MXBlockScaling()),
        ),
        Method("e4m3-gs", "e4m3fn", "GS", f16, True, E4M3, lambda m: GradientScaler(m, dtype=E4M3)),
        entering("e5m2-in-none", E5M2, "no scaling", lambda m: NoScaling()),
        entering("e5m2-in-delayed", E5M2, "per-tensor amax (TE delayed)", lambda m: RecipeScaling()),
        entering("e5m2-in-current", E5M2, "per-tensor current (TE current)", lambda m: RecipeScaling(CurrentScaling())),
        entering("e5m2-in-gs", E5M2, "GS", lambda m: GradientScaler(m, dtype=E5M2)),
        entering("e5m2-in-mx", E5M2, "MX blocks of 32", lambda m: RecipeScaling(MXBlockScaling())),
        entering("e4m3-in-mx", E4M3, "MX blocks of 32 (MXFP8)", lambda m: RecipeScaling(MXBlockScaling())),
        entering("e4m3-in-gs", E4M3, "GS", lambda m: GradientScaler(m, dtype=E4M3)),
    ]
    return {m.key: m for m in rows}


METHODS = _methods()
# format-for-format checks and GS's variants (the opt-in rules, GS without the fp32 recompute), run on request
OPTIONAL_METHODS = (
    "e4m3-gs",
    "e5m2-in-mx",
    "e4m3-in-gs",
    *(f"{grads}-gs-{suffix}" for grads in ("fp16", "e5m2") for suffix, _, _ in GS_VARIANTS),
)
DEFAULT_METHODS = tuple(k for k in METHODS if k not in OPTIONAL_METHODS)


@dataclass
class Run:
    """One training run's results (the fields after ``update_iterations`` are absent from older files)."""

    task: str
    method: str
    seed: int
    metric_name: str
    metric: float
    skipped_steps: int
    underflow: float | None  # mean over sampled steps of the mean over the cast gradient tensors
    seconds: float  # wall time of the training loop (evaluation and the underflow meter's own work excluded)
    losses: list[float] = field(repr=False)
    update_iterations: int | None = None  # GS: backwards that decided the scales (the dearer ones)
    oracle_underflow: float | None = None  # the same mean for the best per-tensor power-of-two scale of each tensor
    grads: str | None = None  # the method's gradient-format column (Method.grads)
    label: str | None = None  # the method's name in the table (Method.label)
    grad_rounding: str | None = None  # emulated: "output" (GEMM outputs cast) or "entering" (∇Y cast); else None
    recomputed_steps: int | None = None  # GS: steps taken after recomputing an overflowed weight gradient in fp32
    lockstep: str | None = None  # the runs stepped in turn with it share this id (train_interleaved)
    # each skipped step (from 0) and the parameters whose gradients were non-finite there, by name
    skips: list[SkippedStep] | None = None
    retried_steps: int | None = None  # GS: steps whose forward and backward ran again after an overflow


class SkippedStep(TypedDict):
    """A step the method skipped, and what overflowed there: the parameters whose ``.grad`` held inf or NaN."""

    step: int
    non_finite: list[str]


class Training:
    """One (task, method, seed) run, a step at a time: :func:`train` runs one alone, :func:`train_interleaved` several
    in lockstep. Each step is timed on its own, so that methods stepped in turn are timed side by side.

    ``meter`` replaces the default :class:`UnderflowMeter` (e.g. one that also groups by layer);
    ``on_step(step, trainer)`` runs after every optimizer step (e.g. to record loss scales).
    """

    def __init__(
        self,
        task: Task,
        method: Method,
        seed: int,
        underflow_every: int,
        *,
        meter: UnderflowMeter | None = None,
        on_step: Callable[[int, Any], None] | None = None,
    ) -> None:
        self.task, self.method, self.seed = task, method, seed
        self.underflow_every, self.on_step = underflow_every, on_step
        self.model = task.build(seed)
        self.model.train()
        self.optimizer = task.make_optimizer(self.model)
        self.trainer = method.make(self.model)
        self.meter = meter if meter is not None else UnderflowMeter(oracle_format=method.grad_dtype or method.autocast)
        self.emulation = None
        if method.emulated:
            self.emulation = emulate(
                method.autocast,
                method.grad_dtype,
                grad_scaling=getattr(self.trainer, "grad_scaling", None),
                grad_rounding=method.grad_rounding,
            )
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(len(task.train[0]), generator=self.generator)
        self.position, self.losses, self.underflow, self.oracle = 0, [], [], []
        self.skips: list[SkippedStep] = []
        self.seconds = 0.0  # the training steps' wall time (evaluation and the meter's own work excluded)

    def step(self, step: int) -> None:
        """Train on the next batch."""
        start, metered = time.perf_counter(), self.meter.seconds
        task, method, emulation = self.task, self.method, self.emulation
        if self.position + task.batch_size > len(self.order):
            self.order, self.position = torch.randperm(len(self.order), generator=self.generator), 0
        images, targets = task.batch(self.order[self.position : self.position + task.batch_size])
        self.position += task.batch_size
        sample = emulation is not None and step % self.underflow_every == 0
        if emulation is not None:
            emulation.underflow = self.meter if sample else None
        losses = []

        def forward_backward() -> None:
            with emulation if emulation is not None else nullcontext():
                with torch.autocast("cpu", dtype=method.autocast or torch.float32, enabled=method.autocast is not None):
                    losses.append(task.loss(self.model, images, targets))
                self.trainer.backward(losses[-1])

        def retry() -> None:  # the meter measures the step's first backward only
            if emulation is not None:
                emulation.underflow = None
            forward_backward()

        self.optimizer.zero_grad(set_to_none=True)
        forward_backward()
        if isinstance(self.trainer, GradientScaler):
            self.trainer.step(self.optimizer, retry=retry)
        else:
            self.trainer.step(self.optimizer)
        loss = losses[-1]
        if self.on_step is not None:
            self.on_step(step, self.trainer)
        self.losses.append(loss.item())
        if sample:
            fractions, oracle_fractions = self.meter.collect_with_oracle()
            self.underflow.append(statistics.fmean(fractions) if fractions else 0.0)
            if oracle_fractions:
                self.oracle.append(statistics.fmean(oracle_fractions))
        # measuring the underflow is the benchmark's work, not the run's: every emulated method would pay it alike,
        # which pulls the ratios of their seconds towards 1
        self.seconds += time.perf_counter() - start - (self.meter.seconds - metered)
        if self.trainer.skipped_steps > len(self.skips):  # what overflowed: read after the timed part, as the meter
            self.skips.append({"step": step, "non_finite": self._non_finite_parameters()})

    def _non_finite_parameters(self) -> list[str]:
        """The parameters whose ``.grad`` holds inf or NaN now (the step just skipped left them there)."""
        return [
            name
            for name, parameter in self.model.named_parameters()
            if parameter.grad is not None and not bool(torch.isfinite(parameter.grad).all())
        ]

    def result(self, lockstep: str | None = None) -> Run:
        """Evaluate in fp32; the run's results (``lockstep``: the id of the runs it was stepped in turn with)."""
        self.model.eval()
        trainer, method = self.trainer, self.method
        return Run(
            self.task.name,
            method.key,
            self.seed,
            self.task.metric_name,
            self.task.evaluate(self.model),
            trainer.skipped_steps,
            statistics.fmean(self.underflow) if self.underflow else None,
            self.seconds,
            self.losses,
            getattr(trainer, "update_iterations", None),
            statistics.fmean(self.oracle) if self.oracle else None,
            method.grads,
            method.label,
            method.grad_rounding if method.emulated else None,
            getattr(trainer, "recomputed_steps", None),
            lockstep,
            self.skips,
            getattr(trainer, "retried_steps", None),
        )


def skip_causes(skips: list[SkippedStep], most: int = 3) -> str:
    """The parameters found non-finite at ``skips``, the most frequent first, each with the number of skipped steps it
    was non-finite at, at most ``most`` named: ``"backbone.extras.2.0.bias (2 of 2), head.4.bias (1 of 2)"``."""
    counts: dict[str, int] = defaultdict(int)
    for skip in skips:
        for name in skip["non_finite"]:
            counts[name] += 1
    named = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    shown = ", ".join(f"{name} ({count} of {len(skips)})" for name, count in named[:most])
    more = len(named) - most
    return (shown or "no parameter") + (f", {more} more" if more > 0 else "")


def train(
    task: Task,
    method: Method,
    seed: int,
    steps: int,
    underflow_every: int,
    *,
    meter: UnderflowMeter | None = None,
    on_step: Callable[[int, Any], None] | None = None,
) -> Run:
    """Train ``task`` with ``method`` from seed ``seed`` for ``steps`` steps; evaluate in fp32 (:class:`Training`)."""
    training = Training(task, method, seed, underflow_every, meter=meter, on_step=on_step)
    for step in range(steps):
        training.step(step)
    return training.result()


def train_interleaved(
    task: Task,
    methods: list[Method],
    seed: int,
    steps: int,
    underflow_every: int,
    meters: list[UnderflowMeter | None] | None = None,
) -> list[Run]:
    """Train ``task`` with every one of ``methods`` from seed ``seed``, in lockstep: step ``t`` of each method in
    turn, then step ``t + 1``. Each method's time is its own steps', taken between the others' under the same
    load, so their ratios hold on a shared machine where separate runs' times do not (:func:`time_ratios`)."""
    meters = meters or [None] * len(methods)
    trainings = [Training(task, m, seed, underflow_every, meter=meter) for m, meter in zip(methods, meters)]
    for step in range(steps):
        for training in trainings:
            training.step(step)
    lockstep = f"{task.name}/{seed}/{time.time():.0f}"
    return [training.result(lockstep) for training in trainings]


def time_ratios(runs: list[Run], baseline: str = "dynamic loss scale") -> dict[tuple[str, str, str], list[float]]:
    """(task, gradient format, method) -> each seed's time over the ``baseline`` method's (by label) in the same
    gradient format, where the two were stepped in lockstep (:func:`train_interleaved`)."""
    base = {
        (r.task, r.grads, r.lockstep): r.seconds
        for r in runs
        if r.label == baseline and r.lockstep is not None and r.seconds > 0
    }
    ratios: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for r in runs:
        if r.lockstep is not None and (r.task, r.grads, r.lockstep) in base:
            ratios[r.task, r.grads, r.method].append(r.seconds / base[r.task, r.grads, r.lockstep])
    return ratios


class TensorUnderflowMeter(UnderflowMeter):
    """An :class:`UnderflowMeter` that also keeps each cast tensor's underflow, averaged over the steps measured.

    A backward casts the same tensors in the same order at every step: a tensor is its place in that
    order. It is named ``∇W`` where its shape is a parameter's (``parameter_shapes``), else ``∇X`` (the
    gradient a GEMM produces) or, where the emulation casts what enters each GEMM, ``∇Y``.
    """

    def __init__(
        self, oracle_format: torch.dtype | None, parameter_shapes: set[tuple[int, ...]], grad_rounding: str = "output"
    ) -> None:
        super().__init__(oracle_format=oracle_format)
        self.parameter_shapes, self.grad_rounding = parameter_shapes, grad_rounding
        self._shapes: list[tuple[int, ...]] = []
        self.shapes: dict[int, tuple[int, ...]] = {}
        self.totals: dict[int, list[float]] = defaultdict(list)  # place -> its underflow at each step measured

    def add(self, exact: torch.Tensor, rounded: torch.Tensor) -> None:
        super().add(exact, rounded)
        self._shapes.append(tuple(exact.shape))

    def collect_with_oracle(self) -> tuple[list[float], list[float]]:
        shapes, self._shapes = self._shapes, []
        fractions, oracle = super().collect_with_oracle()
        for place, (fraction, shape) in enumerate(zip(fractions, shapes)):
            self.shapes[place] = shape
            self.totals[place].append(fraction)
        return fractions, oracle

    def worst(self, count: int) -> str:
        """The ``count`` tensors that underflowed most, on average: ``#place kind shape percent``, most first."""
        means = {place: statistics.fmean(values) for place, values in self.totals.items()}
        entering = "∇Y" if self.grad_rounding == "entering" else "∇X"
        kind = {place: "∇W" if shape in self.parameter_shapes else entering for place, shape in self.shapes.items()}
        return "; ".join(
            f"#{place} {kind[place]} {tuple(self.shapes[place])} {100 * mean:.2f}%"
            for place, mean in sorted(means.items(), key=lambda item: -item[1])[:count]
        )


GRADIENT_HEADER = "Gradient magnitudes per layer"  # docs_results.py finds the printed table by it


def gradient_magnitudes(task: Task, seed: int = 0) -> list[dict[str, Any]]:
    """Per GEMM layer (Linear, convolution), log2 of the median and largest |g| of one fp32 backward.

    Of the weight's gradient ∇W and of the gradient entering the layer's backward GEMMs ∇Y (the
    layer above's ∇X, through its activation): the magnitudes a loss scale has to fit. One backward of
    the task's loss on its first ``batch_size`` training examples from seed ``seed``'s initial weights;
    medians over the nonzero entries (an exact zero cannot underflow).
    """
    model = task.build(seed)
    model.train()
    layers = {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))}
    incoming: dict[str, torch.Tensor] = {}

    def keep_incoming(name: str) -> Callable[[nn.Module, Any, torch.Tensor], None]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            output.register_hook(lambda grad: incoming.__setitem__(name, grad.detach()))

        return hook

    handles = [layer.register_forward_hook(keep_incoming(name)) for name, layer in layers.items()]
    try:
        images, targets = task.batch(torch.arange(task.batch_size))
        task.loss(model, images, targets).backward()
    finally:
        for handle in handles:
            handle.remove()

    def log2_median_max(grad: torch.Tensor | None) -> tuple[float, float]:
        magnitudes = grad.abs().flatten() if grad is not None else torch.zeros(0)
        magnitudes = magnitudes[magnitudes > 0]
        if magnitudes.numel() == 0:
            return math.nan, math.nan
        return math.log2(magnitudes.median().item()), math.log2(magnitudes.max().item())

    rows = []
    for name, layer in layers.items():
        (w_median, w_max), (y_median, y_max) = log2_median_max(layer.weight.grad), log2_median_max(incoming.get(name))
        rows.append({"layer": name, "∇W median": w_median, "∇W max": w_max, "∇Y median": y_median, "∇Y max": y_max})
    return rows


def gradient_table(task_name: str, rows: list[dict[str, Any]], seed: int = 0) -> str:
    """:func:`gradient_magnitudes` (of seed ``seed``) as printed: a header line, a Markdown table, the spread in
    binades."""
    lines = [
        f"{GRADIENT_HEADER} of `{task_name}` (log2 |g|, one fp32 backward at seed {seed}'s initialisation, "
        "medians over nonzero entries):",
        "",
        "| layer | ∇W median | ∇W max | ∇Y median | ∇Y max |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['layer']} | " + " | ".join(f"{r[k]:.1f}" for k in list(r)[1:]) + " |" for r in rows]

    def extreme(pick: Callable[..., Any], stat: str) -> tuple[float, str] | None:
        return pick(
            (
                (r[k], f"{k.split()[0]} of layer {r['layer']}")
                for r in rows
                for k in (f"∇W {stat}", f"∇Y {stat}")
                if math.isfinite(r[k])
            ),
            default=None,
        )

    largest, smallest = extreme(max, "max"), extreme(min, "median")
    if largest is not None and smallest is not None:
        lines += [
            "",
            f"Spread: the largest |g| is 2^{largest[0]:.1f} ({largest[1]}), the smallest median 2^{smallest[0]:.1f} "
            f"({smallest[1]}): {largest[0] - smallest[0]:.1f} binades. fp16 holds 2^-24 (its smallest subnormal) to "
            "2^16 (overflow): 40 binades.",
        ]
    return "\n".join(lines)


def _mean_std(values: list[float]) -> str:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "nan"
    mean = statistics.fmean(finite)
    std = statistics.stdev(finite) if len(finite) > 1 else 0.0
    return f"{mean:.3f} ± {std:.3f}" + ("" if len(finite) == len(values) else f" ({len(values) - len(finite)} nan)")


def _final_loss(run: Run) -> float:
    """Mean training loss over the last tenth of the steps."""
    tail = run.losses[-max(1, len(run.losses) // 10) :]
    return statistics.fmean(tail)


def table(runs: list[Run]) -> str:
    """The markdown table: one row per (task, method), seeds aggregated."""
    metric_of = {r.task: r.metric_name for r in runs}
    lines = [
        "| task | gradients | method | metric (mean ± std) | final train loss | skipped steps "
        "| GS retried steps | GS recomputed steps | gradient underflow | per-tensor oracle | GS update iterations "
        "| s / run | s ÷ dynamic |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = time_ratios(runs)
    for task in dict.fromkeys(r.task for r in runs):
        for key in dict.fromkeys(r.method for r in runs if r.task == task):
            rs = [r for r in runs if r.task == task and r.method == key]
            method = METHODS[key]
            under = [r.underflow for r in rs if r.underflow is not None]
            oracle = [r.oracle_underflow for r in rs if r.oracle_underflow is not None]
            updates = [r.update_iterations for r in rs if r.update_iterations is not None]
            recomputed = [r.recomputed_steps for r in rs if r.recomputed_steps is not None]
            retried = [r.retried_steps for r in rs if r.retried_steps is not None]
            lines.append(
                f"| {task} | {method.grads} | {method.label} | {metric_of[task]} {_mean_std([r.metric for r in rs])} "
                f"| {_mean_std([_final_loss(r) for r in rs])} "
                f"| {statistics.fmean(r.skipped_steps for r in rs):.1f} "
                f"| {f'{statistics.fmean(retried):.1f}' if retried else '—'} "
                f"| {f'{statistics.fmean(recomputed):.1f}' if recomputed else '—'} "
                f"| {_percent(under)} | {_percent(oracle)} "
                f"| {f'{statistics.fmean(updates):.1f}' if updates else '—'} "
                f"| {statistics.fmean(r.seconds for r in rs):.1f} "
                f"| {_ratio(ratios.get((task, method.grads, key), []))} |"
            )
    return "\n".join(lines)


def _ratio(values: list[float]) -> str:
    """Mean of per-seed time ratios (and their range), "—" if none was measured in lockstep."""
    if not values:
        return "—"
    return f"{statistics.fmean(values):.2f}" + (f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else "")


def _percent(values: list[float]) -> str:
    """Mean of fractions as a percentage, "—" if none; three decimals below 0.1% (the oracle is often there)."""
    if not values:
        return "—"
    mean = 100 * statistics.fmean(values)
    return f"{mean:.3f}%" if 0 < mean < 0.1 else f"{mean:.2f}%"


def plot(runs: list[Run], folder: Path) -> list[Path]:
    """Training-loss curves (mean over seeds, smoothed), one PNG per task: fp16, fp8 on the fp16 path, fp8 ∇Y panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for task in dict.fromkeys(r.task for r in runs):
        groups = {
            "fp16 gradients": ("fp32", "bf16", "fp16"),
            "fp8 GEMM outputs (fp16 path)": ("fp32", "e5m2", "e4m3fn"),
            "fp8 ∇Y (hardware path)": ("fp32", "bf16 + e5m2 ∇Y", "bf16 + e4m3fn ∇Y"),
        }
        fig, axes = plt.subplots(1, 3, figsize=(17, 4.2), sharey=True)
        for ax, (title, grads) in zip(axes, groups.items()):
            for key in dict.fromkeys(r.method for r in runs if r.task == task):
                method = METHODS[key]
                if method.grads not in grads:
                    continue
                curves = torch.tensor(
                    [r.losses for r in runs if r.task == task and r.method == key], dtype=torch.float64
                )
                mean = curves.mean(0)
                window = max(1, len(mean) // 30)
                smooth = torch.nn.functional.avg_pool1d(mean[None, None], window, 1).flatten()
                label = method.label if method.grads in ("fp32", "bf16") else f"{method.grads} {method.label}"
                ax.plot(
                    range(window - 1, len(mean)),
                    smooth.numpy(),
                    label=label,
                    linestyle="--" if method.grads in ("fp32", "bf16") else "-",
                )
            ax.set_title(f"{task}: {title}")
            ax.set_xlabel("step")
            ax.set_yscale("log")
            if ax.lines:  # a run may leave a panel empty (no method in its gradient formats)
                ax.legend(fontsize=7)
        axes[0].set_ylabel("training loss (mean over seeds)")
        fig.tight_layout()
        path = folder / f"compare_training_{task}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def add_run_arguments(parser: argparse.ArgumentParser, cache: str) -> None:
    """The options every training bench shares: underflow sampling, data cache, outputs, reports, threads.

    ``cache`` names the folder under the system's temporary directory for the generated datasets.
    """
    # Every step by default: GS updates its scales on some steps (every 100th, and when the gradients
    # drift), so a fixed stride samples them unevenly; steps 0, 10, 20... measured GS's ResNet-8 e5m2
    # underflow at 0.08% where every step gives 0.32% (README, the table's seventh run).
    parser.add_argument(
        "--underflow-every",
        type=int,
        default=1,
        help="measure GEMM-gradient underflow every N steps (default: every step)",
    )
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / cache, help="generated datasets")
    parser.add_argument("--plots", type=Path, default=None, help="folder for the PNG plots (none if unset)")
    parser.add_argument("--json", type=Path, default=None, help="write every run's results here, after each run")
    parser.add_argument(
        "--report", type=Path, nargs="+", default=None, help="train nothing: table and plots of these --json files"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 suits a shared machine; run tasks in parallel)"
    )


def main(argv: list[str] | None = None) -> list[Run]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny datasets, 10 steps, 1 seed: every method in < 3 min")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument(
        "--methods", nargs="+", choices=list(METHODS), default=None, help=f"default: {' '.join(DEFAULT_METHODS)}"
    )
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 3; --quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 300; --quick 10)")
    parser.add_argument(
        "--underflow-by-tensor",
        type=int,
        default=0,
        metavar="N",
        help="after each emulated run, print the N tensors whose underflow was highest (mean over the steps measured)",
    )
    parser.add_argument(
        "--gradient-magnitudes",
        action="store_true",
        help="first print each task's per-layer gradient magnitudes (one fp32 backward at initialisation)",
    )
    add_run_arguments(parser, cache="gs_lightning_compare")
    parser.add_argument(
        "--merge",
        type=Path,
        default=None,
        metavar="INTO",
        help="add these runs to INTO (an earlier --json file, same steps), replacing any of the same task, method "
        "and seed; written after each run; the table is INTO's",
    )
    args = parser.parse_args(argv)
    if args.merge is not None and args.json is not None:
        parser.error("--merge INTO writes INTO; give it or --json, not both")
    if args.merge is not None and not args.merge.exists():
        parser.error(f"--merge {args.merge}: no such file; expected an earlier run's --json file")
    torch.set_num_threads(args.threads)
    if args.report is not None:
        runs = [Run(**run) for path in args.report for run in json.loads(path.read_text())]
        return report(runs, args.plots, table, plot)
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 3)
    steps = args.steps if args.steps is not None else (10 if args.quick else 300)
    methods = [METHODS[k] for k in (args.methods or DEFAULT_METHODS)]
    if seeds < 1 or steps < 1:
        parser.error(f"--seeds and --steps must be positive, got {seeds} and {steps}")

    earlier = [Run(**run) for run in json.loads(args.merge.read_text())] if args.merge is not None else []
    for run in earlier:
        if run.task in args.tasks and len(run.losses) != steps:
            parser.error(
                f"--merge {args.merge}: its {run.task} runs have {len(run.losses)} steps, these {steps}; "
                "expected the same --steps (and --quick) as the table's"
            )
    tasks = [BUILDERS[name](args.cache, args.quick) for name in args.tasks]
    if args.gradient_magnitudes:
        for task in tasks:
            print(gradient_table(task.name, gradient_magnitudes(task)) + "\n", flush=True)
    runs = []
    total = time.perf_counter()
    for task in tasks:
        for seed in range(seeds):  # seed-major: an interrupted table still has every method
            meters = [
                TensorUnderflowMeter(
                    method.grad_dtype or method.autocast,
                    {tuple(p.shape) for p in task.build(seed).parameters()},
                    method.grad_rounding,
                )
                if args.underflow_by_tensor and method.emulated
                else None
                for method in methods
            ]
            lockstep = train_interleaved(task, methods, seed, steps, args.underflow_every, meters)
            runs += lockstep
            for run, meter in zip(lockstep, meters):
                print(
                    f"{task.name:7s} {run.method:18s} seed {seed}: {task.metric_name} {run.metric:.4f}, "
                    f"skipped {run.skipped_steps}, "
                    f"{'' if not run.retried_steps else f'retried {run.retried_steps}, '}"
                    f"underflow {_or_nan(run.underflow):.4f}"
                    f" (oracle {_or_nan(run.oracle_underflow):.4f}), "
                    f"{'' if run.update_iterations is None else f'{run.update_iterations} update iterations, '}"
                    f"{run.seconds:.1f} s",
                    flush=True,
                )
                if run.skips:
                    print(f"  skipped, and what overflowed: {skip_causes(run.skips)}", flush=True)
                if meter is not None:
                    print(
                        "  most underflow (place in the backward's casts, mean over steps): "
                        + meter.worst(args.underflow_by_tensor),
                        flush=True,
                    )
            # after every seed, so that an interrupted table keeps what it has
            if args.json is not None:
                args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))
            if args.merge is not None:
                args.merge.write_text(json.dumps([asdict(r) for r in merged(earlier, runs)], indent=1))
    print(f"\n{len(runs)} runs, {steps} steps each, {seeds} seed(s), {time.perf_counter() - total:.0f} s in all\n")
    if args.merge is not None:
        print(f"merged into {args.merge}:\n")
        return report(merged(earlier, runs), args.plots, table, plot)
    return report(runs, args.plots, table, plot)


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def merged(earlier: list[Run], runs: list[Run]) -> list[Run]:
    """``earlier`` with ``runs`` in: a run of the same task, method and seed takes the earlier one's place, the
    others follow."""
    new = {(r.task, r.method, r.seed): r for r in runs}
    kept = [new.pop((r.task, r.method, r.seed), r) for r in earlier]
    return kept + list(new.values())


R = TypeVar("R", bound=Run)


def report(
    runs: list[R],
    plots: Path | None,
    make_table: Callable[[list[R]], str],
    make_plots: Callable[[list[R], Path], list[Path]],
) -> list[R]:
    """Print the runs' table and, with ``plots``, write the plots there (this bench's or another's)."""
    print(make_table(runs))
    if plots is not None:
        plots.mkdir(parents=True, exist_ok=True)
        for path in make_plots(runs, plots):
            print(f"wrote {path}")
    return runs


if __name__ == "__main__":
    main()
