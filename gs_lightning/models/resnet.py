"""ImageNet ResNets for the classification experiments, built by torchvision."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torchvision.models import resnet18, resnet50

_ARCHS: dict[str, Callable[..., nn.Module]] = {"resnet18": resnet18, "resnet50": resnet50}


def build_resnet(arch: str, num_classes: int = 1000, zero_init_residual: bool = True) -> nn.Module:
    """A randomly initialised torchvision ResNet.

    Args:
        arch: ``"resnet18"`` or ``"resnet50"``.
        num_classes: size of the final fully connected layer.
        zero_init_residual: start the last BN gamma of every residual block at zero, so each
            block begins as the identity (Goyal et al., "Accurate, Large Minibatch SGD", 2017).

    Raises:
        ValueError: ``arch`` is not one of the supported names.
    """
    if arch not in _ARCHS:
        raise ValueError(f"unknown ResNet arch {arch!r}; choose one of {sorted(_ARCHS)}")
    return _ARCHS[arch](weights=None, num_classes=num_classes, zero_init_residual=zero_init_residual)
