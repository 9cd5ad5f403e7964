"""Framework-free core: per-gradient power-of-two scaling on PyTorch's autograd graph.

Imports only torch. ``GradientScaler`` is the entry point; ``underflow`` holds the paper's
statistical model, ``graph`` the reading of autograd's backward DAG, ``formats`` the ranges.
"""

from gs_lightning.scaling.formats import FORMATS, FloatFormat, float_format
from gs_lightning.scaling.scaler import GradientScaler, LayerScale

__all__ = ["FORMATS", "FloatFormat", "GradientScaler", "LayerScale", "float_format"]
