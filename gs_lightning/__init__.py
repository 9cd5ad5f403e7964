"""gs_lightning: per-layer gradient scaling for fp16 mixed precision training, with Lightning."""

from gs_lightning.scaling import GradientScaler, LayerScale

__all__ = ["GradientScaler", "LayerScale"]
