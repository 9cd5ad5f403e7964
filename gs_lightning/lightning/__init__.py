"""Lightning Trainer integration: fp16 precision plugins (``FSDP...`` ones for ``FSDPStrategy``) and the scale-logging
callback.

Works with ``lightning.pytorch`` and ``pytorch_lightning`` (whichever is installed, or both).
"""

from gs_lightning.lightning.callback import GradientScalingCallback
from gs_lightning.lightning.plugins import (
    DynamicLossScalingPlugin,
    FP16MixedPrecision,
    FP16Plugin,
    FSDPDynamicLossScalingPlugin,
    FSDPGradientScalingPlugin,
    FSDPMixedPrecision,
    GradientScalingPlugin,
    LossScalingPlugin,
)
from gs_lightning.lightning.schedulers import SkipAwareScheduler

__all__ = [
    "DynamicLossScalingPlugin",
    "FP16MixedPrecision",
    "FP16Plugin",
    "FSDPDynamicLossScalingPlugin",
    "FSDPGradientScalingPlugin",
    "FSDPMixedPrecision",
    "GradientScalingCallback",
    "GradientScalingPlugin",
    "LossScalingPlugin",
    "SkipAwareScheduler",
]
