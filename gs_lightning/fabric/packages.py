"""The Lightning Fabric packages installed: ``lightning.fabric`` and/or ``lightning_fabric``.

They are the same source under two names, and each ``Fabric`` accepts only its own ``Precision``
subclasses, so the Fabric plugins derive from the ``Precision`` of every installed package. Their
base class methods use no package-specific globals, so nothing needs routing (unlike the Trainer's,
see :mod:`gs_lightning.lightning.packages`).
"""

from __future__ import annotations

from importlib import import_module
from importlib.util import find_spec


def _installed(name: str) -> bool:
    root = name.partition(".")[0]
    return find_spec(root) is not None and find_spec(name) is not None


FABRIC_PRECISIONS: tuple[type, ...] = tuple(
    import_module(f"{name}.plugins.precision").Precision
    for name in ("lightning.fabric", "lightning_fabric")
    if _installed(name)
)
if not FABRIC_PRECISIONS:
    raise ModuleNotFoundError("gs_lightning.fabric needs Lightning Fabric: pip install lightning (or lightning_fabric)")
