"""ImageNet (ILSVRC-2012) in ImageFolder layout: layout checks and the DataModule."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

from gs_lightning.data._common import open_image
from gs_lightning.data.base import ImageDataModule
from gs_lightning.data.errors import DatasetError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EXPECTED_LAYOUT = (
    "expected the ImageFolder layout root/train/<wnid>/*.JPEG and root/val/<wnid>/*.JPEG "
    "with the same class folders in both (sort the flat ILSVRC val images into wnid folders first)"
)
_MAX_LISTED = 5


def load_rgb(path: str) -> Image.Image:
    """ImageFolder loader: the image at ``path`` as RGB; a corrupt file raises DatasetError naming it."""
    return open_image(path, "RGB")


def _class_folders(split_dir: Path) -> list[str]:
    if not split_dir.is_dir():
        raise DatasetError(f"ImageNet folder {split_dir} is missing; {EXPECTED_LAYOUT}")
    classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir())
    if not classes:
        raise DatasetError(f"ImageNet folder {split_dir} holds no class folders; {EXPECTED_LAYOUT}")
    return classes


def check_imagefolder_root(root: str | os.PathLike[str]) -> list[str]:
    """Check ``root`` has train/ and val/ with the same class folders; return the class names.

    Raises:
        DatasetError: a split folder is missing, has no class folders, or the class folders differ.
    """
    root = Path(root)
    train, val = _class_folders(root / "train"), _class_folders(root / "val")
    if train != val:
        only_train = sorted(set(train) - set(val))[:_MAX_LISTED]
        only_val = sorted(set(val) - set(train))[:_MAX_LISTED]
        raise DatasetError(
            f"class folders of {root / 'train'} and {root / 'val'} differ (only in train: {only_train}, "
            f"only in val: {only_val}); {EXPECTED_LAYOUT}"
        )
    return train


def _image_folder(split_dir: Path, transform: v2.Transform) -> ImageFolder:
    try:
        return ImageFolder(str(split_dir), transform=transform, loader=load_rgb)
    except FileNotFoundError as err:  # a class folder without images
        raise DatasetError(f"{split_dir}: {err}; {EXPECTED_LAYOUT}") from err


class ImageNetDataModule(ImageDataModule):
    """ImageNet loaders with the standard ResNet augmentation (as Goyal et al. and torchvision).

    Train: RandomResizedCrop(image_size) + RandomHorizontalFlip; val: Resize(val_resize) +
    CenterCrop(image_size); both then scale to float [0, 1] and normalise with the ImageNet
    mean/std.

    The test split is the validation split: ILSVRC-2012's test labels were never released, and
    the paper (as every ImageNet paper) reports top-1 on the 50k validation images. So
    ``trainer.test`` evaluates the final weights on ``val/`` and logs ``test/top1``.

    Args:
        root: folder with ``train/<wnid>/*.JPEG`` and ``val/<wnid>/*.JPEG``.
        batch_size: per-device batch size.
        num_workers: DataLoader workers.
        image_size: crop size fed to the network.
        val_resize: shorter-side size before the validation centre crop.
        synthetic: keyword arguments of :func:`~gs_lightning.data.synthetic.write_synthetic_imagefolder`;
            when given, :meth:`prepare_data` writes that generated dataset into ``root`` if missing.
    """

    layout = EXPECTED_LAYOUT

    def __init__(
        self,
        root: str | os.PathLike[str],
        batch_size: int = 256,
        num_workers: int = 8,
        image_size: int = 224,
        val_resize: int = 256,
        synthetic: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(root, batch_size, num_workers, synthetic)
        self.image_size = image_size
        self.val_resize = val_resize
        self.datasets: dict[str, ImageFolder] = {}

    @staticmethod
    def synthetic_writer() -> Callable[..., Path]:
        """:func:`~gs_lightning.data.synthetic.write_synthetic_imagefolder`."""
        # Imported here, as in the other formats: the generators module imports CamVid and VOC.
        from gs_lightning.data.synthetic import write_synthetic_imagefolder

        return write_synthetic_imagefolder

    @property
    def train_transform(self) -> v2.Compose:
        """Training augmentation: random-resized crop, flip, float scaling, normalisation."""
        return v2.Compose(
            [
                v2.ToImage(),
                v2.RandomResizedCrop(self.image_size, antialias=True),
                v2.RandomHorizontalFlip(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        )

    @property
    def val_transform(self) -> v2.Compose:
        """Validation preprocessing: resize, centre crop, float scaling, normalisation."""
        return v2.Compose(
            [
                v2.ToImage(),
                v2.Resize(self.val_resize, antialias=True),
                v2.CenterCrop(self.image_size),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        )

    @property
    def num_classes(self) -> int:
        """Number of class folders (after writing a configured synthetic dataset)."""
        self.prepare_data()
        return len(check_imagefolder_root(self.root))

    def setup(self, stage: str | None = None) -> None:
        """Check the layout and index the folders ``stage`` needs; problems raise DatasetError."""
        check_imagefolder_root(self.root)
        for split in ("train", "val") if stage in (None, "fit") else ("val",):
            self.dataset(split)

    def dataset(self, split: str) -> ImageFolder:
        """``train/`` with augmentation for ``"train"``; ``val/`` for ``"val"`` and ``"test"`` (see above)."""
        folder = "train" if split == "train" else "val"
        if folder not in self.datasets:
            transform = self.train_transform if folder == "train" else self.val_transform
            self.datasets[folder] = _image_folder(self.root / folder, transform)
        return self.datasets[folder]
