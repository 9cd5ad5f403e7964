"""The bench networks with synthetic batches and their natural losses, shared by the benches.

Every workload is a network from the paper's experiments (or its torchvision stand-in) in
training mode, a generator of synthetic batches, and the loss the network trains with:

* ``resnet18``  torchvision ResNet-18 (zero-init residual, as trained here), cross-entropy
* ``vgg16``     torchvision VGG-16 without BN, cross-entropy
* ``ssd300``    SSD300 (VGG16 backbone), multibox loss on a few random ground-truth boxes
* ``ssd512``    SSD512, the same
* ``segnet``    SegNet-basic, pixel-wise cross-entropy on blocky random label maps

The inputs are not noise alone: each class paints its own pattern or colour into the image, so
that the fp32 SGD steps of :meth:`Workload.warmup`, which take the weights away from their
random initialisation, train on a learnable task. Batches are drawn on the CPU from a seeded generator and then
moved, so a seed gives the same weights and batches on every device.

Two sizes: ``realistic`` is the paper's (for a GPU), ``small`` shrinks images, batches and
channel widths until an fp16 backward takes a few seconds on a 2-core CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models.vgg import VGG, make_layers

from gs_lightning.models import MultiboxLoss, SegNetBasic, build_resnet, build_ssd

Size = Literal["small", "realistic"]
SIZES: tuple[Size, ...] = ("small", "realistic")

Batch = tuple[Tensor, Any]  # (images, targets): class labels, label maps or per-image boxes


@dataclass(frozen=True)
class Config:
    """Input and width of one workload at one size.

    Attributes:
        batch_size: Images (sequences) per batch.
        height: Image height (SSD: also its width; the SSD input size is fixed); a sequence's length.
        width: Image width; the Transformer's model width.
        width_mult: Channel-width multiplier of the network (1.0 = the real network).
    """

    batch_size: int
    height: int
    width: int
    width_mult: float = 1.0

    def describe(self) -> str:
        """E.g. ``"batch 32, 224x224"`` (``", width x0.125"`` when narrowed)."""
        text = f"batch {self.batch_size}, {self.height}x{self.width}"
        return text if self.width_mult == 1.0 else f"{text}, width x{self.width_mult:g}"


# ResNet-18 has no width option in torchvision, so its small size shrinks only image and batch.
CONFIGS: dict[str, dict[Size, Config]] = {
    "resnet18": {"realistic": Config(32, 224, 224), "small": Config(4, 32, 32)},
    "vgg16": {"realistic": Config(16, 224, 224), "small": Config(8, 32, 32, 0.125)},
    "ssd300": {"realistic": Config(8, 300, 300), "small": Config(1, 300, 300, 0.125)},
    "ssd512": {"realistic": Config(8, 512, 512), "small": Config(1, 512, 512, 0.0625)},
    "segnet": {"realistic": Config(12, 360, 480), "small": Config(4, 48, 64, 0.25)},
    "resnet50": {"realistic": Config(64, 224, 224), "small": Config(2, 32, 32)},
    # BERT-base's encoder shape (12 layers, width 768, 12 heads) on 128-token sequences.
    "transformer": {"realistic": Config(32, 128, 768), "small": Config(4, 16, 64)},
}
MODELS: tuple[str, ...] = tuple(CONFIGS)
TITLES = {
    "resnet18": "ResNet-18",
    "vgg16": "VGG-16",
    "ssd300": "SSD300",
    "ssd512": "SSD512",
    "segnet": "SegNet-basic",
    "resnet50": "ResNet-50",
    "transformer": "Transformer encoder",
}

# SGD learning rates of the warm-up steps (momentum 0.9): each recipe's (ResNet: Goyal et al.'s
# 0.1 per 256 images at batch 32), SegNet's halved because its labels here are noisier.
_LEARNING_RATES = {
    "resnet18": 0.0125,
    "vgg16": 0.01,
    "ssd300": 1e-3,
    "ssd512": 1e-3,
    "segnet": 0.05,
    "resnet50": 0.025,
    "transformer": 1e-3,
}

_NUM_CLASSES = {
    "resnet18": 1000,
    "vgg16": 1000,
    "ssd300": 21,
    "ssd512": 21,
    "segnet": 11,
    "resnet50": 1000,
    "transformer": 10,
}


@dataclass
class Workload:
    """One network in training mode, its batches and its loss.

    Attributes:
        name: Registry key, e.g. ``"resnet18"``.
        config: Input and width settings.
        model: The network, in training mode.
        device: Where the model and its batches live.
        make_batch: Draws a batch from a CPU generator and puts it on the model's device.
        criterion: ``criterion(model output, targets)`` -> scalar fp32 loss.
        lr: Learning rate of :meth:`warmup`.
    """

    name: str
    config: Config
    model: nn.Module
    device: torch.device
    make_batch: Callable[[torch.Generator], Batch]
    criterion: Callable[[Any, Any], Tensor]
    lr: float

    @property
    def title(self) -> str:
        """Display name, e.g. ``"ResNet-18"``."""
        return TITLES[self.name]

    @property
    def settings(self) -> str:
        """Human-readable settings, e.g. ``"batch 32, 224x224"``."""
        return self.config.describe()

    def loss_fn(self, batch: Batch) -> Callable[[nn.Module], Tensor]:
        """``model -> loss`` on a fixed batch: the form ``FidelityProbe`` takes."""
        images, targets = batch
        return lambda model: self.criterion(model(images), targets)

    def warmup(self, steps: int, generator: torch.Generator) -> float | None:
        """Train ``steps`` fp32 SGD steps on fresh batches; returns the last loss (None if no step)."""
        optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)
        loss = None
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = self.loss_fn(self.make_batch(generator))(self.model)
            loss.backward()
            optimizer.step()
        self.model.zero_grad(set_to_none=True)
        return None if loss is None else float(loss.detach())


def build(name: str, size: Size, device: torch.device, seed: int = 0) -> Workload:
    """Build workload ``name`` at ``size`` on ``device``; ``seed`` fixes weights and data."""
    if name not in CONFIGS:
        raise ValueError(f"unknown bench model {name!r}; choose from {', '.join(MODELS)}")
    config = CONFIGS[name][size]
    num_classes = _NUM_CLASSES[name]
    torch.manual_seed(seed)
    # The synthetic "dataset" (class patterns, colours) comes from its own stream, drawn first.
    data = torch.Generator().manual_seed(seed)
    if name in ("resnet18", "resnet50"):
        model = build_resnet(name, num_classes)
        make_batch, criterion = _classification(config, num_classes, data, device)
    elif name == "transformer":
        model = _TransformerClassifier(config, num_classes)
        make_batch, criterion = _sequences(config, num_classes, data, device)
    elif name == "vgg16":
        model = _vgg16(num_classes, config.width_mult)
        make_batch, criterion = _classification(config, num_classes, data, device)
    elif name.startswith("ssd"):
        model = build_ssd(config.height, num_classes, width_mult=config.width_mult)
        make_batch, criterion = _detection(config, num_classes, data, device, model.default_boxes.to(device))
    else:
        model = SegNetBasic(num_classes, width=_scaled(64, config.width_mult))
        make_batch, criterion = _segmentation(config, num_classes, data, device)
    return Workload(name, config, model.to(device).train(), device, make_batch, criterion, _LEARNING_RATES[name])


class _TransformerClassifier(nn.Module):
    """Token embeddings, a pre-norm Transformer encoder (GELU, 4x feed-forward) and a mean-pooled linear head."""

    VOCABULARY = 1000

    def __init__(self, config: Config, num_classes: int) -> None:
        super().__init__()
        width = config.width
        self.embed = nn.Embedding(self.VOCABULARY, width)
        layer = nn.TransformerEncoderLayer(
            width, max(1, width // 64), 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, 12 if width >= 768 else 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def _sequences(
    config: Config, num_classes: int, data: torch.Generator, device: torch.device
) -> tuple[Callable[[torch.Generator], Batch], Callable[[Tensor, Tensor], Tensor]]:
    """Token sequences whose class sets the frequency of a few marker tokens; cross-entropy."""
    markers = torch.randint(0, _TransformerClassifier.VOCABULARY, (num_classes,), generator=data)

    def make_batch(generator: torch.Generator) -> Batch:
        labels = torch.randint(0, num_classes, (config.batch_size,), generator=generator)
        tokens = torch.randint(
            0, _TransformerClassifier.VOCABULARY, (config.batch_size, config.height), generator=generator
        )
        marked = torch.rand(config.batch_size, config.height, generator=generator) < 0.25
        tokens = torch.where(marked, markers[labels].unsqueeze(1), tokens)
        return tokens.to(device), labels.to(device)

    def criterion(logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(logits.float(), labels)

    return make_batch, criterion


def _scaled(channels: int, width_mult: float) -> int:
    return max(1, round(channels * width_mult))


def _vgg16(num_classes: int, width_mult: float) -> nn.Module:
    """torchvision's VGG-16 (config D, no BN) with every width times ``width_mult``.

    At width 1 it is ``torchvision.models.vgg16(num_classes=..., dropout=0.0)``, initialised as
    torchvision does. Dropout is off: its masks are not reproducible across dtypes, so fp32 and
    fp16 runs of one batch would see different networks, and a mask is no precision effect.
    """
    cfg: list[int | str] = [
        v if v == "M" else _scaled(v, width_mult)
        for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
    ]
    model = VGG(make_layers(cfg), num_classes=num_classes, init_weights=False, dropout=0.0)
    hidden, features = _scaled(4096, width_mult), _scaled(512, width_mult) * 7 * 7
    model.classifier = nn.Sequential(
        nn.Linear(features, hidden),
        nn.ReLU(True),
        nn.Dropout(0.0),
        nn.Linear(hidden, hidden),
        nn.ReLU(True),
        nn.Dropout(0.0),
        nn.Linear(hidden, num_classes),
    )
    for module in model.modules():  # torchvision's VGG initialisation
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0, 0.01)
            nn.init.zeros_(module.bias)
    return model


def _blocky(generator: torch.Generator, high: int, shape: tuple[int, int, int], block: int) -> Tensor:
    """Random integer maps in [0, high) that are constant on ``block`` x ``block`` tiles."""
    batch, height, width = shape
    coarse = torch.randint(0, high, (batch, 1, -(-height // block), -(-width // block)), generator=generator)
    return F.interpolate(coarse.float(), scale_factor=block, mode="nearest")[:, 0, :height, :width].long()


def _classification(
    config: Config, num_classes: int, data: torch.Generator, device: torch.device
) -> tuple[Callable[[torch.Generator], Batch], Callable[[Tensor, Tensor], Tensor]]:
    """Standardised images: a low-frequency pattern per class plus unit noise; cross-entropy."""
    shape = (config.height, config.width)
    patterns = F.interpolate(torch.randn(num_classes, 3, 4, 4, generator=data), size=shape, mode="bilinear")

    def make_batch(generator: torch.Generator) -> Batch:
        labels = torch.randint(0, num_classes, (config.batch_size,), generator=generator)
        noise = torch.randn(config.batch_size, 3, *shape, generator=generator)
        return (patterns[labels] + noise).to(device), labels.to(device)

    def criterion(logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(logits.float(), labels)  # fp16 logits, loss in fp32

    return make_batch, criterion


def _segmentation(
    config: Config, num_classes: int, data: torch.Generator, device: torch.device
) -> tuple[Callable[[torch.Generator], Batch], Callable[[Tensor, Tensor], Tensor]]:
    """Raw 0..255 images (SegNet's input): one colour per class on blocky label maps, plus noise."""
    colours = torch.rand(num_classes, 3, generator=data) * 200 + 28

    def make_batch(generator: torch.Generator) -> Batch:
        shape = (config.batch_size, config.height, config.width)
        labels = _blocky(generator, num_classes, shape, block=8)
        noise = torch.randn(config.batch_size, 3, config.height, config.width, generator=generator) * 20
        images = (colours[labels].permute(0, 3, 1, 2) + noise).clamp(0, 255)
        return images.to(device), labels.to(device)

    def criterion(logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(logits.float(), labels)

    return make_batch, criterion


def _detection(
    config: Config, num_classes: int, data: torch.Generator, device: torch.device, default_boxes: Tensor
) -> tuple[Callable[[torch.Generator], Batch], Callable[[tuple[Tensor, Tensor], list[dict[str, Tensor]]], Tensor]]:
    """Mean-subtracted 0..255 images (SSD's input) with 1-3 boxes filled by their class colour."""
    colours = torch.rand(num_classes, 3, generator=data) * 200 - 100
    side = config.height
    multibox = MultiboxLoss()

    def make_batch(generator: torch.Generator) -> Batch:
        images = torch.randn(config.batch_size, 3, side, side, generator=generator) * 30
        targets = []
        for image in images:
            count = int(torch.randint(1, 4, (), generator=generator))
            size = (torch.rand(count, 2, generator=generator) * 0.6 + 0.2) * side
            corner = torch.rand(count, 2, generator=generator) * (side - size)
            boxes = torch.cat([corner, corner + size], dim=1).floor()
            labels = torch.randint(1, num_classes, (count,), generator=generator)
            for (x0, y0, x1, y1), label in zip(boxes.long().tolist(), labels.tolist()):
                image[:, y0:y1, x0:x1] += colours[label].view(3, 1, 1)
            targets.append({"boxes": boxes.to(device), "labels": labels.to(device)})
        return images.to(device), targets

    def criterion(output: tuple[Tensor, Tensor], targets: list[dict[str, Tensor]]) -> Tensor:
        cls_logits, bbox_regression = output
        return multibox(cls_logits, bbox_regression, targets, default_boxes)["loss"]

    return make_batch, criterion
