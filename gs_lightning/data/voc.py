"""PASCAL VOC detection data for SSD: dataset, SSD augmentation and a DataModule.

Layout (the official VOCdevkit tarballs)::

    root/VOCdevkit/VOC2007/Annotations/<id>.xml
    root/VOCdevkit/VOC2007/JPEGImages/<id>.jpg
    root/VOCdevkit/VOC2007/ImageSets/Main/{trainval,test}.txt
    root/VOCdevkit/VOC2012/...                                  (trainval only)

Box convention (ChainerCV's ``VOCBboxDataset``): the XML's 1-based inclusive pixel coordinates
minus 1, i.e. 0-based inclusive pixel indices ``(x1, y1, x2, y2)``. The VOC07 metric
(:mod:`gs_lightning.metrics.voc_map`) treats them with the devkit's "+1" rule.

Bad-input rules (counted in ``VOCDetection.skipped`` and summarised in one warning):

* ``no_objects``: an image whose XML has no object (or none left once difficult ones are
  removed) is skipped when ``keep_difficult=False`` (training). With ``keep_difficult=True``
  (evaluation) it is kept: its detections still count as false positives, as in the devkit.
* ``clipped_boxes``: a box reaching outside the image (per the XML ``<size>``) is clipped to it.
* ``dropped_boxes``: a box of zero or negative area after clipping (``x2 <= x1`` or
  ``y2 <= y1`` in the convention above) is dropped.

Anything else (missing year/split/annotation/JPEG, malformed XML, unknown class, image size
differing from the XML) raises :class:`~gs_lightning.data.errors.DatasetError`.
"""

from __future__ import annotations

import logging
import os
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2

from gs_lightning.data.base import ImageDataModule
from gs_lightning.data.errors import DatasetError

__all__ = [
    "VGG_MEAN",
    "VGG_STD",
    "VOC_CLASSES",
    "VOCDataModule",
    "VOCDetection",
    "collate_detection",
    "ssd_eval_transforms",
    "ssd_train_transforms",
]

logger = logging.getLogger(__name__)

VOC_CLASSES: tuple[str, ...] = (
    "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
)  # fmt: skip
"""The 20 VOC classes; label ``i + 1`` is ``VOC_CLASSES[i]`` (0 = background)."""

# Standardisation expected by torchvision's VGG16 IMAGENET1K_FEATURES weights (the original SSD's
# Caffe preprocessing): 0..255 pixels minus the mean pixel (123, 117, 104), no scaling.
VGG_MEAN: tuple[float, float, float] = (0.48235, 0.45882, 0.40784)
VGG_STD: tuple[float, float, float] = (1.0 / 255.0, 1.0 / 255.0, 1.0 / 255.0)
_MEAN_PIXEL = tuple(round(m * 255) for m in VGG_MEAN)

_LAYOUT = "expected root/VOCdevkit/VOC<year>/{Annotations/<id>.xml, JPEGImages/<id>.jpg, ImageSets/Main/<split>.txt}"
_DEFAULT_TRAIN_SPLITS: tuple[tuple[str, str], ...] = (("2007", "trainval"), ("2012", "trainval"))


@dataclass(frozen=True)
class _Record:
    image: Path
    xml: Path
    height: int
    width: int
    boxes: Tensor  # [N, 4] float32, 0-based inclusive pixel indices
    labels: Tensor  # [N] int64, 1..20
    difficult: Tensor  # [N] bool


class VOCDetection(Dataset):
    """PASCAL VOC detection dataset (VOCdevkit layout, see the module docstring).

    Each item is ``(image, target)``: ``image`` a ``tv_tensors.Image`` uint8 ``[3, H, W]`` (RGB);
    ``target`` a dict with ``boxes`` (``tv_tensors.BoundingBoxes`` XYXY pixels), ``labels``
    (int64, 1..20), ``difficult`` (bool; all False when ``keep_difficult=False``) and
    ``orig_size`` (int64 ``[H, W]`` of the JPEG, untouched by ``transforms``), after
    ``transforms(image, target)`` if given.

    Args:
        root: folder holding ``VOCdevkit``.
        splits: ``(year, split)`` pairs, e.g. ``[("2007", "trainval"), ("2012", "trainval")]``.
        transforms: torchvision v2 transform called as ``transforms(image, target)``.
        keep_difficult: keep difficult objects, flagged (evaluation), instead of removing them
            (training). Also decides whether images without objects are skipped (module docstring).

    Attributes:
        skipped: counts of the bad-input rules applied: ``no_objects``, ``clipped_boxes``,
            ``dropped_boxes``.
        ids: ``(year, image id)`` of each item.

    Raises:
        DatasetError: a year folder, split file, annotation or JPEG is missing, or an XML is
            malformed; the message names the file and the expected layout. When an item is
            read: a JPEG that cannot be decoded or whose size differs from its XML.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        splits: Sequence[tuple[str, str]] = _DEFAULT_TRAIN_SPLITS,
        transforms: v2.Transform | None = None,
        keep_difficult: bool = False,
    ) -> None:
        self.root = Path(root)
        self.transforms = transforms
        self.keep_difficult = keep_difficult
        self.skipped = {"no_objects": 0, "clipped_boxes": 0, "dropped_boxes": 0}
        self.ids: list[tuple[str, str]] = []
        self._records: list[_Record] = []
        for year, split in splits:
            year_dir = self.root / "VOCdevkit" / f"VOC{year}"
            for image_id in _read_split(year_dir, split):
                record = self._parse(year_dir, image_id)
                if record is not None:
                    self.ids.append((str(year), image_id))
                    self._records.append(record)
        if any(self.skipped.values()):
            logger.warning(
                "VOC %s under %s: skipped %d images without objects, clipped %d boxes to their image, "
                "dropped %d boxes of zero area (see VOCDetection.skipped)",
                list(splits),
                self.root,
                self.skipped["no_objects"],
                self.skipped["clipped_boxes"],
                self.skipped["dropped_boxes"],
            )

    def _parse(self, year_dir: Path, image_id: str) -> _Record | None:
        xml_path = year_dir / "Annotations" / f"{image_id}.xml"
        jpg_path = year_dir / "JPEGImages" / f"{image_id}.jpg"
        for path, what in ((xml_path, "annotation"), (jpg_path, "image")):
            if not path.is_file():
                raise DatasetError(f"{path}: {what} of '{image_id}' is missing; {_LAYOUT}")
        try:
            anno = ET.parse(xml_path).getroot()
            width, height = int(anno.findtext("size/width", "")), int(anno.findtext("size/height", ""))
            if width <= 0 or height <= 0:
                raise ValueError(f"image size {width}x{height}")
            boxes, labels, difficult = [], [], []
            for obj in anno.findall("object"):
                name = (obj.findtext("name") or "").strip()
                if name not in VOC_CLASSES:
                    raise ValueError(f"unknown class '{name}'")
                is_difficult = int(obj.findtext("difficult", "0")) == 1
                box = [float(obj.findtext(f"bndbox/{tag}", "")) for tag in ("xmin", "ymin", "xmax", "ymax")]
                if is_difficult and not self.keep_difficult:
                    continue
                boxes.append(box)
                labels.append(VOC_CLASSES.index(name) + 1)
                difficult.append(is_difficult)
        except (ET.ParseError, ValueError) as err:
            raise DatasetError(
                f"{xml_path}: malformed Pascal VOC annotation ({err}); expected <annotation> with "
                "<size><width/><height/></size> and <object><name/><difficult/><bndbox><xmin/><ymin/>"
                "<xmax/><ymax/></bndbox></object> per object"
            ) from err

        raw = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)
        upper = torch.tensor([width, height, width, height], dtype=torch.float32)
        clipped = torch.minimum(raw.clamp(min=1), upper) - 1  # 1-based inclusive -> 0-based
        valid = (clipped[:, 2] > clipped[:, 0]) & (clipped[:, 3] > clipped[:, 1])
        self.skipped["clipped_boxes"] += int(((clipped + 1 != raw).any(dim=1) & valid).sum())
        self.skipped["dropped_boxes"] += int((~valid).sum())
        if not valid.any() and not self.keep_difficult:
            self.skipped["no_objects"] += 1
            return None
        return _Record(
            image=jpg_path,
            xml=xml_path,
            height=height,
            width=width,
            boxes=clipped[valid],
            labels=torch.tensor(labels, dtype=torch.int64).reshape(-1)[valid],
            difficult=torch.tensor(difficult, dtype=torch.bool).reshape(-1)[valid],
        )

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> tuple[Any, dict[str, Any]]:
        """Read image ``index`` and its target, then apply ``transforms``."""
        record = self._records[index]
        try:
            with Image.open(record.image) as pil:
                image = tv_tensors.Image(v2.functional.pil_to_tensor(pil.convert("RGB")))
        except OSError as err:
            raise DatasetError(f"{record.image}: cannot decode the JPEG ({err})") from err
        height, width = image.shape[-2:]
        if (height, width) != (record.height, record.width):
            raise DatasetError(
                f"{record.image}: image is {width}x{height} but {record.xml} says "
                f"{record.width}x{record.height}; the annotation must match its JPEG"
            )
        target = {
            "boxes": tv_tensors.BoundingBoxes(record.boxes.clone(), format="XYXY", canvas_size=(height, width)),
            "labels": record.labels.clone(),
            "difficult": record.difficult.clone(),
            "orig_size": torch.tensor([height, width]),
        }
        if self.transforms is not None:
            image, target = self.transforms(image, target)
        return image, target


def _read_split(year_dir: Path, split: str) -> list[str]:
    if not year_dir.is_dir():
        raise DatasetError(f"VOC year folder {year_dir} not found; {_LAYOUT}")
    split_file = year_dir / "ImageSets" / "Main" / f"{split}.txt"
    if not split_file.is_file():
        raise DatasetError(f"{split_file}: split file not found; {_LAYOUT} with one image id per line")
    ids = []
    for number, line in enumerate(split_file.read_text().splitlines(), start=1):
        fields = line.split()
        if len(fields) > 1:
            raise DatasetError(f"{split_file}, line {number}: '{line}' is not one image id; {_LAYOUT}")
        ids += fields
    if not ids:
        raise DatasetError(f"{split_file}: split file lists no image ids; {_LAYOUT} with one image id per line")
    return ids


def _labels_and_difficult(inputs: tuple[Any, dict[str, Any]]) -> tuple[Tensor, Tensor]:
    # SanitizeBoundingBoxes must drop the same entries from labels and difficult as from boxes.
    target = inputs[1]
    return target["labels"], target["difficult"]


def ssd_train_transforms(size: int = 300) -> v2.Compose:
    """SSD training augmentation on ``(image uint8, target)`` (Liu et al. 2016, Sec. 2.2 / 3.6).

    Photometric distortion, zoom-out up to x4 filled with the mean pixel (p=0.5), IoU-constrained
    random crop, horizontal flip, resize to ``size x size``, removal of degenerate boxes, then
    float conversion and VGG standardisation (:data:`VGG_MEAN`, :data:`VGG_STD`).
    """
    return v2.Compose(
        [
            v2.RandomPhotometricDistort(),
            v2.RandomZoomOut(fill={tv_tensors.Image: _MEAN_PIXEL, "others": 0}, side_range=(1.0, 4.0)),
            v2.RandomIoUCrop(),
            v2.RandomHorizontalFlip(),
            v2.Resize((size, size)),
            v2.SanitizeBoundingBoxes(labels_getter=_labels_and_difficult),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=list(VGG_MEAN), std=list(VGG_STD)),
        ]
    )


def ssd_eval_transforms(size: int = 300) -> v2.Compose:
    """Evaluation preprocessing: resize to ``size x size``, float conversion, VGG standardisation."""
    return v2.Compose(
        [
            v2.Resize((size, size)),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=list(VGG_MEAN), std=list(VGG_STD)),
        ]
    )


def collate_detection(batch: Sequence[tuple[Tensor, dict[str, Tensor]]]) -> tuple[Tensor, list[dict[str, Tensor]]]:
    """Stack same-sized images into ``[B, 3, S, S]`` and keep the targets as a list."""
    images = torch.stack([image.as_subclass(Tensor) for image, _ in batch])
    return images, [target for _, target in batch]


class VOCDataModule(ImageDataModule):
    """VOC detection DataModule for SSD: train on ``train_splits``, validate and test on ``test_split``.

    Batches are ``(images [B, 3, S, S], targets)`` (:func:`collate_detection`). Training uses
    :func:`ssd_train_transforms` without difficult objects; validation and test use
    :func:`ssd_eval_transforms` with difficult objects kept and flagged (VOC07 metric).

    Args:
        root: folder holding ``VOCdevkit``.
        size: SSD input side, 300 or 512.
        batch_size: images per batch (32 as in SSD / ChainerCV).
        num_workers: DataLoader worker processes.
        train_splits: ``(year, split)`` pairs; ``None`` means VOC2007+2012 trainval, or with
            ``synthetic`` the trainval split of each generated year.
        test_split: ``(year, split)`` used for validation and test.
        synthetic: keyword arguments of :func:`~gs_lightning.data.synthetic.write_synthetic_voc`;
            when given, ``prepare_data`` writes that generated dataset under ``root`` first.
    """

    collate_fn = staticmethod(collate_detection)
    layout = _LAYOUT

    def __init__(
        self,
        root: str | os.PathLike[str],
        size: int = 300,
        batch_size: int = 32,
        num_workers: int = 4,
        train_splits: Sequence[tuple[str, str]] | None = None,
        test_split: tuple[str, str] = ("2007", "test"),
        synthetic: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(root, batch_size, num_workers, synthetic)
        self.size = size
        if train_splits is None:
            years = (synthetic or {}).get("years", ("2007",))
            train_splits = [(str(y), "trainval") for y in years] if synthetic is not None else _DEFAULT_TRAIN_SPLITS
        self.train_splits = [tuple(s) for s in train_splits]
        self.test_split = tuple(test_split)
        self.train_set: VOCDetection | None = None
        self.eval_set: VOCDetection | None = None

    @staticmethod
    def synthetic_writer() -> Callable[..., Path]:
        """:func:`~gs_lightning.data.synthetic.write_synthetic_voc`."""
        # Imported here: gs_lightning.data.synthetic imports this module's constants.
        from gs_lightning.data.synthetic import write_synthetic_voc

        return write_synthetic_voc

    def setup(self, stage: str | None = None) -> None:
        """Build the training set for ``fit`` and the VOC07-test set for every stage that evaluates."""
        if stage in ("fit", None):
            self.dataset("train")
        self.dataset("test")

    def dataset(self, split: str) -> VOCDetection:
        """``train_splits`` with SSD augmentation for ``"train"``; ``test_split`` for ``"val"`` and ``"test"``."""
        if split == "train":
            if self.train_set is None:
                self.train_set = VOCDetection(self.root, self.train_splits, ssd_train_transforms(self.size))
            return self.train_set
        if self.eval_set is None:
            self.eval_set = VOCDetection(
                self.root, [self.test_split], ssd_eval_transforms(self.size), keep_difficult=True
            )
        return self.eval_set
