"""What the scaling core knows of each autograd operator, in one registry.

Per autograd node type name (``type(node).__name__``, e.g. ``"AddmmBackward0"``) one frozen
:class:`Operator` record: its :class:`Role` in Algorithm 1 and, where they apply, the operands of the
gradients it sends on (which input edges, how long their sums are), the bound on its weight gradient,
its exact fp32 probe, its fp32 recompute of an overflowed weight gradient, and how it lies on the way
from a GEMM to its parameter. A field that does not apply is ``None``; where a GEMM lacks one,
:attr:`Operator.note` says why. A type not registered here (and a weight-path type off a weight's
path) is an ordinary node: a cast where its dtypes say so, else it passes the gradient on at the scale it
carries, or, a custom ``Function``, it is opaque.

Every consumer looks types up here (:func:`operator`, :func:`node_types`): the graph analysis
(:mod:`~gs_lightning.scaling.graph`), the decisions (:mod:`~gs_lightning.scaling.decide`), the probes
(:mod:`~gs_lightning.scaling.probes`), the recompute (:mod:`~gs_lightning.scaling.recompute`), the gains
(:mod:`~gs_lightning.scaling.gains`), the walks to a parameter (:mod:`~gs_lightning.scaling.walks`) and the
compile adapter (:mod:`~gs_lightning.scaling.compiled`); ``tests/scaling/test_operators.py`` checks that
they agree with it. The records name functions defined beside the mathematics they implement, in modules
that import this one: the table is built on the first lookup (never at import), and cannot be patched.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from torch.autograd.graph import Node

# The node that accumulates a leaf's gradient (a parameter's ``.grad``): where every walk to a parameter ends.
LEAF = "AccumulateGrad"
# torchvision's deformable convolution: an operator with an autograd formula, a GEMM to the walk.
DEFORM_CONV = "GeneratedBackwardFor_torchvision_deform_conv2d_defaultBackward"


class Role(enum.Enum):
    """What a node of a type is to Algorithm 1."""

    LEAF = "leaf"  # AccumulateGrad: a parameter (or an input) receives its gradient
    GEMM = "GEMM"  # a decision point: Theorem 1 on its operands, exact probes of what it sends on
    ATTENTION = "fused attention"  # several low-precision GEMMs in one node: probes of its input gradients decide
    RNN = "fused RNN"  # likewise, the recurrence recomputed in fp32 for a few sequences
    BATCH_NORM = "batch norm"  # a gain no decision sees (gains.py): max_c |γ_c|·invstd_c
    PRODUCT = "product"  # a gain no decision sees where one factor is a constant (gains.constant_factor)
    WEIGHT_PATH = "weight path"  # may lie between a GEMM and its parameter: a cast, a layout, a broadcast (walks.py)
    PASS_THROUGH = "pass-through"  # a Function whose gradient passes through at its scale: not opaque
    REENTRANT_CHECKPOINT = "reentrant checkpoint"  # recomputes its block: the inner graph is scaled on its own
    COMPILED_REGION = "compiled region"  # a torch.compile'd region: opaque to the walk (compiled.py replays it)
    TRACED_INPUT = "traced input"  # AOTAutograd's trace: a region input, where eager records AccumulateGrad
    TRACED_VARIANT = "traced variant"  # AOTAutograd's trace records this type where eager records `eager_name`


@dataclass(frozen=True)
class Layout:
    """How a node on a :attr:`Role.WEIGHT_PATH` treats the weight gradient passing through it.

    Attributes:
        recomputable: Whether the fp32 recompute (:mod:`~gs_lightning.scaling.recompute`) may call the node on a
            recomputed gradient: it only casts or lays the values out (a broadcast sums them: not one of those).
        transposes: Whether this node transposes a 2-D weight (how a matrix operand is laid out behind it).
    """

    recomputable: bool
    transposes: Callable[[Node], bool]


@dataclass(frozen=True)
class Recompute:
    """A GEMM's parameter gradients recomputed in fp32 (:mod:`~gs_lightning.scaling.recompute`).

    Attributes:
        gradient: ``(node, fp32 incoming gradient, fp32 saved operands by name, parameter edge)`` -> that edge's
            fp32 gradient.
        operands: Parameter edge -> the names of the saved operands its gradient is computed from.
    """

    gradient: Callable[[Node, Any, dict[str, Any], int], Any]
    operands: Mapping[int, tuple[str, ...]]


@dataclass(frozen=True)
class Operator:
    """What the core knows of one autograd node type (module docstring); ``None`` where a field does not apply.

    Attributes:
        role: What a node of this type is to Algorithm 1.
        operands: GEMM: input edge -> ``(graph, node index, incoming gradient)`` ->
            :class:`~gs_lightning.scaling.graph.GemmOperand`: the other operand of the gradient sent along that
            edge, and N, the length of each of its sums. Only edges that can carry an activation gradient.
        weight_bound: GEMM: ``(node, incoming gradient, parameter edges)`` -> upper bounds on the largest
            weight (and bias) gradient it computes, by :class:`~gs_lightning.scaling.limits.Limit`, unread.
        probe: GEMM: ``(node, grad, edge, operand, elements)``; fused attention: ``(node, grad, edge, elements,
            scores_elements)``: exact fp32 values of a slice of the gradient sent along ``edge``
            (:func:`~gs_lightning.scaling.probes.probe`). Fused RNN: ``node`` -> the recurrence's inputs and
            weights as this kernel saved them, which :func:`~gs_lightning.scaling.probes.rnn_probe` recomputes.
        probed_edges: Fused nodes: the input edges whose gradients :attr:`probe` computes.
        recompute: GEMM: its parameter gradients in fp32, where one overflowed between updates.
        sent_operands: GEMM: input edge (one of :attr:`operands`) -> the name of the saved operand the gradient sent
            along it is computed from, and no other gradient of the node: multiplied by ``2^k`` as the backward
            unpacks it, it gives that gradient ``k`` binades of scale of its own
            (:attr:`~gs_lightning.scaling.recipe.ScalingRecipe.own_input_gradient_scale`).
        layout: Weight path: how the node treats the weight gradient passing through it.
        eager_name: Traced variant: the type eager autograd records for the same operator.
        note: Why a field that could apply is ``None``.
    """

    role: Role
    operands: Mapping[int, Callable[..., Any]] | None = None
    weight_bound: Callable[..., Mapping[Any, Any]] | None = None
    probe: Callable[..., Any] | None = None
    probed_edges: tuple[int, ...] | None = None
    recompute: Recompute | None = None
    sent_operands: Mapping[int, str] | None = None
    layout: Layout | None = None
    eager_name: str | None = None
    note: str = ""


def _never(node: Node) -> bool:
    return False


def _always(node: Node) -> bool:
    return True


def _swaps_two_dims(node: Node) -> bool:
    return tuple(node._saved_dims) == (1, 0)


# Fused attention kernels (scaled_dot_product_attention): query, key and value's gradients probed.
_ATTENTION = (
    "ScaledDotProductFlashAttentionForCpuBackward0",
    "ScaledDotProductFlashAttentionBackward0",
    "ScaledDotProductEfficientAttentionBackward0",
    "ScaledDotProductCudnnAttentionBackward0",
)
# Between bmm/baddbmm's operands no parameter: attention's scores and values, a mixture's experts batched.
_ACTIVATIONS_ONLY = (
    "both operands are activations (attention's scores and values, batched experts): no weight-gradient bound "
    "or recompute written for it; a parameter reaching one (an expanded weight) is unbounded, and its overflow "
    "skips the step"
)


@functools.cache
def _table() -> Mapping[str, Operator]:
    # The modules whose functions the records name import this one: loaded here, on the first lookup.
    from gs_lightning.scaling import graph, probes, recompute

    def gemm(**fields: Any) -> Operator:
        return Operator(Role.GEMM, **fields)

    def weight_path(recomputable: bool = True, transposes: Callable[[Node], bool] = _never, note: str = "") -> Operator:
        return Operator(Role.WEIGHT_PATH, layout=Layout(recomputable, transposes), note=note)

    operators = {
        LEAF: Operator(Role.LEAF),
        # --- GEMMs: per input edge, the other operand of that edge's gradient and the length of its sums,
        # e.g. addmm(bias, mat1, mat2): ∇mat1 = ∇Y · mat2ᵀ sums over mat2's columns.
        "ConvolutionBackward0": gemm(
            operands={0: graph._conv_input},
            weight_bound=graph._conv_weight_grad_bounds,
            probe=probes._convolution,
            recompute=Recompute(recompute._convolution, {1: ("input", "weight"), 2: ()}),
            sent_operands={0: "weight"},
        ),
        "AddmmBackward0": gemm(
            operands={1: graph._addmm_mat1, 2: graph._saved_operand("mat1", lambda t: t.shape[0])},
            weight_bound=graph._addmm_weight_grad_bounds,
            probe=probes._matmul_probe(1, 2, "mat1", "mat2"),
            recompute=Recompute(recompute._matmul(0, 1, "mat1", "mat2"), {0: (), 1: ("mat2",), 2: ("mat1",)}),
            sent_operands={1: "mat2", 2: "mat1"},
        ),
        "MmBackward0": gemm(
            operands={
                0: graph._saved_operand("mat2", lambda t: t.shape[-1]),
                1: graph._saved_operand("self", lambda t: t.shape[-2]),
            },
            weight_bound=graph._mm_weight_grad_bounds,
            probe=probes._matmul_probe(0, 1, "self", "mat2"),
            recompute=Recompute(recompute._matmul(None, 0, "self", "mat2"), {0: ("mat2",), 1: ("self",)}),
            sent_operands={0: "mat2", 1: "self"},
        ),
        "BmmBackward0": gemm(
            operands={
                0: graph._saved_operand("mat2", lambda t: t.shape[-1]),
                1: graph._saved_operand("self", lambda t: t.shape[-2]),
            },
            probe=probes._matmul_probe(0, 1, "self", "mat2"),
            note=_ACTIVATIONS_ONLY,
        ),
        "BaddbmmBackward0": gemm(
            operands={
                1: graph._saved_operand("batch2", lambda t: t.shape[-1]),
                2: graph._saved_operand("batch1", lambda t: t.shape[-2]),
            },
            probe=probes._matmul_probe(1, 2, "batch1", "batch2"),
            note=_ACTIVATIONS_ONLY,
        ),
        DEFORM_CONV: gemm(
            operands={0: graph._deform_conv_input},
            probe=probes._deform_convolution,
            note="its weight and offset gradients come from torchvision's own kernel: no bound or recompute "
            "written for them yet; an overflow there skips the step",
        ),
        # --- Fused kernels computing several GEMMs in low precision inside one node, and the edges whose
        # gradients an exact fp32 probe computes: query, key, value; an RNN's input (and, for oneDNN's
        # single-layer node, its initial hidden and cell states).
        **{name: Operator(Role.ATTENTION, probe=probes._attention, probed_edges=(0, 1, 2)) for name in _ATTENTION},
        "MkldnnRnnLayerBackward0": Operator(Role.RNN, probe=probes._mkldnn_spec, probed_edges=(0, 5, 6)),
        "CudnnRnnBackward0": Operator(Role.RNN, probe=probes._cudnn_spec, probed_edges=(0,)),
        # --- Gains no decision sees (gains.py). Batch normalisation's backward,
        # dX = γ·invstd·(dY less its projection on 1 and x̂) per channel, can make a gradient larger than it came
        # in, by up to max_c |γ_c|·invstd_c (in L2; 3.85x in max on ResNet-8's stem, where that gain is 4): scales
        # bounded against λmax before it overflowed after it. cuDNN and MIOpen save the inverse std as result2 too.
        **{
            name: Operator(Role.BATCH_NORM)
            for name in ("NativeBatchNormBackward0", "CudnnBatchNormBackward0", "MiopenBatchNormBackward0")
        },
        "MulBackward0": Operator(Role.PRODUCT),
        # --- How a weight reaches a GEMM: autocast's cast, Linear's transpose, reshapes, a broadcast.
        "ToCopyBackward0": weight_path(),
        "TBackward0": weight_path(transposes=_always),
        "TransposeBackward0": weight_path(transposes=_always),
        "PermuteBackward0": weight_path(transposes=_swaps_two_dims),
        "ViewBackward0": weight_path(),
        "UnsafeViewBackward0": weight_path(),
        "ReshapeAliasBackward0": weight_path(),
        "ExpandBackward0": weight_path(
            recomputable=False, note="a broadcast weight, its gradient summed back: left to the step's skip"
        ),
        # --- Custom Functions whose gradient passes through at the scale it carries (not opaque).
        # torchvision's RoI pooling (an autograd formula registered with torch.library) is linear in its gradient.
        **{
            f"GeneratedBackwardFor_torchvision_{op}_defaultBackward": Operator(Role.PASS_THROUGH)
            for op in ("roi_align", "roi_pool", "ps_roi_align", "ps_roi_pool")
        },
        # FSDP2's marker at each sharded module's inputs: an identity whose backward starts the module's
        # gradient reduction (an opaque region scaled it as a unit).
        "RegisterPostBackwardFunctionBackward": Operator(Role.PASS_THROUGH),
        # The root joining several outputs (join.py: an inner graph's, or several scaled outputs').
        "JoinOutputsBackward": Operator(Role.PASS_THROUGH),
        # Reentrant activation checkpointing: its backward recomputes the block and runs a second backward over
        # the block's graph, which the walk never sees (checkpointing.py scales it).
        "CheckpointFunctionBackward": Operator(Role.REENTRANT_CHECKPOINT),
        # --- torch.compile (compiled.py).
        "CompiledFunctionBackward": Operator(Role.COMPILED_REGION),
        "Error": Operator(Role.TRACED_INPUT),
        # Functionalized variants; dropout, which eager runs on the CPU as a multiply by a mask needing no gradient.
        "NativeBatchNormLegitBackward0": Operator(Role.TRACED_VARIANT, eager_name="NativeBatchNormBackward0"),
        # without running statistics (InstanceNorm)
        "NativeBatchNormLegitBackward1": Operator(Role.TRACED_VARIANT, eager_name="NativeBatchNormBackward0"),
        "NativeDropoutBackward0": Operator(Role.TRACED_VARIANT, eager_name="MulBackward0"),
    }
    return MappingProxyType(operators)


def operator(name: str) -> Operator | None:
    """The record of autograd node type ``name``, or ``None`` for a type the core has no special knowledge of."""
    return _table().get(name)


def registry() -> Mapping[str, Operator]:
    """Every record, by node type name (read-only)."""
    return _table()


@functools.cache
def node_types(*roles: Role) -> frozenset[str]:
    """The node types registered with one of ``roles``."""
    return frozenset(name for name, op in _table().items() if op.role in roles)
