"""Callbacks: GradientScalingCallback logs per-layer gradient scales while training and plots them
when it ends; RandomStateCallback puts the random generators' states into checkpoints;
ResumeCallback makes a resumed or extended run continue exactly where an uninterrupted one would;
InterruptCheckpoint saves the step a Ctrl-C interrupted."""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader

from gs_lightning.analysis.plots import (
    history_layers,
    layer_groups,
    plot_scale_heatmap,
    plot_scale_mean_std,
    save_scale_history,
)
from gs_lightning.lightning.packages import KNOWN_LOGGERS, WANDB_LOGGERS
from gs_lightning.lightning.plugins import FP16MixedPrecision, GradientScalingPlugin
from gs_lightning.scaling import GradientScaler

HEATMAP_FILE = "scale_heatmap.png"
MEAN_STD_FILE = "scale_mean_std.png"
HISTORY_FILE = "scale_history.csv"


class GradientScalingCallback(Callback):
    """Logs the per-layer gradient scales of :class:`GradientScalingPlugin` and plots them at the end of fit.

    Every ``log_every_n_steps`` optimizer steps (``trainer.global_step``) and once more at the end of
    training, it logs through every configured logger (CSV, TensorBoard, W&B):

    * ``gs/scale/<layer>``: log2 of the layer's local scale β,
    * ``gs/underflow/<layer>``: the model's estimated underflow rate at that scale, and
      ``gs/underflow/<layer>/measured`` the rate measured on the update's exact fp32 probes,
    * ``gs/drift``: by how many binades the gradients shrank below the last update (measured at
      every step; from 1 on, the next backward updates the scales),
    * ``gs/skipped_steps``: optimizer steps skipped so far for non-finite gradients,
      ``gs/retried_steps`` those whose forward and backward ran again after an overflow instead, and
      ``gs/recomputed_steps`` those taken although a weight gradient overflowed (recomputed in fp32),
    * ``gs/update_iterations``: backward passes so far that decided the scales (the others replayed
      them, at a fraction of the cost),
    * ``gs/update/<reason>``: at every step whose backward decided the scales, whatever
      ``log_every_n_steps``, how many of its updates each reason asked for
      (:class:`~gs_lightning.scaling.schedule.UpdateReason`, lower case: ``gs/update/interval``,
      ``gs/update/skipped_step``, ``gs/update/drift``, ...),

    * ``gs/total/<layer>``: log2 of the accumulated scale its outgoing gradient carries (its own
      scale times those of every layer after it in the forward pass, raised where its weight
      gradients' level fell since the update), and ``gs/raised/<layer>`` by how many binades
      (:meth:`GradientScaler.raised <gs_lightning.scaling.GradientScaler.raised>`), per GEMM,

    and keeps the scales in :attr:`history` (``{step: {layer: log2 scale}}``) and the accumulated
    ones in :attr:`totals`, both saved in checkpoints. When training ends it writes to the run's log
    directory (``trainer.log_dir``) a layer × step heatmap of the scales (the paper's Figure 3b),
    the mean ± std per layer of the local and the accumulated scales (Figure 2) and the local
    history as ``scale_history.csv``. With a ``WandbLogger`` (of ``lightning.pytorch`` or of
    ``pytorch_lightning``) the two figures are also logged as images and the history as one
    line-series chart per layer group. A logger other than W&B, TensorBoard or CSV gets the scalars,
    and a note, once, that the plots are only in the log directory. The heatmap's title names the
    run and the precision plugin, and marks (▼) where updates decided new scales
    (:attr:`update_steps`).

    With a loss-scaling plugin (:class:`DynamicLossScalingPlugin`'s ``GradScaler``,
    :class:`LossScalingPlugin`, :class:`FP16Plugin`) it logs ``gs/loss_scale`` (log2 of the scaler's
    ``get_scale()``) and ``gs/skipped_steps`` (the optimizer steps the plugin did not take for
    non-finite gradients: a backward ran and the optimizer did not step) at the same steps, and
    keeps both as :attr:`loss_scale` and :attr:`skipped_steps`. With any other precision plugin it
    warns once and does nothing.

    Args:
        log_every_n_steps: Log every this many optimizer steps.
        run_name: The run the plots' titles name; by default the logger's name and version, or
            the Trainer's ``default_root_dir``.

    Attributes:
        update_steps: the optimizer steps whose backward decided the scales (the scaler's update
            iterations), saved in checkpoints.
        update_reasons: step of :attr:`update_steps` -> the names of the
            :class:`~gs_lightning.scaling.schedule.UpdateReason` members its updates ran for, saved in
            checkpoints; with a ``WandbLogger`` logged at the end as the table ``gs/updates``.
    """

    def __init__(self, log_every_n_steps: int = 100, run_name: str | None = None) -> None:
        if not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(
                f"GradientScalingCallback: log_every_n_steps must be a positive integer, got {log_every_n_steps!r}"
            )
        self.log_every_n_steps = log_every_n_steps
        self.run_name = run_name
        self.update_steps: list[int] = []
        self.update_reasons: dict[int, list[str]] = {}
        self._updates_seen = 0
        self.history: dict[int, dict[str, float]] = {}
        self.totals: dict[int, dict[str, float]] = {}
        self.plot_paths: list[Path] = []
        self.history_path: Path | None = None
        self._scaler: GradientScaler | None = None
        self._loss_scaler: Any = None  # a loss-scaling plugin's scaler (GradScaler's interface)
        self._skips = 0  # steps the loss-scaling plugin skipped
        self._backward_ran = False  # since the last optimizer step
        self._step_due = False  # a step was due and the optimizer has not taken it yet
        self._step_hooks: list[Any] = []
        self._last_step = 0
        self._loss_scale_logged = -1
        self._warned = False
        self._noted_loggers: set[type] = set()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The plugin builds its scaler when the strategy connects it, which precedes this hook.
        plugin = trainer.precision_plugin
        self._scaler = plugin.scaler if isinstance(plugin, GradientScalingPlugin) else None
        self._loss_scaler = plugin.scaler if isinstance(plugin, FP16MixedPrecision) and self._scaler is None else None
        if self._loss_scaler is not None:
            self._step_hooks = [
                optimizer.register_step_post_hook(self._optimizer_stepped) for optimizer in trainer.optimizers
            ]
        elif self._scaler is None and not self._warned:
            self._warned = True
            rank_zero_warn(
                f"GradientScalingCallback: the precision plugin is {type(plugin).__name__}, which scales no "
                "gradients; there is nothing to log."
            )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []

    @property
    def skipped_steps(self) -> int | None:
        """Optimizer steps skipped for non-finite gradients so far: the GradientScaler's count, or the
        steps a loss-scaling plugin did not take; None with another plugin (or before a fit)."""
        if self._scaler is not None:
            return self._scaler.skipped_steps
        return self._skips if self._loss_scaler is not None else None

    @property
    def loss_scale(self) -> float | None:
        """A loss-scaling plugin's current loss scale (``get_scale()``); None with another plugin."""
        return float(self._loss_scaler.get_scale()) if self._loss_scaler is not None else None

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._backward_ran = True

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # Called after the backward (and unscaling), before the plugin steps or skips.
        self._count_skip()  # an earlier optimizer of the same batch (manual optimization)
        self._step_due, self._backward_ran = self._backward_ran and self._loss_scaler is not None, False

    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._step_due = False

    def _count_skip(self) -> None:
        if self._step_due:
            self._skips += 1
            self._step_due = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step  # nonzero when resuming
        self._updates_seen = self._scaler.update_iterations if self._scaler is not None else 0

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._count_skip()
        step, last = trainer.global_step, self._last_step
        self._last_step = step
        if self._scaler is not None and self._scaler.update_iterations > self._updates_seen:
            self._log_updates(trainer, self._scaler, step)
        # Crossing a multiple of N, not landing on one: several optimizers advance global_step by more than 1.
        if step // self.log_every_n_steps > last // self.log_every_n_steps:
            if self._scaler is not None:
                self._record(trainer, self._scaler, step)
            elif self._loss_scaler is not None:
                self._record_loss_scale(trainer, step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._loss_scaler is not None and trainer.global_step != self._loss_scale_logged:
            self._record_loss_scale(trainer, trainer.global_step)
        if self._scaler is None:
            return
        if trainer.global_step not in self.history:
            self._record(trainer, self._scaler, trainer.global_step)
        log_dir = trainer.log_dir  # a collective call under DDP: every rank makes it
        if not trainer.is_global_zero or not self.history:
            return
        out = Path(log_dir if log_dir is not None else trainer.default_root_dir)
        self.plot_paths = [
            plot_scale_heatmap(self.history, out / HEATMAP_FILE, self.update_steps, title=self._title(trainer)),
            plot_scale_mean_std(self.history, out / MEAN_STD_FILE, totals=self.totals),
        ]
        self.history_path = save_scale_history(self.history, out / HISTORY_FILE)
        for logger in trainer.loggers:
            if isinstance(logger, WANDB_LOGGERS):
                _log_to_wandb(logger, self.history, self.plot_paths, self.update_reasons, trainer.global_step)
            elif not isinstance(logger, KNOWN_LOGGERS) and type(logger) not in self._noted_loggers:
                self._noted_loggers.add(type(logger))
                rank_zero_info(
                    f"GradientScalingCallback: {type(logger).__name__} got the scale scalars; it is not a logger "
                    f"this callback knows (W&B, TensorBoard, CSV), so the plots are only in {out}"
                )
        rank_zero_info(
            f"GradientScalingCallback: wrote {', '.join(str(p) for p in [*self.plot_paths, self.history_path])}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": {step: dict(scales) for step, scales in self.history.items()},
            "totals": {step: dict(scales) for step, scales in self.totals.items()},
            "update_steps": list(self.update_steps),
            "update_reasons": {step: list(names) for step, names in self.update_reasons.items()},
            "skipped_steps": self._skips,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {int(step): dict(scales) for step, scales in state_dict["history"].items()}
        self.totals = {int(step): dict(scales) for step, scales in state_dict.get("totals", {}).items()}
        self.update_steps = [int(step) for step in state_dict.get("update_steps", [])]
        self.update_reasons = {int(step): list(names) for step, names in state_dict.get("update_reasons", {}).items()}
        self._skips = int(state_dict.get("skipped_steps", 0))

    def _title(self, trainer: pl.Trainer) -> str:
        """'<run>' over '<plugin> (<gradient format>[, emulated]): log2 gradient scale per layer'."""
        run = self.run_name
        logger = trainer.logger
        if run is None and logger is not None and logger.name:
            version = logger.version
            run = (
                logger.name
                if version is None
                else f"{logger.name}/{f'version_{version}' if isinstance(version, int) else version}"
            )
        plugin = trainer.precision_plugin
        grads = f"{str(getattr(plugin, 'grad_dtype', 'float16')).removeprefix('torch.')} gradients"
        emulated = ", emulated" if getattr(plugin, "emulate", False) is True else ""
        heading = f"{type(plugin).__name__} ({grads}{emulated}): log2 gradient scale per layer"
        return f"{run or trainer.default_root_dir}\n{heading}"

    def _record_loss_scale(self, trainer: pl.Trainer, step: int) -> None:
        self._loss_scale_logged = step
        metrics = {"gs/loss_scale": math.log2(self.loss_scale), "gs/skipped_steps": float(self._skips)}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _log_updates(self, trainer: pl.Trainer, scaler: GradientScaler, step: int) -> None:
        """The updates since the last batch's end (the last ones of :attr:`GradientScaler.updates
        <gs_lightning.scaling.GradientScaler.updates>`): kept, and logged at ``step`` as how many each reason
        asked for."""
        new = scaler.update_iterations - self._updates_seen
        self._updates_seen = scaler.update_iterations
        self.update_steps.append(step)
        counts = Counter(reason for update in scaler.updates[-new:] for reason in update.reasons)
        names = self.update_reasons.setdefault(step, [])
        names += sorted(reason.name for reason in counts if reason.name not in names)
        metrics = {f"gs/update/{reason.name.lower()}": float(count) for reason, count in counts.items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _record(self, trainer: pl.Trainer, scaler: GradientScaler, step: int) -> None:
        layers = scaler.layers()
        if not layers:  # no update has run yet: nothing chosen
            return
        raised = scaler.raised()
        self.history[step] = {layer.name: float(layer.log2_scale) for layer in layers}
        self.totals[step] = {layer.name: float(layer.log2_total + raised.get(layer.name, 0)) for layer in layers}
        metrics = {f"gs/scale/{layer.name}": float(layer.log2_scale) for layer in layers}
        metrics.update({f"gs/total/{name}": total for name, total in self.totals[step].items()})
        metrics.update(
            {f"gs/raised/{layer.name}": float(raised.get(layer.name, 0)) for layer in layers if layer.kind == "gemm"}
        )
        if scaler.recipe.own_input_gradient_scale:
            metrics.update(
                {
                    f"gs/input_shift/{layer.name}": float(layer.input_gradient_shift)
                    for layer in layers
                    if layer.kind == "gemm"
                }
            )
        metrics.update({f"gs/underflow/{layer.name}": layer.underflow_rate for layer in layers})
        metrics.update(
            {
                f"gs/underflow/{layer.name}/measured": layer.measured_underflow
                for layer in layers
                if layer.measured_underflow is not None
            }
        )
        if math.isfinite(scaler.drift.drift_log2):
            metrics["gs/drift"] = scaler.drift.drift_log2
        if math.isfinite(scaler.drift.surprise_log2):
            metrics["gs/surprise"] = scaler.drift.surprise_log2
        metrics["gs/skipped_steps"] = float(scaler.skipped_steps)
        metrics["gs/retried_steps"] = float(scaler.retried_steps)
        metrics["gs/recomputed_steps"] = float(scaler.recomputed_steps)
        metrics["gs/update_iterations"] = float(scaler.update_iterations)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def _log_to_wandb(
    logger: Any,
    history: dict[int, dict[str, float]],
    plots: list[Path],
    update_reasons: dict[int, list[str]],
    step: int,
) -> None:
    """The figures as images, the history as one line-series chart per layer group, and why each update ran as the
    table ``gs/updates`` (step, reasons): the W&B dashboard."""
    import wandb  # only with a WandbLogger, which needs it anyway

    media: dict[str, Any] = {f"gs/plots/{path.stem}": wandb.Image(str(path)) for path in plots}
    media["gs/updates"] = wandb.Table(
        columns=["step", "reasons"], data=[[s, ", ".join(names)] for s, names in sorted(update_reasons.items())]
    )
    steps = sorted(history)
    for group, layers in layer_groups(history_layers(history)).items():
        xs = [[s for s in steps if layer in history[s]] for layer in layers]
        ys = [[history[s][layer] for s in steps if layer in history[s]] for layer in layers]
        media[f"gs/scale_history/{group}"] = wandb.plot.line_series(
            xs=xs, ys=ys, keys=layers, title=f"log2 gradient scale: {group}", xname="step"
        )
    logger.log_metrics(media, step=step)


class RandomStateCallback(Callback):
    """Saves the states of torch's, numpy's and Python's random generators in every checkpoint and
    restores them when training resumes from one.

    Lightning's checkpoints hold weights, optimizers, schedulers and loop counters but no generator
    state, so a resumed run otherwise draws other random numbers (augmentation in the main process,
    dropout) than an uninterrupted one. Together with Lightning's ``seed_everything(workers=True)``
    and loaders that shuffle by ``(seed, epoch)`` (:class:`~gs_lightning.data.base.EpochShuffleSampler`,
    which also fixes the workers' seeds), a run resumed from a checkpoint written at an epoch
    boundary ends bit-identical to an uninterrupted one on the CPU (with :class:`ResumeCallback`).

    The states are restored when training starts, after the sanity-check validation, which would
    otherwise draw from them first. They are stored as tensors and plain numbers, so a checkpoint
    loads with ``torch.load(weights_only=True)``.
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None
        self._epoch_start: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        state = _random_states()
        if self._epoch_start is not None:
            state["epoch_start"] = self._epoch_start
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_pending()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The states before the epoch's loader iterator is made (by the epoch loop; in a fit's first
        # epoch by ResumeCallback): a resume in the middle of the epoch replays it from them.
        self._epoch_start = _random_states()

    def restore_epoch_start(self) -> bool:
        """Set the generators to their states at the start of the current epoch (those of a checkpoint
        being resumed); return whether there were any."""
        self._restore_pending()  # whichever of the two callbacks' on_train_start runs first
        if self._epoch_start is None:
            return False
        _set_random_states(self._epoch_start)
        return True

    def _restore_pending(self) -> None:
        """The states of the checkpoint being resumed, once."""
        if self._pending is None:
            return
        state, self._pending = self._pending, None
        _set_random_states(state)
        self._epoch_start = state.get("epoch_start")


def _random_states() -> dict[str, Any]:
    """torch's, numpy's and Python's generator states (and CUDA's once in use), as tensors and plain values."""
    _, keys, position, has_gauss, cached_gaussian = np.random.get_state()  # ("MT19937", ...)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_random_states(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, numpy["position"], numpy["has_gauss"], numpy["cached_gaussian"]))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


class ResumeCallback(Callback):
    """Makes a run resumed from a checkpoint, with the same or larger ``max_epochs``/``max_steps``,
    train exactly the steps an uninterrupted run with those limits trains, numbered as it numbers them.

    Lightning (2.6) resumes a checkpoint written when an epoch's batches were all done (at
    validation end, epoch end or the end of ``fit``) as a restart of that epoch when ``max_steps``
    is set: it trains one batch past the epoch's end and numbers the next epochs one off, and a
    checkpoint written at validation end counts its epoch twice against ``max_epochs``. So:

    * on loading, such a checkpoint's loop state is made that of a finished epoch, and one written
      at the end of ``fit`` in the middle of an epoch (``max_steps`` reached) that of an unfinished
      epoch, which Lightning resumes as a mid-epoch restart;
    * when training starts from a finished epoch, the loops are told there is nothing to restart,
      so the next epoch starts as it does in an uninterrupted run;
    * when it starts in the middle of an epoch, the epoch's loader is replayed up to the batch the
      checkpoint had reached: same order, and, when batches are loaded in the main process, the
      random states of the epoch's start (from :class:`RandomStateCallback`), so random
      augmentation draws the same numbers again. That is exact when the model itself draws no
      random numbers (no dropout) or when the loader's workers do the augmenting;
    * at every epoch start the training samplers are numbered by ``trainer.current_epoch`` and, in
      the first epoch of a fit (fresh or resumed), the loader's iterator is made again: Lightning
      made it before the sampler's epoch was set and the random states were restored
      (:class:`RandomStateCallback`), where the epoch loop makes it for every later epoch.

    Checkpoints also record the recipe that wrote them, so that resuming another recipe's can say so.

    Args:
        recipe: the name of the recipe this run trains (``None`` outside the app).
    """

    def __init__(self, recipe: str | None = None) -> None:
        self.recipe = recipe
        self._resumed_finished_epoch = False

    def state_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe}

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Callbacks see the checkpoint before the Trainer restores its loops from it.
        fit_loop = checkpoint.get("loops", {}).get("fit_loop")
        self._resumed_finished_epoch = fit_loop is not None and settle_epoch_progress(fit_loop)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._resumed_finished_epoch:
            self._resumed_finished_epoch = False
            _stop_restarting(trainer.fit_loop)
        elif trainer.fit_loop.restarting and trainer.fit_loop.epoch_loop.batch_progress.current.ready > 0:
            self._replay_epoch(trainer, trainer.fit_loop.epoch_loop.batch_progress.current.ready)

    def _replay_epoch(self, trainer: pl.Trainer, batches: int) -> None:
        """Load the resumed epoch's first ``batches`` batches again (and drop them), as the interrupted run did."""
        apply_to_collection(trainer.train_dataloader, DataLoader, _set_sampler_epoch, trainer.current_epoch)
        loaders: list[DataLoader] = []
        apply_to_collection(trainer.train_dataloader, DataLoader, loaders.append)
        if all(loader.num_workers == 0 for loader in loaders):
            for callback in trainer.callbacks:
                if isinstance(callback, RandomStateCallback):
                    callback.restore_epoch_start()
        fetcher = trainer.fit_loop._data_fetcher
        iter(fetcher)
        for _ in range(batches):
            next(fetcher)
        fetcher.fetched -= batches  # the epoch loop counts the batches the checkpoint had reached itself

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning numbers the samplers' epochs by its count of processed epochs, which can run one
        # ahead of ``current_epoch`` after a resume: the run would shuffle as the epoch after.
        apply_to_collection(trainer.train_dataloader, DataLoader, _set_sampler_epoch, trainer.current_epoch)
        if trainer.current_epoch == 0 or trainer.fit_loop.is_resuming:  # the epoch loop makes it for the others
            iter(trainer.fit_loop._data_fetcher)


def settle_epoch_progress(fit_loop: dict[str, Any]) -> bool:
    """Rewrite a checkpoint's fit-loop state written after an epoch's last batch as a finished epoch,
    and one written at the end of ``fit`` in the middle of an epoch as that epoch unfinished.

    Returns whether the state is now a finished epoch. Other states (a checkpoint written at the end
    of a batch) are left to Lightning.
    """
    batches, epochs = fit_loop["epoch_loop.batch_progress"], fit_loop["epoch_progress"]
    started = epochs["current"]["started"]
    all_batches_done = batches["is_last_batch"] and batches["current"]["completed"] == batches["current"]["ready"]
    if all_batches_done:
        finished = started
    elif epochs["current"]["processed"] == started and batches["current"]["ready"] > 0:
        finished = started - 1  # fit ended on max_steps and counted the epoch as processed
    else:
        return False
    for counts in (epochs["current"], epochs["total"]):
        offset = counts["started"] - started  # total and current differ after an earlier restart
        counts["processed"] = counts["completed"] = finished + offset
    return all_batches_done


def finished_epochs(checkpoint: dict[str, Any]) -> int:
    """How many epochs the run that wrote ``checkpoint`` had finished (all their batches trained)."""
    fit_loop = {
        key: dict(value) if isinstance(value, dict) else value for key, value in checkpoint["loops"]["fit_loop"].items()
    }
    fit_loop["epoch_progress"] = {kind: dict(counts) for kind, counts in fit_loop["epoch_progress"].items()}
    settle_epoch_progress(fit_loop)
    return int(fit_loop["epoch_progress"]["current"]["completed"])


def _stop_restarting(loop: Any) -> None:
    """Mark a loop and the loops inside it as not restarting (Lightning's setter keeps the fit loop
    restarting whenever ``max_steps`` is set)."""
    loop._restarting = False
    for child in vars(loop).values():
        if hasattr(child, "_restarting") and child is not loop and hasattr(child, "trainer"):
            _stop_restarting(child)


class InterruptCheckpoint(Callback):
    """Saves a checkpoint when a fit is interrupted with Ctrl-C (``KeyboardInterrupt``) or stopped by
    SIGTERM (what SLURM, Kubernetes and ``timeout`` send), at the step it reached: ``ckpt_path=``
    resumes from there.

    SIGTERM is Lightning's to catch: its signal connector's handler (which, under SLURM with
    auto-requeue, also keeps the requeue handlers) records it, and the loops end the fit at the end
    of the batch with :class:`~lightning.pytorch.utilities.exceptions.SIGTERMException`, which this
    callback meets in ``on_exception``; it installs no signal handler of its own.

    Not Lightning's :class:`~lightning.pytorch.callbacks.OnExceptionCheckpoint`, which saves on any
    exception (a crash's state, a corrupt image's or a diverged run's, is seldom one to resume),
    removes the file when a fit ends, and makes every later ``fit(ckpt_path=None)`` look for a
    checkpoint to resume. Interrupted between two batches (in a batch-end hook) the checkpoint
    resumes with the next batch, as Lightning's own step checkpoints do; interrupted within a batch,
    it resumes with that batch again. Stopped by SIGTERM, it resumes with the next batch.

    Args:
        dirpath: folder of the checkpoint.
        filename: its name, without ``.ckpt``.

    Attributes:
        saved: the checkpoint written by the last interrupted fit, or None.
    """

    def __init__(self, dirpath: str | Path, filename: str = "interrupted") -> None:
        if not filename:
            raise ValueError("InterruptCheckpoint: filename must not be empty")
        self.path = Path(dirpath) / f"{filename}.ckpt"
        self.saved: Path | None = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning's SIGTERMException is a SystemExit raised once its handler has recorded the signal.
        stopped = isinstance(exception, KeyboardInterrupt) or (
            isinstance(exception, SystemExit) and trainer.received_sigterm
        )
        if stopped and trainer.state.fn == TrainerFn.FITTING:
            trainer.save_checkpoint(self.path)
            self.saved = self.path.resolve()
