"""The models a scaler serves: the names it gives layers, the buffers a skipped step restores, the setups it refuses."""

from __future__ import annotations

import torch
from torch import nn

from gs_lightning.scaling.graph import LEAF, AutogradGraph

# A parameter in one of these formats cannot hold its gradient unscaled without underflow.
_UNSCALABLE_PARAMETER_DTYPES = (torch.float16, torch.float8_e5m2, torch.float8_e4m3fn)


class AttachedModels:
    """What the scaler knows of the models attached to it (:meth:`GradientScaler.attach`).

    Attributes:
        models: The attached models, in order.
        module_names: ``id(parameter)`` -> qualified name of the module owning it (layer names).
        parameter_names: ``id(parameter)`` -> its qualified name (error messages).
        sharded: Whether a model holds FSDP1 units (each rank's ``.grad`` is its own shard).
    """

    def __init__(self) -> None:
        self.models: list[nn.Module] = []
        self.module_names: dict[int, str] = {}
        self.parameter_names: dict[int, str] = {}
        self.sharded = False
        self._buffer_copy: list[torch.Tensor] = []

    def attach(self, model: nn.Module) -> bool:
        """Add ``model``; whether it was new."""
        if any(m is model for m in self.models):
            return False
        self.models.append(model)
        self.sharded = self.sharded or any(is_fsdp1_unit(m) for m in model.modules())
        self.module_names = {**_module_names(model), **self.module_names}
        self.parameter_names = {**{id(p): name for name, p in model.named_parameters()}, **self.parameter_names}
        self._buffer_copy = [b.detach().clone() for b in self._buffers()]
        return True

    def save_buffers(self) -> None:
        """Copy every buffer (BatchNorm running statistics) after a step taken: what a skipped step restores."""
        buffers = self._buffers()
        if not buffers:
            return
        if _same_layout(buffers, self._buffer_copy):
            torch._foreach_copy_(self._buffer_copy, buffers)
        else:  # moved to another device, or buffers added
            self._buffer_copy = [b.detach().clone() for b in buffers]

    def restore_buffers(self) -> int:
        """Put every buffer back to its value before the iteration (a skipped step); returns how many were non-finite.

        Synchronises once per floating-point buffer (only on a skipped step).
        """
        buffers = self._buffers()
        if not buffers or len(buffers) != len(self._buffer_copy):
            return 0
        non_finite = sum(not bool(torch.isfinite(b).all()) for b in buffers if b.is_floating_point())
        with torch.no_grad():
            for buffer, saved in zip(buffers, self._buffer_copy):
                buffer.copy_(saved)
        return non_finite

    def check_parameters(self, graph: AutogradGraph, exits: frozenset[int]) -> None:
        """Refuse a graph whose parameters are in a format their unscaled gradients underflow in."""
        for j, name in enumerate(graph.names):
            variable = graph.nodes[j].variable if name == LEAF and j not in exits else None
            if variable is not None and variable.dtype in _UNSCALABLE_PARAMETER_DTYPES:
                name = self.parameter_names.get(id(variable), f"of shape {tuple(variable.shape)}")
                raise ValueError(
                    f"GradientScaler: parameter {name} is {variable.dtype}; its gradient cannot be unscaled in "
                    f"{variable.dtype} without underflow. Keep parameters in float32 and run the forward under "
                    "torch.autocast instead of model.half() (torch.amp.GradScaler refuses fp16 gradients too)."
                )

    def refuse_fp16_communication(self) -> None:
        """DDP with an fp16 compression hook all-reduces the true gradients in fp16, where what this scaler
        unscaled below fp16's range flushes to zero (at a median of 4e-9 every value was lost)."""
        for model in self.models:
            for hook, _ in getattr(model, "_comm_hooks", ()):
                name = getattr(hook, "__qualname__", "")
                if "fp16_compress" in name:
                    raise ValueError(
                        f"GradientScaler: DDP's communication hook {name} all-reduces gradients in fp16, and they arrive "
                        "there unscaled (true values), so those below fp16's range (6e-8) become 0. Register "
                        "bf16_compress_hook (bf16 has fp32's range) or no compression hook."
                    )

    def _buffers(self) -> list[torch.Tensor]:
        """The attached models' buffers, each once (models may share modules)."""
        return list({id(b): b for model in self.models for b in model.buffers()}.values())


def is_fsdp1_unit(module: nn.Module) -> bool:
    """Whether ``module`` is a ``FullyShardedDataParallel`` unit (FSDP1: plain tensors, each rank's shard)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel  # imports torch.distributed's FSDP machinery: only here

    return isinstance(module, FullyShardedDataParallel)


def _module_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for module_name, module in model.named_modules():
        name = ".".join(part for part in module_name.split(".") if part != "_orig_mod")  # as the model had before torch.compile
        for param in module.parameters(recurse=False):
            names.setdefault(id(param), name or type(module).__name__)
    return names


def _same_layout(tensors: list[torch.Tensor], copies: list[torch.Tensor]) -> bool:
    return len(tensors) == len(copies) and all(
        t.shape == c.shape and t.dtype == c.dtype and t.device == c.device for t, c in zip(tensors, copies)
    )
