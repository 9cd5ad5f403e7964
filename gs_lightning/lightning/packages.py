"""The Lightning Trainer packages installed: ``lightning.pytorch`` and/or ``pytorch_lightning``.

The two are the same source under two names, and neither accepts the other's classes
(``pytorch_lightning.Trainer`` rejects a ``lightning.pytorch`` precision plugin: "Found invalid type
for plugin"). So that one :class:`~gs_lightning.GradientScalingPlugin` works in either Trainer, the
plugins derive from the ``Precision`` of every installed package, and each call that Lightning's
base class implements with package-specific globals is routed to the base class of the package
the LightningModule comes from (:func:`package_of`).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from importlib.util import find_spec
from typing import Any


@dataclass(frozen=True)
class LightningPackage:
    """The few names the plugins need from one Lightning Trainer package."""

    name: str
    Precision: type
    LightningModule: type
    MisconfigurationException: type[Exception]


def _load(name: str) -> LightningPackage:
    return LightningPackage(
        name=name,
        Precision=import_module(f"{name}.plugins.precision").Precision,
        LightningModule=import_module(name).LightningModule,
        MisconfigurationException=import_module(f"{name}.utilities.exceptions").MisconfigurationException,
    )


def _installed(name: str) -> bool:
    root = name.partition(".")[0]
    return find_spec(root) is not None and find_spec(name) is not None


PACKAGES: tuple[LightningPackage, ...] = tuple(
    _load(name) for name in ("lightning.pytorch", "pytorch_lightning") if _installed(name)
)
if not PACKAGES:
    raise ModuleNotFoundError(
        "gs_lightning.lightning needs a Lightning Trainer package: pip install lightning (or pytorch_lightning)"
    )

LIGHTNING_MODULES: tuple[type, ...] = tuple(package.LightningModule for package in PACKAGES)


def package_of(module: Any) -> LightningPackage:
    """The package whose ``LightningModule`` ``module`` is (the first installed one for anything else)."""
    return next((package for package in PACKAGES if isinstance(module, package.LightningModule)), PACKAGES[0])
