"""Pieces every dataset module shares: safe image decoding, a lock for generated data, loaders."""

from __future__ import annotations

import fcntl
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from gs_lightning.data.errors import DatasetError


def open_image(path: str | Path, mode: str | None = None) -> Image.Image:
    """Open and fully decode ``path`` (converted to ``mode`` if given); a failure names the file."""
    try:
        with Image.open(path) as image:
            if mode is not None:
                return image.convert(mode)
            image.load()
            return image
    # PIL reports corrupt files with many exception types (OSError, SyntaxError, ValueError, ...).
    except Exception as err:
        raise DatasetError(f"cannot read image file {path}: {err}") from err


@contextmanager
def exclusive(root: Path) -> Iterator[None]:
    """Serialise writers of generated data, e.g. every DDP rank preparing it before fit."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".synthetic.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def make_loader(
    dataset: Dataset, batch_size: int, num_workers: int, shuffle: bool, collate_fn: Callable[[list], Any] | None = None
) -> DataLoader:
    """The DataLoader every datamodule here uses."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
    )
