"""The Fabric precision plugins in a hand-written Fabric loop (CPU, tiny Linear model), in both Fabric packages."""

from __future__ import annotations

import json
import warnings
from importlib import import_module

import pytest
import torch
import torch.nn.functional as F
from conftest import loader
from torch import nn

from gs_lightning.fabric import (
    DynamicLossScalingPlugin,
    FixedLossScaler,
    FP16Plugin,
    GradientScalingPlugin,
    LossScalingPlugin,
)

PLUGINS = {
    "gradient_scaling": lambda: GradientScalingPlugin(update_interval=3),
    "dynamic_loss_scaling": lambda: DynamicLossScalingPlugin(init_scale=2.0**10, growth_interval=2),
    "loss_scaling": lambda: LossScalingPlugin(scale=128),
    "fp16": FP16Plugin,
}


FABRIC_PACKAGES = ["lightning.fabric", "lightning_fabric"]


@pytest.fixture(params=FABRIC_PACKAGES)
def fabric_package(request: pytest.FixtureRequest) -> str:
    return request.param


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def launch(package: str, plugin, model: nn.Module, lr: float = 0.1):
    fabric = import_module(package).Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    return fabric, model, optimizer


def train(fabric, model, optimizer, steps: int, inf_steps: tuple[int, ...] = ()) -> list[bool]:
    """A Fabric loop; the loss is inf at ``inf_steps``. Returns, per step, whether the weights changed."""
    changed = []
    for step, (x, y) in zip(range(steps), loader()):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss * float("inf") if step in inf_steps else loss)
        optimizer.step()
        changed.append(not all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
        assert all(torch.isfinite(p).all() for p in model.parameters()), f"non-finite weights after step {step}"
    return changed


@pytest.mark.parametrize("name", list(PLUGINS))
def test_fp16_forward_and_skipped_non_finite_steps(name: str, fabric_package: str) -> None:
    """Autocast runs the layers in fp16; steps 1 and 3 overflow and leave the weights alone, the others train."""
    plugin, model = PLUGINS[name](), net()
    dtypes: set[torch.dtype] = set()
    model[-1].register_forward_hook(lambda module, args, out: dtypes.add(out.dtype))
    fabric, model, optimizer = launch(fabric_package, plugin, model)
    assert fabric.strategy.precision is plugin
    assert train(fabric, model, optimizer, steps=5, inf_steps=(1, 3)) == [True, False, True, False, True]
    assert dtypes == {torch.float16}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    if name == "gradient_scaling":
        assert plugin.scaler.skipped_steps == 2


def test_backward_is_scaled_per_layer_and_leaves_true_gradients(fabric_package: str) -> None:
    """fabric.backward goes through the GradientScaler: scales other than 1 were chosen (and are there for
    logging), yet .grad is plain fp16 autocast's (power-of-two scaling is exact away from under/overflow)."""
    plugin, reference = GradientScalingPlugin(), net()
    fabric, model, _ = launch(fabric_package, plugin, net())
    x, y = next(iter(loader()))
    fabric.backward(F.cross_entropy(model(x), y))
    with torch.autocast("cpu", dtype=torch.float16):
        F.cross_entropy(reference(x), y).backward()
    assert plugin.scaler.iteration == 1
    assert "2" in plugin.scaler.scales()  # named after the model's layers (the last Linear)
    assert any(scale != 1.0 for scale in plugin.scaler.scales().values())
    for param, expected in zip(model.parameters(), reference.parameters()):
        assert torch.equal(param.grad, expected.grad)


@pytest.mark.parametrize("name", ["gradient_scaling", "loss_scaling"])
def test_clip_gradients_sees_true_gradients(name: str, fabric_package: str) -> None:
    """fabric.clip_gradients at half the true norm leaves exactly half (Fabric unscales through the plugin)."""
    reference = net()
    x, y = next(iter(loader()))
    with torch.autocast("cpu", dtype=torch.float16):
        F.cross_entropy(reference(x), y).backward()
    true_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    fabric, model, optimizer = launch(fabric_package, PLUGINS[name](), net())
    fabric.backward(F.cross_entropy(model(x), y))
    assert fabric.clip_gradients(model, optimizer, max_norm=true_norm / 2).item() == pytest.approx(true_norm, rel=1e-3)
    clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert clipped == pytest.approx(true_norm / 2, rel=1e-3)


@pytest.mark.parametrize("name", ["gradient_scaling", "dynamic_loss_scaling"])
def test_save_and_load_restore_the_scaler(name: str, fabric_package: str, tmp_path) -> None:
    """The plugin in fabric.save's state: a fresh run loads the scaler's state and continues as the first one."""
    plugin = PLUGINS[name]()
    fabric, model, optimizer = launch(fabric_package, plugin, net())
    train(fabric, model, optimizer, steps=4, inf_steps=(2,))
    fabric.save(tmp_path / "state.ckpt", {"model": model, "optimizer": optimizer, "precision": plugin})
    saved = plugin.state_dict()
    train(fabric, model, optimizer, steps=3)

    resumed_plugin = PLUGINS[name]()
    # another initialisation: everything must come from the checkpoint
    resumed, resumed_model, resumed_optimizer = launch(fabric_package, resumed_plugin, net(seed=1))
    state = {"model": resumed_model, "optimizer": resumed_optimizer, "precision": resumed_plugin}
    resumed.load(tmp_path / "state.ckpt", state)
    assert _plain(resumed_plugin.state_dict()) == _plain(saved)
    train(resumed, resumed_model, resumed_optimizer, steps=3)
    assert _plain(resumed_plugin.state_dict()) == _plain(plugin.state_dict())
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


def _plain(state: dict) -> str:
    """The state as JSON text: comparable where it holds NaN (a layer's underflow rate where no model applies)."""
    return json.dumps({k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}, sort_keys=True)


def test_skipped_first_step_restores_batch_norm_statistics(fabric_package: str) -> None:
    """An inf in the first batch reaches BatchNorm's running statistics; the skipped step puts them back."""
    plugin = GradientScalingPlugin()
    torch.manual_seed(0)
    fabric, model, optimizer = launch(
        fabric_package, plugin, nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    )
    initial = [b.clone() for b in model.buffers()]
    x, y = next(iter(loader()))
    x[0, 0] = float("inf")
    fabric.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    assert plugin.scaler.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(initial, model.buffers()))


def test_scaler_needs_the_model_set_up_first() -> None:
    with pytest.raises(RuntimeError, match=r"fabric.setup\(model\)"):
        _ = GradientScalingPlugin().scaler


def test_emulated_fp8_gradients_with_gradient_scaling(fabric_package: str) -> None:
    """emulate=True, grad_dtype=float8_e5m2: the forward and fabric.backward run emulated; every
    weight gradient is an e5m2 value (3 significant bits) times a power of two."""
    plugin = GradientScalingPlugin(emulate=True, grad_dtype="float8_e5m2")
    fabric, model, optimizer = launch(fabric_package, plugin, net())
    x, y = next(iter(loader()))
    fabric.backward(F.cross_entropy(model(x), y))
    significands = [
        torch.frexp(m.weight.grad[m.weight.grad != 0])[0] * 8 for m in model.modules() if isinstance(m, nn.Linear)
    ]
    assert len(significands) == 2 and all(torch.equal(s, s.round()) for s in significands)
    assert plugin.scaler.format.name == "float8_e5m2"


@pytest.mark.parametrize("scaler_built_first", [False, True], ids=["setup-then-forward", "scaler-before-second-setup"])
def test_a_skipped_step_restores_the_buffers_of_every_module_set_up(
    fabric_package: str, scaler_built_first: bool
) -> None:
    """A GAN set up model by model: the discriminator's BatchNorm statistics are restored too (issue 15)."""
    plugin = GradientScalingPlugin()
    fabric = import_module(fabric_package).Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    generator = fabric.setup(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)))
    if scaler_built_first:
        assert plugin.scaler is not None
    discriminator = nn.Sequential(nn.Linear(8, 1), nn.BatchNorm1d(1))
    discriminator, optimizer = fabric.setup(discriminator, torch.optim.SGD(discriminator.parameters(), lr=0.1))
    buffers = lambda: [b.clone() for m in (generator, discriminator) for b in m.buffers()]  # noqa: E731
    before = buffers()
    loss = discriminator(generator(torch.randn(5, 4))).float().sum()
    fabric.backward(loss * float("inf"))
    optimizer.step()
    assert plugin.scaler.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, buffers()))


def test_a_compiled_model_set_up_with_fabric_gets_a_scale_for_its_region(fabric_package: str) -> None:
    """``fabric.setup(torch.compile(model))`` (issue 16): the compiled backward is scaled as one unit."""
    torch._dynamo.reset()
    plugin = GradientScalingPlugin(emulate=False)  # under emulation (a CPU's default) torch.compile runs eagerly
    fabric, model, optimizer = launch(fabric_package, plugin, torch.compile(net(), backend="aot_eager"))
    with pytest.warns(RuntimeWarning, match="CompiledFunctionBackward.*scaled as one unit"):
        assert train(fabric, model, optimizer, steps=3) == [True, True, True]
    (region,) = [layer for layer in plugin.scaler.layers() if layer.kind == "opaque"]
    assert region.log2_scale > 0 and region.log2_total >= 10


def test_a_compiled_model_set_up_without_recompiling_gets_per_layer_scales(fabric_package: str) -> None:
    """``fabric.setup(torch.compile(model), _reapply_compile=False)``: Fabric keeps the user's compiled
    module, which the plugin then sees, so its layers get their own scales inside the compiled graph
    (by default Fabric compiles its own wrapper after the plugin has seen the model: one unit, above)."""
    torch._dynamo.reset()
    plugin = GradientScalingPlugin(emulate=False)  # under emulation (a CPU's default) torch.compile runs eagerly
    compiled = torch.compile(net(), backend="aot_eager")
    fabric = import_module(fabric_package).Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, optimizer = fabric.setup(
        compiled, torch.optim.SGD(compiled.parameters(), lr=0.1, momentum=0.9), _reapply_compile=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no opaque region, no eager fallback
        assert train(fabric, model, optimizer, steps=4) == [True, True, True, True]
    kinds = {layer.name: layer.kind for layer in plugin.scaler.layers()}
    assert "opaque" not in kinds.values() and [name for name, kind in kinds.items() if kind == "gemm"] == ["2", "0"]


@pytest.mark.parametrize("name", list(PLUGINS))
def test_a_step_without_a_backward_raises_as_gradscaler_does(name: str, fabric_package: str) -> None:
    """``optimizer.zero_grad()`` and no ``fabric.backward``: every plugin's step raises GradScaler's
    AssertionError (issue 53), where it used to step on nothing and report a step."""
    plugin = PLUGINS[name]()
    fabric, model, optimizer = launch(fabric_package, plugin, net())
    assert train(fabric, model, optimizer, steps=1) == [True]
    optimizer.zero_grad()
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        optimizer.step()


def test_fixed_loss_scaler_keeps_gradscalers_order_of_calls() -> None:
    """FixedLossScaler runs on the scaling core's OptimizerSteps: GradScaler's errors for calls out of order,
    gradients divided by the scale once, a non-finite one skipping the step."""
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = FixedLossScaler(4.0)
    with pytest.raises(AssertionError, match="none of its parameters has a gradient"):
        scaler.step(optimizer)
    scaler.scale(param.sum()).backward()
    scaler.unscale_(optimizer)
    assert torch.equal(param.grad, torch.ones(2))
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    assert torch.equal(param.detach(), torch.zeros(2))
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called"):
        scaler.step(optimizer)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)"):
        scaler.unscale_(optimizer)
    scaler.update()
    optimizer.zero_grad()
    scaler.scale(param.sum() * float("inf")).backward()
    assert scaler.step(optimizer) is None and torch.equal(param.detach(), torch.zeros(2))


@pytest.mark.parametrize("name", list(PLUGINS))
def test_plugins_emulate_fp16_on_a_cpu_by_default(name: str, fabric_package: str) -> None:
    """emulate="auto", as the app's precision.emulate: settled when fabric.setup shows the model's device."""
    plugin = PLUGINS[name]()
    assert plugin.emulate == "auto"
    fabric, model, optimizer = launch(fabric_package, plugin, net())
    assert train(fabric, model, optimizer, steps=1) == [True]
    assert plugin.emulate is True


def _closure_step(fabric, model, optimizer, x: torch.Tensor, y: torch.Tensor, calls: list[int], factor: float = 1.0):
    """``optimizer.step(closure)``, the closure zeroing the gradients first and counting its runs."""

    def closure() -> torch.Tensor:
        calls.append(1)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y) * factor
        fabric.backward(loss)
        return loss

    return optimizer.step(closure)


@pytest.mark.parametrize("name", PLUGINS)
def test_a_closure_runs_before_the_check_and_its_loss_is_returned(name: str, fabric_package: str) -> None:
    """``optimizer.step(closure)``, as torch's optimizers take it: the plugin runs the closure, checks the gradients it
    computed and steps on them; the step returns the closure's loss."""
    fabric, model, optimizer = launch(fabric_package, PLUGINS[name](), net())
    for x, y in list(loader())[:3]:
        before = [p.detach().clone() for p in model.parameters()]
        calls: list[int] = []
        loss = _closure_step(fabric, model, optimizer, x, y, calls)
        assert calls == [1] and torch.isfinite(loss) and loss.dim() == 0
        assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_an_overflowed_step_runs_its_closure_again(fabric_package: str) -> None:
    """With gradient scaling, a step whose gradients overflowed in layers the scaler names runs its closure once more
    on the same batch, under the back-off, and is taken (two input channels the first layer's weights ignore hold
    60000, finite in fp16, and the loss is 8 times larger: its weight gradient overflows at the scale chosen on the
    easy batches, while the loss and every gradient sent on stay finite)."""
    model = net()
    with torch.no_grad():
        model[0].weight[:, :2] = 0.0
    plugin = GradientScalingPlugin()
    fabric, model, optimizer = launch(fabric_package, plugin, model, lr=0.0)
    batches = list(loader())[:3]
    for x, y in batches[:2]:
        assert _closure_step(fabric, model, optimizer, x, y, []) is not None
    x, y = batches[2]
    x = x.clone()
    x[:, :2] = 6e4
    calls: list[int] = []
    _closure_step(fabric, model, optimizer, x, y, calls, factor=8.0)
    assert calls == [1, 1]
    assert (plugin.scaler.retried_steps, plugin.scaler.skipped_steps) == (1, 0)
