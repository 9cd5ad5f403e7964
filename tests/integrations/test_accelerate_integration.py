"""install_gradient_scaler in Accelerate's own loop (``accelerator.backward``, ``clip_grad_norm_``,
``accumulate``, the prepared optimizer and LR scheduler, ``save_state``/``load_state``), on a CPU in
fp16 autocast, against the same loop with ``torch.amp.GradScaler("cpu")`` installed the same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.data_loader import skip_first_batches
from integration_helpers import InfInjector, OutputDtypes, fresh_accelerate_state, reset_accelerate_state
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gs_lightning import GradientScaler
from gs_lightning.integrations import install_gradient_scaler

pytestmark = pytest.mark.usefixtures(fresh_accelerate_state.__name__)

_G = torch.Generator().manual_seed(0)
DATA = TensorDataset(torch.randn(48, 8, generator=_G), torch.randint(0, 4, (48,), generator=_G))  # 12 batches of 4


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def make_scaler(kind: str, model: nn.Module) -> GradientScaler | torch.amp.GradScaler:
    return GradientScaler(model) if kind == "gs" else torch.amp.GradScaler("cpu")


@dataclass
class Run:
    """What one run of the loop recorded, per optimizer step."""

    skipped: list[bool] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    dtypes: set[torch.dtype] = field(default_factory=set)
    scaler: GradientScaler | torch.amp.GradScaler | None = None


def train(
    kind: str,
    *,
    install: str = "before",
    batches: int = 8,
    accumulation: int = 1,
    inject: str = "parameter",
    inf_batches: tuple[int, ...] = (),
    save_after: int | None = None,
    resume_from: Path | None = None,
    checkpoint_dir: Path | None = None,
) -> Run:
    """Accelerate's documented loop: ``accumulate``, ``backward``, ``clip_grad_norm_`` on the syncing
    micro-batch, ``optimizer.step``, ``scheduler.step``, ``zero_grad``. An inf is written into a
    gradient on the micro-batches in ``inf_batches``. ``save_after``: ``save_state`` after that many
    micro-batches; ``resume_from``: ``load_state`` and skip the batches the saved run did."""
    run = Run()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16", gradient_accumulation_steps=accumulation)
    injector = InfInjector(model[2], inject, inf_batches)
    dtypes = OutputDtypes(model[0])
    scaler = make_scaler(kind, model)
    if install == "before":
        install_gradient_scaler(accelerator, scaler)
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, DataLoader(DATA, batch_size=4), scheduler
    )
    if install == "after":
        install_gradient_scaler(accelerator, scaler)
    first = 0
    if resume_from is not None:
        accelerator.load_state(resume_from)
        first = int(resume_from.name.rsplit("_", 1)[1])
        loader = skip_first_batches(loader, first)
    for i, (x, y) in enumerate(loader, start=first):
        if i == batches:
            break
        injector.step = i
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                run.norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                run.skipped.append(accelerator.optimizer_step_was_skipped)
                run.lrs.append(scheduler.get_last_lr()[0])
        if save_after is not None and i + 1 == save_after:
            accelerator.save_state(checkpoint_dir / f"state_{save_after}")
    assert sorted(set(injector.injected)) == sorted(b for b in inf_batches if first <= b < batches)
    run.params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    run.dtypes, run.scaler = dtypes.seen, accelerator.scaler
    return run


@pytest.mark.parametrize("install", ["before", "after"])
def test_fp16_autocast_on_cpu_where_accelerate_trains_fp32(install: str) -> None:
    plain = Accelerator(cpu=True, mixed_precision="fp16")
    assert plain.mixed_precision == "fp16" and plain.scaler is None and not plain.native_amp  # Accelerate's silent fp32
    run = train("gs", install=install, batches=2)
    assert run.dtypes == {torch.float16}
    assert run.scaler.iteration == 2


def test_unwrap_model_removes_the_autocast_added_after_prepare() -> None:
    model = make_model()
    dtypes = OutputDtypes(model[0])
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    prepared = accelerator.prepare(model)
    install_gradient_scaler(accelerator, GradientScaler(model))
    prepared(DATA.tensors[0][:4])
    assert dtypes.seen == {torch.float16}
    accelerator.unwrap_model(prepared, keep_fp32_wrapper=False)(DATA.tensors[0][:4])  # as save_model unwraps
    assert dtypes.seen == {torch.float16, torch.float32}


def test_without_the_helper_accelerate_trains_fp32_on_cpu() -> None:
    model = make_model()
    dtypes = OutputDtypes(model[0])
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    model = accelerator.prepare(model)
    model(DATA.tensors[0][:4])
    with accelerator.autocast():
        model(DATA.tensors[0][:4])
    assert dtypes.seen == {torch.float32}


@pytest.mark.parametrize("inject", ["parameter", "activation"])
@pytest.mark.parametrize("install", ["before", "after"])
def test_injected_infs_skip_the_same_steps_as_gradscaler(inject: str, install: str) -> None:
    runs = {kind: train(kind, install=install, inject=inject, inf_batches=(2, 5)) for kind in ("gs", "ref")}
    expected = [i in (2, 5) for i in range(8)]
    assert runs["gs"].skipped == runs["ref"].skipped == expected
    assert runs["gs"].scaler.skipped_steps == 2
    # the prepared scheduler holds the LR on a skipped step, as with GradScaler
    assert runs["gs"].lrs == runs["ref"].lrs
    assert runs["gs"].lrs[2] == runs["gs"].lrs[1] and runs["gs"].lrs[3] < runs["gs"].lrs[2]


def test_replaces_the_gradscaler_prepare_gave_the_optimizer() -> None:
    """On a GPU, Accelerate makes a GradScaler and ``prepare`` hands it to each optimizer; installed after, the
    GradientScaler must replace it there too (setting ``accelerator.scaler`` alone fails at the next step with
    ``Attempted step but _scale is None``). Here a GradScaler installed before ``prepare`` stands in for
    Accelerate's."""
    model = make_model()
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    install_gradient_scaler(accelerator, torch.amp.GradScaler("cpu"))
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = install_gradient_scaler(accelerator, GradientScaler(model))
    assert optimizer.scaler is scaler is accelerator.scaler
    x, y = DATA.tensors[0][:4], DATA.tensors[1][:4]
    for loss_factor, skipped in ((1.0, False), (float("inf"), True), (1.0, False)):
        accelerator.backward(F.cross_entropy(model(x), y) * loss_factor)
        optimizer.step()
        optimizer.zero_grad()
        assert optimizer.step_was_skipped is skipped
    assert (scaler.iteration, scaler.skipped_steps) == (3, 1)


def test_clip_norms_equal_gradscaler_and_no_step_skipped() -> None:
    gs, ref = train("gs", batches=10), train("ref", batches=10)
    assert gs.skipped == ref.skipped == [False] * 10
    assert gs.norms[0] == ref.norms[0]  # same weights, same batch: the same true gradient
    torch.testing.assert_close(torch.tensor(gs.norms), torch.tensor(ref.norms), rtol=1e-3, atol=0)
    for p, q in zip(gs.params, ref.params):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)


def test_accumulate_skips_the_step_whose_micro_batch_overflowed() -> None:
    runs = {kind: train(kind, batches=8, accumulation=2, inf_batches=(3,)) for kind in ("gs", "ref")}
    assert runs["gs"].skipped == runs["ref"].skipped == [False, True, False, False]
    assert runs["gs"].scaler.iteration == 8  # one scaled backward per micro-batch
    torch.testing.assert_close(
        torch.tensor(runs["gs"].norms), torch.tensor(runs["ref"].norms), rtol=1e-3, atol=0, equal_nan=True
    )


def test_save_state_load_state_resumes_bit_identically(tmp_path: Path) -> None:
    straight = train("gs", batches=8, inf_batches=(5,), save_after=4, checkpoint_dir=tmp_path)
    assert (tmp_path / "state_4" / "scaler.pt").is_file()
    reset_accelerate_state()
    resumed = train("gs", batches=8, inf_batches=(5,), resume_from=tmp_path / "state_4")
    assert resumed.skipped == straight.skipped[4:] == [False, True, False, False]
    assert resumed.scaler.state_dict() == straight.scaler.state_dict()
    for p, q in zip(resumed.params, straight.params):
        assert torch.equal(p, q)


def test_bad_input_is_named() -> None:
    model = make_model()
    with pytest.raises(TypeError, match="GradientScaler or torch.amp.GradScaler"):
        install_gradient_scaler(Accelerator(cpu=True, mixed_precision="fp16"), model)
    reset_accelerate_state()
    with pytest.raises(ValueError, match="mixed_precision='no'"):
        install_gradient_scaler(Accelerator(cpu=True), GradientScaler(model))
    with pytest.raises(TypeError, match="accelerate.Accelerator"):
        install_gradient_scaler(object(), GradientScaler(model))
