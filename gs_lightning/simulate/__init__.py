"""Emulated low precision on the CPU, and the fp8-gradient baselines GS is compared with.

``emulate`` runs fp16 GEMMs and convolutions at fp32 speed with fp16 results, and can cast the
backward's gradients to an fp8 format: the gradients backward GEMMs produce (the fp16 path) or
those entering them (the fp8 hardware path). The fp8 scaling recipes: ``DelayedScaling``
(Transformer Engine's per-tensor amax history), ``CurrentScaling`` (each tensor's own amax, as
TE's ``Float8CurrentScaling`` and torchao) and ``MXBlockScaling`` (OCP MX: a power-of-two scale
per 32 values); ``pow2_oracle_underflow`` is the floor any per-tensor power-of-two scale can reach.
``methods`` holds the training-loop methods (no scaling, fixed and dynamic loss scale, fp8
recipes) beside ``GradientScaler``.
"""

from gs_lightning.simulate.delayed_scaling import DelayedScaling
from gs_lightning.simulate.emulation import UnderflowMeter, emulate
from gs_lightning.simulate.grad_scaling import (
    CurrentScaling,
    GradScaling,
    MXBlockScaling,
    largest_pow2_scale,
    pow2_oracle_underflow,
)
from gs_lightning.simulate.rounding import round_to

__all__ = [
    "CurrentScaling",
    "DelayedScaling",
    "GradScaling",
    "MXBlockScaling",
    "UnderflowMeter",
    "emulate",
    "largest_pow2_scale",
    "pow2_oracle_underflow",
    "round_to",
]
