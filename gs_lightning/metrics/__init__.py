"""Evaluation metrics (torchmetrics)."""

from gs_lightning.metrics.segmentation import SegmentationMetrics
from gs_lightning.metrics.voc_map import VOC07MeanAveragePrecision

__all__ = ["SegmentationMetrics", "VOC07MeanAveragePrecision"]
