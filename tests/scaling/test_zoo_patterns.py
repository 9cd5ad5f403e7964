"""Tiny models with the patterns of third-party model zoos that once broke exactness or overflow safety (issue 19).

torchvision's detection heads (views of concatenated outputs, RoI pooling, deformable convolution),
GPT-2's ``Conv1D`` under non-reentrant checkpointing, a weight reused across iterations under
autocast (RAFT), a replay after a bias gradient grew, and gradients in fp32's subnormal range.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_scaler import weight_probes_only_where
from torch import nn
from torch.utils.checkpoint import checkpoint
from torchvision import ops

from gs_lightning import GradientScaler
from gs_lightning.scaling.plan import times_pow2


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _plain_grads(model: nn.Module, loss_fn) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return grads


def _nodes(root, name: str) -> list:
    """The nodes of type ``name`` below ``root``, in breadth-first order."""
    seen, frontier, found = {root}, [root], []
    while frontier:
        node = frontier.pop(0)
        if type(node).__name__ == name:
            found.append(node)
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    return found


# --- Item 1: layouts and torchvision's operators ----------------------------------------------


class ConcatenatedHeads(nn.Module):
    """RPN/SSD heads: per-level conv outputs, anchors × values per position, permuted, flattened and concatenated.

    The gradient each head conv receives is a view into the gradient of the concatenation: not dense.
    """

    def __init__(self, anchors: int = 3, values: int = 4) -> None:
        super().__init__()
        self.body = nn.Conv2d(3, 8, 3, padding=1)
        self.heads = nn.ModuleList(nn.Conv2d(8, anchors * values, 3, padding=1) for _ in range(2))
        self.values = values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = F.relu(self.body(x))
        outputs = []
        for level, head in enumerate(self.heads):
            y = head(features[..., :: level + 1, :: level + 1])
            n, _, h, w = y.shape
            outputs.append(y.view(n, -1, self.values, h, w).permute(0, 3, 4, 1, 2).reshape(n, -1, self.values))
        return torch.cat(outputs, 1)


def test_scaling_keeps_the_layout_of_a_view_into_concatenated_head_outputs() -> None:
    """A head conv receives its gradient with plain backward's strides, so reductions over it (its bias
    gradient) sum in the same order: the scaled sum, unscaled, equals plain backward's bit for bit."""
    torch.manual_seed(0)
    model, x = ConcatenatedHeads(), torch.randn(2, 3, 50, 50)
    weights = torch.linspace(-1.0, 1.0, 4)

    def received(scaler: GradientScaler | None) -> list[tuple[str, tuple[int, ...], torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = (model(x) * weights).pow(2).mean() * 1e-3
        root = scaler.scale(loss) if scaler is not None else loss
        seen = []
        for node in _nodes(root.grad_fn, "ConvolutionBackward0"):
            name = next(n for n, p in model.named_parameters() if p is node.next_functions[1][0].variable).removesuffix(
                ".weight"
            )
            node.register_prehook(
                lambda grads, name=name: seen.append((name, grads[0].stride(), grads[0].sum((0, 2, 3))))
            )
        root.backward()
        return seen

    plain = received(None)
    scaler = GradientScaler(model)
    scaled = received(scaler)
    totals = {layer.name: layer.log2_total for layer in scaler.layers()}
    assert [name for name, _, _ in scaled] == [name for name, _, _ in plain] and {"heads.0", "heads.1"} <= totals.keys()
    assert any(totals[name] != 0 for name in ("heads.0", "heads.1"))
    for (name, stride, total), (_, plain_stride, plain_total) in zip(scaled, plain):
        assert stride == plain_stride, name
        if name in totals:
            assert torch.equal(times_pow2(total, -totals[name]), plain_total), name


def test_scaling_a_strided_or_expanded_gradient_keeps_its_strides() -> None:
    base = torch.randn(4, 30, 3)
    for grad in (base[:, 5:20], base[:, :, 1].t(), torch.randn(3, 1).expand(3, 5), base[:, 5:20].permute(2, 0, 1)):
        scaled = times_pow2(grad, 7)
        assert scaled.stride() == grad.stride() and torch.equal(scaled, grad * 128)


class RoiHead(nn.Module):
    """A deformable convolution and torchvision's four RoI pooling operators, as in detection heads."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.offset = nn.Conv2d(8, 18, 3, padding=1)
        self.mask = nn.Conv2d(8, 9, 3, padding=1)
        self.deform = ops.DeformConv2d(8, 8, 3, padding=1)
        self.classifier = nn.Linear(8 * 16 * 2 + 2 * 4 * 2, 4)

    def forward(self, x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        features = F.relu(self.stem(x))
        features = F.relu(self.deform(features, self.offset(features), torch.sigmoid(self.mask(features))))
        pooled = [
            ops.roi_align(features, boxes, 4),
            ops.roi_pool(features, boxes, 4),
            ops.ps_roi_align(features, boxes, 2),
            ops.ps_roi_pool(features, boxes, 2),
        ]
        return self.classifier(torch.cat([p.flatten(1) for p in pooled], 1))


def test_torchvision_roi_ops_pass_scales_through_and_deform_conv2d_is_a_gemm() -> None:
    torch.manual_seed(0)
    model, x = RoiHead(), torch.randn(2, 3, 16, 16)
    boxes = torch.tensor([[0, 1.0, 1.0, 9.0, 9.0], [1, 2.0, 3.0, 12.0, 14.0]])

    def loss() -> torch.Tensor:
        return F.cross_entropy(model(x, boxes), torch.tensor([1, 2]))

    plain = _plain_grads(model, loss)
    scaler = GradientScaler(model, update_interval=2)
    for _ in range(3):  # update, replay, update
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "opaque" warning
            scaler.backward(loss())
        assert all(torch.equal(g, plain[n]) for n, g in _grads(model).items())
    kinds = {layer.name: layer for layer in scaler.layers()}
    assert not any(layer.kind == "opaque" for layer in kinds.values())
    deform = kinds["deform"]
    # probed: a rate
    assert deform.kind == "gemm" and deform.log2_scale > 0 and deform.underflow_rate == deform.underflow_rate
    assert {"offset", "mask"} <= kinds.keys()  # scales reach the layers below the RoI ops and the deformable conv


# --- Item 3: GPT-2's Conv1D ------------------------------------------------------------------


class Conv1D(nn.Module):
    """GPT-2's ``Conv1D``: a Linear whose weight is stored (in, out) and passed to ``addmm`` as it is."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_features, out_features) * 0.02)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


class Gpt2Mlp(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"c_fc": Conv1D(32, 16), "c_proj": Conv1D(16, 32), "square": Conv1D(16, 16)})
            for _ in range(2)
        )
        self.head = nn.Linear(16, 5)
        self.checkpointed = checkpointed

    def _block(self, block: nn.ModuleDict, h: torch.Tensor) -> torch.Tensor:
        return h + block["square"](block["c_proj"](torch.tanh(block["c_fc"](h))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(self._block, block, h, use_reentrant=False) if self.checkpointed else self._block(block, h)
        return self.head(h)


def test_transposed_weight_addmm_is_scaled_under_non_reentrant_checkpointing() -> None:
    """The operand of ``addmm`` comes from the node's layout (Conv1D's (in, out) weight, square ones
    included), so checkpointed blocks decide as the unchecked model does. With Algorithm 1's rule at
    this fp32 model's residual sums: at the smallest incoming scale, the decision below them is made
    where non-reentrant checkpointing leaves ``blocks.0.square``'s weight gradient unsampled (2^6, 2^7
    without checkpointing), which is not what this test is about."""
    x, y = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(5)), torch.arange(24) % 5
    layers = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = Gpt2Mlp(checkpointed)
        plain = _plain_grads(model, lambda: F.cross_entropy(model(x).flatten(0, 1), y))
        scaler = GradientScaler(model, wide_branch_scale="largest")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "could not compute a scale at AddmmBackward0"
            scaler.backward(F.cross_entropy(model(x).flatten(0, 1), y))
        assert all(torch.equal(g, plain[n]) for n, g in _grads(model).items())
        layers[checkpointed] = [(layer.name, layer.kind, layer.log2_scale) for layer in scaler.layers()]
    assert layers[True] == layers[False]
    assert {"blocks.0.c_proj", "blocks.1.square"} <= {name for name, _, _ in layers[True]}


# --- Item 4: sums and replays in fp16 -------------------------------------------------------


class ReusedLinear(nn.Module):
    """One Linear applied three times (RAFT's update block across flow iterations): autocast casts its
    weight once, so three fp16 weight gradients are summed in fp16 before the cast back."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.shared = nn.Linear(16, 16)
        with torch.no_grad():
            self.pre.weight.copy_(torch.eye(16) * 1500.0)  # large activations: large weight gradients
            self.pre.bias.zero_()
            self.shared.weight.normal_(0.0, 1e-4)  # small weights: the input gradients want large scales
            self.shared.bias.zero_()

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return sum(self.shared(self.pre(x)) for x in inputs)


def _fp16_loss(model: nn.Module, *args, factor: float = 1.0) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        return model(*args).float().sum() * (1e-3 * factor)


def test_a_weight_reused_three_times_under_autocast_does_not_overflow_its_sum() -> None:
    """Each of the three weight gradients is finite at its scale; their fp16 sum must be too."""
    torch.manual_seed(0)
    model = ReusedLinear()
    inputs = [1.0 + 0.01 * torch.randn(1, 16) for _ in range(3)]
    plain = _plain_grads(model, lambda: _fp16_loss(model, inputs))
    assert all(torch.isfinite(g).all() for g in plain.values())
    scaler = GradientScaler(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.backward(_fp16_loss(model, inputs))
    # three decisions, one weight
    assert {"shared", "shared#2", "shared#3"} <= {layer.name for layer in scaler.layers()}
    assert scaler.step(optimizer) and scaler.skipped_steps == 0
    assert all(torch.isfinite(g).all() for g in _grads(model).values())


class BiasBound(nn.Module):
    """A Linear whose scale its bias gradient bounds (an exact bound: the sum of ∇Y over the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.proj = nn.Linear(8, 8)
        with torch.no_grad():
            self.proj.weight.normal_(0.0, 1e-4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.pre(x) * 0.01)


def test_a_replay_after_the_bias_gradient_grew_does_not_overflow() -> None:
    """An update's bounds are tight; its replays must leave room for the gradient to grow (here 1.9x)."""
    torch.manual_seed(0)
    model, x = BiasBound(), torch.randn(400, 8)
    assert all(torch.isfinite(g).all() for g in _plain_grads(model, lambda: _fp16_loss(model, x, factor=1.9)).values())
    scaler = GradientScaler(model, update_interval=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for factor in (1.0, 1.9):  # the update, then a replay whose bias gradient is 1.9x larger
        optimizer.zero_grad(set_to_none=True)
        scaler.backward(_fp16_loss(model, x, factor=factor))
        assert scaler.step(optimizer), f"skipped at factor {factor}"
    assert scaler.skipped_steps == 0


class BranchesAfterBatchNorm(nn.Module):
    """Two Linear branches read one batch-normalised activation of small variance (inputs ×0.005): the
    batch norm's backward multiplies the summed gradient by max|γ|·invstd, about 2^8 here. The branch
    with weights ×1e-4 sends a gradient that wants 2^10 more scale than the other's."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32)
        self.head = nn.Linear(32, 32)
        self.side = nn.Linear(32, 32)
        with torch.no_grad():
            self.side.weight.mul_(1e-4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.pre(x * 0.005)))
        return self.head(h) + self.side(h)


def test_a_branch_sum_before_a_batch_norm_leaves_room_for_its_gain() -> None:
    """The two branches' gradients meet at the batch norm's output. The common scale was the largest
    that keeps their sum below λmax (the side branch's, 2^29); the batch norm then made it inf, and the
    step was skipped where unscaled fp16 is finite. Bounds now include the gains of the batch norms
    between them and the next decision."""
    torch.manual_seed(0)
    model, x = BranchesAfterBatchNorm(), torch.randn(64, 16)

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return model(x).float().square().mean() * 1e-3

    assert all(torch.isfinite(g).all() for g in _plain_grads(model, loss).values())
    scaler = GradientScaler(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.backward(loss())
    assert scaler.step(optimizer) and scaler.skipped_steps == 0
    totals = {layer.name: layer.log2_total for layer in scaler.layers()}
    assert totals["side"] > totals["head"] >= totals["pre"]  # the sum: the head's scale, not the side's


# --- Item 2: fp32's subnormal range ----------------------------------------------------------


def test_fp32_gradients_differ_only_through_subnormals_and_are_then_closer_to_fp64() -> None:
    """The one allowed difference from plain backward in fp32 (README_issue19.md): where a gradient at
    scale 1 lies in fp32's subnormal range (below 2^-126), plain rounding loses bits that the scaled
    gradient keeps. Then GS's gradients differ, and are closer to the fp64 gradients; with the same
    model out of that range they are bit-exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(64, 16)

    def loss(factor: float, net: nn.Module = model, inputs: torch.Tensor = x) -> torch.Tensor:
        return net(inputs).pow(2).sum() * factor

    for factor, exact in ((2.0**-10, True), (2.0**-140, False)):
        plain = _plain_grads(model, lambda: loss(factor))
        scaler = GradientScaler(model)
        scaler.backward(loss(factor))
        scaled = _grads(model)
        model.zero_grad(set_to_none=True)
        assert all(torch.equal(scaled[n], plain[n]) for n in plain) == exact
        if exact:
            continue
        reference = copy.deepcopy(model).double()
        loss(factor, reference, x.double()).backward()
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            assert (scaled[name].double() - r.grad).norm() <= (plain[name].double() - r.grad).norm(), name


# --- Item 4: non-reentrant checkpointing -----------------------------------------------------


class BertAttention(nn.Module):
    """BERT's self-attention written with ``matmul`` (two ``bmm``s whose operands are both activations)."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, dim = x.shape
        q, k, v = self.qkv(x).view(n, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        probs = torch.softmax(q @ k.transpose(-1, -2) / (dim // self.heads) ** 0.5, dim=-1)
        return x + self.out((probs @ v).transpose(1, 2).reshape(n, length, dim))


def test_checkpointed_attention_keeps_its_layers_and_says_what_it_could_not_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under non-reentrant checkpointing, ``layers()`` names what the unchecked model names. GEMMs with a
    parameter operand decide as unchecked without their weight-gradient probes (their inputs are not
    readable); the attention ``bmm``s (both operands activations, unreadable) pass their scale through,
    reported with scale 1 and a NaN rate (README_issue19.md)."""
    x, y = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3)), torch.arange(10) % 4
    layers = {}
    for checkpointed in (False, True):
        if not checkpointed:  # the unchecked model, reading no more than checkpointing lets it
            weight_probes_only_where(monkeypatch, lambda name: not name.startswith("attention."))
        else:
            monkeypatch.undo()
        torch.manual_seed(0)
        attention, head = BertAttention(), nn.Linear(16, 4)
        model = nn.ModuleDict({"attention": attention, "head": head})

        def loss() -> torch.Tensor:
            h = checkpoint(attention, x, use_reentrant=False) if checkpointed else attention(x)
            return F.cross_entropy(head(h).flatten(0, 1), y)

        plain = _plain_grads(model, loss)
        scaler = GradientScaler(model)
        scaler.backward(loss())
        assert all(torch.equal(g, plain[n]) for n, g in _grads(model).items())
        layers[checkpointed] = {layer.name: layer for layer in scaler.layers()}
    assert layers[True].keys() == layers[False].keys() and {"Bmm", "Bmm#2"} <= layers[True].keys()
    for name, layer in layers[True].items():
        if name.startswith("Bmm"):
            assert layer.log2_scale == 0 and layer.underflow_rate != layer.underflow_rate
        else:
            assert layer.log2_scale == layers[False][name].log2_scale, name
