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
  ``update_interval`` iterations (and after a skipped step), with no drift, expected-maxima, spike
  or recompute rule, so that the two can be compared on the same run.

Each field's docstring says what it does and where it was measured ("How it works" in the docs).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, Literal

LambdaMin = Literal["normal", "subnormal"]


@dataclass(frozen=True)
class ScalingRecipe:
    """What :class:`~gs_lightning.scaling.GradientScaler` decides by: the paper's settings and the rules beyond them.

    Built once and validated once (here); ``GradientScaler``, the Lightning and Fabric plugins and
    the app's ``conf/precision/gs.yaml`` all take one. Saved in the scaler's ``state_dict``.

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
        weight_probe_elements: Values computed exactly per probed weight gradient, at most.
        weight_probe_macs: Multiply-adds a weight-gradient probe may spend (fewer values where
            each sums over many positions).

    Rules beyond the paper (each off in :meth:`paper`):

    Attributes:
        replay_headroom_log2: Binades kept below λmax by every exact overflow bound, so a gradient
            may grow between updates before a replay overflows (GPT-2's c_proj bias gradients
            overflowed one SGD step after an update without it). 0 in the paper.
        weight_grad_margin_log2: Binades kept above a weight gradient measured exactly on the
            update iteration, where that measurement replaces the Cauchy–Schwarz bound (measured
            on the first update, then where that bound held on an earlier one).
        opaque_probe_headroom_log2: An opaque region (custom autograd Function, compiled region)
            is probed this many binades below the overflow of the gradient entering it.
        wide_branch_scale: The scale of a branch's sum taken in a wider format than the gradients'
            (fp32 under autocast: a Transformer's residual stream): ``"smallest"`` of the incoming
            ones (exact there; the decisions below raise it as their own values need), or
            ``"largest"`` that fits below overflow, Algorithm 1's rule for every branch, which
            carried a BERT key projection's 2^25 down its whole residual stream until a bias
            gradient overflowed on the next batch (with gradient accumulation; GradScaler skipped none).
        drift_tolerance_log2: Ask for an update when a scale group's largest weight gradient
            falls this many binades below its value at the last update (its underflow roughly
            doubles per binade). ``None``: no drift-triggered update.
        level_steps: A group's largest weight gradient is judged by the larger of the batch's and
            the median of its last this many steps, so that one small batch is not drift.
        expected_maxima_margin_log2: Bound each GEMM by the largest value its parameter
            gradients reached in the last ``update_interval`` steps (their level and spikes),
            with this many binades to spare; a batch above that asks for an update where its
            layer's scale no longer keeps the margin. ``None``: no such bound, no such update.
        spike_room_log2: Under those expected maxima, lower a GEMM's scale by up to this many
            more binades while its outputs still meet γ' against the subnormal range (precision,
            not values, is what that costs).
        recompute_weight_gradients: Between updates, keep each GEMM's incoming gradient and saved
            operand until the step, and recompute a weight gradient that overflowed in fp32
            instead of skipping the step (memory: on ResNet-18 the peak grew by 36% of what the
            forward saves for backward).
        recomputed_spike_share: Where weight gradients are recomputed, their GEMM is bounded by
            their level and this share (in binades) of their spikes.
        backoff_bits: Bits an overflow takes off the accumulated scale of the layers it came from.
        min_backoff_log2: The back-off stops here: a non-finite *forward* cannot be fixed by scaling.
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

    replay_headroom_log2: float = 1.0
    weight_grad_margin_log2: float = 0.5
    opaque_probe_headroom_log2: int = 12
    wide_branch_scale: Literal["smallest", "largest"] = "smallest"
    drift_tolerance_log2: float | None = 1.0
    level_steps: int = 8
    expected_maxima_margin_log2: float | None = 3.0
    spike_room_log2: float = 3.0
    recompute_weight_gradients: bool = True
    recomputed_spike_share: float = 0.5
    backoff_bits: int = 2
    min_backoff_log2: int = -64

    def __post_init__(self) -> None:
        def fail(field: str, expected: str) -> None:
            raise ValueError(f"ScalingRecipe: {field} must be {expected}, got {getattr(self, field)!r}")

        if not (_is_number(self.underflow_rate) and 0.0 < self.underflow_rate < 0.5):
            fail("underflow_rate", "a number in (0, 0.5)")
        for field in ("update_interval", "level_steps", "probe_elements", "weight_probe_elements", "weight_probe_macs"):
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
        for field in ("exact_probes", "recompute_weight_gradients"):
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
        if not _is_int(self.opaque_probe_headroom_log2) or self.opaque_probe_headroom_log2 < 0:
            fail("opaque_probe_headroom_log2", "an integer >= 0")
        if not (_is_number(self.recomputed_spike_share) and 0.0 <= self.recomputed_spike_share <= 1.0):
            fail("recomputed_spike_share", "a number in [0, 1]")
        if not _is_int(self.backoff_bits) or self.backoff_bits < 1:
            fail("backoff_bits", "a positive integer")
        if not _is_int(self.min_backoff_log2) or self.min_backoff_log2 > 0:
            fail("min_backoff_log2", "an integer <= 0")

    @classmethod
    def default(cls) -> ScalingRecipe:
        """The rules measured on ``bench/compare_training.py`` (the same as ``ScalingRecipe()``)."""
        return cls()

    @classmethod
    def paper(cls) -> ScalingRecipe:
        """Algorithm 1 as published: λmin the smallest subnormal, Theorem 1 and 2 alone, an update every
        ``update_interval`` iterations (and after a skipped step), no rule beyond the paper's.

        Nodes the paper has no model for (fused attention and RNNs, opaque regions) are decided as
        in the default recipe, and every overflow bound stays (the paper bounds ∇X; the weight
        gradients computed in low precision are bounded the same way), without headroom.
        """
        return cls(
            lambda_min="subnormal",
            exact_probes=False,
            replay_headroom_log2=0.0,
            wide_branch_scale="largest",
            drift_tolerance_log2=None,
            expected_maxima_margin_log2=None,
            spike_room_log2=0.0,
            recompute_weight_gradients=False,
        )

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
        """Whether a rule reads the weight gradients' largest values between updates (none in the paper's)."""
        return (
            self.drift_tolerance_log2 is not None
            or self.expected_maxima_margin_log2 is not None
            or self.recompute_weight_gradients
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
