"""Shared pieces of the integration tests: writing an inf into a gradient at chosen steps, recording
the dtype a layer computed in, and resetting Accelerate's process-wide state between tests
(``from integration_helpers import ...``: pytest puts this folder on ``sys.path``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from torch import nn


class InfInjector:
    """Writes an inf into one element of a gradient on the steps in ``steps`` (``injector.step`` is
    set by the loop): into ``module.weight``'s gradient through a hook on the parameter
    (``"parameter"``), or into the gradient of ``module``'s output through a hook on that
    activation, so that every layer below receives it (``"activation"``)."""

    def __init__(self, module: nn.Module, where: Literal["parameter", "activation"], steps: Iterable[int]) -> None:
        self.steps = set(steps)
        self.step = 0
        self.injected: list[int] = []
        if where == "parameter":
            module.weight.register_hook(self._write_inf)
        elif where == "activation":
            module.register_forward_hook(self._hook_output)
        else:
            raise ValueError(f"InfInjector: where must be 'parameter' or 'activation', got {where!r}")

    def _hook_output(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(self._write_inf)

    def _write_inf(self, grad: torch.Tensor) -> torch.Tensor | None:
        if self.step not in self.steps:
            return None
        self.injected.append(self.step)
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad


class OutputDtypes:
    """The dtypes ``module``'s forward returned (float16 under fp16 autocast)."""

    def __init__(self, module: nn.Module) -> None:
        self.seen: set[torch.dtype] = set()
        module.register_forward_hook(lambda m, i, output: self.seen.add(output.dtype))


def reset_accelerate_state() -> None:
    """Forget Accelerate's per-process state (``AcceleratorState``, ``GradientState``), as its own tests do,
    so that the next ``Accelerator`` may have other settings."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    """Each test builds its own Accelerators."""
    yield
    reset_accelerate_state()
