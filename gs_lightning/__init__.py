"""gs_lightning: per-layer gradient scaling for fp16 mixed precision training, with Lightning.

``GradientScaler`` (the core) imports only torch; it is also a drop-in for ``torch.amp.GradScaler``.
The Trainer names (plugins for ``lightning.pytorch`` and ``pytorch_lightning``, the callback) are
loaded on first use (PEP 562), so ``from gs_lightning import GradientScaler`` does not import
Lightning. Fabric's plugins, of the same names, are in :mod:`gs_lightning.fabric`.
"""

from importlib import import_module
from typing import Any

from gs_lightning.scaling import GradientScaler, LayerScale, ScalingRecipe

__all__ = [
    "DynamicLossScalingPlugin",
    "FP16MixedPrecision",
    "FP16Plugin",
    "FSDPDynamicLossScalingPlugin",
    "FSDPGradientScalingPlugin",
    "FSDPMixedPrecision",
    "GradientScaler",
    "GradientScalingCallback",
    "GradientScalingPlugin",
    "LayerScale",
    "LossScalingPlugin",
    "ScalingRecipe",
    "SkipAwareScheduler",
]
# Everything but the core's names comes from gs_lightning.lightning, on first use.
_LIGHTNING_NAMES = tuple(name for name in __all__ if name not in ("GradientScaler", "LayerScale", "ScalingRecipe"))


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_NAMES:
        return getattr(import_module("gs_lightning.lightning"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
