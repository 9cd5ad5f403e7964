"""Finiteness checks (and unscaling) of gradients: one fused kernel per device and dtype, no sync.

Shared by :class:`~gs_lightning.scaling.GradientScaler` and the loss-scaling baselines. Sparse
gradients (``nn.Embedding(sparse=True)``) are handled through their values, since torch's fused
kernel only takes dense tensors.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch


def unscale_and_check_(grads: Iterable[torch.Tensor], inv_scale: float = 1.0) -> list[torch.Tensor]:
    """Multiply ``grads`` by ``inv_scale`` in place and flag non-finite values.

    Returns one flag tensor per (device, dtype) group, 1.0 where a gradient of that group holds
    inf or NaN. Nothing is synchronised: reading a flag is the caller's choice.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        if grad is None or not grad.is_floating_point():
            continue
        if grad.is_sparse:  # its values, duplicates included: scaling and checking them is exact
            grad = grad._values()
        groups[(grad.device, grad.dtype)].append(grad)
    flags = []
    for (device, _), tensors in groups.items():
        flag = torch.zeros(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, torch.full((1,), inv_scale, device=device))
        flags.append(flag)
    return flags


def any_non_finite(grads: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``grads`` holds inf or NaN (one synchronisation per device)."""
    return any(bool(flag.item()) for flag in unscale_and_check_(grads))
