"""PyTorch Lightning integration: precision plugins for fp16 training and the scale-logging callback."""

from gs_lightning.lightning.callback import GradientScalingCallback
from gs_lightning.lightning.plugins import (
    DynamicLossScalingPlugin,
    FP16MixedPrecision,
    FP16Plugin,
    GradientScalingPlugin,
    LossScalingPlugin,
    SkipAwareScheduler,
)

__all__ = [
    "DynamicLossScalingPlugin",
    "FP16MixedPrecision",
    "FP16Plugin",
    "GradientScalingCallback",
    "GradientScalingPlugin",
    "LossScalingPlugin",
    "SkipAwareScheduler",
]
