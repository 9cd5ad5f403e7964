"""gs_lightning: per-layer gradient scaling for fp16 mixed precision training, with Lightning."""

from gs_lightning.lightning import (
    DynamicLossScalingPlugin,
    FP16MixedPrecision,
    FP16Plugin,
    GradientScalingCallback,
    GradientScalingPlugin,
    LossScalingPlugin,
    SkipAwareScheduler,
)
from gs_lightning.scaling import GradientScaler, LayerScale

__all__ = [
    "DynamicLossScalingPlugin",
    "FP16MixedPrecision",
    "FP16Plugin",
    "GradientScaler",
    "GradientScalingCallback",
    "GradientScalingPlugin",
    "LayerScale",
    "LossScalingPlugin",
    "SkipAwareScheduler",
]
