"""Per-tensor delayed scaling of fp8 gradients, as Transformer Engine's ``DelayedScaling`` recipe does it.

Followed from Transformer Engine (github.com/NVIDIA/TransformerEngine):

* ``transformer_engine/common/recipe/__init__.py``, ``DelayedScaling``: defaults ``margin=0``,
  ``amax_history_len=1024``, ``amax_compute_algo="max"``, format HYBRID (E4M3 forward, **E5M2
  for gradients**); the documented rule ``scaling_factor = (FP8_MAX / amax) / 2^margin``.
* ``transformer_engine/pytorch/fp8.py``: ``DelayedScalingRecipeState`` (one scale, initialised
  to 1, and one column of an ``[amax_history_len, n]`` history per quantized tensor; the cast
  writes the tensor's amax into row 0); ``_default_get_amax_and_update_history`` (amax = max over
  the history including the current row, then the history rolls by one and row 0 is zeroed);
  ``_default_sf_compute`` (the rule above; the previous scale is kept where amax is 0 or not
  finite; an infinite scale becomes fp32 max). The update runs once per backward pass
  (``FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)``), so iteration t casts
  with the scale computed from the amaxes up to iteration t-1: *delayed* scaling.
* The cast multiplies by the scale and converts with ``__NV_SATFINITE`` (CUDA's ``__nv_fp8_e5m2``
  constructor), i.e. it saturates at ±FP8_MAX instead of overflowing; the consumer multiplies by
  ``scale_inv`` = 1/scale.

torchao's float8 delayed scaling (``torchao/float8/float8_utils.py``: ``amax_history_to_scale``
with ``"max"``, ``amax_to_scale``) is the same rule without margin, with amax clamped at 1e-12
and, for fp16 tensors, the scale capped at 65504; this class follows Transformer Engine.

Transformer Engine quantizes the gradient *entering* each backward GEMM (∇Y):
:func:`gs_lightning.simulate.emulate` does so with ``grad_rounding="entering"``; with its default
``"output"`` it rounds the gradients a backward GEMM *produces* (∇X and ∇W), so each of those gets
its own scale and history. ∇X of one GEMM is, up to elementwise ops, ∇Y of the GEMM before it.
"""

from __future__ import annotations

from typing import Literal

import torch

from gs_lightning.scaling import float_format
from gs_lightning.simulate.rounding import round_to

_FP32_MAX = torch.finfo(torch.float32).max


class DelayedScaling:
    """Transformer Engine's delayed per-tensor amax scaling for the gradients a backward produces.

    Pass it to :func:`gs_lightning.simulate.emulate` (``grad_scaling=``); every gradient the
    emulated backward GEMMs produce is then multiplied by its tensor's scale, cast to the fp8
    format with saturation, and multiplied by the inverse scale. Call :meth:`update` after each
    backward pass: it records the amaxes and computes the scales the next backward uses.

    Tensors are identified by the order in which the backward produces them, which is fixed for a
    fixed graph (one scale per GEMM output, as Transformer Engine keeps one per GEMM operand).

    Args:
        margin: The scale is ``fp8_max / amax / 2**margin``.
        amax_history_len: How many past iterations' amaxes the scale looks at.
        amax_compute_algo: ``"max"`` (largest amax in the history) or ``"most_recent"``.
    """

    def __init__(
        self,
        margin: int = 0,
        amax_history_len: int = 1024,
        amax_compute_algo: Literal["max", "most_recent"] = "max",
    ) -> None:
        if not isinstance(margin, int) or margin < 0:
            raise ValueError(f"DelayedScaling: margin must be a non-negative integer, got {margin!r}")
        if not isinstance(amax_history_len, int) or amax_history_len < 1:
            raise ValueError(f"DelayedScaling: amax_history_len must be a positive integer, got {amax_history_len!r}")
        if amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"DelayedScaling: amax_compute_algo must be 'max' or 'most_recent', got {amax_compute_algo!r}"
            )
        self.margin = margin
        self.amax_history_len = amax_history_len
        self.amax_compute_algo = amax_compute_algo
        self.scale = torch.ones(0)  # [n] scales of the n tensors seen so far
        self.amax_history = torch.zeros(amax_history_len, 0)  # [history, n]; row 0 = current iteration
        self._fp8_max: float | None = None
        self._amaxes: list[torch.Tensor] = []  # amaxes of the current backward, in order

    def quantize(
        self, values: torch.Tensor, fp8_dtype: torch.dtype, out_dtype: torch.dtype, block_dims: tuple[int, ...] = ()
    ) -> torch.Tensor:
        """Scale, cast to ``fp8_dtype`` with saturation, unscale: the next tensor of this backward (``block_dims``
        unused)."""
        fp8_max = float_format(fp8_dtype).max
        if self._fp8_max is None:
            self._fp8_max = fp8_max
        elif self._fp8_max != fp8_max:
            raise ValueError(
                f"DelayedScaling: used with {fp8_dtype} after another fp8 format; use one instance per format"
            )
        k = len(self._amaxes)
        self._amaxes.append(torch.linalg.vector_norm(values.detach(), ord=float("inf"), dtype=torch.float32))
        scale = self.scale[k] if k < self.scale.numel() else torch.ones((), dtype=torch.float32)
        return (round_to(values * scale, fp8_dtype, torch.float32, saturate=True) / scale).to(out_dtype)

    def update(self) -> None:
        """End of a backward pass: record its amaxes, roll the history, compute the next scales."""
        if not self._amaxes:
            return
        n = len(self._amaxes)
        if n > self.scale.numel():  # tensors seen for the first time start at scale 1
            grow = n - self.scale.numel()
            self.scale = torch.cat([self.scale, torch.ones(grow)])
            self.amax_history = torch.cat([self.amax_history, torch.zeros(self.amax_history_len, grow)], dim=1)
        elif n < self.scale.numel():
            raise RuntimeError(
                f"DelayedScaling: this backward produced {n} gradients, earlier ones {self.scale.numel()}; "
                "the graph must stay the same (one instance per model)"
            )
        self.amax_history[0] = torch.stack(self._amaxes)
        self._amaxes.clear()
        if self.amax_compute_algo == "max":
            amax = self.amax_history.max(dim=0).values
        else:
            amax = self.amax_history[0].clone()
        self.amax_history = torch.roll(self.amax_history, -1, 0)
        self.amax_history[0] = 0.0
        new = self._fp8_max / amax / 2.0**self.margin
        new = torch.where((amax > 0) & torch.isfinite(amax), new, self.scale)
        self.scale = torch.where(torch.isinf(new), torch.full_like(new, _FP32_MAX), new)
