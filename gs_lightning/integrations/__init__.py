"""GradientScaler in other libraries' training loops, each in one or two lines.

* Hugging Face Accelerate: :func:`install_gradient_scaler` (``gs_lightning.integrations.accelerate``).
* Transformers ``Trainer``: :class:`GradientScalingTrainer`, or :class:`GradientScalingMixin` for a
  ``Trainer`` subclass (``gs_lightning.integrations.transformers``).
* timm: :class:`TimmGradientScaler`, timm's ``loss_scaler`` (``gs_lightning.integrations.timm``).

Each name is loaded on first use (PEP 562) and imports only its own library: ``import
gs_lightning.integrations`` needs none of them (``pip install "gs_lightning[integrations]"``).
"""

from importlib import import_module
from typing import Any

_MODULE_OF = {
    "install_gradient_scaler": "accelerate",
    "GradientScalingMixin": "transformers",
    "GradientScalingTrainer": "transformers",
    "TimmGradientScaler": "timm",
}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
