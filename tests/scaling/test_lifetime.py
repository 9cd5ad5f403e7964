"""A scaler, and the model it attached, go with their last reference, as torch.amp.GradScaler does: no cycle
keeps them for the garbage collector (under FSDP, until after the process group is gone)."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from gs_lightning import GradientScaler


def _trained() -> tuple[weakref.ref, weakref.ref]:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    scaler, optimizer = GradientScaler(model, update_interval=2), torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):  # an update, a replay, an update
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().square().mean()
        scaler.backward(loss)
        scaler.step(optimizer)
        scaler.update()
    return weakref.ref(model), weakref.ref(scaler)


def test_a_scaler_and_its_model_are_freed_without_the_garbage_collector() -> None:
    _trained()  # first calls import and cache what they need
    gc.collect()
    gc.disable()
    try:
        model, scaler = _trained()
        assert scaler() is None and model() is None
    finally:
        gc.enable()
