"""Where a GradScaler loop meets GradientScaler: gradients written outside the scaler's backward,
``torch.autograd.grad``, pickling, several outputs, several models.

Each test here failed before the step read every gradient it uses (writes through ``.data`` and numpy
bump no version counter), unscaled
captured gradients, pickled without its model and hooks, joined several outputs, and attached
several models (issue 15).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gs_lightning import GradientScaler


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.randn(6, 8), torch.randint(0, 4, (6,))


def fp16_loss(model: nn.Module, seed: int = 1) -> torch.Tensor:
    x, y = batch(seed)
    with torch.autocast("cpu", dtype=torch.float16):
        return F.cross_entropy(model(x), y)


# --- 1. a non-finite .grad is never stepped on, whoever wrote it ------------------------------


def _nan_in_weight(model: nn.Module) -> None:
    model[0].weight.grad[0, 0] = float("nan")


def _second_plain_backward(model: nn.Module) -> None:
    (fp16_loss(model, seed=2) * float("inf")).backward()


def _replaced_grad(model: nn.Module) -> None:
    model[2].bias.grad = torch.full_like(model[2].bias, float("inf"))


def _grad_of_a_parameter_the_backward_missed(model: nn.Module) -> None:
    model.extra = nn.Parameter(torch.zeros(3))
    model.extra.grad = torch.tensor([0.0, float("nan"), 0.0])


def _assert_skipped_with_the_weights_untouched(
    model: nn.Module, scaler: GradientScaler, opt: torch.optim.Optimizer, with_unscale: bool
) -> None:
    before = [p.detach().clone() for p in model.parameters()]
    if with_unscale:
        scaler.unscale_(opt)
    assert scaler.step(opt) is False
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.skipped_steps == 1


@pytest.mark.parametrize(
    "corrupt", [_nan_in_weight, _second_plain_backward, _replaced_grad, _grad_of_a_parameter_the_backward_missed]
)
@pytest.mark.parametrize("with_unscale", [True, False], ids=["unscale_-then-step", "step"])
def test_a_gradient_made_non_finite_after_the_backward_skips_the_step(corrupt, with_unscale: bool) -> None:
    model = make_mlp()
    scaler = GradientScaler(model)
    scaler.scale(fp16_loss(model)).backward()
    corrupt(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # after corrupt: it may have added a parameter
    _assert_skipped_with_the_weights_untouched(model, scaler, opt, with_unscale)


def test_the_issues_example_leaves_the_weights_finite() -> None:
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    s = GradientScaler(m)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = m(torch.randn(2, 4)).pow(2).mean()
    s.scale(loss).backward()
    m.weight.grad[0, 0] = float("nan")
    s.unscale_(opt)
    assert s.step(opt) is False
    assert torch.isfinite(m.weight).all()


def test_unscale_decides_the_step_as_gradscaler_does() -> None:
    """A finite gradient at unscale_ steps even if clipping then rewrote it in place (GradScaler's rule)."""
    model = make_mlp()
    scaler, opt = GradientScaler(model), torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(fp16_loss(model)).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)  # rewrites every .grad in place
    assert scaler.step(opt) is True


def _inf_through_data_fill(model: nn.Module) -> None:
    model[2].weight.grad.data.fill_(float("inf"))


def _inf_through_data_index(model: nn.Module) -> None:
    model[2].weight.grad.data[0, 0] = float("inf")


def _inf_through_numpy(model: nn.Module) -> None:
    model[2].weight.grad.numpy()[0, 0] = float("inf")


@pytest.mark.parametrize("corrupt", [_inf_through_data_fill, _inf_through_data_index, _inf_through_numpy])
@pytest.mark.parametrize("with_unscale", [True, False], ids=["unscale_-then-step", "step"])
@pytest.mark.parametrize("iterations", [1, 3], ids=["update", "replay"])
def test_a_write_no_version_counter_sees_skips_the_step(corrupt, with_unscale: bool, iterations: int) -> None:
    """Old code edits gradients through ``.data`` or numpy (weight decay, gradient noise, hand-written
    clipping): neither bumps ``.grad``'s version counter, and the step still reads what they wrote."""
    model = make_mlp()
    scaler, opt = GradientScaler(model), torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(iterations):  # update_interval=100: the first backward decides the scales, the next replay them
        opt.zero_grad()
        scaler.scale(fp16_loss(model, seed=i + 1)).backward()
        if i < iterations - 1:
            assert scaler.step(opt) is True
            scaler.update()
    assert scaler.update_iterations == 1
    corrupt(model)
    _assert_skipped_with_the_weights_untouched(model, scaler, opt, with_unscale)


# --- 2. autograd.grad returns true gradients ------------------------------------------------


def _penalty_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


@pytest.mark.parametrize("update_interval", [1, 100], ids=["update", "replay"])
def test_autograd_grad_of_scaled_loss_is_the_true_gradient_for_params_and_inputs(update_interval: int) -> None:
    """fp32 compute: equal bit for bit to plain autograd.grad, on update and replay iterations."""
    model = _penalty_model()
    scaler = GradientScaler(model, update_interval=update_interval)
    for _ in range(3):  # the first iteration decides the scales, the next ones replay them (update_interval=100)
        x = torch.randn(6, 8, requires_grad=True)
        loss = (model(x) * 1e-3).pow(2).sum()
        expected = torch.autograd.grad(loss, [*model.parameters(), x], retain_graph=True)
        got = torch.autograd.grad(scaler.scale(loss), [*model.parameters(), x], retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert all(p.grad is None for p in model.parameters())  # nothing accumulated
    assert any(layer.log2_scale != 0 for layer in scaler.layers())  # the scales were not all 1


def test_autograd_grad_of_a_hidden_activation_is_true() -> None:
    model = _penalty_model()
    scaler = GradientScaler(model, update_interval=1)
    x = torch.randn(6, 8)
    hidden = model[1](model[0](x))
    loss = (model[2](hidden) * 1e-3).pow(2).sum()
    (expected,) = torch.autograd.grad(loss, hidden, retain_graph=True)
    (got,) = torch.autograd.grad(scaler.scale(loss), hidden)
    assert torch.equal(got, expected)


def test_gradient_penalty_recipe_matches_plain_autograd() -> None:
    """PyTorch's AMP gradient-penalty recipe, with ``grads / scaler.get_scale()``, in fp32 compute: same weights."""

    def penalty_step(model: nn.Module, opt: torch.optim.Optimizer, scaler: GradientScaler | None) -> None:
        x, y = batch()
        loss = F.cross_entropy(model(x), y)
        outputs = scaler.scale(loss) if scaler is not None else loss
        grads = torch.autograd.grad(outputs, model.parameters(), create_graph=True)
        inv_scale = 1.0 / (scaler.get_scale() if scaler is not None else 1.0)
        penalty = sum((g * inv_scale).pow(2).sum() for g in grads).sqrt()
        total = loss + penalty
        (scaler.scale(total) if scaler is not None else total).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()

    reference, model = make_mlp(), make_mlp()
    ref_opt, opt = torch.optim.SGD(reference.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradientScaler(model, update_interval=2)
    for _ in range(4):
        penalty_step(reference, ref_opt, None)
        penalty_step(model, opt, scaler)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_backward_with_inputs_accumulates_true_gradients_into_those_inputs_only() -> None:
    model, reference = _penalty_model(), _penalty_model()
    scaler = GradientScaler(model, update_interval=1)
    x = torch.randn(6, 8)
    scaler.scale((model(x) * 1e-3).pow(2).sum()).backward(inputs=[model[0].weight])
    (reference(x) * 1e-3).pow(2).sum().backward(inputs=[reference[0].weight])
    assert torch.equal(model[0].weight.grad, reference[0].weight.grad)
    assert model[2].weight.grad is None


# --- 3. pickling and deepcopy at any iteration --------------------------------------------


@pytest.mark.parametrize("dump", [pickle.dumps, copy.deepcopy], ids=["pickle", "deepcopy"])
def test_pickles_and_copies_at_any_iteration_without_the_model(dump) -> None:
    model = make_mlp()
    scaler = GradientScaler(model, update_interval=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for iteration in range(4):  # update, replay, update, replay
        scaler.scale(fp16_loss(model, seed=iteration)).backward()
        copied = pickle.loads(dump(scaler)) if dump is pickle.dumps else dump(scaler)
        assert copied.models == () and copied.iteration == scaler.iteration
        assert copied.state_dict() == scaler.state_dict()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert not any(isinstance(v, nn.Module) for v in scaler.__getstate__().values())


def test_an_unpickled_scaler_replays_the_same_scales_on_the_live_model() -> None:
    model, twin = make_mlp(), make_mlp()
    scaler = GradientScaler(model, update_interval=100)
    scaler.scale(fp16_loss(model)).backward()
    copied = pickle.loads(pickle.dumps(scaler))
    copied.attach(twin)
    for s, m in ((scaler, model), (copied, twin)):
        m.zero_grad()
        s.scale(fp16_loss(m, seed=5)).backward()  # a replay iteration for both
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters()))


# --- 4. scale() takes what GradScaler.scale takes --------------------------------------------


def test_scale_takes_nested_outputs_and_one_backward_gives_true_gradients() -> None:
    model, reference = _penalty_model(), _penalty_model()
    scaler = GradientScaler(model, update_interval=1)
    x = torch.randn(6, 8)
    out, ref_out = model(x), reference(x)
    outputs = [out[:, :2] * 1e-3, (out[:, 2:].sum() * 1e-3, out.mean())]
    scaled = scaler.scale(outputs)
    assert isinstance(scaled, list) and isinstance(scaled[1], tuple) and scaled[0].shape == (6, 2)
    grad_first = torch.ones(6, 2)
    torch.autograd.backward([scaled[0], *scaled[1]], [grad_first, None, None])
    torch.autograd.backward(
        [ref_out[:, :2] * 1e-3, ref_out[:, 2:].sum() * 1e-3, ref_out.mean()], [grad_first, None, None]
    )
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))


def test_scale_of_one_non_scalar_output_backpropagates_its_explicit_gradient() -> None:
    model, reference = _penalty_model(), _penalty_model()
    scaler = GradientScaler(model, update_interval=1)
    x, grad = torch.randn(6, 8), torch.randn(6, 4) * 1e-4
    scaler.scale(model(x)).backward(grad)
    reference(x).backward(grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))


def test_scale_rejects_what_gradscaler_rejects() -> None:
    with pytest.raises(TypeError, match="expected a tensor or"):
        GradientScaler().scale({"loss": torch.ones(())})


# --- 5. buffers of every attached model are restored on a skipped step ------------------------


def test_a_skipped_step_restores_the_buffers_of_every_attached_model() -> None:
    generator, discriminator = (
        nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)),
        nn.Sequential(nn.Linear(8, 1), nn.BatchNorm1d(1)),
    )
    scaler = GradientScaler(generator)
    scaler.attach(discriminator)
    opt = torch.optim.SGD([*generator.parameters(), *discriminator.parameters()], lr=0.1)
    before = [b.clone() for m in (generator, discriminator) for b in m.buffers()]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = discriminator(generator(torch.randn(5, 4) * 1e3)).float().sum() * float("inf")
    scaler.scale(loss).backward()
    assert scaler.step(opt) is False
    assert all(torch.equal(a, b) for a, b in zip(before, [b for m in (generator, discriminator) for b in m.buffers()]))


def test_update_with_a_new_scale_says_there_is_none_to_set() -> None:
    with pytest.raises(ValueError, match="new_scale=1024.0 has nothing to set"):
        GradientScaler().update(1024.0)
