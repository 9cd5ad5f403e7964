"""ImageFolder datamodule and synthetic writer."""

import re
import shutil
from pathlib import Path

import pytest
import torch
from torchvision.transforms import v2

from gs_lightning.data.errors import DatasetError
from gs_lightning.data.imagenet import ImageNetDataModule, check_imagefolder_root
from gs_lightning.data.synthetic import write_synthetic_imagefolder

SYNTH = {"num_classes": 4, "n_train_per_class": 3, "n_val_per_class": 2, "size": (32, 32), "seed": 0}


@pytest.fixture(scope="module")
def synthetic_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_imagefolder(tmp_path_factory.mktemp("imagenet"), **SYNTH)


@pytest.fixture
def writable_copy(synthetic_root: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(synthetic_root, tmp_path / "imagenet"))


def test_synthetic_imagefolder_layout(synthetic_root: Path) -> None:
    classes = check_imagefolder_root(synthetic_root)
    assert classes == [f"n{k:08d}" for k in range(4)]
    assert len(list((synthetic_root / "train" / classes[0]).glob("*.JPEG"))) == 3
    assert len(list((synthetic_root / "val" / classes[3]).glob("*.JPEG"))) == 2


def test_synthetic_imagefolder_is_idempotent(synthetic_root: Path, tmp_path: Path) -> None:
    other = write_synthetic_imagefolder(tmp_path / "again", **SYNTH)
    name = "train/n00000001/synth_train_1_00002.JPEG"
    assert (other / name).read_bytes() == (synthetic_root / name).read_bytes()
    stamp = (other / name).stat().st_mtime_ns
    write_synthetic_imagefolder(other, **SYNTH)
    assert (other / name).stat().st_mtime_ns == stamp
    write_synthetic_imagefolder(other, **{**SYNTH, "num_classes": 2})
    assert len(check_imagefolder_root(other)) == 2


def test_datamodule_transforms_and_shapes(synthetic_root: Path) -> None:
    dm = ImageNetDataModule(synthetic_root, batch_size=4, num_workers=0, image_size=24, val_resize=28)
    assert dm.num_classes == 4
    train_steps = [type(t) for t in dm.train_transform.transforms]
    assert v2.RandomResizedCrop in train_steps and v2.RandomHorizontalFlip in train_steps
    assert train_steps[-1] is v2.Normalize
    val_steps = [type(t) for t in dm.val_transform.transforms]
    assert v2.Resize in val_steps and v2.CenterCrop in val_steps and v2.RandomResizedCrop not in val_steps
    dm.setup("fit")
    assert len(dm.dataset("train")) == 12 and len(dm.dataset("val")) == 8
    assert dm.dataset("test") is dm.dataset("val"), "ImageNet's test split is its validation split"
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (4, 3, 24, 24) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and labels.max() < 4
    assert images.min() < 0 < images.max(), "normalised with the ImageNet mean/std"
    images, labels = next(iter(dm.val_dataloader()))
    assert images.shape == (4, 3, 24, 24)


def test_datamodule_writes_configured_synthetic_data(tmp_path: Path) -> None:
    synthetic = {**SYNTH, "num_classes": 3}
    dm = ImageNetDataModule(
        tmp_path / "synth", batch_size=2, num_workers=0, image_size=16, val_resize=20, synthetic=synthetic
    )
    dm.prepare_data()
    dm.setup("validate")
    images, _ = next(iter(dm.val_dataloader()))
    assert images.shape == (2, 3, 16, 16) and dm.num_classes == 3


def test_missing_val(writable_copy: Path) -> None:
    shutil.rmtree(writable_copy / "val")
    with pytest.raises(DatasetError) as info:
        ImageNetDataModule(writable_copy, num_workers=0).setup("fit")
    message = str(info.value)
    assert str(writable_copy / "val") in message and "root/val/<wnid>/*.JPEG" in message


def test_no_class_folders(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    with pytest.raises(DatasetError, match="no class folders"):
        check_imagefolder_root(tmp_path)


def test_class_folders_differ(writable_copy: Path) -> None:
    (writable_copy / "val" / "n00000003").rename(writable_copy / "val" / "n99999999")
    with pytest.raises(DatasetError, match="n99999999"):
        check_imagefolder_root(writable_copy)


def test_empty_class_folder(writable_copy: Path) -> None:
    for image in (writable_copy / "val" / "n00000002").iterdir():
        image.unlink()
    with pytest.raises(DatasetError, match=re.escape(str(writable_copy / "val"))):
        ImageNetDataModule(writable_copy, num_workers=0).setup("validate")


def test_corrupt_image_names_the_file(writable_copy: Path) -> None:
    bad = writable_copy / "val" / "n00000000" / "synth_val_0_00000.JPEG"
    bad.write_bytes(b"\xff\xd8 not a jpeg")
    dm = ImageNetDataModule(writable_copy, num_workers=0, image_size=24, val_resize=28)
    dm.setup("validate")
    with pytest.raises(DatasetError, match=re.escape(str(bad))):
        dm.dataset("val")[0]


def test_synthetic_refuses_to_overwrite_unmarked_data(tmp_path: Path) -> None:
    (tmp_path / "val").mkdir()
    with pytest.raises(DatasetError, match="refusing to overwrite"):
        write_synthetic_imagefolder(tmp_path, **SYNTH)
