"""Current per-tensor and MX block scaling of fp8 gradients, and the per-tensor power-of-two oracle.

Beside :class:`~gs_lightning.simulate.DelayedScaling` (a scale from past amaxes), the two recipes
that scale each tensor from *its own* values, every time it is cast:

* :class:`CurrentScaling`, as Transformer Engine's ``Float8CurrentScaling`` recipe and torchao's
  default float8 training ("tensorwise", dynamic scaling) do it: ``scale = fp8_max / amax`` of the
  tensor being cast. Followed from Transformer Engine's ``common/recipe/__init__.py``
  (``Float8CurrentScaling``: ``QParams(power_2_scale=False, amax_epsilon=0.0)`` for the backward's
  gradients; power-of-two scales only with ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1``) and
  ``common/recipe/recipe_common.cuh`` (``compute_scale_from_amax``: scale 1 where amax is 0 or
  inf, fp32 max where the scale is inf); torchao's ``Float8LinearConfig`` also defaults to
  ``round_scales_to_power_of_2=False`` for tensorwise scaling. So the default here is **not** a
  power of two; ``power_of_two=True`` rounds it down to one (TE's option, torchao's rowwise recipe).
* :class:`MXBlockScaling`, the OCP Microscaling (MX) format v1.0 that Transformer Engine's
  ``MXFP8BlockScaling`` implements: every block of 32 consecutive values along the GEMM's reduction
  dimension shares one power-of-two (E8M0) scale ``X = 2^(floor(log2(amax_block)) - emax_elem)``,
  ``emax_elem`` the exponent of the element format's largest normal (15 for e5m2, 8 for e4m3); the
  elements are ``value / X`` cast to the fp8 format with saturation (the largest block value may
  exceed the element format's max by up to 2x; the spec leaves that case to the implementation and
  TE's cast saturates).

:func:`pow2_oracle_underflow` is the least underflow any per-tensor power-of-two scale without
overflow can give a tensor: the largest such scale underflows fewest values (underflow only falls as
the scale grows), and with it a power-of-two current scaling reaches that floor by construction.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from gs_lightning.scaling import float_format
from gs_lightning.simulate.rounding import round_to

MX_BLOCK_SIZE = 32
_FP32_MAX = torch.finfo(torch.float32).max
_E8M0_MIN_EXPONENT, _E8M0_MAX_EXPONENT = -127, 127


class GradScaling(Protocol):
    """What :func:`~gs_lightning.simulate.emulate` needs of a ``grad_scaling`` recipe."""

    def quantize(
        self, values: torch.Tensor, fp8_dtype: torch.dtype, out_dtype: torch.dtype, block_dims: tuple[int, ...]
    ) -> torch.Tensor:
        """Scale ``values``, cast them to ``fp8_dtype``, unscale, store as ``out_dtype``.

        ``block_dims`` are the dimensions the consuming GEMM reduces over (block recipes group
        values along them; per-tensor recipes ignore them).
        """
        ...

    def update(self) -> None:
        """End of a backward pass (delayed recipes compute their next scales here)."""
        ...


def largest_pow2_scale(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """The largest ``2^k`` with ``amax * 2^k <= fmt_max``, elementwise; 1 where ``amax`` is 0 or not finite.

    Exact: compares the exponents and significands of ``amax`` and ``fmt_max`` (``torch.frexp``)
    instead of rounding ``log2(fmt_max / amax)``.
    """
    amax = amax.float()
    usable = (amax > 0) & torch.isfinite(amax)
    safe = torch.where(usable, amax, torch.ones_like(amax))
    mantissa, exponent = torch.frexp(safe)
    max_mantissa, max_exponent = torch.frexp(torch.tensor(fmt_max, dtype=torch.float32))
    k = max_exponent - exponent - (mantissa > max_mantissa).to(exponent.dtype)
    return torch.where(usable, torch.ldexp(torch.ones_like(amax), k), torch.ones_like(amax))


def pow2_oracle_underflow(exact: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """How many nonzero values of ``exact`` round to zero in ``fmt`` at the best per-tensor power-of-two scale.

    The scale is :func:`largest_pow2_scale` of the tensor's amax: no value overflows and no
    smaller scale underflows fewer. Returns a 0-d integer tensor (no host synchronisation).
    """
    exact = exact.detach().float()
    scale = largest_pow2_scale(torch.linalg.vector_norm(exact, ord=float("inf")), float_format(fmt).max)
    rounded = round_to(exact * scale, fmt, torch.float32, saturate=True)
    return ((exact != 0) & (rounded == 0)).sum()


class CurrentScaling:
    """Per-tensor current scaling: each cast scales by ``fp8_max / amax`` of the tensor being cast.

    Transformer Engine's ``Float8CurrentScaling`` and torchao's tensorwise float8 scaling (see the
    module docstring): no history, nothing stale; the scale is recomputed at every cast.

    Args:
        power_of_two: Round the scale down to a power of two (TE's ``power_2_scale`` option). The
            default (``False``) is both libraries' default.
    """

    def __init__(self, power_of_two: bool = False) -> None:
        if not isinstance(power_of_two, bool):
            raise ValueError(f"CurrentScaling: power_of_two must be a bool, got {power_of_two!r}")
        self.power_of_two = power_of_two

    def scale(self, values: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
        """The scale a cast of ``values`` to ``fp8_dtype`` uses (0-d fp32 tensor)."""
        fp8_max = float_format(fp8_dtype).max
        amax = torch.linalg.vector_norm(values.detach(), ord=float("inf"), dtype=torch.float32)
        if self.power_of_two:
            return largest_pow2_scale(amax, fp8_max)
        scale = torch.where((amax > 0) & torch.isfinite(amax), fp8_max / amax, torch.ones_like(amax))
        return torch.where(torch.isinf(scale), torch.full_like(scale, _FP32_MAX), scale)

    def quantize(
        self, values: torch.Tensor, fp8_dtype: torch.dtype, out_dtype: torch.dtype, block_dims: tuple[int, ...] = ()
    ) -> torch.Tensor:
        """Scale by :meth:`scale`, cast to ``fp8_dtype`` with saturation, unscale (``block_dims`` unused)."""
        scale = self.scale(values, fp8_dtype)
        return (round_to(values * scale, fp8_dtype, torch.float32, saturate=True) / scale).to(out_dtype)

    def update(self) -> None:
        """Nothing to do: current scaling keeps no state between casts."""


class MXBlockScaling:
    """OCP MX block scaling: blocks of 32 values along the reduction dimension, one E8M0 scale each.

    For a block with largest magnitude ``amax`` the shared scale is
    ``X = 2^(floor(log2(amax)) - emax_elem)`` (``emax_elem``: 15 for e5m2, 8 for e4m3), clamped to
    E8M0's ``2^-127 .. 2^127``; the elements are ``value / X`` cast with saturation. A last block
    shorter than 32 (the reduction length not a multiple of 32) is padded with zeros, which changes
    no scale.
    """

    def quantize(
        self, values: torch.Tensor, fp8_dtype: torch.dtype, out_dtype: torch.dtype, block_dims: tuple[int, ...]
    ) -> torch.Tensor:
        """Cast ``values`` blockwise along ``block_dims`` (flattened in order) to ``fp8_dtype``; store as
        ``out_dtype``."""
        if not block_dims:
            raise ValueError("MXBlockScaling: block_dims must name the reduction dimension(s), got ()")
        if values.numel() == 0:
            return values.to(out_dtype)
        dims = [d % values.dim() for d in block_dims]
        kept = [d for d in range(values.dim()) if d not in dims]
        moved = values.float().permute(*kept, *dims)
        length = math.prod(values.shape[d] for d in dims)
        rows = moved.reshape(-1, length)
        padded = torch.nn.functional.pad(rows, (0, -length % MX_BLOCK_SIZE)).view(rows.shape[0], -1, MX_BLOCK_SIZE)
        scale = self.block_scales(padded, fp8_dtype).unsqueeze(-1)
        quantized = round_to(padded / scale, fp8_dtype, torch.float32, saturate=True) * scale
        restored = quantized.view(rows.shape[0], -1)[:, :length].reshape(moved.shape)
        inverse = torch.argsort(torch.tensor([*kept, *dims])).tolist()
        return restored.permute(*inverse).to(out_dtype)

    @staticmethod
    def block_scales(blocks: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
        """The shared scale ``X`` of each block (the last dimension of ``blocks`` is one block)."""
        amax = blocks.detach().abs().amax(dim=-1).float()
        _, emax_elem = torch.frexp(torch.tensor(float_format(fp8_dtype).max))  # max = m * 2^e, m in [0.5, 1)
        usable = (amax > 0) & torch.isfinite(amax)
        _, exponent = torch.frexp(torch.where(usable, amax, torch.ones_like(amax)))
        shared = (exponent - 1) - (emax_elem - 1)  # floor(log2(amax)) - emax_elem
        shared = torch.where(usable, shared, torch.zeros_like(shared)).clamp(_E8M0_MIN_EXPONENT, _E8M0_MAX_EXPONENT)
        return torch.ldexp(torch.ones_like(amax), shared)

    def update(self) -> None:
        """Nothing to do: block scales come from each cast's own values."""
