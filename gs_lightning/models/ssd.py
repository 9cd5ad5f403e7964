"""SSD300 / SSD512 on a VGG16 backbone, as in the original SSD (Liu et al., ECCV 2016).

The layers, default boxes and post-processing follow the original Caffe SSD for PASCAL VOC
(``ssd_pascal.py`` / ``ssd_pascal_512.py``) and ChainerCV's port of it. torchvision's
``SSDHead``, ``DefaultBoxGenerator`` and ``BoxCoder`` are reused; torchvision's ``SSD`` class
is not, because it normalises and resizes the input itself and returns its own loss, whereas
here the input is a ready batched tensor and the loss lives in
:mod:`gs_lightning.models.multibox` (computed in fp32 under autocast).

Input: a float tensor ``[B, 3, S, S]`` (``S`` = 300 or 512) standardised as the VGG16
``IMAGENET1K_FEATURES`` weights expect (``gs_lightning.data.voc.ssd_eval_transforms`` does it:
pixel values in 0..255 minus the mean pixel).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models import VGG16_Weights
from torchvision.models.detection._utils import BoxCoder
from torchvision.models.detection.anchor_utils import DefaultBoxGenerator
from torchvision.models.detection.image_list import ImageList
from torchvision.models.detection.ssd import SSDHead
from torchvision.ops import boxes as box_ops

__all__ = ["L2Norm", "SSDVGG16", "VGG16Backbone", "build_ssd", "default_vgg16_weights_path"]


@dataclass(frozen=True)
class _SSDConfig:
    """Feature-map grids and default-box settings of one input size (original SSD, VOC)."""

    grids: tuple[int, ...]
    min_sizes: tuple[float, ...]
    max_size: float
    steps: tuple[int, ...]
    aspect_ratios: tuple[tuple[int, ...], ...]


_CONFIGS: dict[int, _SSDConfig] = {
    300: _SSDConfig(
        grids=(38, 19, 10, 5, 3, 1),
        min_sizes=(30.0, 60.0, 111.0, 162.0, 213.0, 264.0),
        max_size=315.0,
        steps=(8, 16, 32, 64, 100, 300),
        aspect_ratios=((2,), (2, 3), (2, 3), (2, 3), (2,), (2,)),
    ),
    512: _SSDConfig(
        grids=(64, 32, 16, 8, 4, 2, 1),
        min_sizes=(35.84, 76.8, 153.6, 230.4, 307.2, 384.0, 460.8),
        max_size=537.6,
        steps=(8, 16, 32, 64, 128, 256, 512),
        aspect_ratios=((2,), (2, 3), (2, 3), (2, 3), (2, 3), (2,), (2,)),
    ),
}

# torchvision's VGG16 ``features`` layout (config "D"): channel widths, "M" = 2x2 max-pool.
_VGG16_CFG: tuple[int | str, ...] = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512)
_CONV4_3_END = 23  # index in ``features`` right after conv4_3's ReLU
_POOL3_INDEX = 16  # pool3 uses ceil_mode so that 75 -> 38 at 300 px (and 128 -> 64 at 512 px)


def _scaled(channels: int, width_mult: float) -> int:
    return max(1, int(round(channels * width_mult)))


def _xavier_init(module: nn.Module) -> None:
    # Caffe SSD initialises all the layers that are not in the ImageNet VGG16 with Xavier.
    for layer in module.modules():
        if isinstance(layer, nn.Conv2d):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)


def _relu() -> nn.ReLU:
    # Not in-place, so module output hooks (e.g. underflow statistics) see each conv's output
    # unmodified; ReLU saves its output for backward either way, so no saved memory is added.
    return nn.ReLU(inplace=False)


class L2Norm(nn.Module):
    """Channel-wise L2 normalisation with a learnable per-channel scale (ParseNet, used on conv4_3).

    Computed in fp32: under fp16 autocast the sum of squares over 512 channels overflows.

    Args:
        channels: number of input channels.
        scale: initial value of every per-channel scale (20 in SSD).
        eps: lower bound of the norm, avoids a division by zero.
    """

    def __init__(self, channels: int, scale: float = 20.0, eps: float = 1e-10) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((channels,), float(scale)))

    def forward(self, x: Tensor) -> Tensor:
        """Normalise ``x`` ``[B, C, H, W]`` over channels and scale it; keeps ``x``'s dtype."""
        out = F.normalize(x.float(), dim=1, eps=self.eps) * self.weight.float().view(1, -1, 1, 1)
        return out.to(x.dtype)


class VGG16Backbone(nn.Module):
    """VGG16 feature extractor of the original SSD, returning the source feature maps.

    conv1_1..conv4_3 (pool3 with ``ceil_mode``), L2Norm on conv4_3, conv5_x, pool5 3x3 stride 1
    pad 1, conv6 3x3 dilation 6 (1024), conv7 1x1 (1024), then the extra layers (conv8..conv11
    for 300 px; conv8..conv12 with a 4x4 conv12_2 for 512 px, as in Caffe's SSD512).

    Args:
        size: input side, 300 or 512.
        width_mult: multiplier of every channel width (1.0 = the real network; small values
            make tiny models for tests).
    """

    def __init__(self, size: int = 300, width_mult: float = 1.0) -> None:
        super().__init__()
        if size not in _CONFIGS:
            raise ValueError(f"SSD input size must be one of {sorted(_CONFIGS)}, got {size}")
        if width_mult <= 0:
            raise ValueError(f"width_mult must be > 0, got {width_mult}")

        def c(channels: int) -> int:
            return _scaled(channels, width_mult)

        layers: list[nn.Module] = []
        in_ch = 3
        for v in _VGG16_CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2, ceil_mode=len(layers) == _POOL3_INDEX))
            else:
                layers += [nn.Conv2d(in_ch, c(int(v)), kernel_size=3, padding=1), _relu()]
                in_ch = c(int(v))
        # Same module indices as torchvision's ``vgg16().features`` so its state_dict maps 1:1.
        self.conv4_3 = nn.Sequential(*layers[:_CONV4_3_END])
        self.conv5_3 = nn.Sequential(*layers[_CONV4_3_END:])
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                # torchvision's VGG init, used when no ImageNet weights are loaded.
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(module.bias)
        self.l2norm = L2Norm(c(512))

        self.fc = nn.Sequential(
            nn.MaxPool2d(kernel_size=3, stride=1, padding=1),  # pool5
            nn.Conv2d(c(512), c(1024), kernel_size=3, padding=6, dilation=6),  # conv6 (atrous fc6)
            _relu(),
            nn.Conv2d(c(1024), c(1024), kernel_size=1),  # conv7 (fc7)
            _relu(),
        )
        _xavier_init(self.fc)

        # (mid channels, out channels, kernel, stride, padding) of the second conv of each extra block.
        if size == 300:
            extra_cfg = [(256, 512, 3, 2, 1), (128, 256, 3, 2, 1), (128, 256, 3, 1, 0), (128, 256, 3, 1, 0)]
        else:
            extra_cfg = [(256, 512, 3, 2, 1)] + [(128, 256, 3, 2, 1)] * 3 + [(128, 256, 4, 1, 1)]
        self.extras = nn.ModuleList()
        in_ch = c(1024)
        for mid, out, kernel, stride, padding in extra_cfg:
            self.extras.append(
                nn.Sequential(
                    nn.Conv2d(in_ch, c(mid), kernel_size=1),
                    _relu(),
                    nn.Conv2d(c(mid), c(out), kernel_size=kernel, stride=stride, padding=padding),
                    _relu(),
                )
            )
            in_ch = c(out)
        _xavier_init(self.extras)

        self.out_channels: list[int] = [c(512), c(1024)] + [c(cfg[1]) for cfg in extra_cfg]

    def forward(self, x: Tensor) -> list[Tensor]:
        """Return the source feature maps, finest first (conv4_3 normalised, conv7, extras)."""
        x = self.conv4_3(x)
        features = [self.l2norm(x)]
        x = self.fc(self.conv5_3(x))
        features.append(x)
        for block in self.extras:
            x = block(x)
            features.append(x)
        return features

    def load_vgg16_state_dict(self, state_dict: dict[str, Tensor], source: str = "state_dict") -> None:
        """Copy conv1_1..conv5_3 from a torchvision ``vgg16`` state_dict (``features.N.*`` keys).

        conv6/conv7 keep their Xavier init: torchvision's ``IMAGENET1K_FEATURES`` file has no
        subsampled fc6/fc7 (its ``classifier`` is not valid).

        Raises:
            ValueError: a conv weight is missing or has the wrong shape (e.g. ``width_mult != 1``).
        """
        targets = {f"features.{i}": m for i, m in enumerate(list(self.conv4_3) + list(self.conv5_3))}
        for prefix, module in targets.items():
            if not isinstance(module, nn.Conv2d):
                continue
            for name, param in (("weight", module.weight), ("bias", module.bias)):
                key = f"{prefix}.{name}"
                value = state_dict.get(key)
                if value is None or value.shape != param.shape:
                    found = "missing" if value is None else f"shape {tuple(value.shape)}"
                    raise ValueError(
                        f"{source}: '{key}' is {found}, expected shape {tuple(param.shape)}; expected a "
                        "torchvision vgg16 state_dict (keys 'features.N.weight'/'features.N.bias')"
                    )
                with torch.no_grad():
                    param.copy_(value)


def default_vgg16_weights_path() -> Path:
    """Where ``torch.hub`` caches torchvision's ``VGG16_Weights.IMAGENET1K_FEATURES`` file."""
    filename = os.path.basename(urlparse(VGG16_Weights.IMAGENET1K_FEATURES.url).path)
    return Path(torch.hub.get_dir()) / "checkpoints" / filename


class SSDVGG16(nn.Module):
    """SSD300 / SSD512 detector (VGG16 backbone, original VOC default boxes).

    Training mode returns ``(cls_logits [B, A, C], bbox_regression [B, A, 4])`` for
    :class:`gs_lightning.models.multibox.MultiboxLoss`; eval mode returns one dict per image with
    ``boxes`` (XYXY pixels of the ``S x S`` input, clipped to it), ``scores`` and ``labels``
    (1..C-1): softmax scores, per class score > ``score_thresh`` and the ``topk_candidates`` best
    (Caffe's ``top_k`` 400), NMS at ``nms_thresh`` per class, then the ``detections_per_img`` best.

    Args:
        size: input side, 300 (8732 default boxes) or 512 (24564 default boxes).
        num_classes: number of classes including background (index 0); 21 for VOC.
        width_mult: channel width multiplier (tests use a small value).
        score_thresh: minimum class score of a detection.
        nms_thresh: IoU threshold of the per-class NMS.
        detections_per_img: detections kept per image after NMS.
        topk_candidates: per-class candidates kept before NMS.

    Attributes:
        default_boxes: ``[A, 4]`` default boxes, XYXY in input pixels (not clipped, as in SSD VOC).
    """

    default_boxes: Tensor

    def __init__(
        self,
        size: int = 300,
        num_classes: int = 21,
        width_mult: float = 1.0,
        score_thresh: float = 0.01,
        nms_thresh: float = 0.45,
        detections_per_img: int = 200,
        topk_candidates: int = 400,
    ) -> None:
        super().__init__()
        self.backbone = VGG16Backbone(size, width_mult)
        cfg = _CONFIGS[size]
        self.size = size
        self.num_classes = num_classes
        self.grids = cfg.grids
        self.anchor_generator = DefaultBoxGenerator(
            [list(ar) for ar in cfg.aspect_ratios],
            scales=[m / size for m in cfg.min_sizes] + [cfg.max_size / size],
            steps=list(cfg.steps),
            clip=False,
        )
        self.head = SSDHead(self.backbone.out_channels, self.anchor_generator.num_anchors_per_location(), num_classes)
        self.box_coder = BoxCoder(weights=(10.0, 10.0, 5.0, 5.0))  # variances (0.1, 0.2)
        self.score_thresh = score_thresh
        self.nms_thresh = nms_thresh
        self.detections_per_img = detections_per_img
        self.topk_candidates = topk_candidates
        # The boxes depend only on the grid shapes, which are fixed by ``size``.
        shapes = ImageList(torch.empty(0, 3, size, size), [(size, size)])
        grids = [torch.empty(0, 0, g, g) for g in cfg.grids]
        self.register_buffer("default_boxes", self.anchor_generator(shapes, grids)[0], persistent=False)

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor] | list[dict[str, Tensor]]:
        """Run the network on ``images`` ``[B, 3, S, S]``; see the class docstring for outputs."""
        if images.dim() != 4 or tuple(images.shape[1:]) != (3, self.size, self.size):
            raise ValueError(f"expected images of shape [B, 3, {self.size}, {self.size}], got {list(images.shape)}")
        features = self.backbone(images)
        grids = tuple(f.shape[-1] for f in features)
        if grids != self.grids:
            raise RuntimeError(f"feature grids {grids} differ from the default-box grids {self.grids}")
        out = self.head(features)
        if self.training:
            return out["cls_logits"], out["bbox_regression"]
        return self.postprocess(out["cls_logits"], out["bbox_regression"])

    @torch.no_grad()
    def postprocess(self, cls_logits: Tensor, bbox_regression: Tensor) -> list[dict[str, Tensor]]:
        """Decode raw head outputs into per-image detections (computed in fp32)."""
        scores_all = F.softmax(cls_logits.float(), dim=-1)
        detections = []
        for reg, scores in zip(bbox_regression.float(), scores_all):
            boxes = self.box_coder.decode_single(reg, self.default_boxes).clamp(min=0, max=self.size)
            keep_boxes, keep_scores, keep_labels = [], [], []
            for label in range(1, self.num_classes):
                score = scores[:, label]
                idx = torch.where(score > self.score_thresh)[0]
                score, order = score[idx].topk(min(self.topk_candidates, idx.numel()))
                keep_boxes.append(boxes[idx[order]])
                keep_scores.append(score)
                keep_labels.append(torch.full_like(order, label))
            cat_boxes, cat_scores, cat_labels = torch.cat(keep_boxes), torch.cat(keep_scores), torch.cat(keep_labels)
            keep = box_ops.batched_nms(cat_boxes, cat_scores, cat_labels, self.nms_thresh)[: self.detections_per_img]
            detections.append({"boxes": cat_boxes[keep], "scores": cat_scores[keep], "labels": cat_labels[keep]})
        return detections


def _vgg16_weights_file(pretrained: bool | str | os.PathLike[str], width_mult: float) -> Path:
    if width_mult != 1.0:
        raise ValueError(f"pretrained VGG16 weights need width_mult=1.0, got {width_mult}")
    path = default_vgg16_weights_path() if pretrained is True else Path(pretrained)
    if not path.is_file():
        url = VGG16_Weights.IMAGENET1K_FEATURES.url
        raise FileNotFoundError(
            f"VGG16 ImageNet weights not found at {path}. Download {url} (torchvision's "
            f"VGG16_Weights.IMAGENET1K_FEATURES; on a machine with internet "
            f"`torchvision.models.vgg16(weights='IMAGENET1K_FEATURES')` stores it in the torch.hub cache, "
            f"{default_vgg16_weights_path()}) and copy it to {path}, or pass its path as pretrained=..."
        )
    return path


def build_ssd(
    size: int = 300,
    num_classes: int = 21,
    pretrained: bool | str | os.PathLike[str] = False,
    width_mult: float = 1.0,
) -> SSDVGG16:
    """Build SSD300 or SSD512, optionally with ImageNet VGG16 weights in conv1_1..conv5_3.

    Args:
        size: 300 or 512.
        num_classes: classes including background (21 for VOC).
        pretrained: ``False`` (random init), a path to a torchvision ``vgg16`` state_dict
            (``.pth``), or ``True`` for torchvision's ``VGG16_Weights.IMAGENET1K_FEATURES`` file
            at its ``torch.hub`` cache path (:func:`default_vgg16_weights_path`). Nothing is
            downloaded.
        width_mult: channel width multiplier; must be 1.0 with ``pretrained``.

    Raises:
        FileNotFoundError: the weights file is not there; the message says where to put it and
            where to get it.
        ValueError: ``pretrained`` with ``width_mult != 1`` or a state_dict of the wrong layout.
    """
    # Check the weights file before building: a full-width SSD takes seconds to initialise.
    path = None if pretrained is False else _vgg16_weights_file(pretrained, width_mult)
    model = SSDVGG16(size=size, num_classes=num_classes, width_mult=width_mult)
    if path is None:
        return model
    state_dict = torch.load(path, map_location="cpu", weights_only=True)
    model.backbone.load_vgg16_state_dict(state_dict, source=str(path))
    return model
