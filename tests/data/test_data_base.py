"""What the DataModules share (gs_lightning/data/base.py, errors.py): checked arguments,
reproducible shuffling and worker seeds, and one dataset-error message with or without workers."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gs_lightning.data import CamVidDataModule, DatasetError, ImageNetDataModule, VOCDataModule
from gs_lightning.data.synthetic import write_synthetic_camvid

SYNTH = {"n_train": 6, "n_val": 2, "n_test": 2, "size": [12, 16], "seed": 0}


@pytest.fixture(scope="module")
def camvid_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_camvid(tmp_path_factory.mktemp("camvid"), **SYNTH)


@pytest.mark.parametrize("module", [CamVidDataModule, ImageNetDataModule, VOCDataModule])
@pytest.mark.parametrize(
    ("argument", "value", "message"),
    [
        ("batch_size", 0, "batch_size must be a whole number >= 1"),
        ("batch_size", 2.5, "batch_size must be a whole number >= 1"),
        ("num_workers", -1, "num_workers must be a whole number >= 0"),
    ],
)
def test_out_of_range_arguments_are_refused_on_construction(module, argument: str, value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        module("/nowhere", **{argument: value})


def test_unknown_synthetic_key_is_named_with_the_valid_ones() -> None:
    with pytest.raises(ValueError) as info:
        CamVidDataModule("/nowhere", synthetic={"n_tran": 5})
    assert str(info.value) == "synthetic has unknown key(s) ['n_tran']; valid keys: n_train, n_val, n_test, size, seed"
    with pytest.raises(ValueError, match=r"\['n_images'\]; valid keys: years, n_trainval, n_test, size, seed"):
        VOCDataModule("/nowhere", synthetic={"n_images": 5})


def test_hyperparameters_are_saved_as_plain_values() -> None:
    dm = VOCDataModule("/data", size=512, synthetic={"n_trainval": 2})
    assert dict(dm.hparams) == {
        "root": "/data", "size": 512, "batch_size": 32, "num_workers": 4, "train_splits": None,
        "test_split": ("2007", "test"), "synthetic": {"n_trainval": 2},
    }  # fmt: skip


def _epoch(dm: CamVidDataModule, epoch: int) -> tuple[list[int], list[torch.Tensor]]:
    """The sample order and the image batches of ``epoch``."""
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(epoch)  # what Lightning does at every epoch start
    order = list(loader.sampler)
    loader.sampler.set_epoch(epoch)
    return order, [images for images, _ in loader]


def test_order_and_worker_augmentation_depend_only_on_seed_and_epoch(camvid_root: Path) -> None:
    """Whatever the global RNG did before, an epoch's order and its workers' random flips are the
    same: a run resumed at an epoch boundary sees the batches of an uninterrupted one. (Without
    workers the flips draw from the global RNG, which the app's checkpoints restore.)"""
    dm = CamVidDataModule(camvid_root, batch_size=2, num_workers=2)
    dm.setup("fit")
    torch.manual_seed(1)
    order, batches = _epoch(dm, 3)
    torch.manual_seed(2)
    again_order, again_batches = _epoch(dm, 3)
    assert order == again_order
    assert all(torch.equal(a, b) for a, b in zip(batches, again_batches, strict=True))
    next_order, next_batches = _epoch(dm, 4)
    assert next_order != order


def _corrupt_then_load(root: Path, num_workers: int) -> str:
    dm = CamVidDataModule(root, batch_size=2, num_workers=num_workers, flip=False)
    dm.setup("fit")
    with pytest.raises(DatasetError) as info:
        list(dm.val_dataloader())
    return str(info.value)


def test_corrupt_image_gives_one_message_with_or_without_workers(camvid_root: Path, tmp_path: Path) -> None:
    root = write_synthetic_camvid(tmp_path, **SYNTH)
    bad = root / "val" / "synth_val_00001.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    in_process, in_worker = _corrupt_then_load(root, 0), _corrupt_then_load(root, 1)
    assert in_worker == in_process
    assert re.match(f"cannot read image file {re.escape(str(bad))}: ", in_process) and "\n" not in in_process


def test_label_of_the_wrong_size_gives_one_message_with_or_without_workers(tmp_path: Path) -> None:
    root = write_synthetic_camvid(tmp_path, **SYNTH)
    label = root / "valannot" / "synth_val_00000.png"
    Image.fromarray(np.zeros((5, 7), dtype=np.uint8)).save(label)
    in_process, in_worker = _corrupt_then_load(root, 0), _corrupt_then_load(root, 1)
    assert in_worker == in_process
    assert in_process.startswith(f"label file {label} is 7x5 but image ") and "expected equal sizes" in in_process


def test_generated_dataset_reads_each_generators_marker(camvid_root: Path, tmp_path: Path) -> None:
    """The CamVid/ImageFolder marker in the root and VOC's inside VOCdevkit name what wrote them;
    a folder without one (a real dataset) reads as None, and every format says what layout it expects."""
    from gs_lightning.data.synthetic import generated_dataset, write_synthetic_voc

    marker, settings = generated_dataset(camvid_root)
    assert marker == camvid_root / ".synthetic.json" and settings == {**SYNTH, "complete": True}
    voc = write_synthetic_voc(tmp_path / "voc", n_trainval=1, n_test=1, size=(16, 20))
    marker, settings = generated_dataset(voc)
    assert marker == voc / "VOCdevkit" / ".synthetic_voc.json" and settings["n_trainval"] == 1
    (tmp_path / "real" / "train").mkdir(parents=True)
    assert generated_dataset(tmp_path / "real") is None
    assert all(
        module.layout.startswith("expected ") for module in (CamVidDataModule, ImageNetDataModule, VOCDataModule)
    )
