"""Exact fp32 values of the gradients a GEMM-like node sends on, and of its weight gradient, on a bounded slice.

On scale-update iterations the scale of a GEMM's output gradient can be read off the values
themselves (:func:`~gs_lightning.scaling.underflow.sample_min_log2_scale`) instead of a model
that assumes Gaussian operands. A probe recomputes part of the node's outgoing gradient from its
incoming gradient and saved operands, in fp32; each value is the exact fp32 result for its element.

Which part: underflow concentrates in some samples (those the loss already fits well, sparse
rows of ∇Y) and, for short sums, in some columns (∇X ≈ ∇Y_r · W_c). So the slice takes every
batch element (and position) the budget allows, splits them into groups and gives each group its
own strided set of columns (channels, features), so that together they cover all columns: a
Latin-square-like design whose values behave much like independent draws. The cost is about
``elements × N`` multiply-adds, at least one sample's worth (one channel map, one attention head,
one sequence); the values returned are thinned with a stride to at most ``elements``.

A weight gradient sums over the whole batch and every position: its slice is whole output
channels (convolutions) or a block of rows × columns (matrix products), each value exact, and
smaller (:func:`weight_probe_elements`).

Saved tensors are read only through :func:`~gs_lightning.scaling.graph.saved_tensor`, which
refuses those an unpack hook owns (checkpointing); a probe then returns ``None``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch.autograd.graph import Node

from gs_lightning.scaling.graph import saved_function_tensor, saved_tensor
from gs_lightning.scaling.operators import Role, operator


def weight_probe_elements(grad: torch.Tensor, elements: int, macs: int) -> int:
    """How many weight-gradient values a probe may compute from the incoming ``grad`` (channels on dim 1):
    at most ``elements``, each summing over the batch and every position, ``macs`` multiply-adds in all (the
    recipe's :attr:`~gs_lightning.scaling.recipe.ScalingRecipe.weight_probe_elements` and
    :attr:`~gs_lightning.scaling.recipe.ScalingRecipe.weight_probe_macs`)."""
    summed = grad.numel() // grad.shape[1] if grad.dim() > 1 and grad.shape[1] else 1  # batch × positions
    return max(1, min(elements, macs // max(1, summed)))


def probe(
    node: Node,
    grad: torch.Tensor,
    edge: int,
    operand: torch.Tensor | None,
    elements: int,
    scores_elements: int | None = None,
) -> torch.Tensor | None:
    """Exact fp32 values of a slice of the gradient ``node`` sends along ``edge``.

    Args:
        node: A GEMM or fused attention node with a probe in the registry
            (:attr:`~gs_lightning.scaling.operators.Operator.probe`).
        grad: The gradient arriving at the node's slot 0 (at its current scale, any dtype).
        edge: Index in ``node.next_functions`` of the outgoing gradient wanted.
        operand: The other GEMM operand, laid out as the node saved it (e.g. ``mat2`` of an
            ``addmm``, which for ``Linear`` is the weight transposed), or ``None`` to read the
            saved one. Unused by attention nodes.
        elements: Upper bound on the number of values returned (the recipe's
            :attr:`~gs_lightning.scaling.recipe.ScalingRecipe.probe_elements`, or a weight-gradient budget).
        scores_elements: Fused attention: the largest score matrix built at once (longer sequences go in
            chunks of query rows, the same values); ``None``: :data:`SCORES_ELEMENTS`.

    Returns:
        At most ``elements`` fp32 values (flattened or not), or ``None`` when they
        cannot be computed (unsupported node or edge, unreadable saved tensors).
    """
    op = operator(type(node).__name__)
    if op is None or op.role not in (Role.GEMM, Role.ATTENTION) or grad is None:
        return None
    with torch.no_grad(), _fp32(grad.device):
        # Each probe converts to fp32 what it slices, not the whole gradient (two or three probes per node).
        if op.role is Role.ATTENTION:  # with its own budget for the score matrices
            return _at_most(op.probe(node, detached(grad), edge, elements, scores_elements), elements)
        return _at_most(op.probe(node, detached(grad), edge, operand, elements), elements)


def _at_most(values: torch.Tensor | None, elements: int) -> torch.Tensor | None:
    """``values`` as they are if few enough, else thinned with a stride (one sample can exceed the budget)."""
    if values is None or values.numel() <= elements:
        return values
    return values.reshape(-1)[:: math.ceil(values.numel() / elements)]


def _fp32(device: torch.device) -> torch.autocast | contextlib.nullcontext:
    """No autocast around a probe's arithmetic: its fp32 must stay fp32 (a backward may run inside autocast).

    Where autocast is off already, nothing to enter (entering and leaving it costs ~10 µs per probe).
    """
    return (
        torch.autocast(device.type, enabled=False)
        if torch.is_autocast_enabled(device.type)
        else contextlib.nullcontext()
    )


# --- Subsets -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _counts(sizes: tuple[int, ...], budget: int) -> tuple[int, ...]:
    """How many indices to take along each axis: product ≤ budget, spread as evenly as the sizes allow.

    Cached: every update asks again for the same layers' shapes.
    """
    counts = [1] * len(sizes)
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    for position, axis in enumerate(order):
        remaining = len(sizes) - position
        counts[axis] = max(1, min(sizes[axis], math.floor(budget ** (1.0 / remaining) + 1e-9)))
        budget = max(1, budget // counts[axis])
    return tuple(counts)


def _sample_counts(samples: tuple[int, ...], columns: int, budget: int) -> tuple[tuple[int, ...], int]:
    """Counts along the sample axes (batch, positions) and along the column axis (features).

    Gradients differ most between samples (a well-fit sample's are tiny; a sparse ∇Y row gives a
    row of ∇X scaled by its few values): values within a sample are correlated, so the slice
    takes every sample the budget allows and, for each, a few strided columns (√budget / 4, more
    if samples are few).
    """
    columns_wanted = min(columns, max(1, math.isqrt(budget) // 4))
    counts = _counts(samples, max(1, budget // columns_wanted))
    return counts, min(columns, max(1, budget // math.prod(counts)))


@functools.lru_cache(maxsize=4096)
def _spread(size: int, count: int, device: torch.device, shift: int = 0, shifts: int = 1) -> torch.Tensor:
    """``count`` indices evenly spread over ``range(size)``, deterministic (never write to the result).

    The ``shift``-th of ``shifts`` such sets is offset by that fraction of the spacing: together
    the sets cover ``min(size, count · shifts)`` distinct indices. Cached: every update asks for
    the same sets, and building one takes five small kernels.
    """
    return (torch.arange(count, device=device) * size + shift * size // shifts) // count % size


def _take(tensor: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``tensor.index_select(dim, index)``, without the copy when ``index`` is every index in order
    (a spread of all of an axis is: weights are large, and most probes take all their groups)."""
    if index.numel() == tensor.shape[dim]:
        return tensor
    return tensor.index_select(dim, index)


def _shifts(samples: int, columns: int, count: int) -> int:
    """Into how many groups to split the chosen samples so that the groups' column sets cover all columns.

    (The Latin-square-like slice of the module docstring: for short sums ∇X ≈ ∇Y_r · W_c, and one
    block of a few columns would see only a few of the W_c.)
    """
    return max(1, min(samples, math.ceil(columns / count)))


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else detached(tensor)


def _float(tensor: torch.Tensor | None) -> torch.Tensor | None:
    detached_ = _detached(tensor)
    return None if detached_ is None else detached_.float()


def detached(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` cut from autograd; without the ``detach`` kernel where nothing needs it: a gradient in a
    backward hook does not require grad (only parameters do), and with grad mode off (in a probe, in a
    backward that creates no graph) nothing computed from a parameter is recorded."""
    return tensor.detach() if tensor.requires_grad and torch.is_grad_enabled() else tensor


# --- Matrix products ---------------------------------------------------------------------------


def _left_grad(grad: torch.Tensor, right: torch.Tensor, alpha: float, elements: int) -> torch.Tensor:
    """A slice of ∇A = α ∇Y Bᵀ for Y = A B (leading batch dimensions allowed), in fp32 whatever the inputs' dtypes."""
    grad, right = grad.reshape(-1, *grad.shape[-2:]), right.reshape(-1, *right.shape[-2:])
    batch, rows, cols = grad.shape[0], grad.shape[1], right.shape[1]
    (b, r), c = _sample_counts((batch, rows), cols, elements)
    bi, ri = _spread(batch, b, grad.device), _spread(rows, r, grad.device)
    shifts = _shifts(r, cols, c)
    if (b, r) == (batch, rows):
        # Every row: the node's own product (no slicing kernels, no gather of a weight's columns, which
        # took 0.3 s per group for VGG's 25088x4096 classifier), then each group's columns of it.
        full = grad.float() @ right.float().transpose(-1, -2)
        if c == cols:
            return _times(alpha, full)
        blocks = [_take(full[:, ri[t::shifts]], 2, _spread(cols, c, grad.device, t, shifts)) for t in range(shifts)]
    else:
        grad, right = _take(grad, 0, bi), _take(right, 0, bi)  # no copy of a whole weight (its batch axis has size 1)
        blocks = [
            grad[:, ri[t::shifts]].float()
            @ right[:, _spread(cols, c, grad.device, t, shifts)].float().transpose(-1, -2)
            for t in range(shifts)
        ]
    return _times(alpha, blocks[0] if shifts == 1 else torch.cat([block.reshape(-1) for block in blocks]))


def _right_grad(grad: torch.Tensor, left: torch.Tensor, alpha: float, elements: int) -> torch.Tensor:
    """A slice of ∇B = α Aᵀ ∇Y for Y = A B (leading batch dimensions allowed), in fp32 whatever the inputs' dtypes."""
    grad, left = grad.reshape(-1, *grad.shape[-2:]), left.reshape(-1, *left.shape[-2:])
    batch, rows, cols = grad.shape[0], left.shape[2], grad.shape[2]
    b, r, c = _counts((batch, rows, cols), elements)
    bi, ri, ci = _spread(batch, b, grad.device), _spread(rows, r, grad.device), _spread(cols, c, grad.device)
    return _times(alpha, _take(left, 0, bi)[:, :, ri].float().transpose(-1, -2) @ _take(grad, 0, bi)[:, :, ci].float())


def _times(alpha: float, values: torch.Tensor) -> torch.Tensor:
    """``alpha · values``, without a kernel for the usual α = 1 (the product would be the same values)."""
    return values if alpha == 1.0 else alpha * values


def _matmul_probe(left_edge: int, right_edge: int, left: str, right: str) -> Callable:
    """Probe for a node computing Y = (β·bias +) α·left·right, ``left``/``right`` being saved names."""

    def compute(
        node: Node, grad: torch.Tensor, edge: int, operand: torch.Tensor | None, elements: int
    ) -> torch.Tensor | None:
        alpha = float(getattr(node, "_saved_alpha", 1.0))
        if edge == left_edge:
            other = _detached(operand if operand is not None else saved_tensor(node, right))
            return None if other is None else _left_grad(grad, other, alpha, elements)
        if edge == right_edge:
            other = _detached(operand if operand is not None else saved_tensor(node, left))
            return None if other is None else _right_grad(grad, other, alpha, elements)
        return None

    return compute


# --- Convolutions ------------------------------------------------------------------------------


def _edge_shape(node: Node, edge: int) -> torch.Size | None:
    """Shape of the gradient ``node`` sends along ``edge``, from the receiving node's metadata."""
    target, slot = node.next_functions[edge]
    return None if target is None else target._input_metadata[slot].shape


def _convolution(
    node: Node, grad: torch.Tensor, edge: int, operand: torch.Tensor | None, elements: int
) -> torch.Tensor | None:
    """∇X (edge 0) or ∇W (edge 1) of a convolution: :func:`_convolution_input` or :func:`_convolution_weight`."""
    if edge == 1:
        return _convolution_weight(node, grad, elements)
    return _convolution_input(node, grad, edge, operand, elements)


def _convolution_weight(node: Node, grad: torch.Tensor, elements: int) -> torch.Tensor | None:
    """∇W of a (transposed, grouped, 1/2/3-d) convolution for a subset of its output channels, each whole.

    The subset: output channels evenly spread (whole groups, for a grouped convolution), each
    summed over the whole batch, as the node sums it.
    """
    # to fp32 once sliced
    inputs, weight = (
        _detached(saved_tensor(node, "input")),
        _detached(saved_tensor(node, "weight")),
    )
    if inputs is None or weight is None:
        return None
    groups, transposed = node._saved_groups, node._saved_transposed
    args = (node._saved_stride, node._saved_padding, node._saved_dilation, transposed, node._saved_output_padding)
    if weight.numel() > elements and groups > 1:  # whole groups: a grouped convolution of the chosen ones
        chosen = max(1, elements * groups // weight.numel())
        index = _spread(groups, chosen, grad.device)
        grad = _take(grad.unflatten(1, (groups, -1)), 1, index).flatten(1, 2)
        inputs = _take(inputs.unflatten(1, (groups, -1)), 1, index).flatten(1, 2)
        weight = _take(weight.unflatten(0, (groups, -1)), 0, index).flatten(0, 1)
        groups = chosen
    elif weight.numel() > elements:  # output channels index dim 1 of a transposed conv's weight, dim 0 of a conv's
        dim = 1 if transposed else 0
        index = _spread(weight.shape[dim], max(1, elements * weight.shape[dim] // weight.numel()), grad.device)
        grad, weight = _take(grad, 1, index), _take(weight, dim, index)
    return torch.ops.aten.convolution_backward(
        grad.float(), inputs.float(), weight.float(), None, *args, groups, [False, True, False]
    )[1]


def _convolution_input(
    node: Node, grad: torch.Tensor, edge: int, operand: torch.Tensor | None, elements: int
) -> torch.Tensor | None:
    """∇X of a (transposed, grouped, 1/2/3-d) convolution for a subset of batch elements × input channels.

    The subset is itself a grouped convolution: the chosen groups, and in each the same chosen
    input channels, with the weights and output channels of those groups.
    """
    weight = _float(operand if operand is not None else saved_tensor(node, "weight"))
    shape = _edge_shape(node, 0)
    if edge != 0 or weight is None or shape is None:
        return None
    groups, transposed = node._saved_groups, node._saved_transposed
    batch, channels, spatial = shape[0], shape[1], shape[2:]
    per_group = channels // groups
    (b,), pairs = _sample_counts((batch,), channels, max(1, elements // max(1, math.prod(spatial))))
    g, c = _counts((groups, per_group), pairs)
    stride, padding, dilation, output_padding = (
        node._saved_stride,
        node._saved_padding,
        node._saved_dilation,
        node._saved_output_padding,
    )
    if (b, g, c) == (batch, groups, per_group):  # all of ∇X: the node's own product, without index or view kernels
        grad = grad.float().contiguous()  # as the copy an index kernel makes
        inputs = grad.new_empty(shape)  # only its shape is read
        return torch.ops.aten.convolution_backward(
            grad,
            inputs,
            weight,
            None,
            stride,
            padding,
            dilation,
            transposed,
            output_padding,
            groups,
            [True, False, False],
        )[0]
    kernel = weight.shape[2:]
    # Input channels index dim 0 of a transposed conv's weight, dim 1 of a conv's.
    weight = (
        weight.reshape(groups, per_group, -1, *kernel) if transposed else weight.reshape(groups, -1, per_group, *kernel)
    )
    grad = grad[_spread(batch, b, grad.device)].reshape(b, groups, -1, *grad.shape[2:])
    shifts = _shifts(b, channels, g * c)
    blocks = []
    for t in range(shifts):
        gi, ci = _spread(groups, g, grad.device, t, shifts), _spread(per_group, c, grad.device, t, shifts)
        chosen = _take(weight, 0, gi)
        if transposed:  # (g, C_in/g, C_out/g, k) -> chosen groups × chosen channels
            chosen = _take(chosen, 1, ci).reshape(g * c, -1, *kernel)
        else:  # (g, C_out/g, C_in/g, k)
            chosen = _take(chosen, 2, ci).reshape(-1, c, *kernel)
        grad_t = _take(grad[t::shifts], 1, gi).flatten(1, 2).float()
        grad_input, _, _ = torch.ops.aten.convolution_backward(
            grad_t,
            grad_t.new_empty((grad_t.shape[0], g * c, *spatial)),  # only its shape is read
            chosen,
            None,
            stride,
            padding,
            dilation,
            transposed,
            output_padding,
            g,
            [True, False, False],
        )
        blocks.append(grad_input)
    return blocks[0] if shifts == 1 else torch.cat([block.reshape(-1) for block in blocks])


def _deform_convolution(
    node: Node, grad: torch.Tensor, edge: int, operand: torch.Tensor | None, elements: int
) -> torch.Tensor | None:
    """∇input of torchvision's ``deform_conv2d`` for a strided subset of batch elements (torchvision's own backward,
    in fp32)."""
    saved = [saved_function_tensor(node, k) for k in range(5)]  # input, weight, offset, mask, bias
    if edge != 0 or any(t is None for t in saved):
        return None
    inputs, weight, offset, mask, bias = (_detached(t) for t in saved)
    weight = _float(operand if operand is not None else weight)
    (b,) = _counts((inputs.shape[0],), max(1, elements // max(1, inputs[0].numel())))
    bi = _spread(inputs.shape[0], b, grad.device)
    inputs, offset, mask, grad = (t[bi].float() for t in (inputs, offset, mask, grad))
    grad_input, *_ = torch.ops.torchvision._deform_conv2d_backward(
        grad, inputs, weight, offset, mask, bias.float(),
        node.stride_h, node.stride_w, node.pad_h, node.pad_w, node.dilation_h, node.dilation_w,
        node.groups, node.offset_groups, node.use_mask,
    )  # fmt: skip
    return grad_input


# --- Fused attention ---------------------------------------------------------------------------

# Largest attention score matrix a probe builds at once (elements): long sequences go in chunks of query
# rows. Memory, not a rule: the values are the same whatever the chunks.
SCORES_ELEMENTS = 2**24


def _attention(
    node: Node, grad: torch.Tensor, edge: int, elements: int, scores_elements: int | None
) -> torch.Tensor | None:
    """∇query (edge 0), ∇key (1) or ∇value (2) of fused attention, on a subset of (batch, head[, row]).

    Recomputes math attention in fp32: P = softmax(q kᵀ · scale + mask), dV = (P ⊙ D)ᵀ dO,
    dP = dO Vᵀ ⊙ D, dS = P ⊙ (dP − rowsum(P ⊙ dP)), dQ = dS K · scale, dK = dSᵀ Q · scale, with D
    the dropout mask over 1 − p (all ones without dropout). Key/value heads shared by several query
    heads (grouped-query attention) sum over their group.

    The kernel draws its dropout mask internally, so with dropout an independent mask of the same
    rate stands in: the values are then draws from the same distribution, not the same values.
    """
    if edge not in (0, 1, 2):
        return None
    dropout = float(getattr(node, "_saved_dropout_p", 0.0))
    query, key, value = (_detached(saved_tensor(node, name)) for name in ("query", "key", "value"))
    if query is None or key is None or value is None or query.dim() < 3:
        return None
    mask = None
    for name in ("attn_mask", "attn_bias"):
        if hasattr(node, f"_raw_saved_{name}"):
            mask = saved_tensor(node, name)
            if mask is None and getattr(node, f"_raw_saved_{name}").unpack_hook is not None:
                return None
    if mask is not None:
        mask = mask.expand(*query.shape[:-1], key.shape[-2])
    # Canonical (batch, heads, length, features): leading axes flattened, a missing heads axis is one head.
    query, key, value, grad, mask = (_heads_layout(t) for t in (query, key, value, grad, mask))
    batch, heads, length, features = query.shape
    kv_heads, kv_length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = node._saved_scale if getattr(node, "_saved_scale", None) is not None else 1.0 / math.sqrt(features)
    device = grad.device
    if edge == 0:  # rows of ∇query are independent: a strided subset of them
        b, h, r = _counts((batch, heads, length), max(1, elements // features))
        query_heads, query_rows = _spread(heads, h, device), _spread(length, r, device)
    else:  # a row of ∇key / ∇value sums over every query row
        b, h = _counts((batch, kv_heads), max(1, elements // (kv_length * features)))
        query_heads = (_spread(kv_heads, h, device)[:, None] * group + torch.arange(group, device=device)).reshape(-1)
        query_rows = torch.arange(length, device=device)
    bi = _spread(batch, b, device)
    q, do = query[bi][:, query_heads].float(), grad[bi][:, query_heads].float()
    k, v = key[bi][:, query_heads // group].float(), value[bi][:, query_heads // group].float()
    generator = torch.Generator(device=device).manual_seed(0) if dropout > 0.0 else None
    # Query rows in chunks, so that the score matrices stay under scores_elements.
    limit = SCORES_ELEMENTS if scores_elements is None else scores_elements
    chunk = max(1, limit // (q.shape[0] * q.shape[1] * kv_length))
    dq_rows, total = [], None
    for start in range(0, len(query_rows), chunk):
        rows = query_rows[start : start + chunk]
        scores = q[:, :, rows] @ k.transpose(-1, -2) * scale
        if mask is not None:
            chosen = mask[bi[:, None, None], query_heads[None, :, None], rows[None, None, :]]
            scores = scores.masked_fill(~chosen, -math.inf) if chosen.dtype == torch.bool else scores + chosen.float()
        if getattr(node, "_saved_is_causal", False):  # top-left aligned, as torch's math attention
            scores = scores.masked_fill(torch.arange(kv_length, device=device) > rows[:, None], -math.inf)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows have no gradient
        keep = None
        if generator is not None:
            keep = (torch.rand(probs.shape, generator=generator, device=device) >= dropout) / (1.0 - dropout)
        rows_do = do[:, :, rows]
        if edge == 2:
            part = (probs if keep is None else probs * keep).transpose(-1, -2) @ rows_do
        else:
            dp = rows_do @ v.transpose(-1, -2)
            if keep is not None:
                dp = dp * keep
            ds = probs * (dp - (dp * probs).sum(-1, keepdim=True))
            if edge == 0:
                dq_rows.append(ds @ k * scale)
                continue
            part = ds.transpose(-1, -2) @ q[:, :, rows] * scale
        total = part if total is None else total + part
    return torch.cat(dq_rows, dim=2) if edge == 0 else _sum_groups(total, group)


def _heads_layout(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    return tensor.reshape(-1, *tensor.shape[-3:]) if tensor.dim() > 3 else tensor.unsqueeze(1)


def _sum_groups(per_query_head: torch.Tensor, group: int) -> torch.Tensor:
    """Sum the contributions of the query heads that share one key/value head."""
    b, heads, *rest = per_query_head.shape
    return per_query_head.reshape(b, heads // group, group, *rest).sum(2)


# --- Fused recurrent layers --------------------------------------------------------------------

# cuDNN's and oneDNN's mode codes, and the cell computing one step in each mode.
_RNN_CELLS: dict[int, Callable] = {
    0: torch.rnn_relu_cell,
    1: torch.rnn_tanh_cell,
    2: torch.lstm_cell,
    3: torch.gru_cell,
}
_LSTM = 2


def rnn_probe(node: Node, grads: Sequence[torch.Tensor | None], edge: int, elements: int) -> torch.Tensor | None:
    """Exact fp32 values of a slice of the gradient a fused RNN node sends along ``edge``.

    The sequences of a batch are independent, so the node's whole recurrence (every layer,
    direction and time step) is recomputed in fp32 for a strided subset of them, and
    differentiated by autograd with the matching slices of the incoming gradients.

    Args:
        node: A fused RNN node (``MkldnnRnnLayerBackward0``: one
            layer and direction, on CPU; ``CudnnRnnBackward0``: the whole stack, on CUDA).
        grads: The gradients arriving at the node's slots (output, final hidden state, final cell
            state), ``None`` where none arrives; at their current scale, any dtype.
        edge: Index in ``node.next_functions``, one of the registry's ``probed_edges``: 0 for the input;
            5 / 6 (oneDNN only) for the initial hidden / cell state.
        elements: Upper bound on the number of values returned.

    Returns:
        At most ``elements`` fp32 values, or ``None`` when they cannot be computed
        (unreadable saved tensors, packed sequences, dropout between layers).
    """
    op = operator(type(node).__name__)
    if op is None or op.role is not Role.RNN or edge not in op.probed_edges or all(g is None for g in grads):
        return None
    spec = op.probe(node)  # where this kernel saved the recurrence's inputs and weights
    if spec is None:
        return None
    x, hx, cx, layers, mode, batch_first = spec
    if batch_first:
        x = x.transpose(0, 1)
    steps, batch, features = x.shape
    wanted_size = features if edge == 0 else hx.shape[-1] if edge == 5 else cx.shape[-1]
    (count,) = _counts((batch,), max(1, elements // (steps * wanted_size if edge == 0 else wanted_size)))
    index = _spread(batch, count, x.device)
    grad_output, grad_hy, grad_cy = (*grads, None, None)[:3]
    if grad_output is not None:
        grad_output = (grad_output.transpose(0, 1) if batch_first else grad_output)[:, index].float()
    # oneDNN's single-layer states have no layer axis: view them like cuDNN's (layers·directions, batch, size).
    grad_hy = None if grad_hy is None else grad_hy.reshape(hx.shape)[:, index].float()
    grad_cy = None if grad_cy is None else grad_cy.reshape(cx.shape)[:, index].float()
    with torch.enable_grad(), _fp32(x.device):
        x = x[:, index].float().requires_grad_()
        hx = hx[:, index].float().requires_grad_()
        cx = None if cx is None else cx[:, index].float().requires_grad_()
        output, hy, cy = _recurrence(x, hx, cx, layers, mode)
        pairs = [
            (t, g) for t, g in ((output, grad_output), (hy, grad_hy), (cy, grad_cy)) if g is not None and t is not None
        ]
        wanted = x if edge == 0 else hx if edge == 5 else cx
        (result,) = torch.autograd.grad([t for t, _ in pairs], [wanted], [g for _, g in pairs], allow_unused=True)
    result = torch.zeros_like(wanted) if result is None else result.detach()
    return _at_most(result if edge == 0 else result[0], elements)  # oneDNN's initial states have no layer axis


# (input, h0, c0, per layer: per direction: (weights, reverse), mode, batch_first)
_RnnSpec = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", list, int, bool]


def _mkldnn_spec(node: Node) -> _RnnSpec | None:
    tensors = [saved_tensor(node, name) for name in ("input", "hx_", "cx_", "weight0", "weight1", "weight2", "weight3")]
    if any(t is None for t in tensors):
        return None
    x, hx, cx, w_ih, w_hh, b_ih, b_hh = tensors
    weights = [w_ih, w_hh, b_ih, b_hh] if node._saved_has_biases else [w_ih, w_hh]
    mode = node._saved_mode
    # One layer, one direction; hx_/cx_ are its initial states. Its input is time-major whatever
    # the saved batch_first says (the module transposes before the layer).
    layers = [[(weights, bool(node._saved_reverse))]]
    return x, hx.unsqueeze(0), cx.unsqueeze(0) if mode == _LSTM else None, layers, mode, False


def _cudnn_spec(node: Node) -> _RnnSpec | None:
    if node._saved_batch_sizes or (node._saved_dropout > 0 and node._saved_train and node._saved_num_layers > 1):
        return None  # packed sequences; dropout masks drawn inside cuDNN
    raw = getattr(node, "_raw_saved_weight", None)
    x, hx = saved_tensor(node, "input"), saved_tensor(node, "hx")
    cx = saved_tensor(node, "cx") if node._saved_mode == _LSTM else None
    if raw is None or any(r.unpack_hook is not None for r in raw) or x is None or hx is None:
        return None
    if node._saved_mode == _LSTM and cx is None:
        return None
    weights = list(node._saved_weight)
    directions = 2 if node._saved_bidirectional else 1
    per = len(weights) // (node._saved_num_layers * directions)
    layers = [
        [
            (weights[(layer * directions + d) * per : (layer * directions + d + 1) * per], d == 1)
            for d in range(directions)
        ]
        for layer in range(node._saved_num_layers)
    ]
    return x, hx, cx, layers, node._saved_mode, node._saved_batch_first


def _recurrence(
    x: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor | None, layers: list, mode: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A (multi-layer, bidirectional) RNN in fp32, step by step, as ``nn.LSTM``/``nn.GRU``/``nn.RNN`` compute it.

    Weights per direction: w_ih, w_hh[, b_ih, b_hh][, w_hr] (w_hr: LSTM projection).
    """
    cell = _RNN_CELLS[mode]
    final_h, final_c = [], []
    for directions in layers:
        outputs = []
        for weights, reverse in directions:
            slot = len(final_h)
            w_ih, w_hh, *rest = (w.detach().float() for w in weights)
            biases = rest[:2] if len(rest) >= 2 else [None, None]
            projection = rest[-1] if len(rest) in (1, 3) else None
            h, c = hx[slot], None if cx is None else cx[slot]
            steps = []
            for t in reversed(range(x.shape[0])) if reverse else range(x.shape[0]):
                if projection is not None:  # torch.lstm_cell has no projection
                    h, c = _projected_lstm_step(x[t], h, c, w_ih, w_hh, *biases, projection)
                elif mode == _LSTM:
                    h, c = cell(x[t], (h, c), w_ih, w_hh, *biases)
                else:
                    h = cell(x[t], h, w_ih, w_hh, *biases)
                steps.append(h)
            if reverse:
                steps.reverse()
            outputs.append(torch.stack(steps))
            final_h.append(h)
            final_c.append(c)
        x = torch.cat(outputs, dim=-1)
    return x, torch.stack(final_h), None if cx is None else torch.stack(final_c)


def _projected_lstm_step(
    x: torch.Tensor,
    h: torch.Tensor,
    c: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
    w_hr: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    gates = x @ w_ih.t() + h @ w_hh.t()
    if b_ih is not None:
        gates = gates + b_ih + b_hh
    i, f, g, o = gates.chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return (torch.sigmoid(o) * torch.tanh(c)) @ w_hr.t(), c
