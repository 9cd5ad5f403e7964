"""Fast emulated fp16 (and fp8-gradient) GEMMs and convolutions on the CPU.

On CPUs fp16 convolutions run tens of times slower than fp32 (their backward above all: a
profile of a small CNN under fp16 autocast puts 84% of the time in ``convolution_backward``).
A GPU's fp16 GEMM multiplies fp16 operands exactly, accumulates in fp32 and rounds the result
to fp16 once; computing in fp32 from the same fp16 operands and rounding gives the same values
(up to the order of summation), at fp32 speed.

:class:`emulate` does that below autograd, with a ``TorchDispatchMode``: autograd still records
its usual nodes (``ConvolutionBackward0``, ``AddmmBackward0``, ``MmBackward0``,
``BmmBackward0``, ...), so :class:`~gs_lightning.GradientScaler`, which reads those nodes, works
unchanged. Only the GEMM kernels are replaced; everything else (autocast's casts, BatchNorm,
pooling, the loss) runs PyTorch's own kernels in autocast's own dtypes, except BatchNorm, whose
fp16 CPU kernel is as slow: it runs in fp32 from the same values, its fp16 outputs rounded.

Under ``torch.inference_mode`` (Lightning validates and tests in it) autograd is off for good and
does not decompose composite operators (``conv2d``, ``linear``, ``matmul``, ``einsum``,
``batch_norm``, ...) before they reach the mode, as it does in training and under ``no_grad``;
the mode decomposes them itself, so the same GEMMs are emulated with the same roundings.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import Self

from gs_lightning.scaling.modes import LowPrecisionOnly
from gs_lightning.simulate.grad_scaling import GradScaling, pow2_oracle_underflow
from gs_lightning.simulate.rounding import EMULATED_DTYPES, GRAD_DTYPES, round_to

aten = torch.ops.aten

# GEMMs autocast runs in low precision; in a backward pass their outputs are gradients. Every
# convolution (conv1d/2d/3d, the transposed ones, conv_tbc) and linear/matmul/einsum decomposes
# into these, by autograd or, under inference_mode, by the mode (_decompose).
_GEMMS = frozenset(
    {
        aten.convolution.default,
        aten._convolution.default,
        aten._convolution.deprecated,
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.addbmm.default,
    }
)
_CONV_BACKWARD = aten.convolution_backward.default
# Operands 1 and 2 are the matrices.
_BIAS_GEMMS = frozenset({aten.addmm.default, aten.baddbmm.default, aten.addbmm.default})
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
# Also slow with fp16 inputs on CPUs (60x fp32 in training mode), not GEMMs: computed in fp32 as
# cuDNN does, only the outputs that are fp16 for real are rounded (to ``dtype``, never to grad_dtype).
_BATCH_NORM = frozenset({aten.native_batch_norm.default, aten.native_batch_norm_backward.default})


class UnderflowMeter:
    """Underflow of the gradients the emulation casts: what backward GEMMs produce (∇X and ∇W) or what enters them (∇Y).

    For each such tensor: the fraction of its nonzero fp32 (exact) elements that rounding made
    zero. With ``oracle_format``, also the fraction the best per-tensor power-of-two scale without
    overflow would have made zero in that format (:func:`~gs_lightning.simulate.grad_scaling.pow2_oracle_underflow`):
    a lower bound for any method that gives the tensor one power-of-two scale, computed from the
    very tensors the run produced. Statistics stay on the device until :meth:`collect`.

    Args:
        oracle_format: Format of the oracle's cast (the emulation's ``grad_dtype``), or ``None``
            for no oracle.

    Attributes:
        seconds: Wall time spent in :meth:`add` and :meth:`collect`: the meter's own work, which a
            benchmark leaves out of the training's time (``bench/compare_training.py``). On a CPU its
            kernels run as they are called; on a GPU this counts their launches only.
    """

    def __init__(self, oracle_format: torch.dtype | None = None) -> None:
        if oracle_format is not None and oracle_format not in GRAD_DTYPES:
            raise ValueError(
                f"UnderflowMeter: oracle_format must be None or one of {list(GRAD_DTYPES)}, got {oracle_format!r}"
            )
        self.oracle_format = oracle_format
        self._pending: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.seconds = 0.0

    def add(self, exact: torch.Tensor, rounded: torch.Tensor) -> None:
        """Record one gradient: its exact fp32 values and what rounding stored."""
        start = time.perf_counter()
        nonzero = exact != 0
        counts = [(nonzero & (rounded == 0)).sum(), nonzero.sum()]
        if self.oracle_format is not None:
            counts.append(pow2_oracle_underflow(exact, self.oracle_format))
        stats = torch.stack(counts)
        with self._lock:
            self._pending.append(stats)
            self.seconds += time.perf_counter() - start

    def collect(self) -> list[float]:
        """Per tensor recorded since the last call, in order: its underflow fraction (one sync)."""
        return self.collect_with_oracle()[0]

    def collect_with_oracle(self) -> tuple[list[float], list[float]]:
        """Per tensor recorded since the last call: underflow fractions and the oracle's.

        The oracle's list is empty without ``oracle_format``.
        """
        start = time.perf_counter()
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return [], []
        stats = torch.stack(pending).double()
        nonzero = stats[:, 1].clamp(min=1)
        oracle = (stats[:, 2] / nonzero).tolist() if stats.shape[1] == 3 else []
        fractions = (stats[:, 0] / nonzero).tolist()
        with self._lock:
            self.seconds += time.perf_counter() - start
        return fractions, oracle


class emulate:  # a context manager, named like torch.autocast and torch.no_grad
    """Emulate low-precision GEMMs with fp32 compute and rounding; optionally fp8 gradients.

    ::

        with emulate(torch.float16):                          # forward
            with torch.autocast("cpu", dtype=torch.float16):
                loss = criterion(model(x), y)
        with emulate(torch.float16):                          # backward
            scaler.backward(loss)

    While active, every convolution, ``mm``, ``addmm``, ``bmm``, ``baddbmm`` and ``addbmm`` whose
    floating-point operands are all ``dtype`` (what autocast produces) runs in fp32 on the same
    values and rounds its result to ``dtype``, subnormals and overflow to inf included.
    BatchNorm with ``dtype`` inputs (forward and backward) also runs in fp32, its ``dtype``
    outputs rounded to ``dtype``: PyTorch's fp16 CPU kernel is as slow as the convolutions'.
    The operators built from these (``conv2d``, ``conv_transpose2d``, ``linear``, ``matmul``,
    ``einsum``, ``batch_norm``, ...) are emulated with the same roundings under ``no_grad`` and
    ``torch.inference_mode`` (where validation and test run) as in training.

    In a backward pass, where the gradients are cast to ``grad_dtype`` depends on ``grad_rounding``:

    * ``"output"`` (the fp16 path): the gradients these GEMMs **produce** (∇X and ∇W; a
      convolution's bias gradient is a sum, not a GEMM output, and stays ``dtype``) are rounded to
      ``grad_dtype`` instead of ``dtype``, e.g. ``torch.float8_e5m2``, and stored in ``dtype``
      (which holds every fp8 value exactly). An fp16 GEMM writes fp16 itself: no method sees the
      result before it is rounded.
    * ``"entering"`` (the fp8 hardware path, as Transformer Engine and torchao run it): the
      gradient **entering** each backward GEMM (∇Y, from its ``dtype`` value) is cast to
      ``grad_dtype``, once per GEMM that reads it (a Linear's ∇Y feeds the ∇X and the ∇W GEMM:
      two casts, whose MX blocks run along different dimensions); the GEMM computes in fp32 and
      writes ``dtype``. The gradient operand is the one that is not a tensor the autograd node
      saved from the forward (a convolution's is its first argument); only gradients are cast,
      the forward operands stay ``dtype``. A convolution's bias gradient is summed from the
      uncast ∇Y.

    Use it as a context manager, around the forward and the backward separately or around both;
    entering is cheap and nesting is harmless (the innermost wins). The mode is thread-local, and
    autograd carries it into the threads that run a backward. The same instance may be entered
    from several places; its ``grad_scaling`` and ``underflow`` state is shared.

    :class:`~gs_lightning.GradientScaler`'s update hooks run outside the mode
    (:class:`~gs_lightning.scaling.modes.LowPrecisionOnly`): their statistics and probes are fp32, which
    the mode would leave as they are, at the cost of its Python dispatch on each operator.

    Args:
        dtype: The compute format to emulate: ``torch.float16`` (or ``torch.bfloat16``).
        grad_dtype: Format of the backward's gradient casts; ``None`` means ``dtype``.
        grad_scaling: Optional scaling of those casts (:class:`~gs_lightning.simulate.DelayedScaling`,
            :class:`~gs_lightning.simulate.CurrentScaling` or
            :class:`~gs_lightning.simulate.MXBlockScaling`); needs an fp8 ``grad_dtype``.
        underflow: Optional :class:`UnderflowMeter` that records, per gradient cast, how many
            nonzero exact values rounding made zero (costs two reductions per cast).
        grad_rounding: ``"output"`` or ``"entering"`` (see above); ``"entering"`` needs a
            ``grad_dtype`` other than ``dtype``.

    Raises:
        ValueError: ``dtype``, ``grad_dtype``, ``grad_scaling`` or ``grad_rounding`` is not one of those supported.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.float16,
        grad_dtype: torch.dtype | None = None,
        *,
        grad_scaling: GradScaling | None = None,
        underflow: UnderflowMeter | None = None,
        grad_rounding: Literal["output", "entering"] = "output",
    ) -> None:
        if dtype not in EMULATED_DTYPES:
            raise ValueError(f"emulate: dtype must be one of {list(EMULATED_DTYPES)}, got {dtype!r}")
        if grad_dtype is not None and grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"emulate: grad_dtype must be None or one of {list(GRAD_DTYPES)}, got {grad_dtype!r}")
        if grad_scaling is not None and grad_dtype not in (torch.float8_e5m2, torch.float8_e4m3fn):
            raise ValueError(
                f"emulate: grad_scaling needs an fp8 grad_dtype (float8_e5m2 or float8_e4m3fn), got {grad_dtype!r}"
            )
        if grad_rounding not in ("output", "entering"):
            raise ValueError(f"emulate: grad_rounding must be 'output' or 'entering', got {grad_rounding!r}")
        if grad_rounding == "entering" and grad_dtype in (None, dtype):
            raise ValueError(
                f"emulate: grad_rounding='entering' needs a grad_dtype other than dtype ({dtype}), got {grad_dtype!r}"
            )
        self.dtype = dtype
        self.grad_dtype = grad_dtype if grad_dtype is not None else dtype
        self.grad_scaling = grad_scaling
        self.underflow = underflow
        self.grad_rounding = grad_rounding
        self._modes = threading.local()

    def __enter__(self) -> Self:
        mode = _EmulationMode(self)
        mode.__enter__()
        stack = getattr(self._modes, "stack", None)
        if stack is None:
            stack = self._modes.stack = []
        stack.append(mode)
        return self

    def __exit__(self, *exc: object) -> None:
        self._modes.stack.pop().__exit__(*exc)

    def _cast_grad(
        self, exact: torch.Tensor | None, block_dims: tuple[int, ...], out_dtype: torch.dtype
    ) -> torch.Tensor | None:
        if exact is None:
            return None
        if self.grad_scaling is not None:
            rounded = self.grad_scaling.quantize(exact, self.grad_dtype, out_dtype, block_dims)
        else:
            rounded = round_to(exact, self.grad_dtype, out_dtype)
        if self.underflow is not None:
            self.underflow.add(exact, rounded)
        return rounded

    def _run_batch_norm(self, func: Any, args: tuple, kwargs: dict) -> Any:
        # Inputs already fp32 (weights, running statistics) pass as themselves: the running
        # statistics are updated in place, as by the real kernel.
        first, *rest = func(*_to_fp32(args), **kwargs)
        return (_maybe_to(first, self.dtype), *rest)

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.grad_rounding == "entering":
            return self._run_entering(func, args, kwargs)
        exact = func(*_to_fp32(args), **_to_fp32(kwargs))
        if func is _CONV_BACKWARD:
            grad_input, grad_weight, grad_bias = exact
            # MX blocks along the dimension the next GEMM reduces: ∇X's channels (the next
            # layer's ∇X GEMM), ∇W's fan-in (a row of the weight matrix).
            weight_dims = tuple(range(1, args[2].dim()))
            return (
                self._cast_grad(grad_input, (1,), self.dtype),
                self._cast_grad(grad_weight, weight_dims, self.dtype),
                _maybe_to(grad_bias, self.dtype),
            )
        if torch._C._current_autograd_node() is not None:  # called by a backward node: a gradient
            return self._cast_grad(exact, (-1,), self.dtype)
        return exact.to(self.dtype)

    def _run_entering(self, func: Any, args: tuple, kwargs: dict) -> Any:
        node = torch._C._current_autograd_node()
        if node is None:  # the forward
            return func(*_to_fp32(args), **_to_fp32(kwargs)).to(self.dtype)
        if func is _CONV_BACKWARD:
            return self._conv_backward_entering(args)
        first = 1 if func in _BIAS_GEMMS else 0
        saved = _saved_storages(node)
        operands = list(_to_fp32(args))
        # a GEMM reduces its first operand's last dim, its second's second-to-last
        for position, block_dim in (
            (first, -1),
            (first + 1, -2),
        ):
            if args[position].untyped_storage().data_ptr() not in saved:
                operands[position] = self._cast_grad(operands[position], (block_dim,), torch.float32)
        return func(*operands, **_to_fp32(kwargs)).to(self.dtype)

    def _conv_backward_entering(self, args: tuple) -> tuple[torch.Tensor | None, ...]:
        grad_output, rest, mask = args[0].float(), _to_fp32(args[1:10]), args[10]
        not_channels = tuple(d for d in range(grad_output.dim()) if d != 1)
        grad_input = grad_weight = grad_bias = None
        if mask[0]:  # ∇X reduces over the output channels
            cast = self._cast_grad(grad_output, (1,), torch.float32)
            grad_input = _CONV_BACKWARD(cast, *rest, [True, False, False])[0].to(self.dtype)
        if mask[1]:  # ∇W reduces over the batch and the positions
            cast = self._cast_grad(grad_output, not_channels, torch.float32)
            grad_weight = _CONV_BACKWARD(cast, *rest, [False, True, False])[1].to(self.dtype)
        if mask[2]:
            grad_bias = grad_output.sum(not_channels).to(self.dtype)
        return grad_input, grad_weight, grad_bias


class _EmulationMode(LowPrecisionOnly, TorchDispatchMode):  # GradientScaler's update statistics (fp32) run outside it
    def __init__(self, spec: emulate) -> None:
        super().__init__()
        self.spec = spec

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (func in _GEMMS or func is _CONV_BACKWARD) and _all_floats_are(args, self.spec.dtype):
            return self.spec._run(func, args, kwargs)
        if func in _BATCH_NORM and args[0].dtype == self.spec.dtype:
            return self.spec._run_batch_norm(func, args, kwargs)
        if _is_composite(func):
            return self._decompose(func, args, kwargs)
        return func(*args, **kwargs)

    def _decompose(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run a composite operator's decomposition (PyTorch's C++ one) with its operators inside this mode.

        A composite operator reaches a dispatch mode only where the Autograd keys are excluded
        (``inference_mode``); elsewhere autograd decomposes it first. Without a mode, PyTorch's own
        kernel would decompose it with the caller's dispatch state, in which autocast still casts
        the operators inside (an ``einsum``'s ``bmm``) unless autocast itself dispatched the
        composite (``conv2d``, ``linear``, ``matmul``: it cast their inputs and stepped aside).
        That state is restored here, then this mode is entered again: every GEMM inside is
        emulated, with the operands and the roundings it has in training.
        """
        guards = [torch._C._RestorePythonTLSSnapshot()]
        autocast_key = _autocast_key(func, args)
        if autocast_key is not None:
            guards.append(torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(autocast_key)))
        with contextlib.ExitStack() as stack:
            for guard in guards:
                stack.enter_context(guard)
            stack.enter_context(self)
            return func._op_dk(_COMPOSITE, *args, **kwargs)


_IS_COMPOSITE: dict[Any, bool] = {}
_AUTOCAST_KEYS: dict[tuple[Any, str], torch._C.DispatchKey | None] = {}


def _is_composite(func: Any) -> bool:
    """Whether ``func`` is a CompositeImplicitAutograd operator (decomposed by autograd where autograd runs)."""
    known = _IS_COMPOSITE.get(func)
    if known is None:
        known = _IS_COMPOSITE[func] = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE)
    return known


def _autocast_key(func: Any, args: tuple) -> torch._C.DispatchKey | None:
    """The autocast key of the arguments' device where autocast has a kernel of its own for ``func``, else ``None``."""
    device = _first_device(args)
    if device is None:
        return None
    cache_key = (func, device)
    if cache_key not in _AUTOCAST_KEYS:
        key = getattr(torch._C.DispatchKey, f"Autocast{device.upper()}", None)
        has_kernel = key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)
        _AUTOCAST_KEYS[cache_key] = key if has_kernel else None
    return _AUTOCAST_KEYS[cache_key]


def _first_device(obj: Any) -> str | None:
    if isinstance(obj, torch.Tensor):
        return obj.device.type
    if isinstance(obj, (tuple, list)):
        for o in obj:
            device = _first_device(o)
            if device is not None:
                return device
    return None


def _all_floats_are(args: tuple, dtype: torch.dtype) -> bool:
    found = False
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            if a.dtype != dtype:
                return False
            found = True
    return found


def _saved_storages(node: Any) -> set[int]:
    """Storages of the tensors an autograd node saved from the forward (its ``_saved_*`` attributes)."""
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = _SAVED_NAMES[type(node)] = tuple(n for n in dir(node) if n.startswith("_saved_"))
    storages = set()
    for name in names:
        value = getattr(node, name)
        if isinstance(value, torch.Tensor):
            storages.add(value.untyped_storage().data_ptr())
    return storages


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _to_fp32(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_fp32(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_fp32(v) for k, v in obj.items()}
    return obj


def _maybe_to(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)
