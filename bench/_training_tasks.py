"""Small versions of the paper's three experiments and a deep plain network, held in memory, for
``bench/compare_training.py``.

Each task writes its generated dataset once (seeded, in the real on-disk layout) under a cache
folder, loads it into tensors, and builds a fresh network from a seed:

* ``ssd``     SSD300 (VGG16, width ×1/32, from scratch) on generated VOC-format boxes, batch 8,
              multibox loss; metric VOC07 mAP on the test split (the paper's Table 1 setting).
* ``segnet``  SegNet-basic (3×3, width 16) on generated CamVid-format road scenes at 48×64,
              class-weighted cross-entropy; metric mIoU on the test split (Table 2).
* ``resnet``  a small ResNet (He et al.'s CIFAR family: ResNet-8, widths 16/32/64, zero-init
              residuals as the repository's ResNets) on generated ImageFolder stripes at 32×32,
              batch 16; metric top-1 on val (Table 3).
* ``deep``    a plain 16-layer CNN (no normalisation, no residuals) whose layers' weights are scaled
              by powers of two from 2^-9 to 2^10, on generated CamVid-format scenes at 24×32, Adam
              with per-layer learning rates that make its fp32 training the unscaled network's;
              metric mIoU. The paper's premise made as strong as fp16's forward allows (printed by
              ``compare_training.py --gradient-magnitudes``): in a ReLU network without biases a
              layer's weight gradient scales as 1 / its weights' scale and an activation gradient
              as 1 / the activations', so a wider spread needs weights or activations outside
              fp16's range; a vanishing gradient (a saturating or contracting network) loses the
              input's information in the forward as fast as the gradient vanishes.

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

TASKS = ("ssd", "segnet", "resnet", "deep")


@dataclass
class Task:
    """One experiment: data in memory, a network factory, its loss and its test metric.

    Attributes:
        name: ``"ssd"``, ``"segnet"``, ``"resnet"`` or ``"deep"``.
        metric_name: What :attr:`evaluate` returns, e.g. ``"mAP"``.
        batch_size: Training batch size.
        lr: Learning rate (SGD's with momentum 0.9, unless :attr:`optimizer` says otherwise).
        weight_decay: SGD weight decay (likewise).
        train: Training inputs ``[N, 3, H, W]`` and targets (a tensor, or a list of per-image dicts).
        build: ``seed -> network`` (same seed, same initial weights).
        loss: ``(network, images, targets) -> scalar loss``.
        evaluate: ``network -> metric`` on the held-out split (network in eval mode, fp32).
        optimizer: ``network -> optimizer``; ``None``: SGD with momentum 0.9, :attr:`lr` and :attr:`weight_decay`.
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
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The task's optimizer over ``model``'s parameters."""
        if self.optimizer is not None:
            return self.optimizer(model)
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9, weight_decay=self.weight_decay)

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
    root = write_synthetic_voc(
        cache / f"voc_{n_train}_{n_test}", years=("2007",), n_trainval=n_train, n_test=n_test, size=(96, 128)
    )
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


def _camvid_segmentation(
    root: Path,
) -> tuple[tuple[Tensor, Tensor], Callable[[nn.Module, Tensor, Tensor], Tensor], Callable[[nn.Module], float]]:
    """A CamVid-format dataset's training tensors, its loss and its metric.

    The loss is cross-entropy weighted by median frequency balancing (the training split's class
    frequencies, as SegNet trains on CamVid); the metric is mIoU on the test split.
    """
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

    def loss(model: nn.Module, images: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(model(images).float(), labels, weight=weights, ignore_index=VOID_LABEL)

    def evaluate(model: nn.Module) -> float:
        metric = SegmentationMetrics(num_classes, ignore_index=VOID_LABEL)
        with torch.no_grad():
            metric.update(model(test[0]).argmax(1), test[1])
        return float(metric.compute()["miou"])

    return train, loss, evaluate


def segnet_task(cache: Path, quick: bool) -> Task:
    """SegNet-basic (3×3, width 16) on generated CamVid-format scenes at 48×64."""
    n_train, n_test = (16, 4) if quick else (96, 32)
    root = write_synthetic_camvid(
        cache / f"camvid_{n_train}_{n_test}", n_train=n_train, n_val=2, n_test=n_test, size=(48, 64)
    )
    train, loss, evaluate = _camvid_segmentation(root)

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return SegNetBasic(num_classes=len(CAMVID_CLASSES), width=16, kernel_size=3)

    return Task("segnet", "mIoU", 8, 0.05, 5e-4, train, build, loss, evaluate)


def small_resnet(num_classes: int, widths: tuple[int, ...] = (16, 32, 64)) -> nn.Module:
    """A CIFAR-style ResNet (He et al. 2016, §4.2) with one BasicBlock per stage: ResNet-8."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, widths[0], 3, padding=1, bias=False),
        nn.BatchNorm2d(widths[0]),
        nn.ReLU(inplace=True),
    ]
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
    root = write_synthetic_imagefolder(
        cache / f"imagefolder_{per_class[0]}_{per_class[1]}",
        num_classes=4,
        n_train_per_class=per_class[0],
        n_val_per_class=per_class[1],
        size=(32, 32),
    )
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


DEEP_LOG2_GAINS = (2, 0, 0, 0, 0, 0, 0, -9, -9, 0, 0, 0, 0, 0, 0, 10)
"""Power-of-two scales of the deep task's 16 layers, bottom first (see :func:`plain_cnn`).

Chosen as far apart as fp16's forward allows, measured: the bottom section's activations reach
2^12.4 at initialisation and 2^14 after 300 fp32 steps (fp16's largest is 2^16), the middle
section's are around 2^-8 (fp16's smallest normal is 2^-14), and no layer's weights lie mostly
below 2^-14 (2^-9 × He's 2^-3.1 for 16 input channels)."""


def plain_cnn(num_classes: int, log2_gains: tuple[int, ...] = DEEP_LOG2_GAINS, width: int = 16) -> nn.Sequential:
    """A plain deep CNN: 3×3 convolutions without bias, each followed by a ReLU but the last; no
    normalisation, no residuals, no pooling (one prediction per pixel).

    Layer ``i`` is He-initialised, then its weights are multiplied by ``2 ** log2_gains[i]``. A
    ReLU network without biases is positively homogeneous, so the network computes the
    He-initialised one's function of its input times ``2 ** sum(log2_gains)`` (−6 by default: raw
    pixels / 64), while each layer's activations, and the gradients that flow back through them,
    take the magnitudes its gains give: a weight gradient scales as ``1 / gain`` of its layer, an
    activation gradient as ``1 /`` the activations' magnitude there.
    """
    layers: list[nn.Module] = []
    channels = 3
    for i, log2_gain in enumerate(log2_gains):
        out = num_classes if i == len(log2_gains) - 1 else width
        conv = nn.Conv2d(channels, out, 3, padding=1, bias=False)
        nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")
        with torch.no_grad():
            conv.weight.mul_(2.0**log2_gain)  # a power of two: exact
        layers += [conv, nn.ReLU()]
        channels = out
    return nn.Sequential(*layers[:-1])


def layer_scaled_adam(model: nn.Module, lr: float, log2_gains: tuple[int, ...], eps: float = 1e-8) -> torch.optim.Adam:
    """Adam over ``model``'s convolutions (in order), layer ``i`` with learning rate ``lr·2^k`` and
    ε ``eps·2^-k`` (``k = log2_gains[i]``).

    Adam's step is invariant to a gradient's scale but not to the parameter's: with these settings
    each layer of :func:`plain_cnn` takes ``2^k`` times the step plain ``Adam(lr, eps)`` takes on the
    He-initialised network (whose weight gradients are ``2^k`` times larger), so in fp32 the two
    trainings are the same up to the power-of-two scales (exactly so: every operation involved
    commutes with them).
    """
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    if len(convs) != len(log2_gains):
        raise ValueError(f"layer_scaled_adam: {len(convs)} convolutions but {len(log2_gains)} gains")
    groups = [{"params": [conv.weight], "lr": lr * 2.0**k, "eps": eps * 2.0**-k} for conv, k in zip(convs, log2_gains)]
    return torch.optim.Adam(groups)


def deep_task(cache: Path, quick: bool) -> Task:
    """A plain 16-layer CNN (:func:`plain_cnn`) on generated CamVid-format scenes at 24×32 (raw
    pixels), per-pixel class-weighted cross-entropy, Adam (:func:`layer_scaled_adam`), batch 8;
    metric mIoU on the test split."""
    n_train, n_test = (16, 4) if quick else (96, 32)
    root = write_synthetic_camvid(
        cache / f"camvid_24x32_{n_train}_{n_test}", n_train=n_train, n_val=2, n_test=n_test, size=(24, 32)
    )
    train, loss, evaluate = _camvid_segmentation(root)
    lr = 1e-3

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return plain_cnn(len(CAMVID_CLASSES))

    return Task(
        "deep",
        "mIoU",
        8,
        lr,
        0.0,
        train,
        build,
        loss,
        evaluate,
        optimizer=lambda model: layer_scaled_adam(model, lr, DEEP_LOG2_GAINS),
    )


BUILDERS: dict[str, Callable[[Path, bool], Task]] = {
    "ssd": ssd_task,
    "segnet": segnet_task,
    "resnet": resnet_task,
    "deep": deep_task,
}
