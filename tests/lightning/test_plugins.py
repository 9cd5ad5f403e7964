"""The fp16 precision plugins under a real Lightning Trainer (CPU, tiny Linear models)."""

from __future__ import annotations

import copy
import pickle
import warnings
from importlib import import_module

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from conftest import DATA, Classifier, loader, make_trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning_packages import on_package
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gs_lightning
import gs_lightning.lightning
from gs_lightning import (
    DynamicLossScalingPlugin,
    FP16MixedPrecision,
    FP16Plugin,
    GradientScalingPlugin,
    LossScalingPlugin,
    SkipAwareScheduler,
)
from gs_lightning.lightning import packages

LR_WARNING = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"

PLUGINS = {
    "gradient_scaling": lambda: GradientScalingPlugin(update_interval=3),
    "dynamic_loss_scaling": lambda: DynamicLossScalingPlugin(init_scale=2.0**10, growth_interval=2),
    "loss_scaling": lambda: LossScalingPlugin(scale=128),
    "fp16": FP16Plugin,
}


class WeightWatch(Callback):
    """Asserts that the weights stay finite after every batch, and keeps them per step."""

    def __init__(self) -> None:
        self.before: dict[int, list[torch.Tensor]] = {}
        self.after: dict[int, list[torch.Tensor]] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self.before[batch_idx] = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        params = [p.detach().clone() for p in pl_module.parameters()]
        assert all(torch.isfinite(p).all() for p in params), f"non-finite weights after batch {batch_idx}"
        self.after[batch_idx] = params


def trainer(package: str, plugin, max_steps: int, callbacks=(), **kwargs):
    """A quiet CPU Trainer of ``package`` that checks, after every batch, that no NaN or inf reached the weights."""
    return make_trainer(plugin, max_steps, callbacks=[*callbacks, WeightWatch()], package=package, **kwargs)


def classifier(package: str, **kwargs) -> L.LightningModule:
    """conftest's Classifier, as a LightningModule of ``package``."""
    return on_package(Classifier, package)(**kwargs)


@pytest.mark.parametrize("name", list(PLUGINS))
def test_root_plugins_are_accepted_by_each_trainer(name: str, lightning_package: str) -> None:
    """``from gs_lightning import ...Plugin`` goes into either package's Trainer (pytorch_lightning's used to
    reject it: "Found invalid type for plugin"), and becomes that Trainer's precision plugin."""
    plugin = PLUGINS[name]()
    fit = import_module(lightning_package).Trainer(accelerator="cpu", plugins=[plugin], logger=False)
    assert fit.precision_plugin is plugin
    assert fit.precision == "16-mixed"


@pytest.mark.parametrize("name", list(PLUGINS))
def test_fit_runs_fp16_autocast_and_trains(name: str, lightning_package: str) -> None:
    torch.manual_seed(0)
    model, watch = classifier(lightning_package), WeightWatch()
    initial = [p.detach().clone() for p in model.parameters()]
    trainer(lightning_package, PLUGINS[name](), max_steps=4, callbacks=[watch]).fit(model, loader())
    assert model.output_dtypes == {torch.float16}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    assert not any(torch.equal(a, b) for a, b in zip(initial, model.parameters()))
    assert sorted(watch.after) == [0, 1, 2, 3]


@pytest.mark.parametrize("name", list(PLUGINS))
def test_skipped_step_leaves_weights_and_schedulers_alone(name: str, lightning_package: str) -> None:
    """Steps 0 and 3 overflow: weights untouched, the scheduler does not advance, torch does not warn."""
    torch.manual_seed(0)
    plugin, model, watch = PLUGINS[name](), classifier(lightning_package, inf_steps=(0, 3)), WeightWatch()
    fit = trainer(lightning_package, plugin, max_steps=6, callbacks=[watch])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(model, loader())
    assert not [w for w in caught if LR_WARNING in str(w.message)]
    for step in (0, 3):
        assert all(torch.equal(a, b) for a, b in zip(watch.before[step], watch.after[step])), (
            f"step {step} changed weights"
        )
    for step in (1, 2, 4, 5):
        assert not all(torch.equal(a, b) for a, b in zip(watch.before[step], watch.after[step])), (
            f"step {step} did not step"
        )
    scheduler = fit.lr_scheduler_configs[0].scheduler
    assert isinstance(scheduler, SkipAwareScheduler)
    assert scheduler.last_epoch == 4  # 6 batches, 2 skipped
    assert scheduler.get_last_lr() == pytest.approx([0.1 * 0.9**4])
    if isinstance(plugin, GradientScalingPlugin):
        assert plugin.scaler.skipped_steps == 2


def test_skipped_step_restores_batch_norm_statistics(lightning_package: str) -> None:
    """An inf in batch 0's input reaches BatchNorm's running statistics; the skipped step puts them back."""
    torch.manual_seed(0)
    model = classifier(lightning_package, batch_norm=True, inf_steps=(0,), inf_inputs=True)
    initial = [b.clone() for b in model.buffers()]
    plugin = GradientScalingPlugin()
    trainer(lightning_package, plugin, max_steps=1).fit(model, loader())
    assert plugin.scaler.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(initial, model.buffers()))


def test_a_diverged_run_stops_with_the_scalers_message(lightning_package: str) -> None:
    """Every step overflows: after max_consecutive_skips skipped steps fit stops, naming the layer."""
    torch.manual_seed(0)
    model = classifier(lightning_package, inf_steps=range(10))
    plugin = GradientScalingPlugin(max_consecutive_skips=3)
    with pytest.raises(RuntimeError, match=r"4 optimizer steps in a row were skipped.*first non-finite gradient"):
        trainer(lightning_package, plugin, max_steps=8).fit(model, loader())
    assert plugin.scaler.skipped_steps == 4


def test_the_plugin_passes_recompute_weight_gradients_on(lightning_package: str) -> None:
    torch.manual_seed(0)
    plugin = GradientScalingPlugin(recompute_weight_gradients=False)
    trainer(lightning_package, plugin, max_steps=2).fit(classifier(lightning_package), loader())
    assert plugin.scaler.recipe.recompute_weight_gradients is False and plugin.scaler.recomputed_steps == 0
    with pytest.raises(ValueError, match="recompute_weight_gradients must be True or False"):
        GradientScalingPlugin(recompute_weight_gradients=None)  # type: ignore[arg-type]


class WeightGrads(Callback):
    """Keeps the Linear layers' weight gradients the optimizer is about to see."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        self.grads += [m.weight.grad.clone() for m in pl_module.net if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("name", ["gradient_scaling", "loss_scaling"])
def test_emulated_fp8_gradients_reach_the_weights(name: str, lightning_package: str) -> None:
    """emulate=True, grad_dtype=float8_e5m2: forward and backward run emulated, so every weight
    gradient a backward GEMM made is an e5m2 value (3 significant bits) times a power of two."""
    torch.manual_seed(0)
    make = {"gradient_scaling": GradientScalingPlugin, "loss_scaling": LossScalingPlugin}[name]
    plugin, capture = make(emulate=True, grad_dtype="float8_e5m2"), WeightGrads()
    trainer(lightning_package, plugin, max_steps=1, callbacks=[capture]).fit(
        classifier(lightning_package, hidden_layers=1), loader()
    )
    significands = [torch.frexp(g[g != 0])[0] * 8 for g in capture.grads]  # in [4, 8): integers iff 3 bits
    assert len(significands) == 3 and all(torch.equal(m, m.round()) for m in significands)
    assert name != "gradient_scaling" or plugin.scaler.format.name == "float8_e5m2"


def test_fp8_gradients_need_emulation() -> None:
    with pytest.raises(ValueError, match="grad_dtype='float8_e5m2' needs emulate=True"):
        GradientScalingPlugin(grad_dtype="float8_e5m2")
    with pytest.raises(ValueError, match=r"grad_dtype must be one of \['float16', 'float8_e5m2', 'float8_e4m3fn'\]"):
        LossScalingPlugin(emulate=True, grad_dtype="int8")


def test_lightning_mixed_precision_has_the_scheduler_flaw() -> None:
    """Control: the same run with Lightning's MixedPrecision advances the schedule and warns."""
    torch.manual_seed(0)
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10))
    fit = trainer("lightning.pytorch", plugin, max_steps=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(Classifier(inf_steps=(0, 3)), loader())
    assert [w for w in caught if LR_WARNING in str(w.message)]
    assert fit.lr_scheduler_configs[0].scheduler.last_epoch == 6


@pytest.mark.parametrize("name", ["gradient_scaling", "dynamic_loss_scaling"])
def test_resume_matches_uninterrupted_run(name: str, lightning_package: str, tmp_path) -> None:
    """4 steps, checkpoint, 4 more: same weights, optimizer, scheduler and scaler state as 8 straight steps.

    With update_interval=3 the resumed run crosses an update (iteration 6); step 5 overflows, so the
    resumed run also has to restore the skipped-step count and recompute after it.
    """
    half = DataLoader(TensorDataset(*DATA[:16]), batch_size=4)  # 4 batches: the checkpoint ends epoch 0
    L.seed_everything(0)
    straight, plugin = classifier(lightning_package, inf_steps=(5,), optimizer="adam"), PLUGINS[name]()
    checkpoint = import_module(lightning_package).callbacks.ModelCheckpoint(
        dirpath=tmp_path, save_top_k=-1, every_n_train_steps=4
    )
    trainer(lightning_package, plugin, max_steps=8, callbacks=[checkpoint], enable_checkpointing=True).fit(
        straight, half
    )
    saved = torch.load(tmp_path / "epoch=0-step=4.ckpt", weights_only=False)
    assert saved[type(plugin).__name__].keys() == plugin.state_dict().keys()  # the scaler's state is saved

    L.seed_everything(1)  # a different initialisation: everything must come from the checkpoint
    resumed_model, resumed_plugin = classifier(lightning_package, inf_steps=(5,), optimizer="adam"), PLUGINS[name]()
    resumed = trainer(
        lightning_package, resumed_plugin, max_steps=8, enable_checkpointing=True, default_root_dir=tmp_path / "resumed"
    )
    resumed.fit(resumed_model, half, ckpt_path=tmp_path / "epoch=0-step=4.ckpt")

    for (key, a), b in zip(straight.state_dict().items(), resumed_model.state_dict().values()):
        assert torch.equal(a, b), key
    assert _state(resumed_plugin) == _state(plugin)
    assert resumed.lr_scheduler_configs[0].scheduler.last_epoch == 7  # 8 steps, one skipped


def _state(plugin: FP16MixedPrecision) -> dict:
    state = plugin.state_dict()
    return {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


class TwoOptimizers(L.LightningModule):
    """Manual optimization with two optimizers, one per layer, each with its own loss and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.encoder = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        opt_encoder, opt_head = self.optimizers()
        loss = F.cross_entropy(self.head(F.relu(self.encoder(x))), y)
        opt_encoder.zero_grad()
        self.manual_backward(loss * float("inf") if batch_idx == 1 else loss)
        opt_encoder.step()
        loss = F.cross_entropy(self.head(F.relu(self.encoder(x)).detach()), y)
        opt_head.zero_grad()
        self.manual_backward(loss)
        opt_head.step()
        for sch in self.lr_schedulers():
            sch.step()

    def configure_optimizers(self):
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (self.encoder, self.head)]
        return optimizers, [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in optimizers]


def test_manual_optimization_with_two_optimizers(lightning_package: str) -> None:
    """Batch 1's first backward overflows: only the encoder's step (and its scheduler) is skipped."""
    torch.manual_seed(0)
    model, watch = on_package(TwoOptimizers, lightning_package)(), WeightWatch()
    plugin = GradientScalingPlugin(update_interval=2)
    # global_step counts both optimizers' steps
    fit = trainer(lightning_package, plugin, max_steps=8, callbacks=[watch])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(model, loader())
    assert not [w for w in caught if LR_WARNING in str(w.message)]
    assert plugin.scaler.iteration == 8 and plugin.scaler.skipped_steps == 1
    encoder_weight, head_weight = 0, 2
    assert torch.equal(watch.before[1][encoder_weight], watch.after[1][encoder_weight])
    assert not torch.equal(watch.before[1][head_weight], watch.after[1][head_weight])
    encoder_sch, head_sch = (config.scheduler for config in fit.lr_scheduler_configs)
    assert (encoder_sch.last_epoch, head_sch.last_epoch) == (3, 4)


class GradientProbe(Callback):
    """Keeps the gradients ``on_before_optimizer_step`` sees, and those the optimizer sees after clipping."""

    def __init__(self) -> None:
        self.seen: list[list[torch.Tensor]] = []
        self.stepped: list[list[torch.Tensor]] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = list(pl_module.parameters())
        trainer.optimizers[0].register_step_pre_hook(lambda *_: self.stepped.append([p.grad.clone() for p in params]))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        self.seen.append([p.grad.clone() for p in pl_module.parameters()])


def test_accumulated_micro_batches_are_scaled_and_unscaled_on_their_own(lightning_package: str) -> None:
    """accumulate_grad_batches=2: one scaler backward per micro-batch, and the accumulated gradient is
    plain fp16 autocast's (power-of-two scaling is exact away from underflow and overflow)."""
    torch.manual_seed(0)
    model, probe = classifier(lightning_package), GradientProbe()
    plugin = GradientScalingPlugin(update_interval=3)
    reference = copy.deepcopy(model)
    trainer(lightning_package, plugin, max_steps=1, callbacks=[probe], accumulate_grad_batches=2).fit(model, loader())
    assert plugin.scaler.iteration == 2
    assert any(scale != 1.0 for scale in plugin.scaler.scales().values())  # scaling did happen
    for x, y in list(loader())[:2]:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(reference.net(x), y) / 2  # Lightning divides by accumulate_grad_batches
        loss.backward()
    (seen,) = probe.seen
    for grad, param in zip(seen, reference.parameters()):
        assert torch.equal(grad, param.grad)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("name", ["gradient_scaling", "dynamic_loss_scaling", "loss_scaling"])
def test_clipping_sees_true_gradients(name: str, algorithm: str, lightning_package: str) -> None:
    """Clipping at half the true gradient's norm (or largest value) leaves exactly half: it saw true values."""
    torch.manual_seed(0)
    model = classifier(lightning_package)
    reference = copy.deepcopy(model)
    x, y = next(iter(loader()))
    with torch.autocast("cpu", dtype=torch.float16):
        F.cross_entropy(reference.net(x), y).backward()
    grads = [p.grad for p in reference.parameters()]
    measure = _norm if algorithm == "norm" else _largest
    clip = measure(grads) / 2
    probe = GradientProbe()
    fit = trainer(
        lightning_package,
        PLUGINS[name](),
        max_steps=1,
        callbacks=[probe],
        gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm,
    )
    fit.fit(model, loader())
    assert measure(probe.seen[0]) == pytest.approx(2 * clip, rel=1e-3)
    assert measure(probe.stepped[0]) == pytest.approx(clip, rel=1e-3)


def _norm(grads: list[torch.Tensor]) -> float:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()


def _largest(grads: list[torch.Tensor]) -> float:
    return max(g.abs().max().item() for g in grads)


def test_skip_aware_scheduler_forwards_everything_else() -> None:
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    inner = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scheduler = SkipAwareScheduler(inner)
    scheduler.step()  # the optimizer has not stepped: withheld
    assert scheduler.last_epoch == 0 and scheduler.get_last_lr() == [1.0]
    opt.step()
    scheduler.step()
    scheduler.step()  # one optimizer step allows one scheduler step
    assert inner.last_epoch == 1 and scheduler.get_last_lr() == [0.5]
    scheduler.gamma = 0.25  # attribute writes reach the scheduler
    assert inner.gamma == 0.25
    assert scheduler.state_dict() == inner.state_dict()
    assert copy.deepcopy(scheduler).last_epoch == 1


@pytest.mark.parametrize(
    "make, option",
    [
        (lambda: GradientScalingPlugin(update_interval=0), "update_interval"),
        (lambda: GradientScalingPlugin(underflow_rate=0.7), "underflow_rate"),
        (lambda: GradientScalingPlugin(max_consecutive_skips=0), "max_consecutive_skips"),
        (lambda: LossScalingPlugin(scale=0), "scale"),
        (lambda: LossScalingPlugin(scale=float("inf")), "scale"),
        (lambda: DynamicLossScalingPlugin(init_scale=-1.0), "scale"),
        (lambda: DynamicLossScalingPlugin(growth_factor=1.0), "growth_factor"),
        (lambda: DynamicLossScalingPlugin(backoff_factor=1.0), "backoff_factor"),
        (lambda: DynamicLossScalingPlugin(growth_interval=0), "growth_interval"),
        (lambda: FP16Plugin(emulate="yes"), "emulate"),
    ],
)
def test_bad_options_fail_when_the_plugin_is_made(make, option: str) -> None:
    with pytest.raises(ValueError, match=option):
        make()


def test_a_lightning_1_install_is_left_out_with_a_warning(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package without Lightning 2's names (1.x's ``PrecisionPlugin``) does not break the import."""
    (tmp_path / "old_lightning" / "plugins").mkdir(parents=True)
    for init in ("old_lightning/__init__.py", "old_lightning/plugins/__init__.py"):
        (tmp_path / init).write_text("")
    (tmp_path / "old_lightning" / "plugins" / "precision.py").write_text("class PrecisionPlugin: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="old_lightning lacks Lightning 2's names"):
        assert packages._load("old_lightning") is None


def test_package_root_lists_every_lightning_name() -> None:
    assert set(gs_lightning._LIGHTNING_NAMES) == set(gs_lightning.lightning.__all__)


def test_both_plugin_families_are_made_from_the_one_table() -> None:
    """Every plugin of the Trainer's and of Fabric's is a row of gs_lightning.fabric.methods.PLUGINS on that
    package's base classes, under the name (and pickled name, and checkpoint key) it always had."""
    import gs_lightning.fabric
    from gs_lightning.fabric import methods
    from gs_lightning.fabric import plugins as fabric_plugins
    from gs_lightning.lightning import plugins as trainer_plugins

    expected = {e.name for e in methods.PLUGINS} | {f"FSDP{e.name}" for e in methods.PLUGINS if e.fsdp_method}
    for module, package in ((trainer_plugins, gs_lightning.lightning), (fabric_plugins, gs_lightning.fabric)):
        assert {name for name in vars(module) if name.endswith("Plugin")} == expected
        assert expected <= set(package.__all__)
        for entry in methods.PLUGINS:
            cls = getattr(module, entry.name)
            assert cls.__bases__ == (entry.method, module.FP16MixedPrecision)
            assert (cls.__module__, cls.__qualname__, cls.__doc__) == (
                module.__name__,
                entry.name,
                entry.method.__doc__,
            )
            assert pickle.loads(pickle.dumps(cls)) is cls
            if entry.fsdp_method is not None:
                assert getattr(module, f"FSDP{entry.name}").__bases__ == (entry.fsdp_method, module.FSDPMixedPrecision)


class Forgetful(Classifier):
    """Manual optimization whose second step forgets the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        if batch_idx == 0:
            self.manual_backward(F.cross_entropy(self.net(batch[0]), batch[1]))
        optimizer.step()


def test_a_manual_step_without_a_backward_raises_as_gradscaler_does(lightning_package: str) -> None:
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        trainer(lightning_package, GradientScalingPlugin(), max_steps=2).fit(
            on_package(Forgetful, lightning_package)(), loader()
        )


@pytest.mark.parametrize("name", list(PLUGINS))
def test_plugins_emulate_fp16_on_a_cpu_by_default(name: str, lightning_package: str) -> None:
    """emulate="auto", as the app's precision.emulate: emulated on a CPU, settled when the Trainer connects
    the plugin, for fit and for a validation alone; a device given settles it at once."""
    plugin, validating = PLUGINS[name](), PLUGINS[name]()
    assert plugin.emulate == validating.emulate == "auto"
    trainer(lightning_package, plugin, max_steps=1).fit(classifier(lightning_package), loader())
    trainer(lightning_package, validating, max_steps=1).validate(classifier(lightning_package), loader())
    assert plugin.emulate is True and validating.emulate is True
    assert type(plugin)(device="cuda").emulate is False and type(plugin)(device="cpu").emulate is True


class SpikingClassifier(Classifier):
    """At global step 2 two input channels hold 60000, channels the first layer's weights ignore (zeros, and the
    learning rate is 0), and the loss is 8 times larger: its weight gradient overflows fp16 at the scale the last
    update chose (2^3), while the loss and every other gradient stay finite. Counts ``training_step`` per step."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[int, int] = {}
        with torch.no_grad():
            self.net[0].weight[:, :2] = 0.0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.calls[self.global_step] = self.calls.get(self.global_step, 0) + 1
        spike = self.global_step == 2
        if spike:
            x = x.clone()
            x[:, :2] = 6e4  # finite in fp16
        return F.cross_entropy(self.net(x), y) * (8.0 if spike else 1.0)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_an_overflowed_step_runs_its_closure_again(accumulate: int, lightning_package: str) -> None:
    """The plugin runs the closure once more where the scaler names the layers that overflowed, and the step is taken;
    not where the closure is one micro-batch of several (its step is skipped)."""
    torch.manual_seed(0)
    model, plugin = on_package(SpikingClassifier, lightning_package)(), GradientScalingPlugin()
    trainer(lightning_package, plugin, max_steps=4, accumulate_grad_batches=accumulate).fit(model, loader())
    retried = accumulate == 1
    assert model.calls[2] == (2 if retried else accumulate)
    assert (plugin.scaler.retried_steps, plugin.scaler.skipped_steps) == ((1, 0) if retried else (0, 1))
