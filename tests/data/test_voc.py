"""VOC dataset, augmentation and DataModule on tiny generated data."""

from __future__ import annotations

import logging
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from torchvision import tv_tensors

from gs_lightning.data.errors import DatasetError
from gs_lightning.data.synthetic import write_synthetic_voc
from gs_lightning.data.voc import (
    VOC_CLASSES,
    VOCDataModule,
    VOCDetection,
    ssd_eval_transforms,
    ssd_train_transforms,
)


@pytest.fixture()
def voc_root(tmp_path: Path) -> Path:
    return write_synthetic_voc(tmp_path, years=("2007",), n_trainval=6, n_test=4, size=(48, 64), seed=1)


def _xml_objects(root: Path, image_id: str) -> list[tuple[str, bool, list[float]]]:
    anno = ET.parse(root / "VOCdevkit" / "VOC2007" / "Annotations" / f"{image_id}.xml").getroot()
    return [
        (
            obj.findtext("name"),
            obj.findtext("difficult") == "1",
            [float(obj.findtext(f"bndbox/{t}")) for t in ("xmin", "ymin", "xmax", "ymax")],
        )
        for obj in anno.findall("object")
    ]


def _rewrite_objects(root: Path, image_id: str, boxes: list[tuple[str, bool, tuple[int, int, int, int]]]) -> None:
    path = root / "VOCdevkit" / "VOC2007" / "Annotations" / f"{image_id}.xml"
    tree = ET.parse(path)
    anno = tree.getroot()
    for obj in anno.findall("object"):
        anno.remove(obj)
    for name, difficult, box in boxes:
        obj = ET.SubElement(anno, "object")
        ET.SubElement(obj, "name").text = name
        ET.SubElement(obj, "difficult").text = str(int(difficult))
        bndbox = ET.SubElement(obj, "bndbox")
        for tag, value in zip(("xmin", "ymin", "xmax", "ymax"), box):
            ET.SubElement(bndbox, tag).text = str(value)
    tree.write(path)


def test_synthetic_layout_and_idempotence(voc_root: Path) -> None:
    year = voc_root / "VOCdevkit" / "VOC2007"
    trainval = (year / "ImageSets" / "Main" / "trainval.txt").read_text().split()
    test = (year / "ImageSets" / "Main" / "test.txt").read_text().split()
    assert len(trainval) == 6 and len(test) == 4 and not set(trainval) & set(test)
    for image_id in trainval + test:
        assert (year / "JPEGImages" / f"{image_id}.jpg").is_file()
        assert (year / "Annotations" / f"{image_id}.xml").is_file()
    jpg = year / "JPEGImages" / f"{trainval[0]}.jpg"
    stamp = jpg.stat().st_mtime_ns
    write_synthetic_voc(voc_root, years=("2007",), n_trainval=6, n_test=4, size=(48, 64), seed=1)
    assert jpg.stat().st_mtime_ns == stamp


def test_items_boxes_and_difficult(voc_root: Path) -> None:
    ids = (voc_root / "VOCdevkit" / "VOC2007" / "ImageSets" / "Main" / "test.txt").read_text().split()
    objects = {i: _xml_objects(voc_root, i) for i in ids}
    assert any(d for objs in objects.values() for _, d, _ in objs), "seed should produce a difficult object"

    evaluation = VOCDetection(voc_root, [("2007", "test")], keep_difficult=True)
    training = VOCDetection(voc_root, [("2007", "test")])
    assert len(evaluation) == len(training) == 4 and evaluation.skipped == dict.fromkeys(evaluation.skipped, 0)
    for index, image_id in enumerate(ids):
        image, target = evaluation[index]
        assert isinstance(image, tv_tensors.Image) and image.dtype == torch.uint8 and image.shape == (3, 48, 64)
        assert isinstance(target["boxes"], tv_tensors.BoundingBoxes) and target["boxes"].canvas_size == (48, 64)
        expected = objects[image_id]
        # 1-based inclusive XML coordinates -> 0-based.
        xml_boxes = torch.tensor([b for *_, b in expected])
        torch.testing.assert_close(target["boxes"].as_subclass(torch.Tensor), xml_boxes - 1)
        assert target["labels"].tolist() == [VOC_CLASSES.index(n) + 1 for n, _, _ in expected]
        assert target["difficult"].tolist() == [d for _, d, _ in expected]
        assert target["orig_size"].tolist() == [48, 64]

        _, train_target = training[index]
        assert not train_target["difficult"].any()
        assert train_target["labels"].tolist() == [VOC_CLASSES.index(n) + 1 for n, d, _ in expected if not d]


def test_clip_and_drop_are_counted(voc_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    image_id = (voc_root / "VOCdevkit" / "VOC2007" / "ImageSets" / "Main" / "test.txt").read_text().split()[0]
    _rewrite_objects(
        voc_root,
        image_id,
        [
            ("dog", False, (10, 5, 70, 40)),  # xmax beyond width 64 -> clipped to 64
            ("cat", False, (-3, 0, 20, 30)),  # xmin, ymin < 1 -> clipped to 1
            ("cow", False, (66, 5, 80, 40)),  # entirely right of the image -> zero width -> dropped
            ("car", False, (7, 5, 7, 40)),  # xmax == xmin -> zero width -> dropped
            ("bus", False, (2, 3, 20, 30)),  # fine
        ],
    )
    with caplog.at_level(logging.WARNING):
        dataset = VOCDetection(voc_root, [("2007", "test")], keep_difficult=True)
    assert dataset.skipped == {"no_objects": 0, "clipped_boxes": 2, "dropped_boxes": 2}
    assert "clipped 2 boxes" in caplog.text and "dropped 2 boxes" in caplog.text
    _, target = dataset[dataset.ids.index(("2007", image_id))]
    expected = torch.tensor([[9.0, 4.0, 63.0, 39.0], [0.0, 0.0, 19.0, 29.0], [1.0, 2.0, 19.0, 29.0]])
    torch.testing.assert_close(target["boxes"].as_subclass(torch.Tensor), expected)
    assert [VOC_CLASSES[i - 1] for i in target["labels"]] == ["dog", "cat", "bus"]


def test_images_without_objects_skipped_for_training(voc_root: Path) -> None:
    ids = (voc_root / "VOCdevkit" / "VOC2007" / "ImageSets" / "Main" / "trainval.txt").read_text().split()
    _rewrite_objects(voc_root, ids[0], [])
    _rewrite_objects(voc_root, ids[1], [("dog", True, (2, 2, 20, 20))])  # only a difficult object
    training = VOCDetection(voc_root, [("2007", "trainval")])
    assert training.skipped["no_objects"] == 2 and len(training) == 4
    assert ("2007", ids[0]) not in training.ids and ("2007", ids[1]) not in training.ids
    # Evaluation keeps them: their detections are false positives in the devkit.
    evaluation = VOCDetection(voc_root, [("2007", "trainval")], keep_difficult=True)
    assert len(evaluation) == 6 and evaluation.skipped["no_objects"] == 0
    assert evaluation[0][1]["boxes"].shape == (0, 4)
    assert evaluation[1][1]["difficult"].tolist() == [True]


def test_missing_year_and_split_name_the_path(voc_root: Path) -> None:
    with pytest.raises(DatasetError) as info:
        VOCDetection(voc_root, [("2007", "trainval"), ("2012", "trainval")])
    assert str(voc_root / "VOCdevkit" / "VOC2012") in str(info.value) and "ImageSets/Main" in str(info.value)
    with pytest.raises(DatasetError) as info:
        VOCDetection(voc_root, [("2007", "val")])
    assert str(voc_root / "VOCdevkit" / "VOC2007" / "ImageSets" / "Main" / "val.txt") in str(info.value)


def test_bad_files_raise_dataset_error_naming_the_file(voc_root: Path) -> None:
    year = voc_root / "VOCdevkit" / "VOC2007"
    test_id = (year / "ImageSets" / "Main" / "test.txt").read_text().split()[0]
    (year / "Annotations" / f"{test_id}.xml").write_text("<annotation><size>")
    with pytest.raises(DatasetError, match=f"{test_id}.xml: malformed"):
        VOCDetection(voc_root, [("2007", "test")])
    trainval_ids = (year / "ImageSets" / "Main" / "trainval.txt").read_text().split()
    xml = year / "Annotations" / f"{trainval_ids[1]}.xml"
    xml.write_text(xml.read_text().replace("<width>64</width>", "<width>65</width>"))
    dataset = VOCDetection(voc_root, [("2007", "trainval")])
    with pytest.raises(DatasetError, match=f"{trainval_ids[1]}.jpg: image is 64x48 but .*{trainval_ids[1]}.xml"):
        dataset[dataset.ids.index(("2007", trainval_ids[1]))]
    (year / "JPEGImages" / f"{trainval_ids[0]}.jpg").unlink()
    with pytest.raises(DatasetError, match=f"{trainval_ids[0]}.jpg: image .* is missing"):
        VOCDetection(voc_root, [("2007", "trainval")])


def test_ssd_transforms(voc_root: Path) -> None:
    torch.manual_seed(0)
    train = VOCDetection(voc_root, [("2007", "trainval")], ssd_train_transforms(300))
    for index in range(len(train)):
        image, target = train[index]
        assert image.shape == (3, 300, 300) and image.dtype == torch.float32
        boxes = target["boxes"]
        assert boxes.canvas_size == (300, 300)
        assert len(boxes) == len(target["labels"]) == len(target["difficult"])
        assert (boxes[:, 2:] > boxes[:, :2]).all() and boxes.min() >= 0 and boxes.max() <= 300
    evaluation = VOCDetection(voc_root, [("2007", "test")], ssd_eval_transforms(300), keep_difficult=True)
    image, target = evaluation[0]
    raw = VOCDetection(voc_root, [("2007", "test")], keep_difficult=True)[0][1]["boxes"]
    scale = torch.tensor([300 / 64, 300 / 48] * 2)
    torch.testing.assert_close(target["boxes"].as_subclass(torch.Tensor), raw.as_subclass(torch.Tensor) * scale)
    # Mean pixel maps to ~0 after the VGG standardisation.
    assert image.abs().mean() < 128


def test_datamodule_batches(tmp_path: Path) -> None:
    data = VOCDataModule(tmp_path, size=300, batch_size=3, num_workers=0, synthetic={"n_trainval": 4, "n_test": 2})
    data.prepare_data()
    data.setup("fit")
    images, targets = next(iter(data.train_dataloader()))
    assert images.shape == (3, 3, 300, 300) and type(images) is torch.Tensor
    assert len(targets) == 3 and not any(t["difficult"].any() for t in targets)
    images, targets = next(iter(data.val_dataloader()))
    assert images.shape == (2, 3, 300, 300) and len(targets) == 2
