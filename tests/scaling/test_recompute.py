"""Weight gradients that overflow between updates are recomputed in fp32, not skipped
(``gs_lightning.scaling.recompute``).

The hard batch spikes only a weight gradient: the first layer's inputs grow 2^12 on channels its
weights ignore (zero columns), so the forward, the loss and every gradient sent on are those of
the easy batch, while that layer's ∇W = ∇Y·Xᵀ overflows fp16 at the scale the update chose.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gs_lightning import GradientScaler

IGNORED = 2  # input channels the first layer's weights ignore


def _linear() -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    return model, torch.randn(256, 16)


def _convolution() -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 1))
    return model, torch.randn(32, 4, 8, 8)


MODELS = {"linear": _linear, "convolution": _convolution}


def _setup(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model, easy = MODELS[name]()
    with torch.no_grad():
        model[0].weight[:, :IGNORED] = 0.0
    hard = easy.clone()
    hard[:, :IGNORED] *= 2.0**12
    return model, easy, hard


def _loss(model: nn.Module, x: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
    return model(x).float().square().mean() * factor  # the same graph whatever the factor


def _step(
    scaler: GradientScaler,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    backwards: int = 1,
    factor: float = 1.0,
) -> bool:
    optimizer.zero_grad(set_to_none=True)
    for _ in range(backwards):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model, x, factor)
        scaler.backward(loss)
    stepped = scaler.step(optimizer)
    scaler.update()
    return stepped


@pytest.mark.parametrize("name", list(MODELS))
def test_a_weight_gradient_that_overflows_by_itself_is_recomputed_and_the_step_taken(name: str) -> None:
    model, easy, hard = _setup(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradientScaler(model, recompute_weight_gradients=True)
    assert all(_step(scaler, model, optimizer, easy) for _ in range(3))  # an update, then replays
    assert _step(scaler, model, optimizer, hard)
    assert (scaler.skipped_steps, scaler.recomputed_steps) == (0, 1)
    assert scaler._read.recompute.held == 0  # what was kept is released with the step
    assert scaler.drift.non_finite == frozenset()  # the recomputed gradient is finite: nothing overflowed in the end
    reference = copy.deepcopy(model)
    reference.zero_grad(set_to_none=True)
    _loss(reference, hard).backward()  # fp32, unscaled
    for (parameter_name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.isfinite(p.grad).all(), parameter_name
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2 * float(q.grad.abs().max()))
    spiked = model[0].weight.grad[:, :IGNORED]
    # it did overflow at that scale
    assert float(spiked.abs().max()) * 2.0 ** scaler.layers()[-1].log2_total > torch.finfo(torch.float16).max
    assert _step(scaler, model, optimizer, easy) and scaler.skipped_steps == 0


def test_what_a_replay_kept_is_released_by_the_steps_read_before_the_optimizer_steps() -> None:
    """Only the first read after a backward recomputes: the GEMM inputs and incoming gradients the replay kept
    (ResNet-50 at batch 16, 224x224: 1.2 GiB) are not held through ``optimizer.step()``."""
    model, easy, _ = _setup("linear")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradientScaler(model, recompute_weight_gradients=True)
    assert all(_step(scaler, model, optimizer, easy) for _ in range(2))  # an update, then a replay
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _loss(model, easy)
    scaler.backward(loss)
    recompute = scaler._read.recompute
    assert recompute.kept  # the replay kept its GEMMs' operands
    held = []
    optimizer.register_step_pre_hook(lambda *_: held.append(recompute.held))
    assert scaler.step(optimizer)
    assert held == [0]


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_computed_from_a_non_finite_one_are_not_recomputed_the_step_is_skipped(name: str) -> None:
    """A loss 2^30 larger overflows what the last layer sends on: every gradient below it is
    non-finite because what it was computed from was. The step is skipped, the weights untouched."""
    model, easy, _ = _setup(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradientScaler(model, recompute_weight_gradients=True)
    assert all(_step(scaler, model, optimizer, easy) for _ in range(3))
    optimizer.param_groups[0]["lr"] = 0.1
    before = copy.deepcopy(model.state_dict())
    assert not _step(scaler, model, optimizer, easy, factor=2.0**30)
    assert (scaler.skipped_steps, scaler.recomputed_steps) == (1, 0)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_an_overflow_into_an_accumulated_gradient_is_not_recomputed() -> None:
    """Two backwards before the step: the second adds to ``.grad``, whose first part the kept
    operands cannot give back. The step is skipped, as before."""
    model, easy, hard = _setup("linear")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradientScaler(model, recompute_weight_gradients=True)
    assert all(_step(scaler, model, optimizer, easy) for _ in range(3))
    assert not _step(scaler, model, optimizer, hard, backwards=2)
    assert (scaler.skipped_steps, scaler.recomputed_steps) == (1, 0)


def test_recomputed_steps_are_saved_and_restored() -> None:
    model, easy, hard = _setup("linear")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradientScaler(model, recompute_weight_gradients=True)
    assert all(_step(scaler, model, optimizer, x) for x in (easy, easy, hard))
    restored = GradientScaler(model, recompute_weight_gradients=True)
    restored.load_state_dict(scaler.state_dict())
    assert restored.recomputed_steps == scaler.recomputed_steps == 1
    assert _step(restored, model, optimizer, easy) and restored.recomputed_steps == 1


# the update's probe reads it first
@pytest.mark.filterwarnings("ignore:GradientScaler. could not compute a scale:RuntimeWarning")
def test_a_saved_operand_modified_in_place_fails_in_autograd_not_in_the_replays_keeping() -> None:
    """The replay takes the operands before the backward; one that user code changed in place is not kept, and the
    backward raises autograd's own error, as it would without the scaler."""
    model, easy, _ = _setup("linear")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradientScaler(model, recompute_weight_gradients=True)
    assert all(_step(scaler, model, optimizer, easy) for _ in range(2))  # an update, then a replay
    hidden = model[1](model[0](easy))
    loss = model[2](hidden).square().mean()
    with torch.no_grad():
        hidden.add_(1.0)  # the last Linear saved it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        scaler.backward(loss)
    assert scaler._read.recompute.held == 0  # what the failed backward kept is released with it
    assert _step(scaler, model, optimizer, easy)  # and the next iteration runs


def test_without_recomputation_nothing_is_kept_and_the_step_is_skipped() -> None:
    model, easy, hard = _setup("linear")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradientScaler(model, recompute_weight_gradients=False)
    assert all(_step(scaler, model, optimizer, easy) for _ in range(3))
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _loss(model, hard)
    scaler.backward(loss)
    assert scaler._read.recompute.held == 0  # no memory held for it
    assert not scaler.step(optimizer)
    assert (scaler.skipped_steps, scaler.recomputed_steps) == (1, 0)
    with pytest.raises(ValueError, match="recompute_weight_gradients must be True or False, got 'yes'"):
        GradientScaler(recompute_weight_gradients="yes")  # type: ignore[arg-type]


class _CheckpointedFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(16, 32), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(checkpoint(lambda t: self.first(t).relu(), x, use_reentrant=False))


def test_layers_whose_operands_checkpointing_recomputes_keep_clear_of_the_spikes() -> None:
    """Non-reentrant checkpointing frees a block's saved operands and recomputes them for its own
    nodes only: nothing can be kept there, so those layers are not bounded as if it could."""
    torch.manual_seed(0)
    model = _CheckpointedFirst()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradientScaler(model, recompute_weight_gradients=True)
    x = torch.randn(64, 16)
    assert all(_step(scaler, model, optimizer, x) for _ in range(2))
    analysis = scaler.graphs[-1].analyses[()]
    assert {analysis.layer_names[i] for i in scaler.graphs[-1].plans[()].recomputable} == {"last"}


def test_an_amp_loop_clips_the_recomputed_gradients() -> None:
    """``unscale_`` reads the flags, so the recomputation happens there, before clipping sees ``.grad``."""
    model, easy, hard = _setup("linear")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradientScaler(model, recompute_weight_gradients=True)
    norms = []
    for x in (easy, easy, easy, hard):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model, x)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)))
        assert scaler.step(optimizer)
        scaler.update()
    assert (scaler.skipped_steps, scaler.recomputed_steps) == (0, 1)
    assert all(math.isfinite(n) for n in norms) and norms[-1] > 100 * norms[0]  # the spiked gradient, clipped


class _Tokens(nn.Module):
    """A Linear on (batch, tokens, features): ``addmm`` on a view, as transformers run it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(8, 16), nn.Linear(16, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(x.view(4, 6, 8)).relu())


LAYOUTS = {  # model, input: every parameter edge kind the recomputation knows
    "grouped convolution": (
        lambda: nn.Sequential(nn.Conv2d(4, 8, 3, groups=2), nn.ReLU(), nn.Conv2d(8, 1, 1, bias=False)),
        (4, 4, 6, 6),
    ),
    "transposed convolution, then a 1-d one": (
        lambda: nn.Sequential(nn.ConvTranspose2d(4, 6, 3, stride=2), nn.ReLU(), nn.Flatten(2), nn.Conv1d(6, 1, 1)),
        (2, 4, 5, 5),
    ),
    "linear on tokens, and without bias": (_Tokens, (24, 8)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("autocast", [False, True])
def test_what_a_replay_keeps_recomputes_every_parameter_gradient(name: str, autocast: bool) -> None:
    """On a replay whose gradients are finite, the recomputation from what was kept gives each
    parameter the gradient the backward gave it (fp32: to rounding; fp16 autocast: to fp16's)."""
    build, shape = LAYOUTS[name]
    torch.manual_seed(0)
    model, x = build(), torch.randn(*shape)
    scaler = GradientScaler(model, recompute_weight_gradients=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(2):  # an update, then a replay
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            loss = model(x).float().square().mean()
        scaler.backward(loss)
        if step == 1:
            leaves = [p.leaf for kept in scaler._read.recompute.kept.values() for p in kept.parameters]
            assert scaler._read.recompute.recompute(leaves) is None  # nothing overflowed: nothing to recompute
            scaler._read.recompute.lambda_max = 0.0  # every value an overflow: the recomputation itself, compared
            recomputed = scaler._read.recompute.recompute(leaves)
            assert recomputed is not None and len(recomputed) == len(list(model.parameters()))
            for parameter, grad in recomputed.values():
                tolerance = 2e-2 if autocast else 1e-5
                torch.testing.assert_close(
                    grad, parameter.grad, rtol=tolerance, atol=tolerance * float(parameter.grad.abs().max())
                )
        scaler.step(optimizer)
        scaler.update()
