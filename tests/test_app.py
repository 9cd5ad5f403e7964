"""The Hydra app: every recipe x precision composes and runs fast_dev_run on tiny generated data
in the real on-disk formats; the no-argument demo runs; bad input stops with one clear message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from gs_lightning.app import build, register_recipes

ROOT = Path(__file__).resolve().parents[1]
RECIPES = register_recipes(ROOT / "recipes")
PRECISIONS = sorted(p.stem for p in (ROOT / "conf" / "precision").glob("*.yaml"))


def _tiny(recipe: str, data_dir: Path) -> list[str]:
    """Overrides that shrink a recipe to seconds on a CPU, keeping its real data format."""
    if recipe in ("demo", "segnet"):
        return [
            f"data.root={data_dir / 'camvid'}",
            "++data.synthetic={n_train: 4, n_val: 2, n_test: 2, size: [24, 32], seed: 0}",
            "data.batch_size=2",
            "model.width=4",
        ]
    if recipe.startswith("resnet"):
        return [
            f"data.root={data_dir / 'imagenet'}",
            "++data.synthetic={num_classes: 4, n_train_per_class: 2, n_val_per_class: 1, size: [32, 32], seed: 0}",
            "data.batch_size=4",
            "data.image_size=32",
            "data.val_resize=36",
            "task.num_classes=4",
        ]
    return [
        f"data.root={data_dir / 'voc'}",
        "++data.synthetic={years: ['2007'], n_trainval: 4, n_test: 2, size: [64, 80], seed: 0}",
        "data.batch_size=2",
        "model.pretrained=false",
        "model.width_mult=0.03125",
    ]


def _compose(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_recipes_and_precisions_are_the_documented_ones() -> None:
    assert RECIPES == ["demo", "resnet18", "resnet50", "segnet", "ssd300", "ssd512"]
    assert PRECISIONS == ["bf16", "dynamic", "fixed", "fp16", "fp32", "gs"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_fast_dev_run(recipe: str, precision: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    data_dir = tmp_path_factory.getbasetemp() / "data"
    out = tmp_path_factory.mktemp(f"{recipe}-{precision}")
    cfg = _compose(
        [f"recipe={recipe}", f"precision={precision}", f"paths.output_dir={out}", "trainer.fast_dev_run=true",
         "trainer.accelerator=cpu", "data.num_workers=0", *_tiny(recipe, data_dir)]
    )
    run = build(cfg)
    run.trainer.fit(run.task, datamodule=run.datamodule)
    assert run.trainer.state.finished
    assert all(p.isfinite().all() for p in run.task.parameters())
    if precision == "gs":
        scaler = run.trainer.precision_plugin.scaler
        assert scaler.iteration == 1 and scaler.scales()


def test_overrides_reach_the_plugin(tmp_path: Path) -> None:
    cfg = _compose(["precision=gs", "precision.update_interval=1000", f"paths.output_dir={tmp_path}"])
    assert cfg.precision.update_interval == 1000
    cfg = _compose(["precision=fixed", "precision.scale=4096", f"paths.output_dir={tmp_path}"])
    assert cfg.precision.scale == 4096


def _train(args: list[str], tmp_path: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "GS_CACHE_DIR": str(tmp_path / "cache"), "GS_DATA_DIR": str(tmp_path / "data")}
    return subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={tmp_path / 'run'}", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def test_default_run_without_arguments(tmp_path: Path) -> None:
    """`python train.py` with only a shorter schedule: generates the data, trains, tests, plots."""
    result = _train(["trainer.max_steps=12", "trainer.check_val_every_n_epoch=1", "callbacks.gradient_scaling.log_every_n_steps=4"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test/miou" in result.stdout
    assert "Per-layer gradient scales" in result.stdout and "classifier.cast" in result.stdout
    plots = [line.split("Plot: ", 1)[1] for line in result.stdout.splitlines() if line.startswith("Plot: ")]
    assert len(plots) == 2 and all(Path(p).is_file() for p in plots)
    assert (tmp_path / "cache" / "camvid_synthetic_48x64" / "trainannot").is_dir()


def test_missing_dataset_names_path_and_layout(tmp_path: Path) -> None:
    result = _train(["recipe=segnet", f"data.root={tmp_path / 'nowhere'}", "trainer.accelerator=cpu"], tmp_path, timeout=120)
    assert result.returncode == 1
    assert str(tmp_path / "nowhere") in result.stderr and "expected" in result.stderr and "annot" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_precision_value_names_the_option(tmp_path: Path) -> None:
    result = _train(["precision.update_interval=0", "trainer.accelerator=cpu"], tmp_path, timeout=120)
    assert result.returncode == 1
    assert "update_interval" in result.stderr and "Traceback" not in result.stderr
