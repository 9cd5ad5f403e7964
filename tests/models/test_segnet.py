"""SegNetBasic: output size for any input size, structure, gradient flow."""

import pytest
import torch
from torch import nn

from gs_lightning.models.segnet import SegNetBasic


@pytest.mark.parametrize("size", [(23, 37), (360 // 8, 480 // 8), (32, 48)])
def test_output_matches_input_size(size: tuple[int, int]) -> None:
    torch.manual_seed(0)
    model = SegNetBasic(num_classes=11, width=8)
    logits = model(torch.rand(2, 3, *size) * 255)
    assert logits.shape == (2, 11, *size)


def test_full_camvid_resolution_in_eval_mode() -> None:
    model = SegNetBasic(num_classes=5, width=4, kernel_size=3).eval()
    with torch.no_grad():
        assert model(torch.rand(1, 3, 360, 480) * 255).shape == (1, 5, 360, 480)


def test_structure_follows_segnet_basic() -> None:
    model = SegNetBasic(num_classes=11, in_channels=3, width=16, kernel_size=7)
    lrn = model.lrn
    assert (lrn.size, lrn.alpha, lrn.beta, lrn.k) == (5, 1e-4, 0.75, 1.0)
    assert len(model.encoders) == 4 and len(model.decoders) == 4
    assert model.pool.ceil_mode and model.pool.return_indices
    for encoder in model.encoders:
        assert [type(m) for m in encoder] == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU]
        assert encoder[0].kernel_size == (7, 7) and encoder[0].out_channels == 16
    for decoder in model.decoders:
        assert [type(m) for m in decoder] == [nn.Conv2d, nn.BatchNorm2d], "no ReLU in SegNet-Basic decoders"
    assert model.classifier.kernel_size == (1, 1) and model.classifier.out_channels == 11
    torch.testing.assert_close(model.decoders[0][1].bias, torch.full((16,), 1e-3))
    # He normal: std sqrt(2 / fan_in), fan_in = 16 * 7 * 7.
    std = model.encoders[1][0].weight.std().item()
    assert abs(std - (2 / (16 * 49)) ** 0.5) < 0.01


def test_gradients_flow_to_every_parameter() -> None:
    torch.manual_seed(0)
    model = SegNetBasic(num_classes=11, width=8)
    images = torch.rand(2, 3, 23, 37) * 255
    target = torch.randint(0, 12, (2, 23, 37))
    loss = nn.functional.cross_entropy(model(images), target, ignore_index=11)
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name
