"""Finiteness checks and unscaling of gradients: one fused kernel per device and dtype, no sync.

Shared by :class:`~gs_lightning.scaling.GradientScaler` and the loss-scaling baselines. Sparse
gradients (``nn.Embedding(sparse=True)``) are handled through their values, since torch's fused
kernel only takes dense tensors.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable

import torch

from gs_lightning.scaling.formats import widened


def unscale_and_check_(
    grads: Iterable[torch.Tensor], inv_scale: float = 1.0, found_inf: dict[torch.device, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Multiply ``grads`` by ``inv_scale`` in place and flag non-finite values.

    Returns one flag tensor per device, 1.0 where a gradient of that device holds inf or NaN.
    ``found_inf`` (device -> flag) lets several calls share their flags: they are set, never
    cleared. Nothing is synchronised: reading a flag is the caller's choice.
    """
    flags = {} if found_inf is None else found_inf
    grads = list(grads)
    groups = _dense_groups(grads)
    for (device, _), tensors in groups.items():
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, _flag(flags, device), _inv_scale(inv_scale, device))
    # finite duplicates of an uncoalesced fp16 gradient may overflow once summed, as the optimizer will
    for grad in grads:
        if grad is not None and grad.is_sparse and grad.dtype == torch.float16 and not grad.is_coalesced():
            torch._amp_foreach_non_finite_check_and_unscale_(
                [grad.coalesce()._values()], _flag(flags, grad.device), _inv_scale(1.0, grad.device)
            )
    return [flags[device] for device in {device for device, _ in groups}]


def unscale_(grads: Iterable[torch.Tensor], inv_scale: float | torch.Tensor) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place (a power of two: exact), one fused kernel per device and dtype.

    ``inv_scale`` may be a 0-dim tensor (an update's scale, unread): it multiplies in fp32 at least, as a
    Python number does. No check: :func:`unscale_and_check_` does that where the step reads every gradient it uses.
    """
    for (device, dtype), tensors in _dense_groups(grads).items():
        factor = inv_scale.to(device, widened(dtype)) if isinstance(inv_scale, torch.Tensor) else inv_scale
        torch._foreach_mul_(tensors, factor)


def _dense_groups(grads: Iterable[torch.Tensor | None]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """The floating-point ``grads`` by device and dtype; a sparse one as its values, duplicates included
    (scaling and checking them is exact)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        if grad is None or not grad.is_floating_point():
            continue
        values = grad._values() if grad.is_sparse else grad
        groups[(values.device, values.dtype)].append(values)
    return groups


def _flag(flags: dict[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The shared found-inf flag of ``device``, made on first use."""
    if device not in flags:
        flags[device] = torch.zeros(1, device=device)
    return flags[device]


@functools.lru_cache(maxsize=256)
def _inv_scale(value: float, device: torch.device) -> torch.Tensor:
    """The kernel wants its factor as a tensor on the device: one per (value, device), reused."""
    return torch.full((1,), value, device=device)


def any_non_finite(grads: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``grads`` holds inf or NaN (one synchronisation per device)."""
    return any(bool(flag.item()) for flag in unscale_and_check_(grads))
