"""The statistics an update's decisions take of a gradient, on its device; what the step reads of them, in one
synchronisation."""

from __future__ import annotations

import math

import torch

from gs_lightning.scaling.probes import detached
from gs_lightning.scaling.underflow import finite


def rms(t: torch.Tensor) -> torch.Tensor:
    """Root mean square, accumulated in fp32."""
    return torch.linalg.vector_norm(t, dtype=torch.float32) / math.sqrt(max(t.numel(), 1))


Extremes = tuple[torch.Tensor, torch.Tensor]  # (smallest, largest) element of a tensor, on its device


def extremes(t: torch.Tensor) -> Extremes:
    """The smallest and largest element, in one kernel: both finite iff every element is, NaN if one is.

    Through ``aminmax`` (on a CPU ``vector_norm(ord=inf)`` measured 12-20x slower); the largest
    magnitude is taken on the host (:func:`magnitudes`), which saves two kernels per tensor.
    """
    if t.numel() == 0:
        zero = torch.zeros((), device=t.device)
        return zero, zero
    low, high = torch.aminmax(memory_order(detached(t)))
    return low, high


def magnitude(pair: Extremes) -> torch.Tensor:
    """The largest magnitude from :func:`extremes`, float64 on their device, unread (NaN if either is)."""
    low, high = pair
    return torch.maximum(-low, high).double()


def all_finite(values: list[torch.Tensor]) -> torch.Tensor:
    """Whether every one of the 0-dim ``values`` is finite, a 0-dim bool tensor on their device, unread."""
    return finite(torch.stack(values)).all()


def memory_order(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its dimensions in memory order, a free view, where that makes it contiguous (a transposed
    weight and its gradient): a reduction over a transposed view measured 15x slower on a CPU."""
    if t.is_contiguous():
        return t
    permuted = t.permute(sorted(range(t.dim()), key=t.stride, reverse=True))
    return permuted if permuted.is_contiguous() else t


FiniteFlags = list[tuple[str, tuple[torch.Tensor, ...]]]  # (layer, values all finite iff its gradient is)


def first_non_finite(flags: FiniteFlags, values: list[float]) -> str | None:
    """The first layer of ``flags`` (in backward order) whose values, as read (``values``, in order), are not all
    finite."""
    position = 0
    for name, flag in flags:
        if not all(map(math.isfinite, values[position : position + len(flag)])):
            return name
        position += len(flag)
    return None


def read(tensors: list[torch.Tensor]) -> list[float]:
    """The values of 0-dim ``tensors`` (any devices, any dtypes), in one synchronisation; fp64 keeps integer counts
    exact."""
    return torch.stack([t.to(tensors[0].device, torch.float64) for t in tensors]).tolist() if tensors else []
