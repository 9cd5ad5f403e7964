"""Framework-free core: per-gradient power-of-two scaling on PyTorch's autograd graph.

Imports only torch. ``GradientScaler`` is the entry point and ``ScalingRecipe`` its policy (every
setting and rule, in one frozen config); ``graph`` reads autograd's backward
DAG, ``update`` decides the scales on an update iteration, ``plan`` replays them in between,
``underflow`` holds the statistical model, ``finite`` the fused finiteness check, ``formats`` the
ranges.
"""

from gs_lightning.scaling.decide import LayerScale
from gs_lightning.scaling.formats import FORMATS, FloatFormat, float_format
from gs_lightning.scaling.recipe import ScalingRecipe
from gs_lightning.scaling.scaler import GradientScaler

__all__ = ["FORMATS", "FloatFormat", "GradientScaler", "LayerScale", "ScalingRecipe", "float_format"]
