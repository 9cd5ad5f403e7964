"""Per-layer scales inside ``torch.compile``d models (issue 16, item 1).

Update iterations run the compiled module eagerly and decide there; the iterations in between run
the compiled graph, whose backward multiplies by a scale vector the scaler writes. In fp32 compute
every ``.grad`` must equal the compiled model's plain backward bit for bit, the scales must be the
eager scaler's, and new scales must not recompile. ``backend="aot_eager"`` builds the same
AOTAutograd graphs as inductor without generating code, so these stay fast on the CPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gs_lightning import GradientScaler

UPDATE_INTERVAL = 2
ITERATIONS = 8  # updates on 0, 2, 4, 6: three changes of scale, with the batch scale below


class ResidualCNN(nn.Module):
    """Convolutions with BatchNorm and a residual branch around two of them."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = F.relu(x + self.block(x))
        return self.head(x.mean((2, 3)))


class AttentionBlock(nn.Module):
    """A pre-norm transformer block: q/k/v projections, ``scaled_dot_product_attention``, an MLP, residuals."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = AttentionBlock()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x).mean(1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)))


INPUTS = {MLP: (8,), ResidualCNN: (3, 6, 6), Transformer: (5, 16)}


def _batch(shape: tuple[int, ...], iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs whose size changes by 2^-3 each update: the scales the updates choose change with them."""
    generator = torch.Generator().manual_seed(iteration)
    x = torch.randn(4, *shape, generator=generator) * 2.0 ** (-6 - 3 * (iteration // UPDATE_INTERVAL))
    return x, torch.randint(0, 4, (4,), generator=generator)


def _fresh(make: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return make()


def _train(
    model: nn.Module, scaler: GradientScaler | None, shape: tuple[int, ...], record: list, lr: float = 0.1
) -> None:
    """SGD steps; ``record`` gets (gradients, scales or None) of each iteration."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for iteration in range(ITERATIONS):
        x, y = _batch(shape, iteration)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.backward(loss)
            scaler.step(optimizer)
            scaler.update()
        record.append(([p.grad.clone() for p in model.parameters()], dict(scaler.scales()) if scaler else None))


def _run_three(make, compile_) -> tuple[list, list, list, GradientScaler]:
    """(compiled plain backward, compiled under GS, eager under GS) records, and the compiled model's scaler."""
    torch._dynamo.reset()
    shape = INPUTS[make]
    plain, scaled, eager = [], [], []
    _train(compile_(_fresh(make)), None, shape, plain)
    compiled = compile_(_fresh(make))
    scaler = GradientScaler(compiled, update_interval=UPDATE_INTERVAL)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="GradientScaler")  # nothing opaque, nothing run eagerly for good
        _train(compiled, scaler, shape, scaled)
    reference = _fresh(make)
    _train(reference, GradientScaler(reference, update_interval=UPDATE_INTERVAL), shape, eager)
    return plain, scaled, eager, scaler


def _whole(model: nn.Module) -> nn.Module:
    return torch.compile(model, backend="aot_eager")


def _regional(model: nn.Module) -> nn.Module:
    """One block compiled on its own inside the eager model."""
    model.block = torch.compile(model.block, backend="aot_eager")
    return model


@pytest.mark.parametrize("make", [MLP, ResidualCNN, Transformer], ids=["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("compile_", [_whole, _regional], ids=["whole", "regional"])
def test_compiled_gradients_equal_plain_compiled_and_scales_equal_eager(make, compile_) -> None:
    plain, scaled, eager, scaler = _run_three(make, compile_)
    for (grads, scales), (plain_grads, _), (_, eager_scales) in zip(scaled, plain, eager):
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
        assert scales == eager_scales
    changes = {tuple(sorted(scales.items())) for _, scales in scaled}
    assert len(changes) >= 3 and any(s > 1 for _, scales in scaled for s in scales.values())
    (module,) = scaler.compiled_modules
    assert module.eager_reason is None
    vectors = [vector for _, vector in module._vectors.values()]
    assert vectors and any(bool((v != 1).any()) for v in vectors)  # the compiled backward applied scales
    assert all(layer.kind != "opaque" for layer in scaler.layers())


def test_new_scales_do_not_recompile() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    plain, scaled, _, scaler = _run_three(MLP, _whole)
    # One graph for the plain model, one for the scaled one; the scaled one replayed three plans.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert sum(torch._dynamo.utils.counters["recompiles"].values()) == 0
    (module,) = scaler.compiled_modules
    assert [version for version, _ in module._vectors.values()] == [ITERATIONS - UPDATE_INTERVAL]


def test_a_fullgraph_model_stays_one_graph() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = torch.compile(_fresh(ResidualCNN), backend="aot_eager", fullgraph=True)
    scaler = GradientScaler(model, update_interval=UPDATE_INTERVAL)
    record: list = []
    _train(model, scaler, INPUTS[ResidualCNN], record)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert scaler.compiled_modules[0].eager_reason is None


@pytest.mark.slow  # two inductor compilations: about 20 s on the 2-core development machine
def test_inductor_replays_are_bit_identical_to_its_plain_backward() -> None:
    """With inductor's generated kernels too; update iterations run the captured graph eagerly, whose fp32
    gradients may round differently from inductor's kernels (on this MLP they do not)."""
    plain, scaled, eager, scaler = _run_three(MLP, torch.compile)
    for iteration, ((grads, scales), (plain_grads, _), (_, eager_scales)) in enumerate(zip(scaled, plain, eager)):
        if iteration % UPDATE_INTERVAL:
            assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
        else:
            for a, b in zip(grads, plain_grads):
                torch.testing.assert_close(a, b)
        assert scales == eager_scales
    assert scaler.compiled_modules[0].eager_reason is None and scaler.compiled_modules[0]._vectors


class BrokenMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(self.stem(x))
        torch._dynamo.graph_break()  # two graphs: one scale vector cannot be matched to both
        return self.head(x)


def test_a_model_with_a_graph_break_runs_eagerly_with_per_layer_scales() -> None:
    torch._dynamo.reset()
    shape = INPUTS[MLP]
    plain, scaled = [], []
    _train(_whole(_fresh(BrokenMLP)), None, shape, plain)
    model = _whole(_fresh(BrokenMLP))
    scaler = GradientScaler(model, update_interval=UPDATE_INTERVAL)
    with pytest.warns(RuntimeWarning, match="runs eagerly from now on.*2 compiled graphs"):
        _train(model, scaler, shape, scaled)
    for (grads, _), (plain_grads, _) in zip(scaled, plain):
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    assert all(layer.kind != "opaque" for layer in scaler.layers())


@pytest.mark.parametrize("make", [MLP, Transformer], ids=["mlp", "transformer"])
def test_under_fp16_autocast_casts_inside_the_region_get_eager_gs_scales(make) -> None:
    """fp16 autocast: cast decision points inside the region. The compiled graph rounds fp16 otherwise than eager
    (its plain backward's gradients differ from eager's too), so gradients are compared with the compiled fp32
    backward's, to fp16 accuracy; the weights stay fixed so that the eager scaler sees the same gradients."""
    torch._dynamo.reset()
    shape = INPUTS[make]
    records = []
    for compile_, scaled, dtype in (
        (_whole, True, torch.float16),
        (lambda model: model, True, torch.float16),
        (_whole, False, torch.float32),
    ):
        model = compile_(_fresh(make))
        scaler = GradientScaler(model, update_interval=UPDATE_INTERVAL) if scaled else None
        record: list = []
        with torch.autocast("cpu", dtype=torch.float16, enabled=dtype == torch.float16):
            _train(model, scaler, shape, record, lr=0.0)
        records.append(record)
        assert scaler is None or any(layer.kind == "cast" for layer in scaler.layers())
    for (grads, scales), (_, eager_scales), (fp32_grads, _) in zip(*records):
        assert scales == eager_scales
        for a, b in zip(grads, fp32_grads):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * float(b.abs().max()))


def test_a_resumed_scaler_replays_its_saved_scales_inside_the_compiled_graph() -> None:
    torch._dynamo.reset()
    model, plain = _whole(_fresh(MLP)), _whole(_fresh(MLP))
    x, y = _batch(INPUTS[MLP], 3)
    scaler = GradientScaler(model, update_interval=100)
    for _ in range(2):
        scaler.backward(F.cross_entropy(model(x), y))
    resumed = GradientScaler(model, update_interval=100)  # takes the compiled model over
    resumed.load_state_dict(scaler.state_dict())
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        resumed.backward(F.cross_entropy(model(x), y))
        F.cross_entropy(plain(x), y).backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
    (module,) = resumed.compiled_modules
    assert resumed.scales() == scaler.scales() and any(s > 1 for s in scaler.scales().values())
    assert [version for version, _ in module._vectors.values()] == [2]  # no update: the saved plan, replayed compiled


def test_gradient_accumulation_through_a_compiled_model_stays_exact() -> None:
    """The second micro-batch adds to an existing ``.grad``: the weight gradients leaving the region are unscaled
    before autograd accumulates them (a pre-hook on the parameter's node) instead of after the backward."""
    torch._dynamo.reset()
    model, plain = _whole(_fresh(ResidualCNN)), _whole(_fresh(ResidualCNN))
    scaler = GradientScaler(model, update_interval=UPDATE_INTERVAL)
    for iteration in range(2 * UPDATE_INTERVAL + 1):
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        for micro in range(2):
            x, y = _batch(INPUTS[ResidualCNN], 2 * iteration + micro)
            scaler.backward(F.cross_entropy(model(x), y))
            F.cross_entropy(plain(x), y).backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
    assert scaler.compiled_modules[0]._vectors and any(s > 1 for s in scaler.scales().values())


def test_a_compiled_module_called_twice_per_iteration_runs_eagerly_with_per_layer_scales() -> None:
    """A siamese use: two calls, two regions in the loss's graph; one scale vector per module cannot serve both."""
    torch._dynamo.reset()
    model, plain = _whole(_fresh(MLP)), _whole(_fresh(MLP))
    scaler = GradientScaler(model, update_interval=UPDATE_INTERVAL)
    with pytest.warns(RuntimeWarning, match="runs eagerly from now on.*more than one call"):
        for iteration in range(3):
            x, y = _batch(INPUTS[MLP], iteration)
            model.zero_grad(set_to_none=True)
            plain.zero_grad(set_to_none=True)
            scaler.backward(F.cross_entropy(model(x) + model(2 * x), y))
            F.cross_entropy(plain(x) + plain(2 * x), y).backward()
            assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
    assert all(layer.kind != "opaque" for layer in scaler.layers())


class NormsAndDropout(nn.Module):
    """GroupNorm, InstanceNorm and dropout, which AOTAutograd's trace records under other autograd nodes than eager."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.Dropout(0.1),
            nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.InstanceNorm2d(8, affine=True), nn.GELU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_norms_and_dropout_are_matched_and_replays_stay_exact() -> None:
    """Replays draw the same dropout masks as the compiled plain model (same seed); the update iterations run the
    captured graph eagerly, whose dropout draws its masks otherwise, so only replays are compared."""
    torch._dynamo.reset()
    model, plain = _whole(_fresh(NormsAndDropout)), _whole(_fresh(NormsAndDropout))
    scaler = GradientScaler(model, update_interval=UPDATE_INTERVAL)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="GradientScaler")
        for iteration in range(2 * UPDATE_INTERVAL):
            x, y = _batch((3, 6, 6), iteration)
            grads = []
            for net, backward in ((model, scaler.backward), (plain, torch.Tensor.backward)):
                net.zero_grad(set_to_none=True)
                torch.manual_seed(iteration)
                backward(F.cross_entropy(net(x), y))
                grads.append([p.grad for p in net.parameters()])
            if iteration % UPDATE_INTERVAL:
                assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert scaler.compiled_modules[0]._vectors and any(s > 1 for s in scaler.scales().values())
