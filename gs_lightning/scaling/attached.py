"""The models a scaler serves: the names it gives layers, the buffers a skipped step restores, the setups it refuses."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from gs_lightning.scaling.graph import AutogradGraph
from gs_lightning.scaling.walks import leaf_variables

# A parameter in one of these formats cannot hold its gradient unscaled without underflow.
_UNSCALABLE_PARAMETER_DTYPES = (torch.float16, torch.float8_e5m2, torch.float8_e4m3fn)


class _FSDPParamNames(NamedTuple):
    """One of FSDP2's parameter records (``FSDPParam``) and the names of the parameter it holds."""

    record: Any  # torch.distributed.fsdp's FSDPParam (private)
    module: str
    parameter: str


class AttachedModels:
    """What the scaler knows of the models attached to it (:meth:`GradientScaler.attach`).

    Attributes:
        models: The attached models, in order.
        sharded: Whether a model holds FSDP1 units (each rank's ``.grad`` is its own shard).
    """

    def __init__(self) -> None:
        self.models: list[nn.Module] = []
        self.sharded = False
        self._module_names: dict[int, str] = {}
        self._parameter_names: dict[int, str] = {}
        self._fsdp_params: list[_FSDPParamNames] = []
        self._buffer_copy: list[torch.Tensor] = []

    @property
    def module_names(self) -> dict[int, str]:
        """``id(parameter)`` -> qualified name of the module owning it (layer names), FSDP2's unsharded parameters
        included."""
        if not self._fsdp_params:
            return self._module_names
        return {**self._module_names, **{id(param): names.module for names, param in self._unsharded()}}

    @property
    def parameter_names(self) -> dict[int, str]:
        """``id(parameter)`` -> its qualified name (error messages), FSDP2's unsharded parameters included."""
        if not self._fsdp_params:
            return self._parameter_names
        return {**self._parameter_names, **{id(param): names.parameter for names, param in self._unsharded()}}

    def attach(self, model: nn.Module) -> bool:
        """Add ``model``; whether it was new."""
        if any(m is model for m in self.models):
            return False
        self.models.append(model)
        self.sharded = self.sharded or any(is_fsdp1_unit(m) for m in model.modules())
        # A later model's names do not replace an earlier one's (models may share modules).
        self._module_names = {**_module_names(model), **self._module_names}
        self._parameter_names = {**{id(p): name for name, p in model.named_parameters()}, **self._parameter_names}
        self._fsdp_params = [*_fsdp_params(model), *self._fsdp_params]  # the earlier model's last: its names win
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
        for j, variable in leaf_variables(graph):
            if j not in exits and variable is not None and variable.dtype in _UNSCALABLE_PARAMETER_DTYPES:
                name = self.parameter_names.get(id(variable), f"of shape {tuple(variable.shape)}")
                raise ValueError(
                    f"GradientScaler: parameter {name} is {variable.dtype}; its gradient cannot be unscaled in "
                    f"{variable.dtype} without underflow. Keep parameters in float32 (no model.half(), no FSDP2 "
                    "MixedPrecisionPolicy(param_dtype=torch.float16)) and run the forward under torch.autocast "
                    "(torch.amp.GradScaler refuses fp16 gradients too)."
                )

    def refuse_fp16_communication(self) -> None:
        """DDP with an fp16 compression hook all-reduces the true gradients in fp16, where what this scaler
        unscaled below fp16's range flushes to zero (at a median of 4e-9 every value was lost)."""
        for model in self.models:
            for hook, _ in getattr(model, "_comm_hooks", ()):
                name = getattr(hook, "__qualname__", "")
                if "fp16_compress" in name:
                    raise ValueError(
                        f"GradientScaler: DDP's communication hook {name} all-reduces gradients in fp16, and they "
                        "arrive there unscaled (true values), so those below fp16's range (6e-8) become 0. Register "
                        "bf16_compress_hook (bf16 has fp32's range) or no compression hook."
                    )

    def _unsharded(self) -> Iterator[tuple[_FSDPParamNames, torch.Tensor]]:
        """FSDP2's unsharded parameters, which its forward puts in the modules and the autograd graph keeps as
        leaves; each is made at its first all-gather (the first forward's) and kept, its storage freed and refilled."""
        for names in self._fsdp_params:
            param = getattr(names.record, "_unsharded_param", None)
            if param is not None:
                yield names, param

    def _buffers(self) -> list[torch.Tensor]:
        """The attached models' buffers, each once (models may share modules)."""
        return list({id(b): b for model in self.models for b in model.buffers()}.values())


def is_fsdp1_unit(module: nn.Module) -> bool:
    """Whether ``module`` is a ``FullyShardedDataParallel`` unit (FSDP1: plain tensors, each rank's shard)."""
    if not torch.distributed.is_available():
        return False
    # Imports torch.distributed's FSDP machinery: only here.
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel)


def _module_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for module_name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            names.setdefault(id(param), _layer_name(module_name, module))
    return names


def _layer_name(module_name: str, module: nn.Module) -> str:
    """A module's name for the layers it owns: as the model had before torch.compile; the root's, its type's."""
    return ".".join(part for part in module_name.split(".") if part != "_orig_mod") or type(module).__name__


def _fsdp_params(model: nn.Module) -> list[_FSDPParamNames]:
    """The records FSDP2 (``fully_shard``) keeps of ``model``'s parameters, with their names.

    ``model.parameters()`` holds the sharded parameters (DTensors); the forward swaps in unsharded ones,
    which the autograd graph's leaves are, so those are named through these records.
    """
    names = {id(module): module_name for module_name, module in model.named_modules()}
    records = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)  # FSDP2's FSDPModule
        if get_state is None:
            continue
        state = get_state()
        # Older torch keeps one group per module.
        groups = state._fsdp_param_groups if hasattr(state, "_fsdp_param_groups") else [state._fsdp_param_group]
        for record in (record for group in groups if group is not None for record in group.fsdp_params):
            owner, param_name = record._module_info.module, record._module_info.param_name
            if id(owner) in names:
                module_name = names[id(owner)]
                parameter = f"{module_name}.{param_name}" if module_name else param_name  # as named_parameters() has it
                records.append(_FSDPParamNames(record, _layer_name(module_name, owner), parameter))
    return records


def _same_layout(tensors: list[torch.Tensor], copies: list[torch.Tensor]) -> bool:
    return len(tensors) == len(copies) and all(
        t.shape == c.shape and t.dtype == c.dtype and t.device == c.device for t, c in zip(tensors, copies)
    )
