"""Pieces every dataset module shares: safe image decoding and a lock for generated data."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from PIL import Image

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
