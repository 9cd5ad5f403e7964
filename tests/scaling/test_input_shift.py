"""What a GEMM sends on at a scale of its own (``ScalingRecipe.own_input_gradient_scale``).

The models' inputs are large (2^10): a GEMM's weight gradient, which sums inputs times the incoming
gradient over every position, then overflows fp16 at the scale its input gradient needs against
underflow, and bounds the node's scale below it. With the rule, the input gradient alone carries the
binades between the two: its weight, multiplied as the backward unpacks it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gs_lightning import GradientScaler
from gs_lightning.scaling import ScalingRecipe
from gs_lightning.scaling.sent_maxima import SentMaxima


def _convolutions() -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.Flatten())
    return model, torch.rand(8, 3, 16, 16) * 1024.0


def _linears() -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Flatten())
    return model, torch.rand(512, 16) * 1024.0


MODELS = {"convolutions": _convolutions, "linears": _linears}


def _loss(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return model(inputs).square().mean() * 1e-9  # small gradients: their scales matter


def _plain_grads(model: nn.Module, inputs: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _loss(model, inputs).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_what_a_gemm_sends_on_carries_its_own_scale_and_every_gradient_stays_exact(name: str) -> None:
    """fp32 arithmetic: every scale a power of two, so the gradients are the plain backward's bit for bit, on the
    update iterations and the replays, while the second GEMM sends on at a scale above the one its weight
    gradients allow, from the second update on (the replays before it measured what it sends on)."""
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    expected = _plain_grads(model, inputs)
    scaler = GradientScaler(model, own_input_gradient_scale=True, update_interval=3)
    sent: list[torch.Tensor] = []
    first = None
    for _ in range(4):  # an update, two replays, an update
        model.zero_grad(set_to_none=True)
        hidden = model[1](model[0](inputs))
        hidden.register_hook(sent.append)  # what the second GEMM sent on, as it carries it
        loss = model[3](model[2](hidden)).square().mean() * 1e-9
        scaler.backward(loss)
        assert not scaler.found_inf
        for parameter, grad in zip(model.parameters(), expected):
            assert torch.equal(parameter.grad, grad)
        scaler.update()
        first = first or next(layer for layer in scaler.layers() if layer.name == "2")
    assert first.input_gradient_shift == 0  # nothing measured what it sends on yet: the node's scale
    second = next(layer for layer in scaler.layers() if layer.name == "2")
    assert second.kind == "gemm" and second.input_gradient_shift > 0
    # the node's own scale is held below γ' by its parameter gradients; what it sent on carried the shift more
    assert second.limit.name in {
        "WEIGHT_GRADIENT",
        "BIAS_GRADIENT",
        "EXPECTED_PARAMETER_GRADIENTS",
        "RECOMPUTED_SPIKES",
        "SPIKE_ROOM",
    }
    model.zero_grad(set_to_none=True)
    hidden = model[1](model[0](inputs))
    hidden.retain_grad()
    (model[3](model[2](hidden)).square().mean() * 1e-9).backward()
    # each replay measured the largest value the second GEMM sent on, at its true scale (exactly: fp32, powers of two)
    node = next(i for i, name in scaler.graphs[0].analyses[()].layer_names.items() if name == "2")
    assert scaler.graphs[0].sent_maxima.expected() == {node: hidden.grad.abs().max().item()}
    # the last update's: the first sent at the node's scale, and the replays measured what it sent
    assert torch.equal(sent[-1], hidden.grad * 2.0 ** (second.log2_total + second.input_gradient_shift))
    assert torch.equal(sent[0], hidden.grad * 2.0**first.log2_total)


def test_the_shift_is_off_by_default_and_in_the_paper_preset_and_survives_a_resume() -> None:
    torch.manual_seed(0)
    model, inputs = _convolutions()
    for recipe in (ScalingRecipe(), ScalingRecipe.paper()):
        scaler = GradientScaler(model, recipe)
        scaler.backward(_loss(model, inputs))
        assert not scaler.found_inf
        scaler.update()
        assert all(layer.input_gradient_shift == 0 for layer in scaler.layers())

    expected = _plain_grads(model, inputs)
    scaler = GradientScaler(model, own_input_gradient_scale=True)
    while scaler._backwards.updates_next():  # the first updates (the second measures the weight gradients)
        scaler.backward(_loss(model, inputs))
        assert not scaler.found_inf  # the step's read, which asks for the next update
        scaler.update()
    resumed = GradientScaler(model, own_input_gradient_scale=True)
    resumed.load_state_dict(scaler.state_dict())
    assert resumed.graphs[0].plans[()].input_shift == scaler.graphs[0].plans[()].input_shift != {}
    model.zero_grad(set_to_none=True)
    resumed.backward(_loss(model, inputs))  # a replay of the restored plan, shifts included
    assert resumed.update_iterations == scaler.update_iterations  # the count resumed, none added
    for parameter, grad in zip(model.parameters(), expected):
        assert torch.equal(parameter.grad, grad)


def test_a_non_finite_maximum_is_not_kept_and_the_window_forgets_the_oldest() -> None:
    """A replay whose input gradient overflowed skips its step: its maximum says nothing of the scale."""
    maxima = SentMaxima(window=2)
    for values in ([1.0, 4.0], [float("inf"), 8.0], [float("nan"), 2.0]):
        maxima._pending = [(3, torch.zeros(())), (5, torch.zeros(()))]
        maxima.take(values)
    assert maxima.expected() == {3: 1.0, 5: 8.0}  # node 5: the last two (8, 2); node 3: its one finite value
    restored = SentMaxima(window=2)
    restored.load_state_dict(maxima.state_dict())
    assert restored.expected() == maxima.expected()


def test_a_replay_whose_shifted_weight_another_hook_owns_says_so() -> None:
    """The update found the weight free to shift; a later forward under saved-tensor hooks cannot take the shift,
    and the scales below it expect it: an error naming the way out, not gradients off by a power of two."""
    torch.manual_seed(0)
    model, inputs = _convolutions()
    scaler = GradientScaler(model, own_input_gradient_scale=True)
    while not any(layer.input_gradient_shift for layer in scaler.layers()):  # until a plan shifts a GEMM
        scaler.backward(_loss(model, inputs))
        assert not scaler.found_inf
        scaler.update()
    assert not scaler._backwards.updates_next()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = _loss(model, inputs)
    with pytest.raises(RuntimeError, match="own_input_gradient_scale multiplies the 'weight'"):
        scaler.backward(loss)
