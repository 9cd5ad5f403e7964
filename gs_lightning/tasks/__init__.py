"""LightningModules: one per experiment family."""

from gs_lightning.tasks.classification import ClassificationTask
from gs_lightning.tasks.detection import DetectionTask
from gs_lightning.tasks.segmentation import SegmentationTask
from gs_lightning.tasks.sharding import ShardedTask

__all__ = ["ClassificationTask", "DetectionTask", "SegmentationTask", "ShardedTask"]
