"""Shared tiny pieces for the tests: a Linear classifier LightningModule, its random data and a
quiet CPU Trainer (import them as ``from conftest import Classifier, loader, make_trainer``: pytest
puts this folder on ``sys.path``), and the ``bench_module`` fixture for the bench scripts."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from importlib import import_module
from pathlib import Path
from types import ModuleType

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

_G = torch.Generator().manual_seed(0)
# 32 samples of 8 features, 4 classes: 8 steps of batch 4 per epoch.
DATA = TensorDataset(torch.randn(32, 8, generator=_G), torch.randint(0, 4, (32,), generator=_G))


def loader(batch_size: int = 4, shuffle: bool = False) -> DataLoader:
    """The shared random data, in order unless ``shuffle``."""
    return DataLoader(DATA, batch_size=batch_size, shuffle=shuffle)


class Classifier(L.LightningModule):
    """``net``: Linear(8, 16) → [BatchNorm1d] → ReLU → ``hidden_layers`` × Linear(16, 16) → Linear(16, 4).

    SGD with momentum (or Adam) and a per-step StepLR. The training loss becomes inf at the global
    steps in ``inf_steps``; ``inf_inputs`` instead puts an inf into the input batch at those steps,
    so that it also reaches BatchNorm's running statistics. Validation logs ``val/loss``.
    """

    def __init__(
        self,
        inf_steps: Iterable[int] = (),
        optimizer: str = "sgd",
        hidden_layers: int = 0,
        batch_norm: bool = False,
        inf_inputs: bool = False,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(8, 16)]
        if batch_norm:
            layers.append(nn.BatchNorm1d(16))
        layers.append(nn.ReLU())
        layers += [nn.Linear(16, 16) for _ in range(hidden_layers)]
        layers.append(nn.Linear(16, 4))
        self.net = nn.Sequential(*layers)
        self.inf_steps = tuple(inf_steps)
        self.inf_inputs = inf_inputs
        self.optimizer = optimizer
        self.output_dtypes: set[torch.dtype] = set()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        overflow = self.global_step in self.inf_steps
        if overflow and self.inf_inputs:
            x = x.clone()
            x[0, 0] = float("inf")
        out = self.net(x)
        self.output_dtypes.add(out.dtype)
        loss = F.cross_entropy(out, y)
        return loss * float("inf") if overflow and not self.inf_inputs else loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> dict:
        if self.optimizer == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def make_trainer(
    plugin: Precision | None = None,
    max_steps: int = 4,
    callbacks: Iterable[Callback] = (),
    package: str = "lightning.pytorch",
    **kwargs,
) -> L.Trainer:
    """A quiet one-device CPU Trainer of ``package`` (or ``"pytorch_lightning"``): no logger,
    checkpoints, progress bar or model summary unless asked."""
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("enable_model_summary", False)
    return import_module(package).Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        plugins=[plugin] if plugin is not None else None,
        callbacks=list(callbacks),
        **kwargs,
    )


@pytest.fixture(params=["lightning.pytorch", "pytorch_lightning"])
def lightning_package(request: pytest.FixtureRequest) -> str:
    """Each Lightning Trainer package in turn: gs_lightning's plugins must work in both."""
    return request.param


BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], ModuleType]]:
    """``bench_module(name)`` imports ``bench/<name>.py`` as the top-level module it is when run from
    ``bench/``; the bench modules it imported are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(BENCH))
    before = set(sys.modules)
    yield import_module
    for name in set(sys.modules) - before:
        if Path(getattr(sys.modules[name], "__file__", None) or "/").parent == BENCH:
            del sys.modules[name]


@pytest.fixture
def measured_weights(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The layers whose weight gradients updates compute exactly (``NodeDecisions._measured_weight_maximum``), in the
    order measured; clear it between iterations."""
    from gs_lightning.scaling.decide import NodeDecisions

    measured: list[str] = []
    measure = NodeDecisions._measured_weight_maximum

    def spy(self: NodeDecisions, i: int, grad: torch.Tensor) -> torch.Tensor | None:
        measured.append(self.analysis.layer_names[i])
        return measure(self, i, grad)

    monkeypatch.setattr(NodeDecisions, "_measured_weight_maximum", spy)
    return measured
