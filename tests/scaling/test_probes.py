"""Probes (issue #8, items 2-3): exact fp32 slices of the gradients GEMM, attention and RNN nodes send on.

Each probe is checked against the real fp32 backward: with a budget that covers everything it
must reproduce the whole gradient; with a small one, every value it returns must be one of the
gradient's. Scales read off probes must then keep the real gradient's underflow ≤ 2γ'.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from gs_lightning.scaling import probes, underflow
from gs_lightning.scaling.operators import Role, operator, registry
from gs_lightning.scaling.recipe import ScalingRecipe

LAMBDA = 2.0**-14
TARGET = 1e-3
EVERYTHING = 2**30
BUDGET = ScalingRecipe().probe_elements  # what a scaler's probes compute


def _probe_at(
    output: torch.Tensor,
    grad: torch.Tensor,
    edge: int,
    elements: int = EVERYTHING,
    operand=None,
    scores_elements: int | None = None,
):
    """Backward ``grad`` through ``output``, probing its node on the way; returns the probe."""
    node, result = output.grad_fn, []
    node.register_prehook(
        lambda grads: result.append(probes.probe(node, grads[0], edge, operand, elements, scores_elements))
    )
    output.backward(grad)
    return result[0]


def _assert_subset(sample: torch.Tensor, exact: torch.Tensor, elements: int) -> None:
    """Every probed value is one of the exact gradient's (to fp32 rounding), and there are few enough."""
    assert 0 < sample.numel() <= elements
    exact = exact.detach().reshape(-1)
    tolerance = 1e-5 * exact.abs().max()
    nearest = (sample.reshape(-1, 1) - exact.reshape(1, -1)).abs().min(dim=1).values
    assert nearest.max() <= tolerance


_CONVOLUTIONS = [
    # (dims, transposed, groups, stride, padding, dilation, output_padding)
    (1, False, 1, 1, 0, 1, 0),
    (1, True, 2, 2, 1, 1, 1),
    (2, False, 1, 2, 1, 1, 0),
    (2, False, 2, 1, 2, 2, 0),
    (2, False, 4, 1, 1, 1, 0),  # depthwise
    (2, True, 1, 2, 1, 1, 1),
    (2, True, 2, 3, 0, 2, 2),
    (3, False, 2, 2, 1, 1, 0),
    (3, True, 1, 2, 0, 1, 1),
]


@pytest.mark.parametrize(
    ("dims", "transposed", "groups", "stride", "padding", "dilation", "output_padding"), _CONVOLUTIONS
)
def test_convolution_probe_is_the_input_gradient(
    dims, transposed, groups, stride, padding, dilation, output_padding
) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, *[6] * dims, generator=generator, requires_grad=True)
    shape = (4, 8 // groups) if transposed else (8, 4 // groups)
    weight = torch.randn(*shape, *[3] * dims, generator=generator)
    kwargs = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    conv = getattr(F, f"conv_transpose{dims}d" if transposed else f"conv{dims}d")
    if transposed:
        kwargs["output_padding"] = output_padding
    y = conv(x, weight, **kwargs)
    grad = torch.randn(y.shape, generator=generator)
    whole = _probe_at(y, grad, 0)
    exact, x.grad = x.grad, None
    torch.testing.assert_close(whole, exact, rtol=1e-5, atol=1e-5)
    small = 2 * x[0, 0].numel()  # two (sample, channel) maps of the twelve
    sample = _probe_at(conv(x, weight, **kwargs), grad, 0, elements=small)
    _assert_subset(sample, exact, small)


def test_one_sample_larger_than_the_budget_is_thinned() -> None:
    x = torch.randn(2, 3, 40, 40, requires_grad=True)
    y = F.conv2d(x, torch.randn(5, 3, 3, 3), padding=1)
    sample = _probe_at(y, torch.randn(y.shape), 0, elements=500)  # one channel map has 1600 values
    _assert_subset(sample, x.grad, 500)


def _matmul_cases():
    g = torch.Generator().manual_seed(1)
    a2, b2 = torch.randn(6, 5, generator=g), torch.randn(5, 7, generator=g)
    a3, b3 = torch.randn(3, 6, 5, generator=g), torch.randn(3, 5, 7, generator=g)
    return [
        ("addmm", lambda a, b: torch.addmm(torch.ones(7), a, b, alpha=2.0), a2, b2, (1, 2)),
        ("mm", torch.mm, a2, b2, (0, 1)),
        ("bmm", torch.bmm, a3, b3, (0, 1)),
        ("baddbmm", lambda a, b: torch.baddbmm(torch.ones(3, 6, 7), a, b, alpha=0.5), a3, b3, (1, 2)),
    ]


@pytest.mark.parametrize(("name", "op", "left", "right", "edges"), _matmul_cases(), ids=[c[0] for c in _matmul_cases()])
def test_matmul_probes_are_the_operand_gradients(name, op, left, right, edges) -> None:
    grad = torch.randn(op(left, right).shape, generator=torch.Generator().manual_seed(2))
    for edge, wanted in zip(edges, ("left", "right")):
        a, b = left.clone().requires_grad_(), right.clone().requires_grad_()
        probe = _probe_at(op(a, b), grad, edge)
        exact = a.grad if wanted == "left" else b.grad
        torch.testing.assert_close(probe.reshape(exact.shape), exact, rtol=1e-6, atol=1e-6)
        a.grad = b.grad = None
        _assert_subset(_probe_at(op(a, b), grad, edge, elements=8), exact, 8)


def test_linear_probe_with_the_weight_passed_in_saved_layout() -> None:
    """The core passes the operand as the node saved it: for Linear, addmm's mat2 is the weight transposed."""
    layer = nn.Linear(32, 16)
    x = torch.randn(64, 32, requires_grad=True)
    grad = torch.randn(64, 16)
    probe = _probe_at(layer(x), grad, 1, operand=layer.weight.detach().t())
    torch.testing.assert_close(probe.reshape(x.shape), x.grad, rtol=1e-6, atol=1e-6)


def test_probe_spreads_over_all_samples_and_columns() -> None:
    """A Latin-square slice: with budget for 1/8 of ∇X it still sees every row and every column."""
    rows, columns = 64, 128
    grad = torch.zeros(rows, 4)
    grad[:, 0] = 2.0 ** torch.arange(rows).float()
    weight = torch.zeros(columns, 4)  # addmm's mat2 layout: (columns, N)
    weight[:, 0] = 2 * torch.arange(columns).float() + 1
    sample = probes._left_grad(grad, weight, 1.0, rows * columns // 8)
    assert sample.numel() <= rows * columns // 8
    # ∇X[r, c] = 2^r (2c + 1): r and c are read back off each value, exactly.
    values = [int(v) for v in sample.tolist()]
    seen_rows = {(v & -v).bit_length() - 1 for v in values}
    seen_columns = {(v // (v & -v) - 1) // 2 for v in values}
    assert seen_rows == set(range(rows))
    assert seen_columns == set(range(columns))


_ATTENTION = [
    # (is_causal, mask, grouped-query)
    (False, None, False),
    (True, None, False),
    (False, "bool", False),
    (False, "float", False),
    (True, None, True),
]


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "row-by-row"])
@pytest.mark.parametrize(("is_causal", "mask", "gqa"), _ATTENTION)
def test_attention_probe_is_the_math_backward(is_causal, mask, gqa, chunked) -> None:
    scores_elements = 1 if chunked else None  # score matrices of one query row at a time, as for long sequences
    generator = torch.Generator().manual_seed(3)
    kv_heads = 2 if gqa else 4
    q = torch.randn(2, 4, 5, 8, generator=generator)
    k, v = torch.randn(2, kv_heads, 7, 8, generator=generator), torch.randn(2, kv_heads, 7, 8, generator=generator)
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(5, 7, generator=generator) > 0.3
        attn_mask[:, 0] = True
    elif mask == "float":
        attn_mask = torch.randn(2, 1, 5, 7, generator=generator)
    grad = torch.randn(2, 4, 5, 8, generator=generator)

    def attention(backend: SDPBackend):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(*inputs, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=gqa)
        return out, inputs

    out, inputs = attention(SDPBackend.MATH)
    out.backward(grad)
    reference = [t.grad for t in inputs]
    for edge in range(3):
        out, inputs = attention(SDPBackend.FLASH_ATTENTION)
        assert operator(type(out.grad_fn).__name__).role is Role.ATTENTION
        probe = _probe_at(out, grad, edge, scores_elements=scores_elements)
        torch.testing.assert_close(probe, reference[edge], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(probe, inputs[edge].grad, rtol=1e-5, atol=1e-5)
        out, _ = attention(SDPBackend.FLASH_ATTENTION)
        sample = _probe_at(out, grad, edge, elements=7 * 8, scores_elements=scores_elements)
        _assert_subset(sample, reference[edge], 7 * 8)  # one head's rows, or fewer


class _Saved:
    """Stands for a SavedVariable without an unpack hook."""

    unpack_hook = None


def _fake_node(type_name: str, **saved) -> object:
    """A stand-in for a CUDA-only autograd node, its saved fields named as derivatives.yaml names them."""
    node = type(type_name, (), {})()
    for name, value in saved.items():
        setattr(node, f"_saved_{name}", value)
        if isinstance(value, torch.Tensor) or value is None:
            setattr(node, f"_raw_saved_{name}", _Saved())
        elif isinstance(value, list):
            setattr(node, f"_raw_saved_{name}", [_Saved() for _ in value])
    return node


@pytest.mark.parametrize("edge", [0, 1, 2])
def test_attention_with_dropout_probes_values_of_the_same_distribution(edge: int) -> None:
    """CUDA kernels draw dropout masks inside: the probe draws its own, and its scale holds for the real one."""
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(8, 4, 64, 16, generator=generator) for _ in range(3))
    grad = torch.randn(8, 4, 64, 16, generator=generator) * 2.0**-24
    node = _fake_node(
        "ScaledDotProductEfficientAttentionBackward0",
        query=q,
        key=k,
        value=v,
        attn_bias=None,
        dropout_p=0.3,
        is_causal=False,
        scale=None,
    )
    sample = probes.probe(node, grad, edge, None, elements=2**14)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(0)
    with sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(*inputs, dropout_p=0.3).backward(grad)
    exact = inputs[edge].grad
    assert sample.numel() <= 2**14
    k = underflow.choose_log2_scale(underflow.sample_min_log2_scale(sample, LAMBDA, TARGET), math.inf)
    assert underflow.sample_underflow_rate(exact, k, LAMBDA) <= 2 * TARGET
    exact_k = underflow.choose_log2_scale(underflow.sample_min_log2_scale(exact, LAMBDA, TARGET), math.inf)
    assert abs(k - exact_k) <= 1  # the same law: about the scale the real values call for


def test_saved_tensors_owned_by_checkpointing_are_left_alone() -> None:
    """Non-reentrant checkpointing unpacks saved tensors once: the probe must not read them first."""
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    y = checkpoint(layer, x, use_reentrant=False)
    assert _probe_at(y, torch.ones_like(y), 1) is None
    reference = torch.ones(4, 8) @ layer.weight
    torch.testing.assert_close(x.grad, reference)  # and the backward itself was untouched


def test_unsupported_nodes_and_edges_give_none() -> None:
    x = torch.randn(3, 3, requires_grad=True)
    assert _probe_at(torch.mm(x, x.detach()), torch.ones(3, 3), 5) is None
    assert _probe_at(x.exp(), torch.ones(3, 3), 0) is None
    probed = {name for name, op in registry().items() if op.probe is not None}
    assert {"ConvolutionBackward0", "AddmmBackward0", "ScaledDotProductFlashAttentionForCpuBackward0"} <= probed


# --- fused RNNs ------------------------------------------------------------------------------------


def _nodes_named(root, name: str) -> list:
    found, seen, stack = [], set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == name:
            found.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


@pytest.mark.parametrize(("bidirectional", "batch_first"), [(False, False), (True, True)])
def test_onednn_lstm_probe_is_the_input_and_state_gradient(bidirectional: bool, batch_first: bool) -> None:
    generator = torch.Generator().manual_seed(4)
    lstm = nn.LSTM(6, 8, bidirectional=bidirectional, batch_first=batch_first)
    directions = 2 if bidirectional else 1
    x = torch.randn(5, 7, 6, generator=generator, requires_grad=True)
    h0 = torch.randn(directions, 5 if batch_first else 7, 8, generator=generator, requires_grad=True)
    c0 = torch.randn_like(h0, requires_grad=True)
    y, (h, c) = lstm(x, (h0, c0))
    nodes = _nodes_named(y.grad_fn, "MkldnnRnnLayerBackward0")
    assert len(nodes) == directions and operator("MkldnnRnnLayerBackward0").probed_edges == (0, 5, 6)
    results = {}
    for node in nodes:
        node.register_prehook(
            lambda grads, node=node: results.update(
                {(node, e): probes.rnn_probe(node, grads, e, BUDGET) for e in (0, 5, 6)}
            )
        )
    torch.autograd.backward([y, h, c], [torch.randn(t.shape, generator=generator) for t in (y, h, c)])
    input_grad = sum(results[(node, 0)] for node in nodes)  # time-major, summed over directions
    torch.testing.assert_close(input_grad, x.grad.transpose(0, 1) if batch_first else x.grad, rtol=1e-5, atol=1e-6)
    states = sorted(nodes, key=lambda n: n._saved_reverse)  # forward direction first, as in h0
    torch.testing.assert_close(torch.stack([results[(n, 5)] for n in states]), h0.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack([results[(n, 6)] for n in states]), c0.grad, rtol=1e-5, atol=1e-6)


def _fake_cudnn_node(rnn: nn.RNNBase, x: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor | None, mode: int):
    """A stand-in for CUDA's CudnnRnnBackward0."""
    return _fake_node(
        "CudnnRnnBackward0",
        input=x,
        weight=list(rnn._flat_weights),
        hx=hx,
        cx=cx,
        mode=mode,
        hidden_size=rnn.hidden_size,
        proj_size=rnn.proj_size,
        num_layers=rnn.num_layers,
        batch_first=rnn.batch_first,
        dropout=rnn.dropout,
        train=True,
        bidirectional=rnn.bidirectional,
        batch_sizes=(),
    )


@pytest.mark.parametrize(
    ("cls", "kwargs", "mode"),
    [(nn.GRU, {}, 3), (nn.LSTM, {"proj_size": 3}, 2), (nn.RNN, {"nonlinearity": "relu"}, 0), (nn.RNN, {}, 1)],
    ids=["gru", "lstm-proj", "rnn-relu", "rnn-tanh"],
)
def test_cudnn_rnn_probe_recomputes_the_whole_stack(cls, kwargs, mode) -> None:
    generator = torch.Generator().manual_seed(5)
    rnn = cls(4, 8, num_layers=2, bidirectional=True, batch_first=True, **kwargs)
    x = torch.randn(6, 5, 4, generator=generator, requires_grad=True)
    hx = torch.randn(4, 6, 3 if kwargs.get("proj_size") else 8, generator=generator)
    cx = torch.randn(4, 6, 8, generator=generator) if cls is nn.LSTM else None
    y, _ = rnn(x, (hx, cx)) if cx is not None else rnn(x, hx)
    grad = torch.randn(y.shape, generator=generator)
    y.backward(grad)
    node = _fake_cudnn_node(rnn, x.detach(), hx, cx, mode)
    probe = probes.rnn_probe(node, (grad, None, None), 0, BUDGET)
    torch.testing.assert_close(probe, x.grad.transpose(0, 1), rtol=1e-5, atol=1e-6)
    node._saved_dropout = 0.2  # between layers, drawn inside cuDNN: cannot be replayed
    assert probes.rnn_probe(node, (grad, None, None), 0, BUDGET) is None


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_rnn_probe_scale_meets_target_on_the_real_input_gradient(cls) -> None:
    """The RNN decision: a scale read off a probe of 1/8 of the sequences keeps ∇x's underflow ≤ 2γ'."""
    generator = torch.Generator().manual_seed(6)
    rnn = cls(16, 32)
    x = torch.randn(12, 128, 16, generator=generator, requires_grad=True)
    y, _ = rnn(x)
    grad = torch.randn(y.shape, generator=generator) * 2.0**-24
    budget = 12 * 16 * 16
    if cls is nn.LSTM:  # on CPU a fused oneDNN node
        (node,) = _nodes_named(y.grad_fn, "MkldnnRnnLayerBackward0")
        samples = []
        node.register_prehook(lambda grads: samples.append(probes.rnn_probe(node, grads, 0, elements=budget)))
        y.backward(grad)
        sample = samples[0]
    else:  # GRU is fused only by cuDNN
        y.backward(grad)
        node = _fake_cudnn_node(rnn, x.detach(), torch.zeros(1, 128, 32), None, 3)
        sample = probes.rnn_probe(node, (grad, None, None), 0, elements=budget)
    assert sample.numel() <= budget
    k = underflow.choose_log2_scale(underflow.sample_min_log2_scale(sample, LAMBDA, TARGET), math.inf)
    assert k > 0
    assert underflow.sample_underflow_rate(x.grad, k, LAMBDA) <= 2 * TARGET


def test_probes_ignore_autocast_around_the_backward() -> None:
    """A backward run inside autocast must not make the probe's fp32 arithmetic low precision."""
    x = torch.randn(16, 64, requires_grad=True)
    w = torch.randn(64, 32)
    y = torch.mm(x, w)
    node, result = y.grad_fn, []
    node.register_prehook(lambda grads: result.append(probes.probe(node, grads[0], 0, None, BUDGET)))
    grad = torch.randn(16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y.backward(grad)
    assert result[0].dtype == torch.float32
    torch.testing.assert_close(result[0].reshape(x.shape), grad @ w.t(), rtol=1e-6, atol=1e-6)
