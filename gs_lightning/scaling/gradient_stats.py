"""The statistics an update's decisions read of a gradient, taken on its device and read in one synchronisation."""

from __future__ import annotations

import math

import torch

from gs_lightning.scaling.probes import detached
from gs_lightning.scaling.underflow import ExactSample


def stats(*values: torch.Tensor) -> list[float]:
    """Statistics to the host in one synchronisation."""
    return torch.stack([v.float() for v in values]).tolist()


OrderStatistics = tuple[float, list[float]]  # an ExactSample's nonzero count and smallest values, read


def stats_and_samples(values: list[torch.Tensor], samples: list[ExactSample], target: float) -> tuple[list[float], list[OrderStatistics]]:
    """:func:`stats` of ``values``, and what :meth:`ExactSample.min_log2_scale` reads of each sample, in one synchronisation."""
    smallest = [v.smallest(target) for v in samples]
    scalars = torch.stack([v.float() for v in (*values, *(v.nonzero_count for v in samples))])
    read = torch.cat([scalars, *smallest]).tolist() if smallest else scalars.tolist()
    counts, position, orders = read[len(values) : len(values) + len(samples)], len(values) + len(samples), []
    for count, tail in zip(counts, smallest):
        orders.append((count, read[position : position + tail.numel()]))
        position += tail.numel()
    return read[: len(values)], orders


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


def magnitude(low: float, high: float) -> float:
    """The largest magnitude, from :func:`extremes` read to the host (NaN if either is)."""
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


def magnitudes(pairs: list[Extremes]) -> list[float]:
    """:func:`magnitude` of each pair of :func:`extremes`, in one synchronisation."""
    values = stats(*(v for pair in pairs for v in pair)) if pairs else []
    return [magnitude(values[2 * k], values[2 * k + 1]) for k in range(len(pairs))]


def memory_order(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its dimensions in memory order, a free view, where that makes it contiguous (a transposed
    weight and its gradient): a reduction over a transposed view measured 15x slower on a CPU."""
    if t.is_contiguous():
        return t
    permuted = t.permute(sorted(range(t.dim()), key=t.stride, reverse=True))
    return permuted if permuted.is_contiguous() else t


FiniteFlags = list[tuple[str, tuple[torch.Tensor, ...]]]  # (layer, values all finite iff its gradient is)


def first_non_finite(flags: FiniteFlags, values: list[float]) -> str | None:
    """The first layer of ``flags`` (in backward order) whose values, as read (``values``, in order), are not all finite."""
    position = 0
    for name, flag in flags:
        if not all(map(math.isfinite, values[position : position + len(flag)])):
            return name
        position += len(flag)
    return None


def read(tensors: list[torch.Tensor]) -> list[float]:
    """The values of 0-dim ``tensors`` (any devices, any dtypes), in one synchronisation; fp64 keeps integer counts exact."""
    return torch.stack([t.to(tensors[0].device, torch.float64) for t in tensors]).tolist() if tensors else []
