"""Lightning Fabric's own tests of its fp16 precision plugin, run with ``gs_lightning.fabric.GradientScalingPlugin``
(issue 15).

Ported from Lightning-AI/pytorch-lightning ``tests/tests_fabric/plugins/precision``: ``test_amp.py``,
``test_amp_integration.py`` and ``test_all.py``, on one CPU device (upstream runs the fp16 ones on CUDA:
on the CPU its ``"16-mixed"`` means bf16, the plugins here run real fp16). Each test names its
upstream test; where upstream reads a ``GradScaler``-only value the port checks the property it
protects, said in a comment there.

Covered in ``test_fabric.py``, not repeated: skipped steps, clipping, save and load.
Not ported: ``test_amp_precision_scaler_with_bf16``, ``test_amp_precision_optimizer_step_without_scaler``
and ``test_amp_precision_parameter_validation`` (bf16 and the ``precision=`` string, which these
plugins do not take; their options are checked in ``test_plugins.py``).
"""

from __future__ import annotations

from importlib import import_module
from unittest import mock
from unittest.mock import Mock

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from test_fabric import FABRIC_PACKAGES, launch, net
from torch import nn

import gs_lightning
from gs_lightning import GradientScaler
from gs_lightning.fabric import GradientScalingPlugin


@pytest.fixture(params=FABRIC_PACKAGES)
def fabric_package(request: pytest.FixtureRequest) -> str:
    """Each installed Fabric package, as in test_fabric.py."""
    return request.param


def test_amp_precision_default_scaler(fabric_package: str) -> None:
    """Upstream's plugin holds a GradScaler from the start; this one builds its GradientScaler for the
    first module set up, whose layers name the scales."""
    plugin = GradientScalingPlugin()
    launch(fabric_package, plugin, net())
    assert isinstance(plugin.scaler, GradientScaler)


def test_amp_precision_forward_context(fabric_package: str) -> None:
    """fp16 autocast on the model's device type (here the CPU, where upstream's ``16-mixed`` is bf16),
    the default dtype left at fp32."""
    plugin = GradientScalingPlugin()
    launch(fabric_package, plugin, net())
    assert torch.get_default_dtype() == torch.float32
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.float16
    assert not torch.is_autocast_enabled("cpu")


def test_amp_precision_backward() -> None:
    """backward scales the tensor through the scaler and passes the backward's arguments on."""
    scaler = Mock()
    scaler.scale = Mock(side_effect=lambda x: x)
    tensor, model = Mock(), Mock()
    with mock.patch.object(GradientScalingPlugin, "scaler", scaler):
        # device="cpu" settles emulate="auto" (the mocked scaler, which would settle it, is never built)
        GradientScalingPlugin(device="cpu").backward(tensor, model, "positional-arg", keyword="arg")
    scaler.scale.assert_called_once_with(tensor)
    tensor.backward.assert_called_once_with("positional-arg", keyword="arg")


def test_amp_precision_optimizer_step_with_scaler() -> None:
    scaler, optimizer = Mock(), Mock()
    with mock.patch.object(GradientScalingPlugin, "scaler", scaler):
        GradientScalingPlugin().optimizer_step(optimizer, keyword="arg")
    scaler.step.assert_called_once_with(optimizer, keyword="arg")
    scaler.update.assert_called_once()


@pytest.mark.parametrize(
    "plugin", [GradientScalingPlugin, gs_lightning.GradientScalingPlugin], ids=["fabric", "trainer"]
)
def test_default_dtype_is_restored(plugin) -> None:
    """test_all.py (Fabric's and the Trainer's): a plugin's init context (``init_context`` then, now
    ``tensor_init_context`` and ``module_init_context``) restores the default dtype even when the block
    raises. Upstream runs it for the true-precision plugins, which change it inside; a mixed-precision
    plugin keeps fp32 master weights, so it stays fp32 inside too. One test for both plugin families."""
    precision = plugin()
    for init_context in (precision.tensor_init_context, precision.module_init_context):
        assert torch.get_default_dtype() is torch.float32
        with pytest.raises(RuntimeError, match="foo"), init_context():
            assert torch.get_default_dtype() is torch.float32
            raise RuntimeError("foo")
        assert torch.get_default_dtype() is torch.float32


class MixedPrecisionModule(nn.Module):
    """Asserts, inside its forward, fp16 inputs, autocast and fp16 outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(32, 32)
        self.layer = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == torch.float16
        assert torch.is_autocast_enabled("cpu")
        output = self.layer(torch.relu(self.hidden(x)))
        assert output.dtype == torch.float16
        return output


def test_amp(fabric_package: str) -> None:
    """test_amp_integration.py::test_amp (its BoringFabric loop): fp32 weights and batches outside the
    model, fp16 inside, fp32 outputs back, fp32 gradients after fabric.backward."""
    torch.manual_seed(0)
    plugin = GradientScalingPlugin()
    fabric, model, optimizer = launch(fabric_package, plugin, MixedPrecisionModule())
    for batch in torch.randn(4, 2, 32):
        assert model.layer.weight.dtype == torch.float32
        assert batch.dtype == torch.float32
        output = model(batch)
        assert output.dtype == torch.float32
        fabric.backward(F.mse_loss(output, torch.ones_like(output)))
        assert model.layer.weight.grad.dtype == torch.float32
        optimizer.step()
        optimizer.zero_grad()
    assert plugin.scaler.iteration == 4 and plugin.scaler.skipped_steps == 0


def test_amp_fused_optimizer_parity(fabric_package: str) -> None:
    """The regular and the fused Adam give the same losses and weights under the plugin."""

    def run(fused: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        L.seed_everything(1234)
        fabric = import_module(fabric_package).Fabric(accelerator="cpu", devices=1, plugins=[GradientScalingPlugin()])
        model = net()
        model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1.0, fused=fused))
        data, target = torch.randn(10, 8), torch.randn(10, 4)
        losses = []
        for _ in range(5):
            optimizer.zero_grad()
            loss = (model(data) - target).abs().sum()
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.detach())
        return torch.stack(losses), list(model.parameters())

    losses, params = run(fused=False)
    losses_fused, params_fused = run(fused=True)
    torch.testing.assert_close(losses, losses_fused)
    for p, q in zip(params, params_fused):
        torch.testing.assert_close(p, q)
