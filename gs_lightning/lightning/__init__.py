"""Lightning Trainer integration: fp16 precision plugins and the scale-logging callback.

Works with ``lightning.pytorch`` and ``pytorch_lightning`` (whichever is installed, or both).
"""

from gs_lightning.lightning.callback import GradientScalingCallback
from gs_lightning.lightning.plugins import (
    DynamicLossScalingPlugin,
    FP16MixedPrecision,
    FP16Plugin,
    GradientScalingPlugin,
    LossScalingPlugin,
)
from gs_lightning.lightning.schedulers import SkipAwareScheduler

__all__ = [
    "DynamicLossScalingPlugin",
    "FP16MixedPrecision",
    "FP16Plugin",
    "GradientScalingCallback",
    "GradientScalingPlugin",
    "LossScalingPlugin",
    "SkipAwareScheduler",
]
