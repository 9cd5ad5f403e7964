"""Small versions of the paper's three experiments, held in memory, for ``bench/compare_training.py``.

Each task writes its generated dataset once (seeded, in the real on-disk layout) under a cache
folder, loads it into tensors, and builds a fresh network from a seed:

* ``ssd``     SSD300 (VGG16, width ×1/32, from scratch) on generated VOC-format boxes, batch 8,
              multibox loss; metric VOC07 mAP on the test split (the paper's Table 1 setting).
* ``segnet``  SegNet-basic (3×3, width 16) on generated CamVid-format road scenes at 48×64,
              class-weighted cross-entropy; metric mIoU on the test split (Table 2).
* ``resnet``  a small ResNet (He et al.'s CIFAR family: ResNet-8, widths 16/32/64, zero-init
              residuals as the repository's ResNets) on generated ImageFolder stripes at 32×32,
              batch 16; metric top-1 on val (Table 3).

``quick`` shrinks the datasets (and SSD's test split) so that every method fits a short test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock

from gs_lightning.data import (
    CAMVID_CLASSES,
    VOID_LABEL,
    CamVid,
    VOCDetection,
    collate_detection,
    ssd_eval_transforms,
    write_synthetic_camvid,
    write_synthetic_imagefolder,
    write_synthetic_voc,
)
from gs_lightning.metrics import SegmentationMetrics, VOC07MeanAveragePrecision
from gs_lightning.models import MultiboxLoss, SegNetBasic, build_ssd

TASKS = ("ssd", "segnet", "resnet")


@dataclass
class Task:
    """One experiment: data in memory, a network factory, its loss and its test metric.

    Attributes:
        name: ``"ssd"``, ``"segnet"`` or ``"resnet"``.
        metric_name: What :attr:`evaluate` returns, e.g. ``"mAP"``.
        batch_size: Training batch size.
        lr: SGD learning rate (momentum 0.9).
        weight_decay: SGD weight decay.
        train: Training inputs ``[N, 3, H, W]`` and targets (a tensor, or a list of per-image dicts).
        build: ``seed -> network`` (same seed, same initial weights).
        loss: ``(network, images, targets) -> scalar loss``.
        evaluate: ``network -> metric`` on the held-out split (network in eval mode, fp32).
    """

    name: str
    metric_name: str
    batch_size: int
    lr: float
    weight_decay: float
    train: tuple[Tensor, Any]
    build: Callable[[int], nn.Module]
    loss: Callable[[nn.Module, Tensor, Any], Tensor]
    evaluate: Callable[[nn.Module], float]

    def batch(self, index: Tensor) -> tuple[Tensor, Any]:
        """The training examples at ``index``."""
        images, targets = self.train
        if isinstance(targets, list):
            return images[index], [targets[i] for i in index.tolist()]
        return images[index], targets[index]


def _load(dataset: Any) -> list[tuple[Any, Any]]:
    return [dataset[i] for i in range(len(dataset))]


def ssd_task(cache: Path, quick: bool) -> Task:
    """SSD300, width ×1/32, batch 8, on generated VOC-format data (4 classes)."""
    n_train, n_test = (8, 4) if quick else (64, 24)
    root = write_synthetic_voc(cache / f"voc_{n_train}_{n_test}", years=("2007",), n_trainval=n_train, n_test=n_test, size=(96, 128))
    transform = ssd_eval_transforms(300)
    train = collate_detection(_load(VOCDetection(root, [("2007", "trainval")], transforms=transform)))
    test = collate_detection(_load(VOCDetection(root, [("2007", "test")], transforms=transform, keep_difficult=True)))
    criterion = MultiboxLoss()

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return build_ssd(300, num_classes=5, width_mult=1 / 32)

    def loss(model: nn.Module, images: Tensor, targets: list[dict[str, Tensor]]) -> Tensor:
        cls_logits, regression = model(images)
        return criterion(cls_logits, regression, targets, model.default_boxes)["loss"]

    def evaluate(model: nn.Module) -> float:
        metric = VOC07MeanAveragePrecision(num_classes=4)
        images, targets = test
        with torch.no_grad():
            for start in range(0, len(images), 8):
                detections = model(images[start : start + 8])
                metric.update(detections, targets[start : start + 8])
        return float(metric.compute()["map"])

    return Task("ssd", "mAP", 8, 1e-3, 5e-4, train, build, loss, evaluate)


def segnet_task(cache: Path, quick: bool) -> Task:
    """SegNet-basic (3×3, width 16) on generated CamVid-format scenes at 48×64."""
    n_train, n_test = (16, 4) if quick else (96, 32)
    root = write_synthetic_camvid(cache / f"camvid_{n_train}_{n_test}", n_train=n_train, n_val=2, n_test=n_test, size=(48, 64))
    num_classes = len(CAMVID_CLASSES)

    def tensors(split: str) -> tuple[Tensor, Tensor]:
        items = _load(CamVid(root, split))
        return (
            torch.stack([image.as_subclass(Tensor).float() for image, _ in items]),
            torch.stack([mask.as_subclass(Tensor).long() for _, mask in items]),
        )

    train, test = tensors("train"), tensors("test")
    counts = torch.bincount(train[1][train[1] != VOID_LABEL].flatten(), minlength=num_classes).double()
    freq = counts / counts.sum()
    weights = torch.where(counts > 0, freq[counts > 0].median() / freq.clamp(min=1e-12), 0.0).float()

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return SegNetBasic(num_classes=num_classes, width=16, kernel_size=3)

    def loss(model: nn.Module, images: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(model(images).float(), labels, weight=weights, ignore_index=VOID_LABEL)

    def evaluate(model: nn.Module) -> float:
        metric = SegmentationMetrics(num_classes, ignore_index=VOID_LABEL)
        with torch.no_grad():
            metric.update(model(test[0]).argmax(1), test[1])
        return float(metric.compute()["miou"])

    return Task("segnet", "mIoU", 8, 0.05, 5e-4, train, build, loss, evaluate)


def small_resnet(num_classes: int, widths: tuple[int, ...] = (16, 32, 64)) -> nn.Module:
    """A CIFAR-style ResNet (He et al. 2016, §4.2) with one BasicBlock per stage: ResNet-8."""
    layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True)]
    for i, width in enumerate(widths):
        stride, previous = (1, width) if i == 0 else (2, widths[i - 1])
        downsample = None
        if stride != 1 or previous != width:
            downsample = nn.Sequential(nn.Conv2d(previous, width, 1, stride, bias=False), nn.BatchNorm2d(width))
        block = BasicBlock(previous, width, stride, downsample)
        nn.init.zeros_(block.bn2.weight)  # zero-init residual (Goyal et al.), as build_resnet does
        layers.append(block)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], num_classes)]
    return nn.Sequential(*layers)


def resnet_task(cache: Path, quick: bool) -> Task:
    """A small ResNet (ResNet-8) on generated ImageFolder stripes (4 classes) at 32×32."""
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    per_class = (8, 2) if quick else (48, 16)
    root = write_synthetic_imagefolder(cache / f"imagefolder_{per_class[0]}_{per_class[1]}", num_classes=4,
                                       n_train_per_class=per_class[0], n_val_per_class=per_class[1], size=(32, 32))
    transform = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.25] * 3)])

    def tensors(split: str) -> tuple[Tensor, Tensor]:
        items = _load(ImageFolder(str(root / split), transform=transform))
        return torch.stack([x.as_subclass(Tensor) for x, _ in items]), torch.tensor([y for _, y in items])

    train, test = tensors("train"), tensors("val")

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return small_resnet(num_classes=4)

    def loss(model: nn.Module, images: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(model(images).float(), labels)

    def evaluate(model: nn.Module) -> float:
        with torch.no_grad():
            return float((model(test[0]).argmax(1) == test[1]).float().mean())

    return Task("resnet", "top-1", 16, 0.02, 1e-4, train, build, loss, evaluate)


BUILDERS: dict[str, Callable[[Path, bool], Task]] = {"ssd": ssd_task, "segnet": segnet_task, "resnet": resnet_task}
