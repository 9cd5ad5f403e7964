"""The training application behind ``train.py``: a composed Hydra config in, a trained run out.

Data flows one way: the recipe's config builds the datamodule, the model, the task and the
trainer; the precision plugin scales; the callbacks observe. Recipes are the YAML files in the
repository's ``recipes/`` folder, registered as Hydra's ``recipe`` config group.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from hydra.core.config_store import ConfigStore
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from gs_lightning.data.errors import DatasetError

log = logging.getLogger(__name__)


def register_recipes(directory: Path) -> list[str]:
    """Register every ``<directory>/<name>.yaml`` as the Hydra option ``recipe=<name>``."""
    store = ConfigStore.instance()
    names = sorted(path.stem for path in directory.glob("*.yaml"))
    for name in names:
        store.store(group="recipe", name=name, node=OmegaConf.load(directory / f"{name}.yaml"), package="_global_")
    return names


@dataclass
class Run:
    """Everything a recipe builds."""

    trainer: L.Trainer
    task: L.LightningModule
    datamodule: L.LightningDataModule


def precision_arguments(precision: DictConfig) -> dict[str, Any]:
    """Trainer arguments for the ``precision`` group: one of our plugins, or Lightning's own flag."""
    if "_target_" in precision:
        return {"plugins": [instantiate(precision)]}
    if "lightning_precision" in precision:
        return {"precision": precision.lightning_precision}
    raise ValueError(
        f"precision config {OmegaConf.to_yaml(precision).strip()!r} names neither a plugin (_target_) "
        "nor Lightning's own precision (lightning_precision); expected one of conf/precision/*.yaml"
    )


def build(cfg: DictConfig) -> Run:
    """Build datamodule, model, task and trainer from a composed config."""
    L.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    task = instantiate(cfg.task, model=instantiate(cfg.model))
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c is not None]
    trainer = instantiate(cfg.trainer, logger=instantiate(cfg.logger), callbacks=callbacks, **precision_arguments(cfg.precision))
    return Run(trainer, task, datamodule)


def run(cfg: DictConfig) -> dict[str, float]:
    """Fit (and test) the recipe; return the final metrics. Bad input exits with one clear message."""
    try:
        built = build(cfg)
        built.trainer.fit(built.task, datamodule=built.datamodule, ckpt_path=cfg.ckpt_path)
        metrics = {k: float(v) for k, v in built.trainer.callback_metrics.items()}
        if cfg.test and not cfg.trainer.fast_dev_run:
            for result in built.trainer.test(built.task, datamodule=built.datamodule, verbose=False):
                metrics.update(result)
    except (DatasetError, FileNotFoundError) as error:
        sys.exit(f"error: {error}")
    except InstantiationException as error:
        sys.exit(f"error: bad config value: {error}")
    if built.trainer.is_global_zero:
        print(summary(built.trainer, metrics))
    return metrics


def summary(trainer: L.Trainer, metrics: dict[str, float]) -> str:
    """Final metrics, the per-layer scales of the last update, and the plots written."""
    lines = ["", "Final metrics:"]
    lines += [f"  {name:<28} {value:.4f}" for name, value in sorted(metrics.items()) if "/" in name]
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    layers = scaler.layers() if scaler is not None and hasattr(scaler, "layers") else []
    if layers:
        lines += [
            "",
            f"Per-layer gradient scales (last update; {scaler.skipped_steps} skipped steps):",
            f"  {'layer':<32} {'log2 scale':>10} {'log2 total':>10} {'est. underflow':>15}",
        ]
        lines += [
            f"  {layer.name:<32} {layer.log2_scale:>10} {layer.log2_total:>10} {layer.underflow_rate:>15.2e}" for layer in layers
        ]
    for callback in trainer.callbacks:
        for path in getattr(callback, "plot_paths", []):
            lines.append(f"Plot: {path}")
    return "\n".join(lines)
