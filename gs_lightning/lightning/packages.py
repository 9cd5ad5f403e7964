"""The Lightning Trainer packages installed: ``lightning.pytorch`` and/or ``pytorch_lightning``.

The two are the same source under two names, and neither accepts the other's classes
(``pytorch_lightning.Trainer`` rejects a ``lightning.pytorch`` precision plugin: "Found invalid type
for plugin"). So that one :class:`~gs_lightning.GradientScalingPlugin` works in either Trainer, the
plugins derive from the ``Precision`` of every installed package, and each call that Lightning's
base class implements with package-specific globals is routed to the base class of the package
the LightningModule comes from (:func:`package_of`).
"""

from __future__ import annotations

import warnings
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
    WandbLogger: type
    # The loggers the callback knows (CSV, TensorBoard, W&B): any other gets the scalars and a note.
    known_loggers: tuple[type, ...]


def _load(name: str) -> LightningPackage | None:
    """The package's names; ``None``, with a warning, for one that lacks them (a Lightning 1.x install)."""
    root = name.partition(".")[0]
    if find_spec(root) is None or find_spec(name) is None:
        return None
    try:
        loggers = import_module(f"{name}.loggers")  # the classes import without their optional packages
        return LightningPackage(
            name=name,
            Precision=import_module(f"{name}.plugins.precision").Precision,
            LightningModule=import_module(name).LightningModule,
            MisconfigurationException=import_module(f"{name}.utilities.exceptions").MisconfigurationException,
            WandbLogger=loggers.WandbLogger,
            known_loggers=(loggers.CSVLogger, loggers.TensorBoardLogger, loggers.WandbLogger),
        )
    except (ImportError, AttributeError) as error:
        warnings.warn(
            f"gs_lightning: the installed {name} lacks Lightning 2's names ({error}); its Trainer will not accept "
            "gs_lightning's plugins (supported: Lightning >= 2.4)",
            stacklevel=2,
        )
        return None


PACKAGES: tuple[LightningPackage, ...] = tuple(
    package for package in map(_load, ("lightning.pytorch", "pytorch_lightning")) if package is not None
)
if not PACKAGES:
    raise ModuleNotFoundError(
        "gs_lightning.lightning needs a Lightning Trainer package: pip install lightning (or pytorch_lightning)"
    )

LIGHTNING_MODULES: tuple[type, ...] = tuple(package.LightningModule for package in PACKAGES)
WANDB_LOGGERS: tuple[type, ...] = tuple(package.WandbLogger for package in PACKAGES)
KNOWN_LOGGERS: tuple[type, ...] = tuple(logger for package in PACKAGES for logger in package.known_loggers)


def package_of(module: Any) -> LightningPackage:
    """The package whose ``LightningModule`` ``module`` is (the first installed one for anything else)."""
    return next((package for package in PACKAGES if isinstance(module, package.LightningModule)), PACKAGES[0])
