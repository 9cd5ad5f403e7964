"""GradientScalingCallback (CSV and offline W&B loggers), RandomStateCallback and the framework-free plots."""

from __future__ import annotations

import csv
import json
import math
import random
import time
import warnings
from importlib import import_module
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from conftest import Classifier, loader, make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning_packages import on_package

from gs_lightning import DynamicLossScalingPlugin, FP16Plugin, GradientScalingCallback, GradientScalingPlugin
from gs_lightning.analysis import (
    history_layers,
    history_matrix,
    layer_groups,
    plot_scale_heatmap,
    plot_scale_mean_std,
    save_scale_history,
)
from gs_lightning.lightning.callback import RandomStateCallback
from gs_lightning.scaling.schedule import UpdateReason

PNG = b"\x89PNG\r\n\x1a\n"


def fit(
    plugin,
    callback: GradientScalingCallback,
    max_steps: int,
    root: Path,
    model: L.LightningModule | None = None,
    **kwargs,
) -> L.Trainer:
    """Fit ``model`` (a Classifier with a Linear → Linear pair by default) on the shared data; weights stay finite."""
    ckpt_path = kwargs.pop("ckpt_path", None)
    kwargs.setdefault("log_every_n_steps", 1)
    trainer = make_trainer(
        plugin, max_steps, callbacks=[callback, *kwargs.pop("callbacks", [])], default_root_dir=root, **kwargs
    )
    trainer.fit(model or Classifier(hidden_layers=1), loader(), ckpt_path=ckpt_path)
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
    return trainer


def test_the_input_gradient_shifts_are_logged_where_the_recipe_gives_them(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plugin = GradientScalingPlugin(update_interval=2, own_input_gradient_scale=True)
    logger = CSVLogger(tmp_path)
    fit(plugin, GradientScalingCallback(log_every_n_steps=2), 4, tmp_path, logger=logger)
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("gs/skipped_steps")]
    gemms = [layer for layer in plugin.scaler.layers() if layer.kind == "gemm"]
    assert gemms and all(
        float(rows[-1][f"gs/input_shift/{layer.name}"]) == layer.input_gradient_shift for layer in gemms
    )


def test_csv_metrics_have_the_scales_at_every_nth_step_and_the_end(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plugin, callback = GradientScalingPlugin(update_interval=2), GradientScalingCallback(log_every_n_steps=2)
    logger = CSVLogger(tmp_path)
    fit(plugin, callback, 5, tmp_path, model=Classifier(inf_steps=(2,), hidden_layers=1), logger=logger)

    layers = plugin.scaler.layers()
    assert {layer.name for layer in layers} >= {"net.2", "net.3", "net.3.cast"}
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("gs/skipped_steps")]
    assert [int(row["step"]) for row in rows] == [2, 4, 5]
    assert [float(row["gs/skipped_steps"]) for row in rows] == [0.0, 1.0, 1.0]
    for layer in layers:
        assert float(rows[-1][f"gs/scale/{layer.name}"]) == layer.log2_scale
        assert float(rows[-1][f"gs/total/{layer.name}"]) == layer.log2_total
        assert float(rows[-1][f"gs/underflow/{layer.name}"]) == pytest.approx(layer.underflow_rate)
        if layer.measured_underflow is not None:
            assert float(rows[-1][f"gs/underflow/{layer.name}/measured"]) == pytest.approx(layer.measured_underflow)
    assert any(row.get("gs/drift") for row in rows)
    assert sorted(callback.history) == sorted(callback.totals) == [2, 4, 5]
    assert callback.totals[5] == {layer.name: float(layer.log2_total) for layer in layers}

    assert [p.name for p in callback.plot_paths] == ["scale_heatmap.png", "scale_mean_std.png"]
    for path in callback.plot_paths:
        assert path.parent == Path(logger.log_dir) and path.read_bytes().startswith(PNG)
    assert callback.history_path == Path(logger.log_dir) / "scale_history.csv"
    with open(callback.history_path) as file:
        table = list(csv.reader(file))
    assert table[0] == ["step", *callback.history[2]]
    assert [row[0] for row in table[1:]] == ["2", "4", "5"]


def test_between_updates_the_surprise_and_the_update_count_are_logged(tmp_path: Path) -> None:
    """``gs/surprise``: how far the weight gradients rose above what the last update expected of them (on replays
    once an update had history to expect from); ``gs/update_iterations``: how many backwards decided scales so far."""
    torch.manual_seed(0)
    plugin, callback = GradientScalingPlugin(update_interval=2), GradientScalingCallback(log_every_n_steps=1)
    logger = CSVLogger(tmp_path)
    fit(plugin, callback, 6, tmp_path, model=Classifier(hidden_layers=1), logger=logger)
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    logged = [float(row["gs/surprise"]) for row in rows if row.get("gs/surprise")]
    assert logged and all(math.isfinite(v) for v in logged)
    updates = [float(row["gs/update_iterations"]) for row in rows if row.get("gs/update_iterations")]
    # every second backward, at least
    assert updates == sorted(updates) and 3 <= updates[-1] == plugin.scaler.update_iterations <= 6


def test_history_continues_after_resume(tmp_path: Path) -> None:
    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    fit(
        GradientScalingPlugin(),
        GradientScalingCallback(log_every_n_steps=2),
        4,
        tmp_path,
        callbacks=[checkpoint],
        enable_checkpointing=True,
    )
    resumed = GradientScalingCallback(log_every_n_steps=2)
    fit(GradientScalingPlugin(), resumed, 8, tmp_path / "resumed", ckpt_path=tmp_path / "epoch=0-step=4.ckpt")
    assert sorted(resumed.history) == [2, 4, 6, 8]


def test_plugins_that_scale_nothing_warn_once_and_log_nothing(tmp_path: Path) -> None:
    callback = GradientScalingCallback(log_every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            fit(None, callback, 2, tmp_path, logger=CSVLogger(tmp_path))
    assert len([w for w in caught if "GradientScalingCallback" in str(w.message)]) == 1
    assert callback.history == {} and callback.plot_paths == [] and callback.skipped_steps is None
    assert not list(tmp_path.rglob("*.png"))


@pytest.mark.parametrize(
    ("plugin", "scales"),
    [(DynamicLossScalingPlugin, [16.0, 15.0, 15.0]), (FP16Plugin, [0.0, 0.0, 0.0])],
    ids=["dynamic", "fp16"],
)
def test_loss_scaling_plugins_log_the_loss_scale_and_the_skipped_steps(
    plugin, scales: list[float], tmp_path: Path
) -> None:
    """GradScaler halves its scale on step 2's inf loss and the step is skipped (the weights stay); the
    CSV has gs/loss_scale (log2) and gs/skipped_steps at steps 2, 4 and the end; no plots."""
    torch.manual_seed(0)
    callback, logger = GradientScalingCallback(log_every_n_steps=2), CSVLogger(tmp_path)
    trainer = fit(plugin(), callback, 5, tmp_path, model=Classifier(inf_steps=(2,), hidden_layers=1), logger=logger)
    assert callback.skipped_steps == 1 and callback.loss_scale == 2.0 ** scales[-1]
    assert callback.loss_scale == trainer.precision_plugin.scaler.get_scale()
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("gs/loss_scale")]
    assert [(int(row["step"]), float(row["gs/loss_scale"]), float(row["gs/skipped_steps"])) for row in rows] == [
        (step, scale, skipped) for step, scale, skipped in zip([2, 4, 5], scales, [0.0, 1.0, 1.0])
    ]
    assert callback.history == {} and not list(tmp_path.rglob("*.png"))
    assert callback.state_dict()["skipped_steps"] == 1


def test_every_update_is_logged_with_why_it_ran_whatever_log_every_n_steps(tmp_path: Path) -> None:
    """The first backward, the one after the skipped step, the interval's: each step that updated has its reasons,
    by member name, in ``update_reasons`` (and checkpoints) and as ``gs/update/<reason>`` in every logger."""
    torch.manual_seed(0)
    plugin, callback = GradientScalingPlugin(update_interval=2), GradientScalingCallback(log_every_n_steps=100)
    logger = CSVLogger(tmp_path)
    model = Classifier(inf_steps=(2,), hidden_layers=1, inf_inputs=True)  # an inf input: the graph stays the same
    fit(plugin, callback, 5, tmp_path, model=model, logger=logger)

    assert sorted(callback.update_reasons) == callback.update_steps and callback.update_steps
    assert callback.update_reasons[callback.update_steps[0]] == [UpdateReason.FIRST.name]
    reasons = {UpdateReason[name] for names in callback.update_reasons.values() for name in names}
    assert {UpdateReason.SKIPPED_STEP, UpdateReason.INTERVAL} <= reasons
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        logged = {
            (int(row["step"]), key.removeprefix("gs/update/"))
            for row in csv.DictReader(file)
            for key, value in row.items()
            if key.startswith("gs/update/") and value
        }
    assert logged == {(step, name.lower()) for step, names in callback.update_reasons.items() for name in names}
    restored = GradientScalingCallback()
    restored.load_state_dict(callback.state_dict())
    assert restored.update_reasons == callback.update_reasons


def test_offline_wandb_run_holds_the_scale_history_and_both_images(
    tmp_path: Path, monkeypatch, lightning_package: str
) -> None:
    """In either package's Trainer with that package's WandbLogger."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    torch.manual_seed(0)
    callback = GradientScalingCallback(log_every_n_steps=2)
    logger = import_module(f"{lightning_package}.loggers").WandbLogger(
        offline=True, save_dir=str(tmp_path), project="gs"
    )
    model = on_package(Classifier, lightning_package)(hidden_layers=1)
    try:
        fit(GradientScalingPlugin(), callback, 4, tmp_path, model=model, logger=logger, package=lightning_package)
    finally:
        wandb.finish()

    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    images = sorted(p.name.rsplit("_", 2)[0] for p in (run / "files/media/images/gs/plots").glob("*.png"))
    assert images == ["scale_heatmap", "scale_mean_std"]  # W&B names them <key>_<its step>_<hash>.png
    # One line-series chart per layer group (e.g. "2", "3"); their tables are plain JSON in the run's files.
    tables = sorted((run / "files/media/table/gs/scale_history").glob("*.table.json"))
    assert [t.name.split("_")[0] for t in tables] == sorted(layer_groups(history_layers(callback.history)))
    logged = {}
    for table in tables:
        content = json.loads(table.read_text())
        assert content["columns"] == ["step", "lineKey", "lineVal"]
        logged.update({(step, layer): value for step, layer, value in content["data"]})
    assert logged == {
        (step, layer): value for step, scales in callback.history.items() for layer, value in scales.items()
    }
    (updates,) = (run / "files/media/table/gs").glob("updates_*.table.json")  # why each update ran
    content = json.loads(updates.read_text())
    assert content["columns"] == ["step", "reasons"]
    assert content["data"] == [[step, ", ".join(names)] for step, names in sorted(callback.update_reasons.items())]
    # The logged metrics are in the run's transaction log (protobuf): their keys are stored verbatim.
    # W&B's service process may still be writing it after wandb.finish() returns on a busy machine.
    (log,) = run.glob("run-*.wandb")
    keys = [
        "gs/skipped_steps",
        *(f"gs/{kind}/{layer}" for kind in ("scale", "total", "underflow") for layer in callback.history[4]),
    ]
    deadline = time.monotonic() + 30
    while not all(key.encode() in log.read_bytes() for key in keys) and time.monotonic() < deadline:
        time.sleep(0.2)
    records = log.read_bytes()
    for key in keys:
        assert key.encode() in records, key


class _ListLogger(Logger):
    """A logger the callback does not know: keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    name = "list"
    version = 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append(metrics)

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def test_unknown_logger_gets_the_scalars_and_one_note(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    logger = _ListLogger()
    callback = GradientScalingCallback(log_every_n_steps=2)
    with caplog.at_level("INFO"):
        for _ in range(2):
            fit(GradientScalingPlugin(), callback, 4, tmp_path, logger=logger)
    assert any("gs/scale/net.0" in metrics for metrics in logger.metrics)
    notes = [r.message for r in caplog.records if "not a logger this callback knows" in r.message]
    assert len(notes) == 1 and "_ListLogger got the scale scalars" in notes[0]


def test_plots_and_table_from_a_history(tmp_path: Path) -> None:
    history = {
        10: {"fc.cast": 3.0, "fc": 1.0, "layer1.0": 2.0},
        20: {"fc.cast": 4.0, "fc": 1.0},
        30: {"fc.cast": 4.0, "fc": -2.0, "layer1.0": 3.0},
    }
    steps, layers, matrix = history_matrix(history)
    assert steps == [10, 20, 30] and layers == ["fc.cast", "fc", "layer1.0"]
    assert math.isnan(matrix[2, 1]) and matrix[1, 2] == -2.0
    assert plot_scale_heatmap(history, tmp_path / "a/heat.png").read_bytes().startswith(PNG)
    assert plot_scale_mean_std(history, tmp_path / "a/mean.png").read_bytes().startswith(PNG)
    totals = {step: {layer: value + 5 for layer, value in scales.items()} for step, scales in history.items()}
    assert plot_scale_mean_std(history, tmp_path / "a/both.png", totals=totals).read_bytes().startswith(PNG)
    with open(save_scale_history(history, tmp_path / "h.csv")) as file:
        assert list(csv.reader(file)) == [
            ["step", *layers],
            ["10", "3", "1", "2"],
            ["20", "4", "1", ""],
            ["30", "4", "-2", "3"],
        ]
    assert np.nanmean(matrix, axis=1).tolist() == pytest.approx([11 / 3, 0.0, 2.5])


def test_layer_groups_skip_the_shared_prefix() -> None:
    assert layer_groups(["model.fc.cast", "model.fc", "model.layer1.0.conv1", "model.conv1"]) == {
        "fc": ["model.fc.cast", "model.fc"],
        "layer1": ["model.layer1.0.conv1"],
        "conv1": ["model.conv1"],
    }
    assert layer_groups(["net.2.cast", "net.2"]) == {"2": ["net.2.cast", "net.2"]}


def test_random_states_survive_a_weights_only_checkpoint(tmp_path: Path) -> None:
    """Saved as plain tensors and numbers, restored when training starts: the same draws follow."""
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    torch.save({"random_state": RandomStateCallback().state_dict()}, tmp_path / "checkpoint.pt")
    expected = torch.rand(3), np.random.rand(3), random.random()
    restored = RandomStateCallback()
    restored.load_state_dict(torch.load(tmp_path / "checkpoint.pt", weights_only=True)["random_state"])
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    restored.on_train_start(None, None)  # type: ignore[arg-type]  # uses neither
    assert torch.equal(torch.rand(3), expected[0]) and np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]


def test_log_every_n_steps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="log_every_n_steps"):
        GradientScalingCallback(log_every_n_steps=0)


def test_heatmap_marks_the_update_steps_and_names_the_run_and_precision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step whose backward decided the scales is in ``update_steps`` (and reaches the heatmap),
    the first one at step 1; the title names the run and the precision plugin."""
    drawn = {}

    def heatmap(history, path, update_steps=(), title=None):
        drawn.update(update_steps=list(update_steps), title=title)
        return plot_scale_heatmap(history, path, update_steps, title)

    monkeypatch.setattr("gs_lightning.lightning.callback.plot_scale_heatmap", heatmap)
    torch.manual_seed(0)
    plugin, callback = (
        GradientScalingPlugin(update_interval=2),
        GradientScalingCallback(log_every_n_steps=2, run_name="demo/gs/run"),
    )
    fit(plugin, callback, 6, tmp_path, model=Classifier(hidden_layers=1), logger=CSVLogger(tmp_path))
    assert callback.update_steps[0] == 1 and len(callback.update_steps) == plugin.scaler.update_iterations
    assert (
        callback.update_steps == sorted(set(callback.update_steps)) and drawn["update_steps"] == callback.update_steps
    )
    # emulated: the plugin's default on a CPU (emulate="auto")
    assert (
        drawn["title"]
        == "demo/gs/run\nGradientScalingPlugin (float16 gradients, emulated): log2 gradient scale per layer"
    )
    assert callback.state_dict()["update_steps"] == callback.update_steps


def test_heatmap_colours_diverge_from_white_at_zero_one_per_binade() -> None:
    """-1, 0 and +1 stand apart on a range of ±16: 0 white, +1 a clear red, -1 a clear blue."""
    from gs_lightning.analysis.plots import _diverging_binades

    cmap, norm, ticks = _diverging_binades(np.array([[16.0, -3.0], [np.nan, 0.0]]))
    white, plus, minus, top = (np.array(cmap(norm(v))[:3]) for v in (0, 1, -1, 16))
    assert white.tolist() == [1.0, 1.0, 1.0]
    assert np.abs(plus - white).max() > 0.2 and np.abs(minus - white).max() > 0.2
    assert plus[0] > plus[2] and minus[2] > minus[0] and top.sum() < plus.sum()  # red, blue, deeper further out
    assert cmap(norm(2)) != cmap(norm(1)) and 0 in ticks and ticks == [-t for t in reversed(ticks)]
