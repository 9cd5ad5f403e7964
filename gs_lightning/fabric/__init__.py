"""Lightning Fabric integration: fp16 precision plugins, named as Lightning names its Fabric plugins.

``Fabric(plugins=[GradientScalingPlugin()])`` works with ``lightning.fabric`` and ``lightning_fabric``;
``Fabric(strategy="fsdp", plugins=[FSDPGradientScalingPlugin()])`` with FSDP.
"""

from gs_lightning.fabric.methods import FixedLossScaler
from gs_lightning.fabric.plugins import (
    DynamicLossScalingPlugin,
    FP16MixedPrecision,
    FP16Plugin,
    FSDPDynamicLossScalingPlugin,
    FSDPGradientScalingPlugin,
    FSDPMixedPrecision,
    GradientScalingPlugin,
    LossScalingPlugin,
)

__all__ = [
    "DynamicLossScalingPlugin",
    "FP16MixedPrecision",
    "FP16Plugin",
    "FSDPDynamicLossScalingPlugin",
    "FSDPGradientScalingPlugin",
    "FSDPMixedPrecision",
    "FixedLossScaler",
    "GradientScalingPlugin",
    "LossScalingPlugin",
]
