"""ImageNet (ILSVRC-2012) in ImageFolder layout, plus a synthetic stand-in."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

from gs_lightning.data._common import exclusive, make_loader, open_image
from gs_lightning.data.errors import DatasetError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EXPECTED_LAYOUT = (
    "expected the ImageFolder layout root/train/<wnid>/*.JPEG and root/val/<wnid>/*.JPEG "
    "with the same class folders in both (sort the flat ILSVRC val images into wnid folders first)"
)
_MARKER = ".synthetic.json"
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


def write_synthetic_imagefolder(
    root: str | os.PathLike[str],
    num_classes: int = 4,
    n_train_per_class: int = 8,
    n_val_per_class: int = 2,
    size: tuple[int, int] = (32, 32),
    seed: int = 0,
) -> Path:
    """Write a deterministic, learnable synthetic dataset in ImageNet's ImageFolder layout.

    Class ``k`` is a stripe pattern whose colour and orientation depend on ``k``, with random
    phase, brightness and pixel noise; images are JPEGs in ``root/{train,val}/n{k:08d}/``.
    Idempotent and safe to call from several processes at once: a root whose
    ``.synthetic.json`` records a complete write with the same parameters is left as is.

    Returns:
        ``root`` as a Path.

    Raises:
        DatasetError: ``root`` already holds train/ or val/ not written by this function.
    """
    root = Path(root)
    height, width = (int(v) for v in size)
    params = {
        "num_classes": num_classes,
        "n_train_per_class": n_train_per_class,
        "n_val_per_class": n_val_per_class,
        "size": [height, width],
        "seed": seed,
    }
    marker = root / _MARKER
    with exclusive(root):
        if marker.is_file():
            if json.loads(marker.read_text()) == {**params, "complete": True}:
                return root
            # Written by an earlier call with other parameters, or cut short: start afresh.
            for split in ("train", "val"):
                shutil.rmtree(root / split, ignore_errors=True)
        elif (root / "train").exists() or (root / "val").exists():
            raise DatasetError(
                f"{root} already holds train/ or val/ but no {_MARKER}; refusing to overwrite what may "
                "be the real dataset with synthetic data"
            )
        marker.write_text(json.dumps({**params, "complete": False}))
        colours = np.random.default_rng(seed).uniform(40, 215, size=(num_classes, 3))
        yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
        for split_index, (split, n) in enumerate((("train", n_train_per_class), ("val", n_val_per_class))):
            for k in range(num_classes):
                folder = root / split / f"n{k:08d}"
                folder.mkdir(parents=True, exist_ok=True)
                angle = np.pi * k / num_classes
                wave = (np.cos(angle) * xx + np.sin(angle) * yy) * (2 * np.pi / 8)
                for i in range(n):
                    rng = np.random.default_rng([seed, split_index, k, i])
                    stripes = 1.0 + 0.5 * np.sin(wave + rng.uniform(0, 2 * np.pi))
                    rgb = colours[k] * stripes[..., None] + rng.uniform(-25, 25)
                    rgb += rng.normal(0.0, 10.0, size=rgb.shape)
                    image = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))
                    image.save(folder / f"synth_{split}_{k}_{i:05d}.JPEG", format="JPEG", quality=95)
        marker.write_text(json.dumps({**params, "complete": True}, indent=2))
    return root


class ImageNetDataModule(LightningDataModule):
    """ImageNet loaders with the standard ResNet augmentation (as Goyal et al. and torchvision).

    Train: RandomResizedCrop(image_size) + RandomHorizontalFlip; val: Resize(val_resize) +
    CenterCrop(image_size); both then scale to float [0, 1] and normalise with the ImageNet
    mean/std.

    Args:
        root: folder with ``train/<wnid>/*.JPEG`` and ``val/<wnid>/*.JPEG``.
        batch_size: per-device batch size.
        num_workers: DataLoader workers.
        image_size: crop size fed to the network.
        val_resize: shorter-side size before the validation centre crop.
        synthetic: keyword arguments for :func:`write_synthetic_imagefolder`; when given,
            the synthetic dataset is written into ``root`` by :meth:`prepare_data` if missing.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        batch_size: int = 256,
        num_workers: int = 8,
        image_size: int = 224,
        val_resize: int = 256,
        synthetic: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.root = Path(root)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.image_size = image_size
        self.val_resize = val_resize
        self.synthetic = dict(synthetic) if synthetic is not None else None
        self.train_set: ImageFolder | None = None
        self.val_set: ImageFolder | None = None

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

    def prepare_data(self) -> None:
        """Write the synthetic dataset into ``root`` when configured and not there yet."""
        if self.synthetic is not None:
            write_synthetic_imagefolder(self.root, **self.synthetic)

    def setup(self, stage: str | None = None) -> None:
        """Check the layout and index train/ and val/; problems raise DatasetError."""
        check_imagefolder_root(self.root)
        if stage in (None, "fit") and self.train_set is None:
            self.train_set = _image_folder(self.root / "train", self.train_transform)
        if self.val_set is None:
            self.val_set = _image_folder(self.root / "val", self.val_transform)

    def _loader(self, dataset: ImageFolder | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        return make_loader(dataset, self.batch_size, self.num_workers, shuffle)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)
