"""Fused and foreach optimizers on every path: scaler.backward, the GradScaler-style loop, Trainer and Fabric plugins.

Fused optimizers unscale a ``GradScaler``'s gradients themselves when the scaler hands them its scale;
with gradient scaling ``.grad`` is already true, so they must step on it as it is. Each path runs
three batches, the second with an infinite loss, and must end where the same optimizer ends after
plain fp16 autocast steps on the first and third batches only: a skipped step touches neither the
weights nor the optimizer's state (Adam's step count and moments), and a taken one is not unscaled twice.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from conftest import Classifier, loader, make_trainer
from lightning.fabric.plugins import MixedPrecision
from torch import nn

import gs_lightning.fabric
from gs_lightning import DynamicLossScalingPlugin, FP16Plugin, GradientScaler, GradientScalingPlugin, LossScalingPlugin

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam_fused": lambda params: torch.optim.Adam(params, lr=1e-2, fused=True),
    "adamw_foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
    "sgd_fused": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True),
}
PLUGIN_NAMES = ["GradientScalingPlugin", "DynamicLossScalingPlugin", "LossScalingPlugin", "FP16Plugin"]
TRAINER_PLUGINS = {
    plugin.__name__: plugin
    for plugin in (GradientScalingPlugin, DynamicLossScalingPlugin, LossScalingPlugin, FP16Plugin)
}
INF_STEP = 1


def plugin_options(name: str) -> dict:
    return {"GradientScalingPlugin": {"update_interval": 2}, "DynamicLossScalingPlugin": {"init_scale": 2.0**10}}.get(
        name, {}
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(loader())[:3]


def expected_weights(net: nn.Module, optimizer: str) -> list[torch.Tensor]:
    """``net`` after plain fp16 autocast steps of the same optimizer on batches 0 and 2."""
    net = copy.deepcopy(net)
    opt = OPTIMIZERS[optimizer](net.parameters())
    for step, (x, y) in enumerate(batches()):
        if step == INF_STEP:
            continue
        with torch.autocast("cpu", dtype=torch.float16):
            F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in net.parameters()]


def assert_weights(net: nn.Module, expected: list[torch.Tensor]) -> None:
    for actual, wanted in zip(net.parameters(), expected):
        torch.testing.assert_close(actual.detach(), wanted, rtol=1e-4, atol=1e-6)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def inf_if_skipped(loss: torch.Tensor, step: int) -> torch.Tensor:
    return loss * float("inf") if step == INF_STEP else loss


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_scaler_backward_loop(optimizer: str) -> None:
    net = mlp()
    expected = expected_weights(net, optimizer)
    scaler, opt = GradientScaler(net, update_interval=2), OPTIMIZERS[optimizer](net.parameters())
    for step, (x, y) in enumerate(batches()):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(net(x), y)
        scaler.backward(inf_if_skipped(loss, step))
        assert scaler.step(opt) == (step != INF_STEP)
        opt.zero_grad()
    assert_weights(net, expected)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_gradscaler_style_loop(optimizer: str) -> None:
    net = mlp()
    expected = expected_weights(net, optimizer)
    scaler, opt = GradientScaler(net, update_interval=2), OPTIMIZERS[optimizer](net.parameters())
    for step, (x, y) in enumerate(batches()):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(net(x), y)
        scaler.scale(inf_if_skipped(loss, step)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=1e6)  # far above the norm: changes nothing
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert_weights(net, expected)


class FusedClassifier(Classifier):
    """conftest's Classifier with one of OPTIMIZERS and no scheduler."""

    def __init__(self, optimizer: str) -> None:
        super().__init__(inf_steps=(INF_STEP,))
        self.optimizer_name = optimizer

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.optimizer_name](self.parameters())


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("plugin", PLUGIN_NAMES)
def test_trainer_plugins(plugin: str, optimizer: str) -> None:
    torch.manual_seed(0)
    model = FusedClassifier(optimizer)
    expected = expected_weights(model.net, optimizer)
    make_trainer(TRAINER_PLUGINS[plugin](**plugin_options(plugin)), max_steps=3).fit(model, loader())
    assert_weights(model.net, expected)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("plugin", PLUGIN_NAMES)
def test_fabric_plugins_with_gradient_clipping(plugin: str, optimizer: str) -> None:
    """fabric.clip_gradients works with fused optimizers too (Fabric's own MixedPrecision refuses, below)."""
    net = mlp()
    expected = expected_weights(net, optimizer)
    fabric = L.Fabric(
        accelerator="cpu", devices=1, plugins=[getattr(gs_lightning.fabric, plugin)(**plugin_options(plugin))]
    )
    model, opt = fabric.setup(net, OPTIMIZERS[optimizer](net.parameters()))
    for step, (x, y) in enumerate(batches()):
        fabric.backward(inf_if_skipped(F.cross_entropy(model(x), y), step))
        fabric.clip_gradients(model, opt, max_norm=1e6, error_if_nonfinite=False)  # the step is skipped instead
        opt.step()
        opt.zero_grad()
    assert_weights(net, expected)


def test_fabric_mixed_precision_cannot_clip_with_a_fused_optimizer() -> None:
    """Control: Lightning's own fp16 Fabric plugin raises where the plugins above clip."""
    net = mlp()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu")])
    model, opt = fabric.setup(net, OPTIMIZERS["adam_fused"](net.parameters()))
    x, y = next(iter(loader()))
    fabric.backward(F.cross_entropy(model(x), y))
    with pytest.raises(
        NotImplementedError, match="Gradient clipping is not implemented for optimizers handling the unscaling"
    ):
        fabric.clip_gradients(model, opt, max_norm=1e6, error_if_nonfinite=False)  # the step is skipped instead
