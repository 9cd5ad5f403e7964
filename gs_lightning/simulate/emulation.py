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
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import Self

from gs_lightning.simulate.delayed_scaling import DelayedScaling
from gs_lightning.simulate.rounding import EMULATED_DTYPES, GRAD_DTYPES, round_to

aten = torch.ops.aten

# GEMMs autocast runs in low precision; in a backward pass their outputs are gradients.
_GEMMS = frozenset({aten.convolution.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
_CONV_BACKWARD = aten.convolution_backward.default
# Also slow with fp16 inputs on CPUs (60x fp32 in training mode), not GEMMs: computed in fp32 as
# cuDNN does, only the outputs that are fp16 for real are rounded (to ``dtype``, never to grad_dtype).
_BATCH_NORM = frozenset({aten.native_batch_norm.default, aten.native_batch_norm_backward.default})


class UnderflowMeter:
    """Underflow of the gradients emulated backward GEMMs produce (∇X and ∇W).

    For each such tensor: the fraction of its nonzero fp32 (exact) elements that rounding made
    zero. Statistics stay on the device until :meth:`collect`.
    """

    def __init__(self) -> None:
        self._pending: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def add(self, exact: torch.Tensor, rounded: torch.Tensor) -> None:
        """Record one gradient: its exact fp32 values and what rounding stored."""
        nonzero = exact != 0
        stats = torch.stack([(nonzero & (rounded == 0)).sum(), nonzero.sum()])
        with self._lock:
            self._pending.append(stats)

    def collect(self) -> list[float]:
        """Per tensor recorded since the last call, in order: its underflow fraction (one sync)."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return []
        lost, nonzero = torch.stack(pending).double().unbind(1)
        return (lost / nonzero.clamp(min=1)).tolist()


class emulate:  # a context manager, named like torch.autocast and torch.no_grad
    """Emulate low-precision GEMMs with fp32 compute and rounding; optionally fp8 gradients.

    ::

        with emulate(torch.float16):                          # forward
            with torch.autocast("cpu", dtype=torch.float16):
                loss = criterion(model(x), y)
        with emulate(torch.float16):                          # backward
            scaler.backward(loss)

    While active, every convolution, ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` whose
    floating-point operands are all ``dtype`` (what autocast produces) runs in fp32 on the same
    values and rounds its result to ``dtype``, subnormals and overflow to inf included. In a
    backward pass the gradients these GEMMs produce (∇X and ∇W; a convolution's bias gradient is a
    sum, not a GEMM output, and stays ``dtype``) are rounded to ``grad_dtype`` instead, e.g.
    ``torch.float8_e5m2``, and stored in ``dtype`` (which holds every fp8 value exactly).
    BatchNorm with ``dtype`` inputs (forward and backward) also runs in fp32, its ``dtype``
    outputs rounded to ``dtype``: PyTorch's fp16 CPU kernel is as slow as the convolutions'.

    Use it as a context manager, around the forward and the backward separately or around both;
    entering is cheap and nesting is harmless (the innermost wins). The mode is thread-local, and
    autograd carries it into the threads that run a backward. The same instance may be entered
    from several places; its ``grad_scaling`` and ``underflow`` state is shared.

    Args:
        dtype: The compute format to emulate: ``torch.float16`` (or ``torch.bfloat16``).
        grad_dtype: Format of the gradients backward GEMMs produce; ``None`` means ``dtype``.
        grad_scaling: Optional per-tensor scaling of those gradients before they are rounded
            (:class:`DelayedScaling`, Transformer Engine's recipe); needs an fp8 ``grad_dtype``.
        underflow: Optional :class:`UnderflowMeter` that records, per backward GEMM output, how
            many nonzero exact values rounding made zero (costs two reductions per GEMM).

    Raises:
        ValueError: ``dtype``, ``grad_dtype`` or ``grad_scaling`` is not one of those supported.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.float16,
        grad_dtype: torch.dtype | None = None,
        *,
        grad_scaling: DelayedScaling | None = None,
        underflow: UnderflowMeter | None = None,
    ) -> None:
        if dtype not in EMULATED_DTYPES:
            raise ValueError(f"emulate: dtype must be one of {list(EMULATED_DTYPES)}, got {dtype!r}")
        if grad_dtype is not None and grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"emulate: grad_dtype must be None or one of {list(GRAD_DTYPES)}, got {grad_dtype!r}")
        if grad_scaling is not None and grad_dtype not in (torch.float8_e5m2, torch.float8_e4m3fn):
            raise ValueError(f"emulate: grad_scaling needs an fp8 grad_dtype (float8_e5m2 or float8_e4m3fn), got {grad_dtype!r}")
        self.dtype = dtype
        self.grad_dtype = grad_dtype if grad_dtype is not None else dtype
        self.grad_scaling = grad_scaling
        self.underflow = underflow
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

    def _round_grad(self, exact: torch.Tensor | None) -> torch.Tensor | None:
        if exact is None:
            return None
        if self.grad_scaling is not None:
            rounded = self.grad_scaling.quantize(exact, self.grad_dtype, self.dtype)
        else:
            rounded = round_to(exact, self.grad_dtype, self.dtype)
        if self.underflow is not None:
            self.underflow.add(exact, rounded)
        return rounded

    def _run_batch_norm(self, func: Any, args: tuple, kwargs: dict) -> Any:
        # Inputs already fp32 (weights, running statistics) pass as themselves: the running
        # statistics are updated in place, as by the real kernel.
        first, *rest = func(*_to_fp32(args), **kwargs)
        return (_maybe_to(first, self.dtype), *rest)

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        exact = func(*_to_fp32(args), **_to_fp32(kwargs))
        if func is _CONV_BACKWARD:
            grad_input, grad_weight, grad_bias = exact
            return self._round_grad(grad_input), self._round_grad(grad_weight), _maybe_to(grad_bias, self.dtype)
        if torch._C._current_autograd_node() is not None:  # called by a backward node: a gradient
            return self._round_grad(exact)
        return exact.to(self.dtype)


class _EmulationMode(TorchDispatchMode):
    def __init__(self, spec: emulate) -> None:
        super().__init__()
        self.spec = spec

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (func in _GEMMS or func is _CONV_BACKWARD) and _all_floats_are(args, self.spec.dtype):
            return self.spec._run(func, args, kwargs)
        if func in _BATCH_NORM and args[0].dtype == self.spec.dtype:
            return self.spec._run_batch_norm(func, args, kwargs)
        return func(*args, **kwargs)


def _all_floats_are(args: tuple, dtype: torch.dtype) -> bool:
    found = False
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            if a.dtype != dtype:
                return False
            found = True
    return found


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
