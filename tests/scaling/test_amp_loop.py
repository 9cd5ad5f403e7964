"""GradientScaler as a drop-in for torch.amp.GradScaler in a loop written as PyTorch's AMP recipe writes it.

The loop below is the recipe's ("Automatic Mixed Precision", pytorch.org/tutorials/recipes/recipes/
amp_recipe.html: autocast forward, ``scaler.scale(loss).backward()``, ``unscale_`` then gradient
clipping, ``step``, ``update``, and the scaler's ``state_dict`` in the checkpoint). Only the line that
builds the scaler differs between the two scalers.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import loader
from torch import nn

from gs_lightning import GradientScaler

SCALERS: dict[str, Callable[[nn.Module, bool], object]] = {
    "GradScaler": lambda net, use_amp: torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=use_amp),
    "GradientScaler": lambda net, use_amp: GradientScaler(net, update_interval=3, enabled=use_amp),
}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def recipe_loop(
    net, opt, scaler, use_amp: bool, steps: int, inf_steps=(), max_norm: float = 0.5
) -> list[list[torch.Tensor]]:
    """The recipe's training loop: the gradients the optimizer saw at each step (after unscale_ and clipping)."""
    seen = []
    for step, (input, target) in zip(range(steps), loader()):
        with torch.autocast(device_type="cpu", dtype=torch.float16, enabled=use_amp):
            output = net(input)
            loss = F.cross_entropy(output, target)
        if step in inf_steps:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        # Unscales the gradients of optimizer's assigned params in-place
        scaler.unscale_(opt)
        # Since the gradients of optimizer's assigned params are now unscaled, clips as usual.
        torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=max_norm)
        seen.append([p.grad.clone() for p in net.parameters()])
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return seen


def plain_loop(net, opt, steps: int, max_norm: float = 0.5) -> list[list[torch.Tensor]]:
    """The same loop in fp32 without any scaler."""
    seen = []
    for _, (input, target) in zip(range(steps), loader()):
        F.cross_entropy(net(input), target).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=max_norm)
        seen.append([p.grad.clone() for p in net.parameters()])
        opt.step()
        opt.zero_grad()
    return seen


def sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_fp32_gradients_after_unscale_equal_plain_backward_bit_for_bit(enabled: bool) -> None:
    """In fp32 (no autocast) the scaled backward, with scales chosen or not, gives plain backward's gradients
    and weights exactly, step by step through an update of the scales (update_interval=3)."""
    net, reference = make_model(), make_model()
    scaler, opt = GradientScaler(net, update_interval=3, enabled=enabled), sgd(net)
    assert scaler.is_enabled() == enabled
    seen = recipe_loop(net, opt, scaler, use_amp=False, steps=5)  # use_amp=False: no autocast
    expected = plain_loop(reference, sgd(reference), steps=5)
    for step, (grads, plain) in enumerate(zip(seen, expected)):
        assert all(torch.equal(a, b) for a, b in zip(grads, plain)), f"step {step}"
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), reference.parameters()))
    if enabled:
        assert any(scale != 1.0 for scale in scaler.scales().values())  # scaling did happen


@pytest.mark.parametrize("name", list(SCALERS))
def test_fp16_recipe_trains_and_skips_non_finite_steps(name: str) -> None:
    """fp16 autocast: step 2 overflows and leaves weights and momentum alone; the other steps train."""
    net = make_model()
    opt, scaler = sgd(net), SCALERS[name](net, True)
    snapshots = []
    opt.register_step_post_hook(lambda *_: snapshots.append(len(snapshots)))
    weights = [[p.detach().clone() for p in net.parameters()]]
    for step in range(5):
        recipe_loop(net, opt, scaler, use_amp=True, steps=1, inf_steps=(0,) if step == 2 else ())
        weights.append([p.detach().clone() for p in net.parameters()])
    changed = [not all(torch.equal(a, b) for a, b in zip(weights[i], weights[i + 1])) for i in range(5)]
    assert changed == [True, True, False, True, True]
    assert len(snapshots) == 4  # the optimizer stepped four times
    assert all(torch.isfinite(p).all() for p in net.parameters())


@pytest.mark.parametrize("name", list(SCALERS))
def test_misuse_raises_as_gradscaler_does(name: str) -> None:
    """unscale_ twice, or after step, before update() is an error for both; after update() it is fine again."""
    net = make_model()
    opt, scaler = sgd(net), SCALERS[name](net, True)
    x, y = next(iter(loader()))

    def backward() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(net(x), y)
        scaler.scale(loss).backward()

    backward()
    scaler.unscale_(opt)
    with pytest.raises(
        RuntimeError, match=r"unscale_\(\) has already been called on this optimizer since the last update\(\)"
    ):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)"):
        scaler.unscale_(opt)
    scaler.update()
    opt.zero_grad()
    backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


def test_checkpoint_with_the_scaler_state_resumes_exactly(tmp_path) -> None:
    """The recipe's checkpoint ({"model", "optimizer", "scaler"} state dicts): 3 steps, save, 4 more = 7 straight."""
    net = make_model()
    opt, scaler = sgd(net), GradientScaler(net, update_interval=3)
    recipe_loop(net, opt, scaler, use_amp=True, steps=3, inf_steps=(1,))
    checkpoint = {"model": net.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()}
    torch.save(checkpoint, tmp_path / "checkpoint.pt")
    recipe_loop(net, opt, scaler, use_amp=True, steps=4)

    resumed = make_model(seed=1)
    resumed_opt, resumed_scaler = sgd(resumed), GradientScaler(resumed, update_interval=3)
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    resumed_scaler.load_state_dict(checkpoint["scaler"])
    recipe_loop(resumed, resumed_opt, resumed_scaler, use_amp=True, steps=4)

    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), resumed.parameters()))
    assert (
        (resumed_scaler.iteration, resumed_scaler.skipped_steps) == (scaler.iteration, scaler.skipped_steps) == (7, 1)
    )
    assert resumed_scaler.scales() == scaler.scales()


def test_scale_then_backward_is_scaler_backward() -> None:
    """``scaler.scale(loss).backward()`` and ``scaler.backward(loss)`` give the same gradients and scales."""
    x, y = next(iter(loader()))
    results = []
    for run_backward in (lambda s, loss: s.scale(loss).backward(), lambda s, loss: s.backward(loss)):
        net = make_model()
        scaler = GradientScaler(net)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(net(x), y)
        run_backward(scaler, loss)
        results.append(([p.grad for p in net.parameters()], scaler.scales()))
    (grads_a, scales_a), (grads_b, scales_b) = results
    assert scales_a == scales_b and any(scale != 1.0 for scale in scales_a.values())
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
