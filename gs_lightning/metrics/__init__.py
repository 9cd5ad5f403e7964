"""Evaluation metrics (torchmetrics)."""

from gs_lightning.metrics.segmentation import SegmentationMetrics

__all__ = ["SegmentationMetrics"]
from gs_lightning.metrics.voc_map import VOC07MeanAveragePrecision  # noqa: E402

__all__ += ["VOC07MeanAveragePrecision"]
