"""The core GradientScaler: exactness, fp16 fidelity, overflow handling, and every entry and input."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import torchvision
from nets import (
    CheckpointedNet,
    CheckpointSharedNet,
    DenseBlock,
    PlainCNN,
    SegNetLike,
    SplitNet,
    SSDLike,
    TiedLM,
    TwoOutputNet,
)
from torch import nn

from gs_lightning import GradientScaler
from gs_lightning.analysis.fidelity import FidelityProbe
from gs_lightning.scaling.decide import NodeDecisions

_G = torch.Generator().manual_seed(0)
_X = torch.randn(2, 3, 32, 32, generator=_G)

CASES = {
    "resnet18": (
        lambda: torchvision.models.resnet18(num_classes=10),
        lambda m: F.cross_entropy(m(_X), torch.tensor([1, 2])),
    ),
    "ssd_like": (SSDLike, lambda m: m(_X[:, :, :16, :16])),
    "segnet_like": (
        SegNetLike,
        lambda m: F.cross_entropy(
            m(_X[:, :, :12, :20]), torch.randint(0, 3, (2, 12, 20), generator=torch.Generator().manual_seed(1))
        ),
    ),
    "densenet_like": (DenseBlock, lambda m: F.cross_entropy(m(_X[:, :, :8, :8]), torch.tensor([1, 2]))),
    "weight_tied": (
        TiedLM,
        lambda m: F.cross_entropy(m(torch.tensor([[1, 2, 3], [4, 5, 6]])).flatten(0, 1), torch.arange(1, 7)),
    ),
    "split_chunk_unbind": (SplitNet, lambda m: F.cross_entropy(m(_X[:, 0, 0, :6]), torch.tensor([1, 2]))),
    "two_output_function": (TwoOutputNet, lambda m: F.cross_entropy(m(_X[:, 0, 0, :5]), torch.tensor([1, 0]))),
    "checkpoint_non_reentrant": (
        lambda: CheckpointedNet(use_reentrant=False),
        lambda m: F.cross_entropy(m(_X[:, 0, :4, :8].flatten(0, 1)), torch.arange(8) % 4),
    ),
    "checkpoint_reentrant": (
        lambda: CheckpointedNet(use_reentrant=True),
        lambda m: F.cross_entropy(m(_X[:, 0, :4, :8].flatten(0, 1)), torch.arange(8) % 4),
    ),
    "checkpoint_shared_weight": (
        CheckpointSharedNet,
        lambda m: F.cross_entropy(m(_X[:, 0, :4, :8].flatten(0, 1)), torch.arange(8) % 4),
    ),
}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_gradients_are_bit_exact(case: str) -> None:
    """Power-of-two scaling and unscaling is exact in fp32: gradients equal plain backward's."""
    build, loss_fn = CASES[case]
    torch.manual_seed(0)
    model = build()
    model.zero_grad(set_to_none=True)
    (loss_fn(model) * 1e-6).backward()
    reference = _grads(model)
    scaler = GradientScaler(model, update_interval=100)
    for iteration in range(2):  # an update iteration, then one replaying its scales
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # opaque and reentrant-checkpoint notices, torch's nested-checkpoint one
            scaler.backward(loss_fn(model) * 1e-6)
        grads = _grads(model)
        assert grads.keys() == reference.keys()
        mismatched = [n for n in reference if not torch.equal(grads[n], reference[n])]
        assert not mismatched, f"iteration {iteration}: {mismatched}"
    scales = scaler.scales()
    assert scales and any(s != 1.0 for s in scales.values()), scales


def test_layer_names_are_module_names() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    scaler = GradientScaler(model)
    scaler.backward(F.cross_entropy(model(_X), torch.tensor([1, 2])))
    assert {"fc", "layer1.0.conv1", "layer4.1.conv2"} <= set(scaler.scales())
    assert set(scaler.underflow_rates()) == set(scaler.scales())


# --- the statistical model against Monte-Carlo samples ----------------------------------------


# --- fp16 fidelity -----------------------------------------------------------------------------


def test_fp16_fidelity_against_fixed_loss_scales() -> None:
    torch.manual_seed(0)
    model = PlainCNN(width=8, depth=6)
    x, y = torch.randn(4, 3, 12, 12), torch.randint(0, 10, (4,))
    probe = FidelityProbe(model, lambda m: F.cross_entropy(m(x), y) * 1e-6)
    none = probe.none()
    _, best = probe.best_fixed()
    _, gs = probe.gradient_scaling()
    assert none.error > 0.3 and none.underflow > 0.9  # without scaling the gradients vanish
    assert gs.error < none.error / 100
    assert gs.error <= 1.5 * best.error, (gs, best)
    assert gs.underflow < 0.01


# --- overflow ----------------------------------------------------------------------------------


def test_non_finite_gradient_skips_step_and_recovers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradientScaler(model, update_interval=100)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))

    def iteration(poison: bool) -> bool:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
            if poison:
                out = out * torch.tensor(float("inf"))
            loss = F.cross_entropy(out.float(), y)
        scaler.backward(loss)
        return scaler.step(optimizer)

    assert iteration(False)
    before = [p.detach().clone() for p in model.parameters()]
    assert not iteration(True)
    assert scaler.found_inf and scaler.skipped_steps == 1
    assert all(torch.equal(b, p) and torch.isfinite(p).all() for b, p in zip(before, model.parameters()))
    updates_before = scaler.iteration
    assert iteration(False)  # recomputes scales on the next iteration and steps again
    assert not scaler.found_inf and scaler.iteration == updates_before + 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_overflow_the_model_cannot_see_backs_off_until_finite() -> None:
    """An op after the cast multiplies the gradient by 64 (a tensor of 64s: a product by a constant
    scalar is a gain the update sees), so the cast's scale overflows fp16 downstream. Steps are
    skipped, weights stay intact, and the cap on the accumulated scale halves per skip until steps go through."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)
    scaler = GradientScaler(model)
    x = torch.randn(256, 64)
    upstream = torch.exp(-10 + 3 * torch.randn(256, 64))
    stepped = []
    for _ in range(12):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ((model(x) * torch.full((64,), 64.0, dtype=torch.float16)).float() * upstream).sum()
        scaler.backward(loss)
        stepped.append(scaler.step(optimizer))
        assert all(torch.isfinite(p).all() for p in model.parameters())
        if not stepped[-1]:
            assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert not stepped[0] and stepped[-1]
    assert scaler.skipped_steps == stepped.index(True) <= 8
    assert all(stepped[stepped.index(True) :])


def test_weight_gradients_do_not_overflow() -> None:
    """Large activations and wide log-normal loss gradients: at the scales that keep ∇X above
    λmin, the weight gradient (a sum over 4096 rows) would overflow fp16. Its bound keeps it finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    scaler = GradientScaler(model)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (model(torch.randn(4096, 64) * 30).float() * torch.exp(-10 + 3 * torch.randn(4096, 64))).sum()
    scaler.backward(loss)
    assert not scaler.found_inf
    assert max(scaler.scales().values()) > 1.0


def test_each_optimizer_is_judged_by_its_own_gradients() -> None:
    """As GradScaler: an overflow in one optimizer's parameters skips only that optimizer."""
    torch.manual_seed(0)
    body, head = nn.Linear(4, 4), nn.Linear(4, 2)
    opt_body, opt_head = torch.optim.SGD(body.parameters(), lr=0.1), torch.optim.SGD(head.parameters(), lr=0.1)
    scaler = GradientScaler()
    x = torch.randn(3, 4)
    h = body(x)
    scaler.backward((head(h.detach()) * torch.tensor([float("inf"), 1.0])).sum() + h.sum())
    head_before = [p.detach().clone() for p in head.parameters()]
    assert scaler.found_inf
    assert scaler.step(opt_body) and not scaler.step(opt_head)
    assert all(torch.equal(b, p) for b, p in zip(head_before, head.parameters()))
    assert scaler.skipped_steps == 1


# --- robustness --------------------------------------------------------------------------------


def test_hooks_removed_retain_graph_second_backward_and_frozen_params() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    x = torch.randn(3, 4)
    loss = model(x).pow(2).sum() * 1e-6
    scaler = GradientScaler(model)
    scaler.backward(loss, retain_graph=True)
    first = _grads(model)
    assert "0.weight" not in first
    scaler.backward(loss, retain_graph=True)  # a second scaled backward on the same graph accumulates
    assert all(torch.equal(model.get_parameter(n).grad, 2 * g) for n, g in first.items())
    model.zero_grad()
    loss.backward()  # plain backward afterwards: no hook of ours is left on the graph
    assert all(torch.equal(model.get_parameter(n).grad, g) for n, g in first.items())


def test_opaque_compiled_node_warns_once_and_passes_through() -> None:
    class CompiledFunction(torch.autograd.Function):  # named as torch.compile's backward node
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w.T, x.T @ g

    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4)
    scaler = GradientScaler()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            w.grad = None
            scaler.backward(CompiledFunction.apply(x, w).sum())
    messages = [str(c.message) for c in caught if "CompiledFunction" in str(c.message)]
    assert len(messages) == 1
    assert torch.allclose(w.grad, x.T @ torch.ones(2, 4))


@pytest.mark.parametrize("case", ["split_chunk_unbind", "checkpoint_reentrant"])
def test_state_dict_round_trip_reuses_scales(case: str) -> None:
    """A restored scaler replays the saved scales (those of checkpoints' inner graphs included)."""
    build, loss_fn = CASES[case]
    torch.manual_seed(0)
    model = build()
    scaler = GradientScaler(model, update_interval=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler.backward(loss_fn(model) * 1e-6)
        state = scaler.state_dict()
        restored = GradientScaler(model, update_interval=10)
        restored.load_state_dict(state)
        # inner graphs' runs are part of it
        assert restored.scales() == scaler.scales() and restored.iteration == restored.update_iterations == 1
        assert {path: plan.alpha_out for path, plan in restored.graphs[-1].plans.items()} == {
            p: q.alpha_out for p, q in scaler.graphs[-1].plans.items()
        }
        model.zero_grad()
        scaler.backward(loss_fn(model) * 1e-6)
        expected = _grads(model)
        model.zero_grad()
        restored.backward(loss_fn(model) * 1e-6)  # a replay: no new decision
    assert all(torch.equal(expected[n], g) for n, g in _grads(model).items())
    assert restored.layers() == scaler.layers() and restored.graphs[-1].plans.keys() == scaler.graphs[-1].plans.keys()
    assert restored.update_iterations == scaler.update_iterations == 1
    assert case != "checkpoint_reentrant" or len(restored.graphs[-1].plans) > 1


def test_update_iterations_count_the_backwards_that_decided_scales() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    scaler = GradientScaler(model, update_interval=3)
    for _ in range(7):
        model.zero_grad()
        scaler.backward(model(x).pow(2).sum())
    assert (scaler.iteration, scaler.update_iterations) == (7, 3)  # iterations 0, 3 and 6


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("underflow_rate", 0.0),
        ("underflow_rate", 0.7),
        ("update_interval", 0),
        ("lambda_min", "tiny"),
        ("max_total_scale", 0.5),
    ],
)
def test_bad_options_name_what_is_wrong(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=option):
        GradientScaler(**{option: value})


def test_unsupported_dtype_lists_the_formats() -> None:
    with pytest.raises(ValueError, match="float16.*bfloat16.*float8_e5m2.*float8_e4m3fn"):
        GradientScaler(dtype=torch.int8)


def test_core_imports_no_lightning() -> None:
    code = "import sys, gs_lightning.scaling, gs_lightning; assert 'lightning' not in sys.modules, 'lightning imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- inputs that used to crash or go silent ----------------------------------------------------


def test_sparse_gradients_step_and_report_non_finite() -> None:
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 4, sparse=True)
    head = nn.Linear(4, 2)
    model = nn.Sequential(embedding, head)
    optimizers = [torch.optim.SparseAdam(embedding.parameters(), lr=0.1), torch.optim.SGD(head.parameters(), lr=0.1)]
    scaler = GradientScaler(model)
    tokens = torch.tensor([1, 2, 2, 5])
    before = embedding.weight.detach().clone()
    scaler.backward(F.cross_entropy(model(tokens), torch.tensor([0, 1, 1, 0])))
    assert embedding.weight.grad.is_sparse and not scaler.found_inf
    assert all(scaler.step(optimizer) for optimizer in optimizers)
    assert not torch.equal(before, embedding.weight) and torch.equal(before[3], embedding.weight[3])

    for optimizer in optimizers:
        optimizer.zero_grad()
    scaler.backward(F.cross_entropy(model(tokens) * torch.tensor(float("inf")), torch.tensor([0, 1, 1, 0])))
    before = embedding.weight.detach().clone()
    assert scaler.found_inf and not scaler.step(optimizers[0])
    assert torch.equal(before, embedding.weight)


def test_a_diverged_run_stops_naming_the_first_non_finite_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradientScaler(model, max_consecutive_skips=3)
    x = torch.randn(5, 4)

    def diverged_step() -> bool:
        optimizer.zero_grad()
        out = model[0](x)
        out = out * torch.tensor(float("inf"))  # non-finite from the first layer's output on
        scaler.backward(model[2](model[1](out)).sum())
        return scaler.step(optimizer)

    assert not any(diverged_step() for _ in range(3))
    with pytest.raises(
        RuntimeError, match=r"4 optimizer steps in a row were skipped.*max_consecutive_skips=3.*layer '2'"
    ):
        diverged_step()
    assert GradientScaler(max_consecutive_skips=None).max_consecutive_skips is None


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "3"])
def test_max_consecutive_skips_is_checked_when_given_and_when_set(value) -> None:
    with pytest.raises(ValueError, match="max_consecutive_skips must be None or a positive integer"):
        GradientScaler(max_consecutive_skips=value)
    scaler = GradientScaler(max_consecutive_skips=5)
    with pytest.raises(ValueError, match="max_consecutive_skips must be None or a positive integer"):
        scaler.max_consecutive_skips = value
    scaler.max_consecutive_skips = 2
    assert scaler.max_consecutive_skips == 2 and scaler.state_dict()["consecutive_skips"] == 0


def test_consecutive_skips_reset_after_a_step() -> None:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradientScaler(model, max_consecutive_skips=1)
    for poison in (True, False, True, False):  # never two skips in a row
        optimizer.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an inf input is a skipped step, not a decision that failed
            scaler.backward(model(torch.randn(3, 4) * (float("inf") if poison else 1.0)).sum())
        assert scaler.step(optimizer) is not poison


def test_fp16_parameters_are_refused_before_any_gradient_is_written() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).half()
    scaler = GradientScaler(model)
    loss = model(torch.randn(3, 4, dtype=torch.float16)).float().sum()
    with pytest.raises(ValueError, match=r"parameter 1\.bias is torch\.float16.*float32.*torch\.autocast"):
        scaler.backward(loss)
    assert all(p.grad is None for p in model.parameters())


def test_fp32_master_weights_under_fp16_autocast_get_fp32_true_gradients() -> None:
    """The supported alternative to model.half(): fp32 parameters, fp16 compute. The gradients the
    scaler leaves are fp32 and equal plain fp16 autocast's wherever plain fp16 did not underflow."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    plain = _grads(model)
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    GradientScaler(model).backward(loss)
    for name, grad in _grads(model).items():
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, plain[name], rtol=2e-3, atol=1e-6)


def test_a_skipped_step_leaves_the_buffers_as_they_were() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradientScaler(model)
    x = torch.randn(6, 4)
    optimizer.zero_grad()
    scaler.backward(model(x).sum())
    assert scaler.step(optimizer)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    optimizer.zero_grad()
    poisoned = x.clone()
    poisoned[0, 0] = float("inf")
    scaler.backward(model(poisoned).sum())
    assert not torch.isfinite(model[1].running_mean).all()  # the forward already spoilt them
    with pytest.warns(RuntimeWarning, match="non-finite buffer.*restored"):
        assert not scaler.step(optimizer)
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    model.eval()
    assert torch.isfinite(model(x)).all()


def test_gradscaler_loop_runs_unchanged_and_keeps_gradscaler_rules() -> None:
    """PyTorch's AMP recipe loop with GradientScaler in place of GradScaler (fp32 here: exact)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    scaler = GradientScaler(model)
    assert scaler.is_enabled()
    for _ in range(3):
        optimizer.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y) * 1e-6).backward()
        scaler.unscale_(optimizer)
        with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
            scaler.unscale_(optimizer)
        reference.zero_grad()
        (F.cross_entropy(reference(x), y) * 1e-6).backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert scaler.step(optimizer)
        with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
            scaler.step(optimizer)
        scaler.update()
        reference.load_state_dict(model.state_dict())
    assert scaler.iteration == 3 and any(s != 1.0 for s in scaler.scales().values())


def test_accumulated_gradients_are_exact() -> None:
    """Micro-batches accumulate into .grad: later ones are unscaled before autograd adds them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    batches = [(torch.randn(8, 8), torch.randint(0, 4, (8,))) for _ in range(3)]
    for x, y in batches:
        (F.cross_entropy(model(x), y) * 1e-6).backward()
    reference = _grads(model)
    model.zero_grad()
    scaler = GradientScaler(model, update_interval=2)
    for x, y in batches:
        scaler.backward(F.cross_entropy(model(x), y) * 1e-6)
    assert all(torch.equal(g, reference[n]) for n, g in _grads(model).items())


def test_opaque_nodes_are_named_in_the_warning_and_scaled_as_one_unit() -> None:
    model = TwoOutputNet()
    scaler = GradientScaler(model)
    with pytest.warns(RuntimeWarning, match="_ScaleAndShiftBackward.*scaled as one unit"):
        scaler.backward(F.cross_entropy(model(_X[:, 0, 0, :5]), torch.tensor([1, 0])))
    opaque = [layer for layer in scaler.layers() if layer.kind == "opaque"]
    assert [layer.name for layer in opaque] == ["_ScaleAndShiftBackward"] and opaque[0].log2_scale > 0


def weight_probes_only_where(monkeypatch: pytest.MonkeyPatch, readable: Callable[[str], bool]) -> None:
    """Let only the layers ``readable`` accepts (by name) probe their weight gradients, as non-reentrant
    checkpointing leaves them: a checkpointed layer's input cannot be read."""
    weight_samples = NodeDecisions._weight_samples

    def readable_samples(self, i, grad, elements=None):
        return weight_samples(self, i, grad, elements) if readable(self.analysis.layer_names[i]) else []

    monkeypatch.setattr(NodeDecisions, "_weight_samples", readable_samples)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_blocks_are_scaled_as_the_plain_model(
    use_reentrant: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpointing changes how activations are kept, not what is scaled. Non-reentrant: the very
    same scales as the plain model decides without its weight-gradient probes (a checkpointed
    layer's input is not readable). Reentrant: every layer inside is still a decision point (the
    scaler prepares the block's inner backward when the block is recomputed); the gradient leaving
    a block returns to the scale it entered with, so later scales may differ."""
    import nets

    def scales_of(model: nn.Module) -> dict[str, float]:
        scaler = GradientScaler(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(
                model(torch.randn(64, 8, generator=torch.Generator().manual_seed(0))).float(), torch.arange(64) % 4
            )
        scaler.backward(loss * 1e-4)
        return scaler.scales()

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notice on the nested reentrant checkpoint's inputs
        checkpointed = scales_of(CheckpointedNet(use_reentrant=use_reentrant))
    monkeypatch.setattr(nets, "checkpoint", lambda function, *args, **kwargs: function(*args))
    monkeypatch.setattr(nets, "checkpoint_sequential", lambda functions, segments, x, **kwargs: functions(x))
    # outside the blocks only (checkpoint_sequential runs its last segment plainly)
    weight_probes_only_where(monkeypatch, lambda name: name in ("stem", "tail.2", "head"))
    torch.manual_seed(0)
    plain = scales_of(CheckpointedNet(use_reentrant=use_reentrant))
    assert len(plain) > 5 and checkpointed.keys() == plain.keys()
    assert (
        checkpointed == plain
        if not use_reentrant
        else any(checkpointed[f"blocks.{k}.{n}"] > 1 for k in (0, 1) for n in "ab")
    )


def test_a_failed_backward_leaves_no_scaled_gradient_behind() -> None:
    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    scaler = GradientScaler(model)
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="boom"):
            scaler.backward((model[2](Fails.apply(model[1](model[0](x)))) * 1e-6).sum())
    assert all(p.grad is None for p in model.parameters())  # the head's scaled gradient was dropped
    scaler.backward((model(x) * 1e-6).sum())  # and the scaler works on
    assert all(p.grad is not None for p in model.parameters())


def test_a_gradscaler_state_is_refused_with_a_clear_message() -> None:
    state = torch.amp.GradScaler("cpu").state_dict()
    with pytest.raises(ValueError, match=r"not a GradientScaler state.*start the GradientScaler fresh"):
        GradientScaler().load_state_dict(state)
