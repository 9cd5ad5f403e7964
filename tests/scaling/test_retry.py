"""A step whose gradients overflow runs its forward and backward again, under the back-off, instead of being skipped
(``ScalingRecipe.retry_overflowed_steps``, ``GradientScaler.step(retry=...)``).

The hard batch spikes only a weight gradient, as in ``test_recompute.py``: the first layer's inputs grow 2^12 on
channels its weights ignore, so the loss and every gradient sent on are the easy batch's, while that layer's
∇W = ∇Y·Xᵀ overflows fp16 at the scale the update chose.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from gs_lightning import GradientScaler
from gs_lightning.scaling.schedule import UpdateReason

IGNORED = 2  # input channels the first layer's weights ignore


def _setup() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))
    easy = torch.randn(256, 16)
    with torch.no_grad():
        model[0].weight[:, :IGNORED] = 0.0
    hard = easy.clone()
    hard[:, :IGNORED] *= 2.0**12
    return model, easy, hard


class Loop:
    """A training loop that gives the scaler a retry, counting the forward-backward passes it runs."""

    def __init__(self, model: nn.Module, **recipe: object) -> None:
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.scaler = GradientScaler(model, **recipe)
        self.passes = 0

    def forward_backward(self, x: torch.Tensor, factor: float = 1.0) -> None:
        self.passes += 1
        with torch.autocast("cpu", dtype=torch.float16):
            loss = self.model(x).float().square().mean() * factor
        self.scaler.backward(loss)

    def step(self, x: torch.Tensor, factor: float = 1.0, retry: bool = True) -> bool:
        self.optimizer.zero_grad(set_to_none=True)
        self.forward_backward(x, factor)
        stepped = self.scaler.step(self.optimizer, retry=(lambda: self.forward_backward(x, factor)) if retry else None)
        self.scaler.update()
        return stepped


def test_an_overflowed_step_runs_again_on_the_same_batch_and_is_taken() -> None:
    model, easy, hard = _setup()
    loop = Loop(model)
    assert all(loop.step(easy) for _ in range(3))  # an update, then replays
    buffers = {k: v.clone() for k, v in model.state_dict().items() if "num_batches_tracked" in k}
    before = copy.deepcopy(model)
    assert loop.passes == 3

    assert loop.step(hard)
    assert loop.passes == 5  # the hard batch ran twice
    assert (loop.scaler.skipped_steps, loop.scaler.retried_steps) == (0, 1)
    (update,) = loop.scaler.updates  # the retry's backward decided again, under the back-off
    assert UpdateReason.RETRIED_STEP in update.reasons
    # The step used the retry's gradients, those of one backward on the hard batch, and the buffers moved once.
    reference = copy.deepcopy(before)
    reference(hard).float().square().mean().backward()
    for p, start, q in zip(model.parameters(), before.parameters(), reference.parameters()):
        assert torch.allclose(p, start - 1e-3 * q.grad, rtol=1e-2, atol=1e-4)
    for key, value in buffers.items():
        assert torch.equal(model.state_dict()[key], reference.state_dict()[key]), key


def test_the_retry_caps_go_with_its_step_and_its_overflow_is_not_kept_as_a_spike() -> None:
    model, easy, hard = _setup()
    loop = Loop(model)
    for _ in range(3):
        loop.step(easy)
    graph = loop.scaler.graphs[-1]
    recent = len(graph.drift.recent)
    assert loop.step(hard)
    assert graph.layer_backoff.caps == {}  # the retry decided under the caps; its taken step lifts them
    assert len(graph.drift.recent) == recent + 1  # one reading for the batch: the retry's, all finite
    assert all(v < float("inf") for v in graph.drift.recent[-1].values())


def test_a_non_finite_loss_is_not_retried() -> None:
    model, easy, _ = _setup()
    loop = Loop(model)
    loop.step(easy)
    assert not loop.step(easy, factor=float("inf"))
    assert loop.passes == 2  # a forward that overflows overflows again: no retry
    assert (loop.scaler.skipped_steps, loop.scaler.retried_steps) == (1, 0)


def test_a_retry_that_overflows_again_skips_the_step_and_runs_once() -> None:
    model, easy, hard = _setup()
    loop = Loop(model)
    loop.step(easy)
    calls = []

    def retry() -> None:  # user code writes an inf into one gradient, every time
        calls.append(1)
        loop.forward_backward(easy)
        model[3].weight.grad[0, 0] = float("inf")

    loop.optimizer.zero_grad(set_to_none=True)
    loop.forward_backward(easy)
    model[3].weight.grad[0, 0] = float("inf")
    weights = [p.detach().clone() for p in model.parameters()]
    assert not loop.scaler.step(loop.optimizer, retry=retry)
    loop.scaler.update()
    assert len(calls) == 1
    assert (loop.scaler.skipped_steps, loop.scaler.retried_steps) == (1, 1)
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    assert loop.step(easy)
    assert loop.scaler.graphs[-1].layer_backoff.caps  # a skipped step's caps stay, as without a retry


def test_without_the_rule_an_overflowed_step_is_skipped() -> None:
    model, easy, hard = _setup()
    loop = Loop(model, retry_overflowed_steps=False)
    for _ in range(3):
        loop.step(easy)
    assert not loop.step(hard)
    assert loop.passes == 4
    assert (loop.scaler.skipped_steps, loop.scaler.retried_steps) == (1, 0)


def test_no_retry_after_another_optimizer_stepped() -> None:
    model, easy, _ = _setup()
    scaler = GradientScaler(model)
    first = torch.optim.SGD(model[3].parameters(), lr=0.0)
    second = torch.optim.SGD([*model[0].parameters(), *model[1].parameters()], lr=0.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(easy).float().square().mean()
    scaler.backward(loss)
    model[0].weight.grad[0, 0] = float("inf")
    assert scaler.step(first)
    assert not scaler.prepare_retry(second)  # the iteration cannot run again: an optimizer stepped on it
    assert not scaler.step(second)


def test_the_retried_steps_survive_a_resume() -> None:
    model, easy, hard = _setup()
    loop = Loop(model)
    for batch in (easy, easy, easy, hard):
        loop.step(batch)
    restored = GradientScaler(copy.deepcopy(model))
    restored.load_state_dict(loop.scaler.state_dict())
    assert restored.retried_steps == 1


def test_updates_after_an_offered_retry_share_the_spikes() -> None:
    """Where the steps can run again, an update bounds every GEMM by its level and a share of its spikes, as the
    recompute bounds the GEMMs it can recompute: a spike 2^6 above the first layer's weight gradients holds its scale
    down a binade where the loop gives no retry, and not where it does."""
    totals = {}
    for retry in (True, False):
        model, easy, _ = _setup()
        spiky = easy.clone()
        spiky[:, :IGNORED] *= 2.0**6
        loop = Loop(model, update_interval=4)
        for x in (easy, spiky, easy, easy, easy):  # the fifth backward updates
            assert loop.step(x, retry=retry)
        totals[retry] = {layer.name: layer.log2_total for layer in loop.scaler.layers()}
    assert totals[True]["0"] == totals[False]["0"] + 1


def test_the_retry_names_the_layers_where_no_other_rule_reads_the_gradients() -> None:
    """Without the drift and expected-maxima rules nothing else reads the weight gradients between updates: the
    retry reads them itself, to name the layers that overflowed."""
    model, easy, hard = _setup()
    loop = Loop(
        model,
        drift_tolerance_log2=None,
        expected_maxima_margin_log2=None,
        update_after_zero_gradient=False,
        level_steps=1,
        kept_downstream_cap=False,
        expect_surprise_within_margin=False,
        spike_room_log2=0.0,
    )
    for _ in range(3):
        loop.step(easy)
    assert loop.step(hard)
    assert (loop.scaler.skipped_steps, loop.scaler.retried_steps) == (0, 1)


def test_the_retry_measures_every_weight_gradient(measured_weights: list[str]) -> None:
    """A retried step's batch went beyond what the steps' reads expected: its update computes every GEMM's weight
    gradient exactly for its bound, as the first update does, instead of taking the expectation in its place."""
    model, easy, hard = _setup()
    loop = Loop(model)
    assert loop.step(easy) and sorted(measured_weights) == ["0", "3"]  # the first update: nothing expected yet
    measured_weights.clear()
    assert all(loop.step(easy) for _ in range(2))
    assert loop.step(hard) and loop.scaler.retried_steps == 1
    assert sorted(measured_weights) == ["0", "3"]
