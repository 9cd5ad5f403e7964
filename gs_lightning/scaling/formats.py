"""Ranges of the low-precision formats whose underflow and overflow the scales protect against."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatFormat:
    """The representable range of a floating-point format.

    Attributes:
        name: Short name, e.g. ``"float16"``.
        subnormal_min: Smallest positive (subnormal) value; the paper's λmin.
        normal_min: Smallest positive normal value; below it values keep fewer significant bits.
        max: Largest finite value, λmax.
        saturates: Whether PyTorch's conversion clamps values beyond λmax to ±λmax (float8_e4m3fn has
            no inf): an overflow then clips the largest values instead of skipping the step.
    """

    name: str
    subnormal_min: float
    normal_min: float
    max: float
    saturates: bool = False

    def lambda_min(self, which: str) -> float:
        """λmin of the underflow model: :attr:`normal_min` for ``"normal"``, :attr:`subnormal_min` for
        ``"subnormal"`` (:attr:`ScalingRecipe.lambda_min <gs_lightning.scaling.recipe.ScalingRecipe.lambda_min>`)."""
        return self.normal_min if which == "normal" else self.subnormal_min


FORMATS: dict[torch.dtype, FloatFormat] = {
    torch.float16: FloatFormat("float16", 2.0**-24, 2.0**-14, 65504.0),
    torch.bfloat16: FloatFormat("bfloat16", 2.0**-133, 2.0**-126, 3.3895313892515355e38),
    torch.float8_e5m2: FloatFormat("float8_e5m2", 2.0**-16, 2.0**-14, 57344.0),
    torch.float8_e4m3fn: FloatFormat("float8_e4m3fn", 2.0**-9, 2.0**-6, 448.0, saturates=True),
}


def float_format(dtype: torch.dtype) -> FloatFormat:
    """Return the range of ``dtype``; raise ``ValueError`` naming the supported formats."""
    try:
        return FORMATS[dtype]
    except KeyError:
        supported = ", ".join(f"torch.{f.name}" for f in FORMATS.values())
        raise ValueError(
            f"GradientScaler: dtype {dtype} is not a supported format; expected one of {supported}"
        ) from None


@functools.cache
def widened(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` promoted to fp32 at least, where a power-of-two factor multiplies gradients of that dtype.

    Looked up once per dtype: ``torch.promote_types`` is an operator, which a dispatch mode (the fp16
    emulation, a profiler's) would see on every product.
    """
    return torch.promote_types(dtype, torch.float32)
