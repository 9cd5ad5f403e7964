"""Lightning's own tests of its fp16 precision plugin, run with ``GradientScalingPlugin`` (issue 15).

Ported from Lightning-AI/pytorch-lightning ``tests/tests_pytorch``: ``plugins/precision/test_amp.py``,
``plugins/precision/test_amp_integration.py``, ``plugins/test_amp_plugins.py`` (its last version,
``test_amp_gradient_unscale``) and ``trainer/optimization/test_manual_optimization.py`` (the tests that
run with ``precision="16-mixed"``). Upstream runs most of them on CUDA (some with DDP on two GPUs);
here they run on one CPU device, the property they check being the same. Each test names its
upstream test. Where upstream reads a ``GradScaler``-only value (its scale, its per-optimizer stage)
the port checks the property it protects, said in a comment there. The models are conftest's
``Classifier`` (two Linear layers, so that there is a layer gradient to scale) in place of
``BoringModel``'s single layer.

Covered elsewhere, not repeated: skipped steps and schedulers, resume, clipping by norm and by value
at a known norm, micro-batch accumulation (``test_plugins.py``); fused optimizers against a plain fp16
run (``test_fused_optimizers.py``); ``test_all.py`` (``tests/fabric/test_fabric_precision_parity.py``,
for both plugin families).
Not ported: ``test_amp_skip_optimizer`` (several optimizers in automatic optimization, gone from
Lightning 2); the autocast-cache tests (``test_torch_autocast_cache_behavior_*``,
``test_amp_forward_context_restores_grad_mode_context_managers``, ``..._keeps_cache_enabled``), which pin
how Lightning's ``MixedPrecision`` works around autocast's weight cache; the plugins here turn the
cache off, and ``test_amp_with_no_grad`` checks the behaviour both ways protect.
"""

from __future__ import annotations

import collections
from unittest import mock
from unittest.mock import Mock

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from conftest import Classifier, loader, make_trainer
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning_packages import on_package
from torch import nn
from torch.optim import Optimizer

from gs_lightning import GradientScaler, GradientScalingPlugin


def assert_empty_grad(grad: torch.Tensor | None) -> None:
    assert grad is None


def count_backwards(trainer):
    """Upstream's ``mock.patch.object(Strategy, "backward", wraps=...)``, on the Trainer's own package's Strategy."""
    return mock.patch.object(type(trainer.strategy), "backward", wraps=trainer.strategy.backward)


def assert_unscaled(scaler: GradientScaler, optimizer: Optimizer) -> None:
    """Upstream asserts the GradScaler's per-optimizer stage is UNSCALED. The property: ``unscale_`` has
    run for this optimizer in this iteration, so a second call is GradScaler's error."""
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called on this optimizer"):
        scaler.unscale_(optimizer)


def assert_scaling_happened(scaler: GradientScaler) -> None:
    """Upstream asserts ``scaler.get_scale() != 1.0`` (scaling is on). GradientScaler's ``get_scale()``
    is always 1; its layers' scales are what is on."""
    assert any(scale != 1.0 for scale in scaler.scales().values())


# --- plugins/precision/test_amp.py ------------------------------------------------------------------


@pytest.mark.parametrize("unscales_in_step", [False, True], ids=["", "optimizer_unscales_in_step"])
def test_clip_gradients(unscales_in_step: bool) -> None:
    """Clipping is a no-op when disabled and dispatches on the algorithm otherwise.

    ``optimizer_unscales_in_step`` is upstream's ``test_optimizer_amp_scaling_support_in_step_method``,
    inverted: ``MixedPrecision`` refuses to clip for an optimizer that unscales in its own step (fused
    Adam), whose ``.grad`` is still scaled then. With gradient scaling ``.grad`` is true: it clips."""
    optimizer = Mock(spec=Optimizer, _step_supports_amp_scaling=unscales_in_step)
    precision = GradientScalingPlugin(device="cpu")
    precision.clip_grad_by_value = Mock()
    precision.clip_grad_by_norm = Mock()
    precision.clip_gradients(optimizer)
    precision.clip_grad_by_value.assert_not_called()
    precision.clip_grad_by_norm.assert_not_called()

    precision.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.VALUE)
    precision.clip_grad_by_value.assert_called_once()
    precision.clip_grad_by_norm.assert_not_called()

    precision.clip_grad_by_value.reset_mock()
    precision.clip_grad_by_norm.reset_mock()

    precision.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM)
    precision.clip_grad_by_value.assert_not_called()
    precision.clip_grad_by_norm.assert_called_once()


@pytest.mark.parametrize("no_grad_context", [torch.no_grad, torch.inference_mode])
def test_amp_with_no_grad(no_grad_context) -> None:
    """A forward under no_grad (or inference_mode) inside the persistent autocast context does not break
    the gradient of a later forward (test_amp_with_no_grad, test_amp_with_inference_mode)."""
    layer = nn.Linear(2, 1)
    x = torch.randn(1, 2)
    amp = GradientScalingPlugin(device="cpu")
    with amp.forward_context():
        with no_grad_context():
            _ = layer(x)
        loss = layer(x).mean()
        loss.backward()
        assert loss.grad_fn is not None


# --- plugins/precision/test_amp_integration.py -------------------------------------------------------


class FusedOptimizerParityModel(Classifier):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused

    def configure_optimizers(self) -> Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1.0, fused=self.fused)


def test_amp_fused_optimizer_parity(lightning_package: str) -> None:
    """The regular and the fused Adam end with the same weights under the plugin."""

    def run(fused: bool) -> list[torch.Tensor]:
        L.seed_everything(1234)
        model = on_package(FusedOptimizerParityModel, lightning_package)(fused)
        trainer = make_trainer(GradientScalingPlugin(update_interval=2), max_steps=5, package=lightning_package)
        trainer.fit(model, loader())
        # Upstream asserts this in configure_optimizers; the plugin builds its scaler from the model when
        # the Trainer connects it, which is after configure_optimizers.
        assert isinstance(trainer.precision_plugin.scaler, GradientScaler)
        return list(model.parameters())

    for p, q in zip(run(fused=False), run(fused=True)):
        torch.testing.assert_close(p, q)


class SkipOddBatches(Classifier):
    def training_step(self, batch, batch_idx):
        if batch_idx % 2:
            return None  # skipping the backward should skip the grad scaler too
        return super().training_step(batch, batch_idx)


def test_skip_training_step_with_grad_scaler(lightning_package: str) -> None:
    """A training_step that returns None runs no backward: the scaler's unscale_, step and update are
    skipped for it too (5 batches, 3 with a loss), gradient clipping on."""
    L.seed_everything(0)
    calls = {
        name: mock.patch.object(GradientScaler, name, autospec=True, side_effect=getattr(GradientScaler, name))
        for name in ("unscale_", "step", "update")
    }
    with calls["unscale_"] as unscale_, calls["step"] as step, calls["update"] as update:
        trainer = make_trainer(GradientScalingPlugin(), max_steps=5, gradient_clip_val=0.5, package=lightning_package)
        trainer.fit(on_package(SkipOddBatches, lightning_package)(), loader())
    assert (unscale_.call_count, step.call_count, update.call_count) == (3, 3, 3)


# --- plugins/test_amp_plugins.py::test_amp_gradient_unscale --------------------------------------------


class ClippingOptimizer(torch.optim.SGD):
    """Checks, as it steps, that the gradients it gets are the clipped ones."""

    def step(self, *args, pl_module=None):
        pl_module.check_grads_clipped()
        return super().step(*args)


class PrecisionModel(Classifier):
    """The sister of test_manual_optimization.py::test_multiple_optimizers_step: the gradients the hooks
    and the optimizer see, after the backward, after unscale_ and after clipping."""

    def on_after_backward(self) -> None:
        scaler = self.trainer.precision_plugin.scaler
        assert_scaling_happened(scaler)
        # Upstream keeps grad * (1 / scale) as the expected unscaled gradient; GradientScaler's .grad is already true.
        self.original_grads = [p.grad.clone() for p in self.parameters()]

    def check_grads_unscaled(self, optimizer: Optimizer) -> None:
        assert_unscaled(self.trainer.precision_plugin.scaler, optimizer)
        grads = [p.grad for p in self.parameters()]
        assert len(grads) == len(self.original_grads)
        for actual, expected in zip(grads, self.original_grads):
            torch.testing.assert_close(actual, expected, equal_nan=True)

    def check_grads_clipped(self) -> None:
        parameters = list(self.parameters())
        assert len(parameters) == len(self.clipped_parameters)
        for actual, expected in zip(parameters, self.clipped_parameters):
            torch.testing.assert_close(actual.grad, expected.grad, equal_nan=True)

    def on_before_optimizer_step(self, optimizer: Optimizer) -> None:
        # Where upstream's log_grad_norm (track_grad_norm, gone from Lightning 2) also checked them.
        self.check_grads_unscaled(optimizer)
        self.clipped_parameters = []
        for p in self.parameters():  # clip copies by hand, for configure_gradient_clipping to match
            copy = p.detach().clone()
            copy.grad = p.grad.clone()
            self.clipped_parameters.append(copy)
        torch.nn.utils.clip_grad_value_(self.clipped_parameters, self.trainer.gradient_clip_val)

    def configure_gradient_clipping(self, *args, **kwargs) -> None:
        super().configure_gradient_clipping(*args, **kwargs)  # let Lightning clip
        self.check_grads_clipped()

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        optimizer.step(closure=optimizer_closure, pl_module=self)  # pass self as a kwarg, through the plugin

    def configure_optimizers(self) -> Optimizer:
        return ClippingOptimizer(self.parameters(), lr=0.1)


@pytest.mark.parametrize("accum", [1, 2])
def test_amp_gradient_unscale(accum: int, lightning_package: str) -> None:
    """on_before_optimizer_step sees unscaled gradients, clipping by value (at a tiny value, 1e-3) clips
    those, and the optimizer gets the clipped ones, with and without accumulation (upstream: DDP on two
    GPUs)."""
    L.seed_everything(0)
    trainer = make_trainer(
        GradientScalingPlugin(update_interval=2),
        max_steps=-1,
        max_epochs=2,
        limit_train_batches=2,
        gradient_clip_val=1e-3,
        gradient_clip_algorithm="value",
        accumulate_grad_batches=accum,
        package=lightning_package,
    )
    trainer.fit(on_package(PrecisionModel, lightning_package)(), loader())
    assert trainer.global_step == 4 // accum


# --- trainer/optimization/test_manual_optimization.py --------------------------------------------------


class ManualOptModel(Classifier):
    """Two optimizers on the same parameters, the second after two backwards of one loss."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def loss_of(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        assert_empty_grad(self.net[-1].weight.grad)  # make sure there are no grads

        loss_1 = self.loss_of(batch)
        self.manual_backward(loss_1)
        opt_a.step()
        opt_a.zero_grad()
        assert_empty_grad(self.net[-1].weight.grad)

        loss_2 = self.loss_of(batch)
        # the second backward of the same graph accumulates into the first's .grad
        self.manual_backward(loss_2, retain_graph=True)
        self.manual_backward(loss_2)
        assert self.net[-1].weight.grad is not None
        opt_b.step()
        opt_b.zero_grad()
        assert_empty_grad(self.net[-1].weight.grad)
        return loss_2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)


def test_multiple_optimizers_manual_call_counts(lightning_package: str) -> None:
    """Three backwards and two scaler steps per batch, two global steps."""
    L.seed_everything(0)
    limit_train_batches = 2
    trainer = make_trainer(
        GradientScalingPlugin(),
        max_steps=-1,
        max_epochs=1,
        limit_train_batches=limit_train_batches,
        package=lightning_package,
    )
    # count the scaler's steps rather than the optimizer's, which a non-finite gradient would skip
    with (
        count_backwards(trainer) as bwd_mock,
        mock.patch.object(GradientScaler, "step", autospec=True, side_effect=GradientScaler.step) as scaler_step,
    ):
        trainer.fit(on_package(ManualOptModel, lightning_package)(), loader())
    assert bwd_mock.call_count == limit_train_batches * 3
    assert trainer.global_step == limit_train_batches * 2
    assert scaler_step.call_count == 2 * limit_train_batches


class StepGradientsModel(ManualOptModel):
    """test_multiple_optimizers_step's model: opt_a steps without zero_grad, so loss_2's two backwards
    accumulate onto loss_1's gradients; each optimizer must see exactly what the backwards left."""

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        loss_1 = self.loss_of(batch)
        assert_empty_grad(self.net[-1].weight.grad)  # make sure there are no grads
        self.manual_backward(loss_1)
        opt_a.step()

        loss_2 = self.loss_of(batch)  # fake discriminator
        self.manual_backward(loss_2, retain_graph=True)
        self.manual_backward(loss_2, retain_graph=True)
        assert self.net[-1].weight.grad is not None
        opt_b.step()
        opt_b.zero_grad()
        return {"loss1": loss_1.detach(), "loss2": loss_2.detach()}

    on_after_backward = PrecisionModel.on_after_backward

    def on_before_optimizer_step(self, optimizer: Optimizer) -> None:
        PrecisionModel.check_grads_unscaled(self, optimizer)


def test_multiple_optimizers_step(lightning_package: str) -> None:
    L.seed_everything(0)
    limit_train_batches = 2
    trainer = make_trainer(
        GradientScalingPlugin(update_interval=2),
        max_steps=-1,
        max_epochs=1,
        limit_train_batches=limit_train_batches,
        package=lightning_package,
    )
    with count_backwards(trainer) as bwd_mock:
        trainer.fit(on_package(StepGradientsModel, lightning_package)(), loader())
    assert bwd_mock.call_count == limit_train_batches * 3


class ManualOptimizationExtendedModel(Classifier):
    """Steps on every other batch (``count`` even); the loss is returned from training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.count = 0
        self.called: collections.Counter = collections.Counter()

    @property
    def should_update(self) -> bool:
        return self.count % 2 == 0

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.called["on_train_batch_start"] += 1
        self.weight_before = self.net[-1].weight.clone()

    def training_step(self, batch, batch_idx):
        self.called["training_step"] += 1
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        loss /= loss.clone().detach()
        loss *= 0.1
        if self.should_update:
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
        return loss

    def on_train_batch_end(self, *_) -> None:
        self.called["on_train_batch_end"] += 1
        after = self.net[-1].weight.clone()
        # Upstream suppresses the first check ("1 every 3 runs, weights don't get updated": GradScaler
        # skips steps while its first scale backs off); gradient scaling skips none here, so it is asserted.
        assert torch.equal(self.weight_before, after) != self.should_update  # changed exactly when it stepped
        assert_empty_grad(self.net[-1].weight.grad)
        self.count += 1

    def on_train_end(self) -> None:
        assert self.called == {"training_step": 10, "on_train_batch_start": 10, "on_train_batch_end": 10}


def test_manual_optimization_and_return_tensor(lightning_package: str) -> None:
    """Returning the loss from training_step in manual optimization adds no gradient (upstream: DDP spawn
    on two GPUs)."""
    L.seed_everything(0)
    trainer = make_trainer(
        GradientScalingPlugin(), max_steps=-1, max_epochs=1, limit_train_batches=10, package=lightning_package
    )
    trainer.fit(on_package(ManualOptimizationExtendedModel, lightning_package)(), loader(batch_size=2))


class AccumulatingModel(ManualOptimizationExtendedModel):
    """Backward on every other batch, step on every fourth: gradients accumulate over two backwards."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 1

    @property
    def should_have_updated(self) -> bool:
        return self.count % 4 == 0

    def training_step(self, batch, batch_idx):
        self.called["training_step"] += 1
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        loss /= loss.clone().detach()
        loss *= 0.1
        if self.should_update:
            self.manual_backward(loss)
            if self.should_have_updated:
                opt.step()
                opt.zero_grad()
        return loss

    def on_train_batch_end(self, *_) -> None:
        self.called["on_train_batch_end"] += 1
        after = self.net[-1].weight.clone()
        if self.should_update and self.should_have_updated:
            assert not torch.equal(self.weight_before, after), self.count
            assert_empty_grad(self.net[-1].weight.grad)
        else:
            assert torch.equal(self.weight_before, after)
            if self.count > 1:
                if self.count % 4 == 1:
                    assert_empty_grad(self.net[-1].weight.grad)
                else:
                    assert torch.sum(self.net[-1].weight.grad) != 0
        self.count += 1

    def on_train_end(self) -> None:
        assert self.called == {"training_step": 20, "on_train_batch_start": 20, "on_train_batch_end": 20}


def test_manual_optimization_and_accumulated_gradient(lightning_package: str) -> None:
    """In manual optimization the step runs only when the user steps, not on every backward."""
    L.seed_everything(234)
    plugin = GradientScalingPlugin(update_interval=3)
    trainer = make_trainer(plugin, max_steps=-1, max_epochs=1, limit_train_batches=20, package=lightning_package)
    trainer.fit(on_package(AccumulatingModel, lightning_package)(), loader(batch_size=1))
    assert plugin.scaler.iteration == 10 and plugin.scaler.skipped_steps == 0


class ToggledOptimizers(Classifier):
    """A discriminator and a generator step, each under ``toggle_optimizer``. Upstream's two optimizers
    share the model's one layer; here the generator's owns the head only, so toggling it freezes the
    first layer and the two backwards of a step walk different graphs, which the scaler must follow."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizer1, optimizer2 = self.optimizers()
        for name, optimizer in (("loss_d", optimizer1), ("loss_g", optimizer2)):
            self.toggle_optimizer(optimizer)
            loss = F.cross_entropy(self.net(x), y)
            self.log(name, loss, prog_bar=True)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            self.untoggle_optimizer(optimizer)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.net[-1].parameters(), lr=0.1)


def test_multiple_optimizers_logging(lightning_package: str, tmp_path) -> None:
    L.seed_everything(0)
    plugin = GradientScalingPlugin()
    model = on_package(ToggledOptimizers, lightning_package)()
    first_layer = model.net[0].weight.detach().clone()
    trainer = make_trainer(
        plugin,
        max_steps=-1,
        max_epochs=1,
        limit_train_batches=2,
        log_every_n_steps=1,
        logger=True,
        default_root_dir=tmp_path,
        package=lightning_package,
    )
    trainer.fit(model, loader())
    assert set(trainer.logged_metrics) == {"loss_d", "loss_g"}
    assert set(trainer.progress_bar_metrics) == {"loss_d", "loss_g"}
    assert plugin.scaler.iteration == 4 and plugin.scaler.skipped_steps == 0
    assert not torch.equal(first_layer, model.net[0].weight)  # the discriminator's steps reached it


class _NanAfterManualBackward(Classifier):
    """Manual optimization that writes a NaN into a gradient between ``manual_backward`` and ``opt.step()``."""

    def __init__(self, nan_steps: tuple[int, ...]) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.nan_steps = nan_steps
        self.stepped: list[bool] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        self.manual_backward(F.cross_entropy(self.net(x), y))
        if len(self.stepped) in self.nan_steps:
            self.net[0].weight.grad[0, 0] = float("nan")
        before = self.net[0].weight.detach().clone()
        opt.step()
        self.stepped.append(not torch.equal(before, self.net[0].weight))


def test_manual_optimization_never_steps_on_a_gradient_made_non_finite_after_manual_backward(
    lightning_package: str,
) -> None:
    """GradScaler's rule, through Lightning's manual optimization: the optimizer step judges the ``.grad``
    it is about to use, not only what the scaler's backward wrote (issue 15)."""
    torch.manual_seed(0)
    plugin = GradientScalingPlugin()
    model = on_package(_NanAfterManualBackward, lightning_package)(nan_steps=(1,))
    make_trainer(plugin, max_steps=3, package=lightning_package).fit(model, loader())
    assert model.stepped == [True, False, True]
    assert plugin.scaler.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
