"""GradientScalingCallback: log per-layer gradient scales while training, plot them when it ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from gs_lightning.analysis.plots import (
    history_layers,
    layer_groups,
    plot_scale_heatmap,
    plot_scale_mean_std,
    save_scale_history,
)
from gs_lightning.lightning.plugins import GradientScalingPlugin
from gs_lightning.scaling import GradientScaler

HEATMAP_FILE = "scale_heatmap.png"
MEAN_STD_FILE = "scale_mean_std.png"
HISTORY_FILE = "scale_history.csv"


class GradientScalingCallback(Callback):
    """Logs the per-layer gradient scales of :class:`GradientScalingPlugin` and plots them at the end of fit.

    Every ``log_every_n_steps`` optimizer steps (``trainer.global_step``) and once more at the end of
    training, it logs through every configured logger (CSV, TensorBoard, W&B):

    * ``gs/scale/<layer>``: log2 of the layer's local scale β,
    * ``gs/underflow/<layer>``: the model's estimated underflow rate at that scale,
    * ``gs/skipped_steps``: optimizer steps skipped so far for non-finite gradients,

    and keeps the scales in :attr:`history` (``{step: {layer: log2 scale}}``, saved in checkpoints).
    When training ends it writes to the run's log directory (``trainer.log_dir``) a layer × step
    heatmap of the scales (the paper's Figure 3b), their mean ± std per layer (Figure 2) and the
    history as ``scale_history.csv``. With a :class:`~lightning.pytorch.loggers.WandbLogger` the
    two figures are also logged as images and the history as one line-series chart per layer group.

    With any other precision plugin it warns once and does nothing.

    Args:
        log_every_n_steps: Log every this many optimizer steps.
    """

    def __init__(self, log_every_n_steps: int = 100) -> None:
        if not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(f"GradientScalingCallback: log_every_n_steps must be a positive integer, got {log_every_n_steps!r}")
        self.log_every_n_steps = log_every_n_steps
        self.history: dict[int, dict[str, float]] = {}
        self.plot_paths: list[Path] = []
        self.history_path: Path | None = None
        self._scaler: GradientScaler | None = None
        self._last_step = 0
        self._warned = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The plugin builds its scaler when the strategy connects it, which precedes this hook.
        plugin = trainer.precision_plugin
        if isinstance(plugin, GradientScalingPlugin):
            self._scaler = plugin.scaler
        else:
            self._scaler = None
            if not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"GradientScalingCallback: the precision plugin is {type(plugin).__name__}, not "
                    "GradientScalingPlugin; there are no gradient scales to log."
                )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step  # nonzero when resuming

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, last = trainer.global_step, self._last_step
        self._last_step = step
        # Crossing a multiple of N, not landing on one: several optimizers advance global_step by more than 1.
        if self._scaler is not None and step // self.log_every_n_steps > last // self.log_every_n_steps:
            self._record(trainer, self._scaler, step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._scaler is None:
            return
        if trainer.global_step not in self.history:
            self._record(trainer, self._scaler, trainer.global_step)
        log_dir = trainer.log_dir  # a collective call under DDP: every rank makes it
        if not trainer.is_global_zero or not self.history:
            return
        out = Path(log_dir if log_dir is not None else trainer.default_root_dir)
        self.plot_paths = [
            plot_scale_heatmap(self.history, out / HEATMAP_FILE),
            plot_scale_mean_std(self.history, out / MEAN_STD_FILE),
        ]
        self.history_path = save_scale_history(self.history, out / HISTORY_FILE)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                _log_to_wandb(logger, self.history, self.plot_paths, trainer.global_step)
        rank_zero_info(f"GradientScalingCallback: wrote {', '.join(str(p) for p in [*self.plot_paths, self.history_path])}")

    def state_dict(self) -> dict[str, Any]:
        return {"history": {step: dict(scales) for step, scales in self.history.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {int(step): dict(scales) for step, scales in state_dict["history"].items()}

    def _record(self, trainer: pl.Trainer, scaler: GradientScaler, step: int) -> None:
        layers = scaler.layers()
        if not layers:  # no update has run yet: nothing chosen
            return
        self.history[step] = {layer.name: float(layer.log2_scale) for layer in layers}
        metrics = {f"gs/scale/{layer.name}": float(layer.log2_scale) for layer in layers}
        metrics.update({f"gs/underflow/{layer.name}": layer.underflow_rate for layer in layers})
        metrics["gs/skipped_steps"] = float(scaler.skipped_steps)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def _log_to_wandb(logger: WandbLogger, history: dict[int, dict[str, float]], plots: list[Path], step: int) -> None:
    """The figures as images, and the history as one line-series chart per layer group: the W&B dashboard."""
    import wandb  # only with a WandbLogger, which needs it anyway

    media: dict[str, Any] = {f"gs/plots/{path.stem}": wandb.Image(str(path)) for path in plots}
    steps = sorted(history)
    for group, layers in layer_groups(history_layers(history)).items():
        xs = [[s for s in steps if layer in history[s]] for layer in layers]
        ys = [[history[s][layer] for s in steps if layer in history[s]] for layer in layers]
        media[f"gs/scale_history/{group}"] = wandb.plot.line_series(
            xs=xs, ys=ys, keys=layers, title=f"log2 gradient scale: {group}", xname="step"
        )
    logger.log_metrics(media, step=step)
