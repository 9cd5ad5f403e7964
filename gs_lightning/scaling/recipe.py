"""The scaling recipe: Algorithm 1's settings and every rule this implementation adds to it, in one frozen config.

Policy lives here; the mechanism that applies it (:mod:`~gs_lightning.scaling.update`,
:mod:`~gs_lightning.scaling.drift`, :mod:`~gs_lightning.scaling.recompute`) reads it and holds no
tuned number of its own, as Transformer Engine's ``DelayedScaling`` and torchao's
``Float8LinearConfig`` keep theirs. Two presets:

* :meth:`ScalingRecipe.default` (``ScalingRecipe()``): the rules measured on
  ``bench/compare_training.py`` (three tasks, fp16 and e5m2 gradients, three seeds), which took
  its GS cells to no skipped step;
* :meth:`ScalingRecipe.paper`: Algorithm 1 as published (Zhao et al., IJCAI 2020): the paper's
  λmin, scales from Theorem 1 (GEMMs) and Theorem 2 (casts) alone, recomputed every
  ``update_interval`` iterations (and after a skipped step), with each rule beyond the paper off by
  name, so that the two can be compared on the same run. What the paper is silent on (the bounds on
  weight gradients, branch sums and gains, opaque regions, the back-off after an overflow, the fp32
  range of a scale) is decided as in the default.

Each field's docstring says what it protects against, the case that needed it and the command that
measures it ("How it works" in the docs). :meth:`ScalingRecipe.inert_fields` names the fields another
field turns off.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

LambdaMin = Literal["normal", "subnormal"]


@dataclass(frozen=True)
class ScalingRecipe:
    """What :class:`~gs_lightning.scaling.GradientScaler` decides by: the paper's settings and the rules beyond them.

    Built once and validated once (here); ``GradientScaler``, the Lightning and Fabric plugins and
    the app's ``conf/precision/gs.yaml`` all take one. Saved in the scaler's ``state_dict`` and
    restored from it (:meth:`GradientScaler.load_state_dict <gs_lightning.scaling.GradientScaler.load_state_dict>`).
    Every field below says what it protects against, the case that needed it and the command that
    measures it (``pytest`` paths are under ``tests/scaling/``, benches under ``bench/``).

    Algorithm 1's settings (the paper's):

    Attributes:
        underflow_rate: γ', the fraction of a gradient's elements allowed to underflow (paper: 1e-3).
        update_interval: Recompute the scales at least every this many backward passes (paper:
            100); sooner when a rule below asks.
        lambda_min: λmin of the underflow model: ``"subnormal"``, the format's smallest subnormal
            (the paper's 6e-8 for fp16), or ``"normal"``, its smallest normal number, below which
            values keep fewer significant bits (measured closer to fp32: ``bench/fidelity.py``).
        relu_factor: Multiplies the accumulation length N of Lemma 1 (the paper: 1/2 behind a
            ReLU; 1 fits when σ(∇Y) is measured on the actual gradient, zeros included).
        max_layer_scale: Optional cap on each local scale β (the reference code used 16).
        max_total_scale: Optional cap on each accumulated scale (the reference code used 1024).

    How a decision measures underflow:

    Attributes:
        exact_probes: Decide GEMMs and casts on exact fp32 values of what they send on and of
            their weight gradients (order statistics of a probe slice), where Theorem 1 misjudges
            small N and sparse ∇Y and Theorem 2 misjudges non-log-normal casts (SSD300's heads:
            up to 40% of weight-gradient values below λmin without). ``False``: Theorem 1 and 2 alone.
        probe_elements: Values computed exactly per probed output (what a GEMM sends on, a cast, a
            fused node's inputs).
        weight_probe_elements: Values computed exactly per probed weight gradient, at most. No effect
            without ``exact_probes``.
        weight_probe_macs: Multiply-adds a weight-gradient probe may spend (fewer values where
            each sums over many positions). No effect without ``exact_probes``.

    Where the paper is silent (the same in both presets: Algorithm 1 on a real autograd graph needs
    each, and :meth:`paper` decides with them as the default does):

    Attributes:
        weight_grad_bounds: Bound each GEMM's scale by a Cauchy–Schwarz bound on the weight (and
            exact bias) gradient it computes in low precision, beside the paper's bound on the ∇X
            it sends on. Protects against weight gradients overflowing fp16 first, since each sums
            over batch × positions (SSD300's heads). Measured by ``python
            bench/weight_grad_overflow.py`` (the run with and without it) and ``pytest
            tests/scaling/test_scaler.py::test_weight_gradients_do_not_overflow``.
        branch_sum_bound: Bound the **sum** of the parts meeting at a branch, not each part, and do
            so where they share a scale if the sum is taken in a low precision. Protects against a
            sum that overflows although every part is finite (a weight used three times under
            autocast). Measured by ``pytest tests/scaling/test_zoo_patterns.py
            -k "reused_three_times or branch_sum_before"``.
        gain_bounds: Multiply every bound on a gradient sent towards a node that can make it grow
            before the next decision by that growth: a batch norm's max|γ|·invstd, a product by a
            constant, a first backward's saved gradient under a second. Protects against a gradient
            bounded below λmax that a batch norm then lifts above it (a branch sum before a batch
            norm; SegNet-basic). Measured by ``pytest tests/scaling/test_zoo_patterns.py
            -k branch_sum_before_a_batch_norm`` and ``pytest
            tests/scaling/test_update.py::test_a_product_by_a_constant_counts_as_a_gain``.
        opaque_probe_headroom_log2: An opaque region (custom autograd Function, compiled region)
            is probed this many binades below the overflow of the gradient entering it: room for
            its gradients to grow inside it, where nothing can be measured (its weight gradients
            measured 2^1.4 (MLP), 2^3.0 (ResNet-18) and 2^10.4 (SegNet-basic on 0-255 pixels) above
            the gradient entering it, compiled with torch.compile; commit 3823f68). Measured by
            ``pytest tests/scaling/test_opaque.py``.
        opaque_margin_log2: Binades an opaque region's settled scale keeps below the overflow of
            what entered or left it on its probe, as a dynamic loss scale keeps one (the gradients
            of the batches to come are not measured inside it). Measured by ``pytest
            tests/scaling/test_opaque.py``.
        backoff_bits: Bits an overflow takes off the accumulated scale of the layers it came from
            (per-layer back-off). Protects against the next
            update choosing the same scale on a batch like the one that overflowed. Chosen on
            ``python bench/compare_training.py`` (ResNet-8, e5m2 gradients, seed 0, 200 steps; commit
            067a424): 2 bits skipped 5 steps at 0.084% GEMM-gradient underflow, 3 bits 3 steps at
            0.129%; the rule by ``pytest tests/scaling/test_drift.py -k lowers_only_the_overflowing``.
        unattributed_backoff_bits: Bits an overflow no layer can be named for (a non-finite loss, a
            gradient written by user code) takes off every accumulated scale, below the largest that
            ran: the whole graph backs off, as a dynamic loss scale does (by one binade, as
            ``GradScaler``'s default ``backoff_factor=0.5``). The rule by ``pytest
            tests/scaling/test_backoff.py``.
        min_backoff_log2: The back-off stops here: a non-finite *forward* cannot be fixed by scaling.
        max_log2_total_scale: Accumulated scales stay at or below 2^this, where fp32 (the
            arithmetic that applies a factor, and the scalar it is given as) represents every
            factor and its inverse as a normal number: beyond 2^127 a factor is inf (gradients of
            1e-42 in fp32 asked for 2^140 and came back NaN). A constant of fp32, kept a field so
            that nothing caps a scale outside the recipe. At most 126.
        max_graphs: Backward graph structures kept at once, each with its own plans and schedule
            (:mod:`~gs_lightning.scaling.graph_scales`): a model whose graph changes with its input
            would otherwise keep one plan per variant it ever ran; the least recently run goes
            first. Measured by ``pytest
            tests/scaling/test_graph_scales.py::test_at_most_max_graphs_structures_are_kept``.

    Rules beyond the paper (each off in :meth:`paper`; its value there in brackets):

    Attributes:
        replay_headroom_log2: Binades kept below λmax by every exact overflow bound, so a gradient
            may grow between updates before a replay overflows (GPT-2's c_proj bias gradients
            overflowed one SGD step after an update without it; ``python bench/replay_headroom.py``).
            [0]
        weight_grad_margin_log2: Binades kept above a weight gradient measured exactly on the
            update iteration, where that measurement replaces the Cauchy–Schwarz bound (measured
            where no expected maximum bounds the GEMM's parameter gradients instead: on the first
            update and a retried step's; without ``expected_maxima_margin_log2``, then where that
            bound held on an earlier update): the measured value is this batch's, and the batches
            until the next update vary around it. Chosen on
            ``python bench/compare_training.py`` (commit 383b9ea); the rule by ``pytest
            tests/scaling/test_drift.py -k "weight_gradient_is_measured"``. No effect without
            ``exact_probes`` and ``weight_grad_bounds``. [0]
        wide_branch_scale: The scale of a branch's sum taken in a wider format than the gradients'
            (fp32 under autocast: a Transformer's residual stream): ``"smallest"`` of the incoming
            ones (exact there; the decisions below raise it as their own values need), or
            ``"largest"`` that fits below overflow, Algorithm 1's rule for every branch, which
            carried a BERT key projection's 2^25 down its whole residual stream until a bias
            gradient overflowed on the next batch (with gradient accumulation; GradScaler skipped
            none). [``"largest"``]
        drift_tolerance_log2: Ask for an update when a scale group's largest weight gradient
            falls this many binades below its value at the last update (its underflow roughly
            doubles per binade), where ``follow_gradients`` does not raise it instead. ``None``: no
            drift-triggered update. Measured by ``pytest tests/scaling/test_drift.py -k shrinkage`` and
            ``tests/scaling/test_recipe.py -k on_schedule_only``. [``None``]
        update_after_zero_gradient: An update that meets a weight gradient newly all zeros asks for
            another on the next backward, and between updates one that turns nonzero counts as
            drift: such a gradient gives its layers nothing to decide on, and it turns nonzero with
            the first step (a residual branch behind a zero-initialised BatchNorm weight, LoRA's
            zero B). Measured by ``pytest tests/scaling/test_drift.py -k all_zero``. No effect
            without ``drift_tolerance_log2``. [``False``]
        keep_scale_on_zero_gradient: A GEMM whose incoming gradient is all zeros on an update keeps the
            accumulated scale of the plan the update replaces (not on a structure's first update, which has
            none), and its weight gradients, all zeros, ask for no other update (``update_after_zero_gradient``);
            between updates, a scale group whose weight and bias gradients are all zeros received zeros, which is
            not drift: nothing to decide on, and nothing decided on nothing (SSD300's heads on a feature map where
            a batch has no positive anchor: 17 of 29 updates in 100 steps had a zero gradient among their reasons,
            fp16, seed 0). Measured by ``python bench/compare_training.py --tasks ssd`` and ``pytest
            tests/scaling/test_drift.py -k keeps_its_scale``. [``False``]
        level_steps: A group's largest weight gradient is judged by the larger of the batch's and
            the median of its last this many steps, so that one small batch is not drift; the
            expected maxima's level is the same median. 1: the batch alone. No effect without
            ``drift_tolerance_log2`` or ``expected_maxima_margin_log2``. [1]
        expected_maxima_margin_log2: Bound each GEMM by the largest value its parameter
            gradients reached in the last ``update_interval`` steps (their level and spikes),
            with this many binades to spare; a batch above that asks for an update where its
            layer's scale no longer keeps the margin. Only gradients the format can overflow
            (:func:`~gs_lightning.scaling.walks.format_bounded_leaves`): not a normalisation's fp32
            weight and bias, computed in fp32. ``None``: no such bound, no such update.
            Where it is known, it stands in for a weight gradient's Cauchy–Schwarz bound, which
            an update then needs no exact GEMM to relax (``weight_grad_margin_log2``): ResNet-8
            (fp16, 200 steps) ran 15-16 updates instead of 17-21, none asked for to measure a
            layer, at the same underflow. Protects against a converged task's occasional hard batch
            (ResNet-8's, up to 2^10 above the median) overflowing scales an update chose on easy
            ones; 3 chosen on ``python bench/compare_training.py`` (commit 9032bdd); the rule by ``pytest
            tests/scaling/test_drift.py -k spikes_of_recent_batches``. [``None``]
        kept_downstream_cap: Send no GEMM more scale than it keeps for its own weight gradients
            (under expected maxima): the surplus protects no value (the GEMM multiplies it away
            first) and can only overflow (ResNet-8's logits gradient overflowed on a hard batch
            although the layer it feeds sat 2^5 lower; what holds the demo's cast before the
            softmax). Measured by ``pytest tests/scaling/test_drift.py -k sends_no_more_scale``. No
            effect without ``expected_maxima_margin_log2``. [``False``]
        expect_surprise_within_margin: A weight gradient rising above what the last update expected
            of it asks for no update where its layer's scale still keeps the margin above the new
            value: that value is expected from then on (the update would not lower the layer on its
            account; SegNet updated on 45-54 of 200 steps without it, 4-9 with it). Measured by
            ``pytest tests/scaling/test_drift.py -k within_the_margin``. No effect without
            ``expected_maxima_margin_log2``. [``False``]
        spike_room_log2: Under those expected maxima, lower a GEMM's scale by up to this many
            more binades while its outputs still meet γ' against the subnormal range (precision,
            not values, is what that costs; ResNet-8 seed 0 skipped step 72 without it). Measured by
            ``pytest tests/scaling/test_drift.py -k spike_room``. No effect without
            ``expected_maxima_margin_log2``, nor with ``lambda_min="subnormal"``. [0]
        retry_overflowed_steps: Where a step's gradients overflowed in layers the step's read can name (not a
            non-finite loss) and the caller gave :meth:`GradientScaler.step <gs_lightning.scaling.GradientScaler.step>`
            a ``retry`` (the Lightning and Fabric plugins give their closures), back those layers off as a skipped step
            would and run the iteration's forward and backward again on the same batch, an update iteration, instead of
            skipping the step; the caps go with the retried step, whose read holds the values that overflowed. The
            overflow costs one iteration more, not a batch, and nothing is kept between updates for it (the fp32
            recompute, ``recompute_weight_gradients``, keeps the forward's activations until the step: 1.19× a plain
            backward's peak on ResNet-50, 1.36× on ViT-B/16). Once per step: an overflow on the retry skips it. On the
            training tables it skipped no step in any cell, where the recompute (*GS, fp32 recompute*) skips 0.3 per run
            on one of the eight and a loop without a retry 0.2-1.7 on six (*GS, no retry*), at -3 to +7 points of the
            run's time over the dynamic loss scale's against the recompute. Measured by ``python
            bench/compare_training.py`` (its *GS retried steps*) and ``pytest tests/scaling/test_retry.py``.
            [``False``]
        recomputed_spike_share: Where an overflowed weight gradient is recomputed, or its step retried (after a step
            that offered a retry), each GEMM is bounded by the level of its parameter gradients and this share (in
            binades) of their spikes: a spike above it costs a recompute or a retry, not a skipped step (0 skipped
            steps at 0.5 where 0 skipped once on 2 of 3 seeds of ResNet-8 e5m2; ``python
            bench/compare_training.py``, commit edf8514); 1: the whole spikes, as where an overflow skips the
            step. No effect without ``recompute_weight_gradients`` or ``retry_overflowed_steps``, and
            ``expected_maxima_margin_log2``. [1]

    Opt-in rules (off in both presets):

    Attributes:
        recompute_weight_gradients: Between updates, keep each GEMM's incoming gradient and saved
            operand until the step, and recompute a weight gradient that overflowed in fp32
            instead of skipping the step: for loops that give :meth:`GradientScaler.step
            <gs_lightning.scaling.GradientScaler.step>` no retry (the Fabric plugin, Accelerate, the Hugging Face
            Trainer), at the price of memory (the peak between updates 1.19× a plain backward's on ResNet-50 at
            batch 16, 128², 1.36× on ViT-B/16: ``python bench/memory.py``; the rule by ``pytest
            tests/scaling/test_recompute.py``). Off in both presets: memory as a plain backward's by default.
        own_input_gradient_scale: Give what a GEMM sends on (its input gradient, ∇X) a scale of its own, up to the
            one γ' asks of it, where the node's scale is held lower by its weight and bias gradients (their overflow
            bounds, expected maxima and spike room): the saved weight the node computes ∇X from is multiplied by that
            power of two as the backward unpacks it (exact; its weight and bias gradients, computed from the input and
            the incoming gradient, keep the node's scale). Its own bound against spikes: the largest ∇X it sent on in
            the last ``update_interval`` replays, grown by the batch norms before the next decision, kept
            ``expected_maxima_margin_log2`` below λmax (one reduction per such GEMM on each replay; none before the
            replays measured it). A branch's sum then takes the smallest scale its parts carry (a part is raised for
            its own values, not for the others'). Costs that reduction, a product over each shifted weight as its
            node runs, and a second choice on updates. Eager graphs only: not in a reentrant checkpoint's inner graph,
            a compiled module's, or where the weight's saved tensor has hooks of its own. Off in both presets: on the
            training tables (their *GS, own input-gradient scales* rows) it lowered GEMM-gradient underflow in 7 of
            8 cells (the deep CNN with e5m2 gradients: 0.16% against 2.68%), cost 4-11 points of the run's time over
            the dynamic loss scale's, and skipped a step in 1 of 3 SSD300 fp16 runs and 1 of 5 deep e5m2 runs, where
            GS skips none. Measured by ``python bench/compare_training.py --methods e5m2-gs e5m2-gs-own-input-scale``
            and ``pytest tests/scaling/test_input_shift.py``.
        follow_gradients: Between updates, raise each GEMM's accumulated scale at the step by the whole binades
            the level of the parameter gradients it computes fell below the update's, and by a binade more
            each step more than γ' of their nonzero values sit below λmin at its scale, up to the update's
            own bound on them, and lower it to that bound where their level or a spike rose above it; all layers
            at once on the host, from what the step's one read takes (:mod:`~gs_lightning.scaling.follow`).
            Such a fall, or such a rise, then asks for no update (the drift rule still asks where a GEMM's scale
            was held by what it sends on). Fewer update iterations where gradients
            shrink as a run converges, for a count over a strided sample of each followed weight gradient at
            the step (on a CPU, ResNet-50's ``step()`` took 22 ms with it against 13 ms without, 64x64, batch
            2, one thread).
            Off in both presets until it holds every cell of the training tables (their *GS, following the
            gradients* rows). Measured by ``python bench/compare_training.py --methods fp16-gs fp16-gs-follow``
            and ``pytest tests/scaling/test_follow.py``.

    A field with no effect given another (each "No effect without" above) is allowed at its default
    and at its value in :meth:`paper`, and :meth:`inert_fields` names it with the field that turns it
    off; any other value there is an error naming both (a setting that was asked for and does nothing).
    """

    underflow_rate: float = 1e-3
    update_interval: int = 100
    lambda_min: LambdaMin = "normal"
    relu_factor: float = 1.0
    max_layer_scale: float | None = None
    max_total_scale: float | None = None

    exact_probes: bool = True
    probe_elements: int = 2**16
    weight_probe_elements: int = 2**13
    weight_probe_macs: int = 2**22

    weight_grad_bounds: bool = True
    branch_sum_bound: bool = True
    gain_bounds: bool = True
    opaque_probe_headroom_log2: int = 12
    opaque_margin_log2: int = 1
    backoff_bits: int = 2
    unattributed_backoff_bits: int = 1
    min_backoff_log2: int = -64
    max_log2_total_scale: int = 100
    max_graphs: int = 8

    replay_headroom_log2: float = 1.0
    weight_grad_margin_log2: float = 0.5
    wide_branch_scale: Literal["smallest", "largest"] = "smallest"
    drift_tolerance_log2: float | None = 1.0
    update_after_zero_gradient: bool = True
    keep_scale_on_zero_gradient: bool = True
    level_steps: int = 8
    expected_maxima_margin_log2: float | None = 3.0
    kept_downstream_cap: bool = True
    expect_surprise_within_margin: bool = True
    spike_room_log2: float = 3.0
    retry_overflowed_steps: bool = True
    recomputed_spike_share: float = 0.5

    recompute_weight_gradients: bool = False
    own_input_gradient_scale: bool = False
    follow_gradients: bool = False

    def __post_init__(self) -> None:
        def fail(field: str, expected: str) -> None:
            raise ValueError(f"ScalingRecipe: {field} must be {expected}, got {getattr(self, field)!r}")

        if not (_is_number(self.underflow_rate) and 0.0 < self.underflow_rate < 0.5):
            fail("underflow_rate", "a number in (0, 0.5)")
        positive = ("update_interval", "level_steps", "probe_elements", "weight_probe_elements", "weight_probe_macs")
        for field in (*positive, "max_graphs"):
            if not _is_int(getattr(self, field)) or getattr(self, field) < 1:
                fail(field, "a positive integer")
        if self.lambda_min not in ("normal", "subnormal"):
            fail("lambda_min", "'normal' or 'subnormal'")
        if not (_is_number(self.relu_factor) and self.relu_factor > 0.0):
            fail("relu_factor", "a positive number")
        for field in ("max_layer_scale", "max_total_scale"):
            value = getattr(self, field)
            if value is not None and not (_is_number(value) and value >= 1.0):
                fail(field, "None or a number >= 1")
        switches = (
            "exact_probes",
            "follow_gradients",
            "weight_grad_bounds",
            "branch_sum_bound",
            "gain_bounds",
            "update_after_zero_gradient",
            "keep_scale_on_zero_gradient",
            "kept_downstream_cap",
            "expect_surprise_within_margin",
            "recompute_weight_gradients",
            "retry_overflowed_steps",
            "own_input_gradient_scale",
        )
        for field in switches:
            if not isinstance(getattr(self, field), bool):
                fail(field, "True or False")
        for field in ("replay_headroom_log2", "weight_grad_margin_log2", "spike_room_log2"):
            if not (_is_number(getattr(self, field)) and getattr(self, field) >= 0.0):
                fail(field, "a number >= 0 (binades)")
        for field in ("drift_tolerance_log2", "expected_maxima_margin_log2"):
            value = getattr(self, field)
            if value is not None and not (_is_number(value) and value > 0.0):
                fail(field, "None (the rule off) or a positive number of binades")
        if self.wide_branch_scale not in ("smallest", "largest"):
            fail("wide_branch_scale", "'smallest' or 'largest'")
        for field in ("opaque_probe_headroom_log2", "opaque_margin_log2"):
            if not _is_int(getattr(self, field)) or getattr(self, field) < 0:
                fail(field, "an integer >= 0")
        if not (_is_number(self.recomputed_spike_share) and 0.0 <= self.recomputed_spike_share <= 1.0):
            fail("recomputed_spike_share", "a number in [0, 1]")
        for name in ("backoff_bits", "unattributed_backoff_bits"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                fail(name, "a positive integer")
        if not _is_int(self.min_backoff_log2) or self.min_backoff_log2 > 0:
            fail("min_backoff_log2", "an integer <= 0")
        if not _is_int(self.max_log2_total_scale) or not 1 <= self.max_log2_total_scale <= 126:
            fail("max_log2_total_scale", "an integer in [1, 126] (fp32 keeps 2^±126 normal)")
        self._check_couplings()

    def _check_couplings(self) -> None:
        """Refuse a value that was asked for and does nothing given another field (class docstring)."""
        if self.max_total_scale is not None and math.log2(self.max_total_scale) >= self.max_log2_total_scale:
            raise ValueError(
                f"ScalingRecipe: max_total_scale={self.max_total_scale!r} caps nothing: max_log2_total_scale="
                f"{self.max_log2_total_scale!r} already keeps every accumulated scale at or below "
                f"2^{self.max_log2_total_scale}. Leave max_total_scale None or give it a smaller value."
            )
        defaults, paper = ScalingRecipe.__dataclass_fields__, _PAPER_VALUES
        for field, why in self.inert_fields().items():
            value = getattr(self, field)
            allowed = (defaults[field].default, paper.get(field, defaults[field].default))
            if value not in allowed:
                kept = " or ".join(dict.fromkeys(map(repr, allowed)))
                raise ValueError(
                    f"ScalingRecipe: {field}={value!r} has no effect: {why}. Leave {field} at {kept}, or change "
                    "the field that turns it off."
                )

    def inert_fields(self) -> dict[str, str]:
        """Field -> why it has no effect in this recipe, naming the field (or fields) that turn it off.

        Empty for the default recipe; :meth:`paper`'s turns off rules whose settings stay at values
        that then decide nothing.
        """
        return {
            field: f"it is read only {where}, and here {', '.join(f'{n}={getattr(self, n)!r}' for n in needs)}"
            for field, needs, active, where in _COUPLINGS
            if not active(self)
        }

    @classmethod
    def default(cls) -> ScalingRecipe:
        """The rules measured on ``bench/compare_training.py`` (the same as ``ScalingRecipe()``)."""
        return cls()

    @classmethod
    def paper(cls) -> ScalingRecipe:
        """Algorithm 1 as published: λmin the smallest subnormal, Theorem 1 and 2 alone, an update every
        ``update_interval`` iterations (and after a skipped step), and every rule beyond the paper's off,
        each named (the class docstring's last group, with its value here in brackets).

        What the paper is silent on stays as in the default recipe (the class docstring's third group):
        nodes it has no model for (fused attention and RNNs, opaque regions), the overflow bounds on
        what a GEMM computes besides ∇X (the paper bounds ∇X; the weight gradients computed in low
        precision are bounded the same way), without headroom, and the back-off after an overflow.
        """
        return cls(**_PAPER_VALUES)

    @classmethod
    def named(cls, name: str) -> ScalingRecipe:
        """A preset by name: ``"default"`` or ``"paper"``."""
        presets = {"default": cls.default, "paper": cls.paper}
        if name not in presets:
            raise ValueError(f"ScalingRecipe: no preset named {name!r}; expected one of {sorted(presets)}")
        return presets[name]()

    def replace(self, **changes: Any) -> ScalingRecipe:
        """A copy with ``changes`` applied (validated); an unknown field is an error naming the nearest ones."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(changes.keys() - fields)
        if unknown:
            hints = {k: difflib.get_close_matches(k, sorted(fields), n=2) for k in unknown}
            said = "; ".join(
                f"{k!r}" + (f" (did you mean {' or '.join(map(repr, h))}?)" if h else "") for k, h in hints.items()
            )
            raise TypeError(f"ScalingRecipe has no field {said}. Its fields: {', '.join(sorted(fields))}")
        return dataclasses.replace(self, **changes)

    @property
    def measures_drift(self) -> bool:
        """Whether a rule reads the weight gradients' largest values between updates (none in the paper's): the
        retry too, which needs the layers that overflowed named."""
        return (
            self.follow_gradients
            or self.drift_tolerance_log2 is not None
            or self.expected_maxima_margin_log2 is not None
            or self.recompute_weight_gradients
            or self.retry_overflowed_steps
        )

    def state_dict(self) -> dict[str, Any]:
        """Every field, as plain values."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> ScalingRecipe:
        """The recipe :meth:`state_dict` saved (fields added since keep their defaults)."""
        return cls().replace(**state)

    def differences(self, other: ScalingRecipe) -> dict[str, tuple[Any, Any]]:
        """Field -> (this value, ``other``'s) where they differ."""
        return {
            f.name: (getattr(self, f.name), getattr(other, f.name))
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        }


# The paper preset: the paper's λmin, Theorem 1 and 2 without exact probes, and each rule beyond the paper at its
# off value. tests/scaling/test_recipe.py checks that this is every beyond-paper field and nothing else.
_PAPER_VALUES: dict[str, Any] = {
    "lambda_min": "subnormal",
    "exact_probes": False,
    "replay_headroom_log2": 0.0,
    "weight_grad_margin_log2": 0.0,
    "wide_branch_scale": "largest",
    "drift_tolerance_log2": None,
    "update_after_zero_gradient": False,
    "keep_scale_on_zero_gradient": False,
    "level_steps": 1,
    "expected_maxima_margin_log2": None,
    "kept_downstream_cap": False,
    "expect_surprise_within_margin": False,
    "spike_room_log2": 0.0,
    "retry_overflowed_steps": False,
    "recomputed_spike_share": 1.0,
}

# (field, the fields it depends on, whether they let it act, where it is read): a field whose condition fails has no
# effect (ScalingRecipe.inert_fields).
_COUPLINGS: tuple[tuple[str, tuple[str, ...], Callable[[ScalingRecipe], bool], str], ...] = (
    (
        "weight_grad_margin_log2",
        ("exact_probes", "weight_grad_bounds"),
        lambda r: r.exact_probes and r.weight_grad_bounds,
        "where an exact probe measures a weight gradient whose overflow bound binds",
    ),
    ("weight_probe_elements", ("exact_probes",), lambda r: r.exact_probes, "by exact probes"),
    ("weight_probe_macs", ("exact_probes",), lambda r: r.exact_probes, "by exact probes"),
    (
        "update_after_zero_gradient",
        ("drift_tolerance_log2",),
        lambda r: r.drift_tolerance_log2 is not None,
        "as drift, which only a drift tolerance turns into an update",
    ),
    (
        "level_steps",
        ("drift_tolerance_log2", "expected_maxima_margin_log2"),
        lambda r: r.drift_tolerance_log2 is not None or r.expected_maxima_margin_log2 is not None,
        "by the drift rule and the expected maxima",
    ),
    (
        "kept_downstream_cap",
        ("expected_maxima_margin_log2",),
        lambda r: r.expected_maxima_margin_log2 is not None,
        "under expected maxima (the scale a GEMM keeps comes from them)",
    ),
    (
        "expect_surprise_within_margin",
        ("expected_maxima_margin_log2",),
        lambda r: r.expected_maxima_margin_log2 is not None,
        "under expected maxima (a surprise is a rise above them)",
    ),
    (
        "spike_room_log2",
        ("expected_maxima_margin_log2", "lambda_min"),
        lambda r: r.expected_maxima_margin_log2 is not None and r.lambda_min == "normal",
        "under expected maxima, against the subnormal range below lambda_min='normal'",
    ),
    (
        "recomputed_spike_share",
        ("recompute_weight_gradients", "retry_overflowed_steps", "expected_maxima_margin_log2"),
        lambda r: (
            (r.recompute_weight_gradients or r.retry_overflowed_steps) and r.expected_maxima_margin_log2 is not None
        ),
        "where weight gradients are recomputed or overflowed steps retried, under expected maxima (the spikes it "
        "shares are theirs)",
    ),
)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_recipe(recipe: ScalingRecipe | str | None = None, **fields: Any) -> ScalingRecipe:
    """``recipe`` (a :class:`ScalingRecipe`, a preset's name, or ``None`` for the default) with ``fields`` changed.

    The one place options become a recipe: :class:`~gs_lightning.scaling.GradientScaler`, the
    plugins and the app's config all call it, so a bad value fails the same way everywhere.
    """
    if recipe is None:
        recipe = ScalingRecipe()
    elif isinstance(recipe, str):
        recipe = ScalingRecipe.named(recipe)
    elif not isinstance(recipe, ScalingRecipe):
        raise TypeError(
            f"recipe must be a ScalingRecipe, a preset's name ('default', 'paper') or None, got {type(recipe).__name__}"
        )
    return recipe.replace(**fields) if fields else recipe
