"""Datasets and LightningDataModules.

Names are re-exported lazily (PEP 562) so that ``gs_lightning.data.errors`` stays cheap to
import: the dataset modules pull in Lightning and torchvision.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "CAMVID_CLASSES": "gs_lightning.data.camvid",
    "VOID_LABEL": "gs_lightning.data.camvid",
    "CamVid": "gs_lightning.data.camvid",
    "CamVidDataModule": "gs_lightning.data.camvid",
    "median_frequency_weights": "gs_lightning.data.camvid",
    "write_synthetic_camvid": "gs_lightning.data.synthetic",
    "ImageNetDataModule": "gs_lightning.data.imagenet",
    "write_synthetic_imagefolder": "gs_lightning.data.synthetic",
    "DatasetError": "gs_lightning.data.errors",
    "EpochShuffleSampler": "gs_lightning.data.base",
    "ImageDataModule": "gs_lightning.data.base",
    "VGG_MEAN": "gs_lightning.data.voc",
    "VGG_STD": "gs_lightning.data.voc",
    "VOC_CLASSES": "gs_lightning.data.voc",
    "VOCDataModule": "gs_lightning.data.voc",
    "VOCDetection": "gs_lightning.data.voc",
    "collate_detection": "gs_lightning.data.voc",
    "ssd_eval_transforms": "gs_lightning.data.voc",
    "ssd_train_transforms": "gs_lightning.data.voc",
    "write_synthetic_voc": "gs_lightning.data.synthetic",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
