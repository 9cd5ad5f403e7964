"""Run the Trainer tests in each Lightning package: ``lightning.pytorch`` and ``pytorch_lightning``.

``pytorch_lightning`` is ``lightning.pytorch``'s source under another name, and each Trainer takes
only its own package's ``LightningModule`` (and finds only its own ``ModelCheckpoint``).
:func:`on_package` rebuilds a test LightningModule of ``conftest`` on another package's base class,
so both packages train the very same model code (``conftest.make_trainer(package=...)`` builds
either package's Trainer). Callbacks need no rebuilding: Trainers call them by hook name.
"""

from __future__ import annotations

import functools
import types
from importlib import import_module

from lightning.pytorch import LightningModule


@functools.cache
def on_package(cls: type, package_name: str) -> type:
    """``cls`` (a ``lightning.pytorch.LightningModule`` subclass, single inheritance) on ``package_name``'s
    LightningModule."""
    if issubclass(cls, import_module(package_name).LightningModule):
        return cls
    (parent,) = cls.__bases__
    base = (
        import_module(package_name).LightningModule if parent is LightningModule else on_package(parent, package_name)
    )
    namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    rebuilt = types.new_class(cls.__name__, (base,), exec_body=lambda ns: ns.update(namespace))
    for name, value in namespace.items():  # zero-argument super() refers to the class it was written in
        if isinstance(value, types.FunctionType) and "__class__" in value.__code__.co_freevars:
            setattr(rebuilt, name, _with_class_cell(value, rebuilt))
    return rebuilt


def _with_class_cell(function: types.FunctionType, cls: type) -> types.FunctionType:
    cells = tuple(
        types.CellType(cls) if name == "__class__" else cell
        for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ())
    )
    rebuilt = types.FunctionType(
        function.__code__, function.__globals__, function.__name__, function.__defaults__, cells
    )
    rebuilt.__kwdefaults__ = function.__kwdefaults__
    rebuilt.__qualname__ = function.__qualname__
    return rebuilt
