"""Emulated low precision on the CPU, and the fp8-gradient baselines GS is compared with.

``emulate`` runs fp16 GEMMs and convolutions at fp32 speed with fp16 results (and can round
the gradients backward GEMMs produce to an fp8 format); ``DelayedScaling`` is Transformer
Engine's per-tensor amax scaling of those gradients; ``methods`` holds the training-loop
methods (no scaling, fixed and dynamic loss scale, per-tensor amax) beside ``GradientScaler``.
"""

from gs_lightning.simulate.delayed_scaling import DelayedScaling
from gs_lightning.simulate.emulation import UnderflowMeter, emulate
from gs_lightning.simulate.rounding import round_to

__all__ = ["DelayedScaling", "UnderflowMeter", "emulate", "round_to"]
