"""The statistics an update's decisions take of a gradient, on its device; what the step reads of them, in one
synchronisation."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping

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


def first_non_finite(flags: FiniteFlags, values: Mapping[Hashable, list[float]], prefix: tuple) -> str | None:
    """The first layer of ``flags`` (in backward order) whose values, as read under ``(*prefix, k)`` for the k-th
    layer (:meth:`DeviceRead.put`), are not all finite."""
    return next((name for k, (name, _) in enumerate(flags) if not all(map(math.isfinite, values[(*prefix, k)]))), None)


class DeviceRead:
    """Tensors left on the device by several producers, read in one synchronisation and handed back by key.

    Each producer puts its 0-dim or 1-D tensors under a key of its own and takes their values back by
    the same key: a producer added, removed or reordered cannot shift another's values. The step's
    read is one of these (:mod:`~gs_lightning.scaling.step_read`); so is an update's, where something
    asks for its layers before the step.
    """

    def __init__(self) -> None:
        self._parts: dict[Hashable, list[torch.Tensor]] = {}

    def put(self, key: Hashable, tensors: Iterable[torch.Tensor]) -> None:
        """Read ``tensors`` (any devices and dtypes, flattened in order) under ``key``, which is new to this read."""
        if key in self._parts:
            raise KeyError(f"DeviceRead: {key!r} was put twice in one read")
        self._parts[key] = list(tensors)

    def read(self) -> dict[Hashable, list[float]]:
        """Every key's values, in one synchronisation; float64 keeps integer counts exact.

        Synchronises with the device (one ``tolist``), once, where anything was put. The 0-dim tensors (most of an
        update's: a few per decision) go in one ``stack`` per dtype, converted once: a few operations in all, not
        one per value.
        """
        tensors = [t for part in self._parts.values() for t in part]
        if not tensors:
            return {key: [] for key in self._parts}
        device = tensors[0].device
        scalars: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
        for k, t in enumerate(tensors):
            if t.dim() == 0:
                scalars[t.device, t.dtype].append(k)
        pieces = [torch.stack([tensors[k] for k in group]).to(device, torch.float64) for group in scalars.values()]
        vectors = [k for k, t in enumerate(tensors) if t.dim() != 0]
        pieces += [tensors[k].reshape(-1).to(device, torch.float64) for k in vectors]
        values = iter(torch.cat(pieces).tolist())  # the one sync
        by_tensor: list[list[float]] = [[] for _ in tensors]
        for k in (k for group in scalars.values() for k in group):
            by_tensor[k] = [next(values)]
        for k in vectors:
            by_tensor[k] = [next(values) for _ in range(tensors[k].numel())]
        positions = iter(range(len(tensors)))
        return {key: [v for _ in part for v in by_tensor[next(positions)]] for key, part in self._parts.items()}
