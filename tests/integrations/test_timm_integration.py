"""TimmGradientScaler as timm's ``loss_scaler``: the call timm's training script makes (backward,
clip in modes norm/value/agc, ``need_update`` for accumulation, ``create_graph``), its checkpoint
round trip through ``CheckpointSaver`` and ``resume_checkpoint`` (``weights_only=True``), on a tiny
ViT in fp16 autocast on a CPU, against timm's ``NativeScaler("cpu")``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from integration_helpers import InfInjector
from timm.models import VisionTransformer, model_parameters, resume_checkpoint
from timm.utils import CheckpointSaver, NativeScaler

from gs_lightning import GradientScaler
from gs_lightning.integrations import TimmGradientScaler

_G = torch.Generator().manual_seed(0)
IMAGES, LABELS = torch.randn(32, 3, 16, 16, generator=_G), torch.randint(0, 4, (32,), generator=_G)  # 8 batches of 4


def tiny_vit() -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=4)


class NativeScalerFromScale(NativeScaler):
    """timm's ``NativeScaler`` with its ``GradScaler`` starting at 2^10: from timm's 2^16 the first backward
    of this ViT overflows and GradScaler skips its first steps on its own, so the runs would part there."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self._scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)


@dataclass
class Run:
    """What the optimizer used, per batch that stepped: the gradients it read (after clipping)."""

    stepped: list[int] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    loss_scaler: TimmGradientScaler | NativeScaler | None = None


def train(
    kind: str,
    *,
    batches: int = 4,
    clip_mode: str = "norm",
    clip_grad: float | None = 0.5,
    accumulation: int = 1,
    inf_batches: tuple[int, ...] = (),
    create_graph: bool = False,
    save_after: int | None = None,
    resume_from: Path | None = None,
    checkpoint_dir: Path | None = None,
) -> Run:
    """timm's ``train_one_epoch`` in brief: autocast forward, the loss divided for accumulation,
    ``loss_scaler(...)`` with ``need_update`` on the last micro-batch, ``zero_grad`` after an update."""
    run = Run()
    model = tiny_vit()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    loss_scaler = {
        "gs": lambda: TimmGradientScaler(GradientScaler(model)),
        "ref": NativeScalerFromScale,
        "native": lambda: NativeScaler("cpu"),
    }[kind]()
    injector = InfInjector(model.blocks[0].mlp.fc1, "parameter", inf_batches)
    batch = 0

    def record(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        run.stepped.append(batch)
        run.grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))

    optimizer.register_step_pre_hook(record)
    first = 0
    if resume_from is not None:
        resume_checkpoint(model, str(resume_from), optimizer, loss_scaler)  # weights_only=True, timm's default
        first = int(resume_from.name.split("-")[2].split(".")[0])
    saver = (
        CheckpointSaver(model, optimizer, amp_scaler=loss_scaler, recovery_dir=str(checkpoint_dir))
        if save_after
        else None
    )
    for batch in range(first, batches):
        injector.step = batch
        need_update = (batch + 1) % accumulation == 0
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (
                F.cross_entropy(model(IMAGES[4 * batch : 4 * batch + 4]), LABELS[4 * batch : 4 * batch + 4])
                / accumulation
            )
        loss_scaler(
            loss,
            optimizer,
            clip_grad=clip_grad,
            clip_mode=clip_mode,
            parameters=model_parameters(model, exclude_head="agc" in clip_mode),
            create_graph=create_graph,
            need_update=need_update,
        )
        if need_update:
            optimizer.zero_grad()
        if saver is not None and batch + 1 == save_after:
            saver.save_recovery(epoch=0, batch_idx=batch + 1)
    run.params = [p.detach().clone() for p in model.parameters()]
    run.loss_scaler = loss_scaler
    return run


def norms(run: Run) -> torch.Tensor:
    return torch.stack([g.norm() for g in run.grads])


@pytest.mark.parametrize(("clip_mode", "clip_grad"), [("norm", 0.5), ("value", 0.01), ("agc", 0.01), ("norm", None)])
def test_clipped_gradients_equal_native_scalers_and_no_step_skipped(clip_mode: str, clip_grad: float | None) -> None:
    gs, ref = (
        train("gs", clip_mode=clip_mode, clip_grad=clip_grad),
        train("ref", clip_mode=clip_mode, clip_grad=clip_grad),
    )
    assert gs.stepped == ref.stepped == [0, 1, 2, 3]
    torch.testing.assert_close(gs.grads[0], ref.grads[0], rtol=1e-3, atol=1e-6)  # same weights, same batch
    # later, AdamW's first steps move each weight by about the LR whatever its gradient's size, so the
    # tiniest gradients part by more than fp16's rounding; what clipping decides, the norm, stays equal
    torch.testing.assert_close(norms(gs), norms(ref), rtol=1e-3, atol=0)
    if clip_mode == "norm" and clip_grad is not None:
        assert max(float(g.norm()) for g in gs.grads) == pytest.approx(clip_grad, rel=1e-5)  # the clip bit


def test_native_scaler_skips_where_gradient_scaler_does_not() -> None:
    gs, native = train("gs"), train("native")
    assert gs.stepped == [0, 1, 2, 3] and native.stepped[0] != 0  # GradScaler's 2^16 overflowed the first backward


@pytest.mark.parametrize("clip_mode", ["norm", "value", "agc"])
def test_injected_inf_skips_the_step_native_scaler_skips(clip_mode: str) -> None:
    gs, ref = (train(kind, batches=5, clip_mode=clip_mode, clip_grad=0.01, inf_batches=(2,)) for kind in ("gs", "ref"))
    assert gs.stepped == ref.stepped == [0, 1, 3, 4]
    assert gs.loss_scaler.scaler.skipped_steps == 1


def test_need_update_accumulates_and_skips_the_overflowing_update() -> None:
    gs, ref = (train(kind, batches=8, accumulation=2, inf_batches=(5,)) for kind in ("gs", "ref"))
    assert gs.stepped == ref.stepped == [1, 3, 7]  # the update of batches 4-5 is skipped
    assert gs.loss_scaler.scaler.iteration == 8
    for g, r in zip(gs.grads, ref.grads):
        torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-6)


# PyTorch's, on any such backward
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
def test_create_graph_backward_steps_with_true_gradients() -> None:
    gs, ref = train("gs", batches=2, create_graph=True), train("ref", batches=2, create_graph=True)
    assert gs.stepped == ref.stepped == [0, 1]
    torch.testing.assert_close(gs.grads[1], ref.grads[1], rtol=1e-3, atol=1e-6)


def test_checkpoint_saver_and_resume_checkpoint_resume_bit_identically(tmp_path: Path) -> None:
    straight = train("gs", batches=6, inf_batches=(4,), save_after=3, checkpoint_dir=tmp_path)
    recovery = tmp_path / "recovery-0-3.pth.tar"
    assert recovery.is_file()
    saved = torch.load(recovery, weights_only=True)
    assert saved[TimmGradientScaler.state_dict_key]["iteration"] == 3
    resumed = train("gs", batches=6, inf_batches=(4,), resume_from=recovery)
    assert resumed.stepped == [3, 5]
    assert resumed.loss_scaler.state_dict() == straight.loss_scaler.state_dict()
    for p, q in zip(resumed.params, straight.params):
        assert torch.equal(p, q)


def test_bad_input_is_named() -> None:
    with pytest.raises(TypeError, match="timm.utils.NativeScaler"):
        TimmGradientScaler(torch.amp.GradScaler("cpu"))
    model = tiny_vit()
    loss_scaler = TimmGradientScaler(GradientScaler(model))
    loss = model(IMAGES[:4]).sum()
    with pytest.raises(ValueError, match="parameters to clip"):
        loss_scaler(loss, torch.optim.SGD(model.parameters(), lr=0.1), clip_grad=1.0)
