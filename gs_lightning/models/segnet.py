"""SegNet-Basic for semantic segmentation (Badrinarayanan et al., PAMI 2017).

Follows the ``segnet_basic_train.prototxt`` of SegNet-Tutorial
(https://github.com/alexgkendall/SegNet-Tutorial) and ChainerCV's ``SegNetBasic``
(chainercv/links/model/segnet/segnet_basic.py), the model the gradient-scaling paper trains on CamVid.
"""

from __future__ import annotations

import torch
from torch import nn


def _conv_bn(in_channels: int, out_channels: int, kernel_size: int) -> list[nn.Module]:
    # No conv bias: the BN shift that follows makes it redundant (ChainerCV uses nobias=True).
    return [
        nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2, bias=False),
        nn.BatchNorm2d(out_channels),
    ]


class SegNetBasic(nn.Module):
    """SegNet-Basic: LRN, 4 conv-BN-ReLU-pool encoders, 4 unpool-conv-BN decoders, 1x1 classifier.

    The input is local-response normalised first (size 5, alpha 1e-4, beta 0.75, k 1 as in the
    SegNet-Tutorial prototxt; PyTorch divides alpha by size like Caffe, which ChainerCV matches
    with ``alpha=1e-4 / 5``). Max-pooling uses ``ceil_mode=True`` (Caffe/Chainer ``cover_all``)
    and each unpooling restores the exact pre-pool size, so the logits have the input's height
    and width for any size, multiples of 16 or not. As in SegNet-Basic, decoder convolutions
    have no ReLU.

    Expects float images with raw 0..255 pixel values, as SegNet-Tutorial and ChainerCV feed them.

    Args:
        num_classes: output channels (CamVid: 11).
        in_channels: input image channels.
        width: channels of every encoder/decoder convolution (64 in SegNet-Basic).
        kernel_size: size of the encoder/decoder convolutions (7 in SegNet-Basic).
    """

    def __init__(self, num_classes: int = 11, in_channels: int = 3, width: int = 64, kernel_size: int = 7) -> None:
        super().__init__()
        self.lrn = nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=1.0)
        self.encoders = nn.ModuleList(
            nn.Sequential(*_conv_bn(in_channels if i == 0 else width, width, kernel_size), nn.ReLU(inplace=True))
            for i in range(4)
        )
        self.pool = nn.MaxPool2d(2, stride=2, ceil_mode=True, return_indices=True)
        self.unpool = nn.MaxUnpool2d(2, stride=2)
        self.decoders = nn.ModuleList(nn.Sequential(*_conv_bn(width, width, kernel_size)) for _ in range(4))
        self.classifier = nn.Conv2d(width, num_classes, 1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise as ChainerCV's SegNetBasic.

        He-normal convolutions (ChainerCV ``initializers.HeNormal``; SegNet-Tutorial's "msra"
        filler), BN gamma 1 and beta 0.001 (ChainerCV ``initial_beta=0.001``), zero classifier bias.
        """
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.constant_(module.bias, 1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images [N, C, H, W] to class logits [N, num_classes, H, W]."""
        h = self.lrn(x)
        skips: list[tuple[torch.Tensor, torch.Size]] = []
        for encoder in self.encoders:
            h = encoder(h)
            size = h.shape[-2:]
            h, indices = self.pool(h)
            skips.append((indices, size))
        for decoder, (indices, size) in zip(self.decoders, reversed(skips)):
            h = decoder(self.unpool(h, indices, output_size=size))
        return self.classifier(h)
