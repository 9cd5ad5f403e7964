"""GradientScaler's own work as ranges in the PyTorch profiler's trace, while a profiler records.

``torch.profiler.profile``, Lightning's ``Trainer(profiler="pytorch")`` and ``emit_nvtx`` (Nsight) show
them beside the kernels: ``GradientScaler.prepare`` (the walk of the graph and its hooks, as a backward
starts), ``GradientScaler.decide:<layer>`` (one decision of an update iteration: its statistics,
probes and scale, on the device), ``GradientScaler.unscale`` (the fused unscale after the
backward), ``GradientScaler.step_read`` (the step's one read) and ``GradientScaler.recompute``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def profiled(name: str, detail: str | None = None) -> AbstractContextManager:
    """A profiler range named ``name`` (``name:detail`` with a ``detail``, joined only while recording: a decision's
    range is asked for once per layer); nothing while no profiler records (a range costs ~6 µs even then)."""
    if not torch._C._autograd._profiler_enabled():
        return nullcontext()
    return torch.profiler.record_function(name if detail is None else f"{name}:{detail}")
