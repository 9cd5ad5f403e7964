"""The training application behind ``train.py``: a composed Hydra config in, a trained run out.

Data flows one way: the recipe's config builds the datamodule, the model, the task and the
trainer; the precision plugin scales; the callbacks observe. Recipes are the YAML files in the
repository's ``recipes/`` folder, registered as Hydra's ``recipe`` config group. Bad input stops
the run with one line naming what is wrong and what was expected (:class:`AppError`).
"""

from __future__ import annotations

import difflib
import inspect
import json
import logging
import math
import re
import shlex
import shutil
import signal
import sys
import textwrap
import time
import warnings
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException, InstantiationException, OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from hydra.utils import get_object, instantiate
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from omegaconf import DictConfig, OmegaConf

from gs_lightning.data.errors import DatasetError
from gs_lightning.data.synthetic import generated_dataset
from gs_lightning.lightning.callback import (
    GradientScalingCallback,
    InterruptCheckpoint,
    ResumeCallback,
    finished_epochs,
)
from gs_lightning.lightning.plugins import FP16MixedPrecision
from gs_lightning.scaling.scaler import GradientScaler

log = logging.getLogger(__name__)

# The pip extra that provides each optional logger.
_LOGGER_EXTRAS = {"WandbLogger": "wandb", "TensorBoardLogger": "tensorboard"}

_SCALE_TABLE_HELP = (
    "How to read the scales: each layer multiplies the gradient it sends on by 2^(log2 scale); log2 "
    "total is the scale that gradient then carries (the product over it and every layer after it in "
    "the forward pass); est. underflow is the estimated fraction of its nonzero values still lost to "
    "fp16 (target 1e-3; a cast before the loss can stay near 0.1: its values span more than fp16's "
    "range, the paper's §5.4). The plots show the same over the run."
)


# Each run's final numbers (write_results), and a multirun's table of them (RunComparison).
RESULTS_FILE = "results.json"
COMPARISON_FILE = "comparison.md"


class AppError(Exception):
    """Bad input to the app: the message says what is wrong and what was expected."""


def register_recipes(directory: Path) -> list[str]:
    """Register every ``<directory>/<name>.yaml`` as the Hydra option ``recipe=<name>``."""
    store = ConfigStore.instance()
    names = sorted(path.stem for path in directory.glob("*.yaml"))
    for name in names:
        store.store(group="recipe", name=name, node=OmegaConf.load(directory / f"{name}.yaml"), package="_global_")
    return names


def override_hints(arguments: Sequence[str], config_dir: Path) -> list[str]:
    """For each ``key=value`` of a command line whose key the composed config lacks, a line naming the
    nearest valid key(s) at that level (``difflib``), or the valid ones when none is near.

    Hydra refuses such an override with "not in struct ... use +", and a ``+`` would add a key
    that nothing reads. The config is composed with the command line's group choices (the first
    of a sweep's); ``+``, ``++``, ``~`` and ``hydra.`` overrides are left alone. Empty when every
    key exists or the command line does not compose for another reason.
    """
    parser = OverridesParser.create()
    overrides = []
    for argument in arguments:
        if "=" in argument and not argument.startswith("-"):
            try:
                overrides += parser.parse_overrides([argument])
            except OverrideParseException:
                continue
    groups = {path.name for path in config_dir.iterdir() if path.is_dir()} | set(ConfigStore.instance().repo)
    choices, settings = [], []
    for override in overrides:
        if override.is_add() or override.is_force_add() or override.is_delete() or override.package is not None:
            continue
        if override.key_or_group in groups:
            value = (
                next(iter(override.sweep_string_iterator()))
                if override.is_sweep_override()
                else override.get_value_element_as_str()
            )
            choices.append(f"{override.key_or_group}={value}")
        elif override.key_or_group.split(".")[0] != "hydra":
            settings.append(override)
    if not settings:
        return []
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            config = OmegaConf.to_container(compose(config_name="config", overrides=choices), resolve=False)
    except HydraException:
        return []
    return [hint for override in settings if (hint := _key_hint(override, config))]


def _key_hint(override: Override, config: dict[str, Any]) -> str:
    """'Did you mean ...' for an override whose key is not in ``config`` ('' when it is)."""
    parts = override.key_or_group.split(".")
    node = config
    for depth, part in enumerate(parts):
        if not isinstance(node, dict):
            return ""
        if part in node:
            node = node[part]
            continue
        level = ".".join(parts[:depth])
        where = level or "the config"
        keys = [str(key) for key in node]
        value = override.input_line.split("=", 1)[1]
        near = difflib.get_close_matches(part, keys, n=3, cutoff=0.6)
        if not near:
            return f"{where} has no key {part!r}; its keys: {', '.join(keys)}"
        rest = ".".join(parts[depth + 1 :])
        spelled = [".".join(p for p in (level, key, rest) if p) + f"={value}" for key in near]
        return (
            f"Did you mean {' or '.join(spelled)}? ({where} has no key {part!r}; "
            "a leading + would add one that nothing reads)"
        )
    return ""


@dataclass
class Run:
    """Everything a recipe builds."""

    trainer: L.Trainer
    task: L.LightningModule
    datamodule: L.LightningDataModule


class EpochsRichProgressBar(RichProgressBar):
    """Lightning's Rich progress bar (its default where rich is installed), with the number of epochs a
    run limited by ``trainer.max_steps`` takes: Lightning's shows ``max_epochs - 1`` as the last epoch,
    "Epoch 0/-2" for such a run (``max_epochs=-1``)."""

    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        epochs = trainer.max_epochs if trainer.max_epochs not in (None, -1) else None
        batches = trainer.num_training_batches
        if trainer.max_steps != -1 and 0 < batches < math.inf:
            steps_per_epoch = math.ceil(batches / trainer.accumulate_grad_batches)
            by_steps = math.ceil(trainer.max_steps / steps_per_epoch)
            epochs = by_steps if epochs is None else min(epochs, by_steps)
        description = f"Epoch {current_epoch}" if epochs is None else f"Epoch {current_epoch}/{epochs - 1}"
        # As Lightning's: as wide as the validation bar's description, or the bars flicker.
        return f"{description:{len(self.validation_description)}}"


# Lightning's FSDPStrategy takes only an FSDPPrecision: the same method, in the plugin built on it.
_FSDP_PLUGINS = {
    "gs_lightning.GradientScalingPlugin": "gs_lightning.lightning.FSDPGradientScalingPlugin",
    "gs_lightning.DynamicLossScalingPlugin": "gs_lightning.lightning.FSDPDynamicLossScalingPlugin",
}


def precision_arguments(precision: DictConfig, strategy: Any = None) -> dict[str, Any]:
    """Trainer arguments for the ``precision`` group: one of our plugins, or Lightning's own flag.

    With ``trainer=fsdp`` (``strategy="fsdp"``) a scaling plugin is built on Lightning's FSDPPrecision.
    """
    if "_target_" in precision:
        if strategy == "fsdp":
            fsdp_target = _FSDP_PLUGINS.get(precision._target_)
            if fsdp_target is None:
                raise AppError(
                    f"trainer=fsdp takes precision=gs, dynamic, bf16 or fp32, not the plugin {precision._target_}: "
                    "under FSDP each rank holds a shard, and its non-finite check would be its own shard's"
                )
            precision = OmegaConf.merge(precision, {"_target_": fsdp_target})
        return {"plugins": [_instantiate(precision)]}
    if "lightning_precision" in precision:
        return {"precision": precision.lightning_precision}
    raise AppError(
        f"precision config {OmegaConf.to_yaml(precision).strip()!r} names neither a plugin (_target_) "
        "nor Lightning's own precision (lightning_precision); expected one of conf/precision/*.yaml"
    )


def build(cfg: DictConfig) -> Run:
    """Build datamodule, model, task and trainer from a composed config.

    Raises:
        AppError: a config value out of range, an unknown key, a missing file or package.
    """
    _check_mesh(cfg)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = _instantiate(cfg.data)
    _check_data_root(datamodule, cfg)
    task = _instantiate(cfg.task, model=_instantiate(cfg.model))
    callbacks = [_instantiate(c) for c in cfg.callbacks.values() if c is not None]
    show_progress = cfg.trainer.get("enable_progress_bar", True) is not False
    if show_progress and _RICH_AVAILABLE and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(EpochsRichProgressBar())  # the bar Lightning would pick, with the epoch count
    for callback in callbacks:
        if isinstance(callback, ResumeCallback):
            callback.recipe = _recipe_name()
        if isinstance(callback, GradientScalingCallback) and callback.run_name is None:
            callback.run_name = _run_label(Path(cfg.paths.output_dir))
    trainer = _instantiate(
        cfg.trainer,
        logger=_instantiate(cfg.logger),
        callbacks=callbacks,
        **precision_arguments(cfg.precision, cfg.trainer.get("strategy")),
    )
    return Run(trainer, task, datamodule)


def _check_mesh(cfg: DictConfig) -> None:
    """Refuse a tensor-parallel mesh before any process starts (each rank's task would raise it as a traceback).

    The tasks shard their networks over data-parallel ranks only (:class:`~gs_lightning.tasks.sharding.ShardedTask`).
    """
    strategy = cfg.trainer.get("strategy")
    if not isinstance(strategy, DictConfig) or not str(strategy.get("_target_", "")).endswith(".ModelParallelStrategy"):
        return
    size = strategy.get("tensor_parallel_size", "auto")
    if size != 1:
        raise AppError(
            f"trainer.strategy.tensor_parallel_size={size}: the tasks shard their networks over data-parallel "
            "ranks only "
            "(FSDP2, no tensor parallelism); expected 1, with trainer.strategy.data_parallel_size=<devices x nodes>"
        )


def run(cfg: DictConfig) -> dict[str, float]:
    """Fit and test the recipe; return the final metrics, which hold ``cfg.optimized_metric``
    (none when ``ckpt_path``'s run already reached the limits: nothing is trained, a line says so).

    Bad input, a checkpoint that cannot be resumed included, exits with one line on stderr.
    """
    _quiet_lightning()
    started = time.monotonic()
    try:
        built = build(cfg)
        _say_where_the_data_comes_from(built.datamodule, cfg)
        _say_how_fp16_runs(built.trainer)
        if cfg.ckpt_path is not None:
            reached = _check_resume(Path(cfg.ckpt_path), built)
            if reached is not None:
                log.info(reached)
                return {}
        try:
            built.trainer.fit(built.task, datamodule=built.datamodule, ckpt_path=cfg.ckpt_path)
        except SystemExit as stop:  # Lightning's exit after a Ctrl-C, or its SIGTERMException
            if built.trainer.interrupted and built.trainer.is_global_zero:
                log.info(_how_to_resume(built.trainer))
            raise _exit_status(built.trainer, stop) from None
        metrics = {k: float(v) for k, v in built.trainer.callback_metrics.items()}
        if cfg.test and not cfg.trainer.fast_dev_run:
            try:
                for result in built.trainer.test(built.task, datamodule=built.datamodule, verbose=False):
                    metrics.update(result)
            except SystemExit as stop:
                if built.trainer.received_sigterm and built.trainer.is_global_zero:
                    last = getattr(built.trainer.checkpoint_callback, "last_model_path", "") or "none"
                    log.info(f"\nStopped by SIGTERM while testing; the fit had finished (its checkpoint: {last})")
                raise _exit_status(built.trainer, stop) from None
    except (AppError, DatasetError, FileNotFoundError) as error:
        _remove_empty_run_directory(Path(cfg.paths.output_dir))
        sys.exit(f"error: {_data_root_hint(error, cfg)}")
    if built.trainer.is_global_zero:
        write_results(built.trainer, metrics, Path(cfg.paths.output_dir), time.monotonic() - started)
        log.info(summary(built.trainer, metrics, cfg))
    try:
        objective(cfg, metrics)
    except AppError as error:
        sys.exit(f"error: {error}")
    return metrics


def objective(cfg: DictConfig, metrics: dict[str, float]) -> float | None:
    """The value of ``cfg.optimized_metric`` that ``train.py`` returns to Hydra's sweepers.

    None when no metric is named, when nothing was trained (a resumed run had already reached its
    limits), or when the test that logs it did not run (``test=false``, ``fast_dev_run``).

    Raises:
        AppError: the named metric should have been logged and was not.
    """
    name = cfg.get("optimized_metric")
    if name is None or name in metrics or not metrics:
        return metrics.get(name)
    if name.startswith("test/") and (not cfg.test or cfg.trainer.fast_dev_run):
        return None
    raise AppError(f"optimized_metric={name!r} was not logged; logged metrics: {', '.join(sorted(metrics))}")


def summary(trainer: L.Trainer, metrics: dict[str, float], cfg: DictConfig | None = None) -> str:
    """Final metrics, the per-layer scales of the last update with how to read them, and where
    the run's files are."""
    lines = ["", "Final metrics:"]
    lines += [f"  {name:<28} {value:.4f}" for name, value in sorted(metrics.items()) if "/" in name]
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    layers = scaler.layers() if scaler is not None and hasattr(scaler, "layers") else []
    if layers:
        lines += [
            "",
            f"Per-layer gradient scales (last update; {scaler.skipped_steps} skipped steps, "
            f"{scaler.retried_steps} retried, {scaler.recomputed_steps} with weight gradients recomputed, "
            f"{scaler.update_iterations} of {scaler.iteration} backwards decided the scales):",
            f"  {'layer':<32} {'log2 scale':>10} {'log2 total':>10} {'est. underflow':>15}",
        ]
        lines += [
            f"  {layer.name:<32} {layer.log2_scale:>10} {layer.log2_total:>10} {layer.underflow_rate:>15.2e}"
            for layer in layers
        ]
        lines += textwrap.wrap(_SCALE_TABLE_HELP, width=100)
        ended_skipping = textwrap.wrap(_skipped_at_the_end(scaler), width=100)
        lines += ["", *ended_skipping] if ended_skipping else []
    callback = _scale_callback(trainer)
    if callback is not None and callback.loss_scale is not None:
        lines += [
            "",
            f"Loss scale at the end: 2^{math.log2(callback.loss_scale):g} ({type(scaler).__name__}); "
            f"{callback.skipped_steps} of {trainer.global_step} steps skipped (non-finite gradients)",
        ]
    lines += ["", *_where(trainer, cfg)]
    return "\n".join(lines)


def write_results(trainer: L.Trainer, metrics: dict[str, float], run_dir: Path, wall_s: float) -> Path:
    """``<run_dir>/results.json``: the run's final metrics, steps, skipped steps, loss scale (loss-scaling
    plugins) and wall time, for :class:`RunComparison` and scripts."""
    callback = _scale_callback(trainer)
    results = {
        "recipe": _choice("recipe"),
        "precision": _choice("precision") or _precision_name(trainer),
        "job": HydraConfig.get().job.num
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
        else None,
        "metrics": {name: value for name, value in sorted(metrics.items()) if "/" in name},
        "steps": trainer.global_step,
        "skipped_steps": callback.skipped_steps if callback is not None else None,
        "loss_scale": callback.loss_scale if callback is not None else None,
        "wall_s": round(wall_s, 1),
    }
    path = run_dir / RESULTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def comparison_table(sweep_dir: Path) -> str:
    """A Markdown table of the runs of a multirun's folder (every subfolder Hydra made, by job number):
    final metrics, steps, skipped steps and wall time from each ``results.json``; '' without runs."""
    runs = []
    for folder in (d for d in sweep_dir.iterdir() if (d / ".hydra").is_dir()):
        results = json.loads((folder / RESULTS_FILE).read_text()) if (folder / RESULTS_FILE).is_file() else None
        runs.append((folder.name, results))
    if not runs:
        return ""
    runs.sort(key=lambda run: (run[1] is None, (run[1] or {}).get("job") or 0, run[0]))
    names = sorted({name for _, results in runs if results for name in results["metrics"]})
    header = ["run", "precision", *names, "steps", "skipped steps", "wall (s)"]
    rows = []
    for folder, results in runs:
        if results is None:
            rows.append([folder, "", *[""] * len(names), "", "", "no results.json: failed, or nothing to train"])
            continue
        values = [f"{results['metrics'][name]:.4f}" if name in results["metrics"] else "" for name in names]
        skipped = results["skipped_steps"]
        rows.append(
            [
                folder,
                results["precision"],
                *values,
                str(results["steps"]),
                "-" if skipped is None else str(skipped),
                f"{results['wall_s']:.1f}",
            ]
        )
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


class RunComparison(Callback):
    """Hydra callback (``hydra.callbacks``): a multirun (``-m``) ends with one table of its runs' final
    metrics, skipped steps and wall time, printed and written to ``<sweep dir>/comparison.md``."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        table = comparison_table(sweep_dir) if sweep_dir.is_dir() else ""
        if table:
            (sweep_dir / COMPARISON_FILE).write_text(table + "\n")
            # print, not log: after the sweep the logging handlers are still the last job's (its train.log)
            print(f"\nThe runs of {sweep_dir}:\n{table}\n(also in {sweep_dir / COMPARISON_FILE})")


def _precision_name(trainer: L.Trainer) -> str:
    """One of our plugins by its class name, Lightning's own precision by its flag ("32-true")."""
    plugin = trainer.precision_plugin
    return type(plugin).__name__ if isinstance(plugin, FP16MixedPrecision) else str(trainer.precision)


def _scale_callback(trainer: L.Trainer) -> GradientScalingCallback | None:
    return next((c for c in trainer.callbacks if isinstance(c, GradientScalingCallback)), None)


def _skipped_at_the_end(scaler: GradientScaler) -> str:
    """What to make of a run whose last steps were skipped: where the last update first met a
    non-finite gradient, and whether any scale had been applied to it ('' if the last step was taken)."""
    skipped = scaler.consecutive_skips
    if not skipped:
        return ""
    text = f"The run ended with {skipped} steps skipped in a row: the weights are those of the last step taken."
    layer = next((layer for layer in scaler.layers() if layer.name == scaler.first_non_finite), None)
    if layer is None:
        return text
    text += (
        " On the last update the first non-finite gradient, in backward order, was at "
        f"{layer.name} (log2 total {layer.log2_total})"
    )
    if layer.log2_total > 0:
        return text + "; the scales of the table are that update's."
    return text + (
        ", before any scale: unscaled fp16 would have failed there too. The loss or the forward was non-finite, "
        "or training diverged (lower the learning rate, check the inputs); the table's NaN rows are that update's."
    )


# The exit status of a run stopped by SIGTERM: 128 + 15, as a shell reports a process that SIGTERM ended.
SIGTERM_EXIT_STATUS = 128 + signal.SIGTERM


def _exit_status(trainer: L.Trainer, stop: SystemExit) -> SystemExit:
    """The exit of a run Lightning stopped: its own for Ctrl-C (status 1); for SIGTERM, whose
    SIGTERMException would exit 0 (a job scheduler would take the run as finished), status 143."""
    return SystemExit(SIGTERM_EXIT_STATUS) if trainer.received_sigterm else stop


def _how_to_resume(trainer: L.Trainer) -> str:
    """Where an interrupted run stopped, what it saved, and the command line that resumes it."""
    saved = next(
        (c.saved for c in trainer.callbacks if isinstance(c, InterruptCheckpoint) and c.saved is not None), None
    )
    how = "Stopped by SIGTERM" if trainer.received_sigterm else "Interrupted"
    lines = ["", f"{how} at step {trainer.global_step} (epoch {trainer.current_epoch})."]
    if saved is None:
        last = getattr(trainer.checkpoint_callback, "last_model_path", "")
        lines.append(
            f"No checkpoint of that step was saved (no InterruptCheckpoint callback); the last one: {last or 'none'}"
        )
        saved = Path(last).resolve() if last else None
    else:
        lines.append(f"Checkpoint:    {saved}")
    lines.append(f"Run directory: {Path(trainer.default_root_dir).resolve()}")
    if saved is not None:
        overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
        program = sys.argv[0] if HydraConfig.initialized() else "train.py"
        command = ["python", program, *(o for o in overrides if not o.startswith("ckpt_path=")), f"ckpt_path={saved}"]
        lines.append(f"Resume:        {shlex.join(command)}")
    return "\n".join(lines)


def _check_data_root(datamodule: L.LightningDataModule, cfg: DictConfig) -> None:
    """A recipe that generates its data (the demo) writes it into a folder that exists or under
    ``paths.cache_dir``: a ``data.root`` that does not exist is more likely a mistyped path to a
    real dataset than a wish for generated data there."""
    if getattr(datamodule, "synthetic", None) is None or datamodule.root.exists():
        return
    cache = Path(str(cfg.paths.cache_dir)).expanduser().absolute()
    if cache == datamodule.root or cache in datamodule.root.parents:
        return
    raise AppError(
        f"data.root={datamodule.root} does not exist; {datamodule.layout}. The demo writes its generated data only "
        f"under paths.cache_dir ({cache}; leave data.root unset) or into a folder that exists"
    )


def _say_where_the_data_comes_from(datamodule: L.LightningDataModule, cfg: DictConfig) -> None:
    """One line: generated data (and where), or the dataset's folder; a warning when a recipe that
    trains on a real dataset is pointed at a folder of generated data (the generator's marker file)."""
    root, name = datamodule.root, type(datamodule).__name__.removesuffix("DataModule")
    if getattr(datamodule, "synthetic", None) is not None:
        settings = ", ".join(f"{key}={value}" for key, value in datamodule.synthetic.items())
        log.info(f"Data: generated, seeded, in {name}'s on-disk layout ({settings}), written on first use into {root}")
        return
    generated = generated_dataset(root)
    if generated is None:
        log.info(f"Data: {name} from {root}")
        return
    marker, settings = generated
    recipe = f"recipe={_recipe_name()}" if _recipe_name() else "this recipe"
    log.warning(
        f"warning: data.root={root} holds generated data ({marker.name} records "
        f"{', '.join(f'{k}={v}' for k, v in settings.items() if k != 'complete')}), not the real {name}: {recipe} "
        f"(trainer.max_steps={cfg.trainer.max_steps}) trains on the generated set; "
        f"give data.root=/path/to/{name} for results that mean anything"
    )


def _say_how_fp16_runs(trainer: L.Trainer) -> None:
    """Settle ``precision.emulate=auto`` for the device and say, first, how fp16 runs."""
    plugin = trainer.precision_plugin
    if not hasattr(plugin, "settle_emulation"):
        return
    device = trainer.strategy.root_device.type
    setting = plugin.emulate
    if plugin.settle_emulation(device):
        how = (
            f"emulated on the {device.upper()} (GEMMs and convolutions computed in fp32 and rounded to fp16: "
            "fp16's rounding at fp32 speed)"
        )
    else:
        how = f"the {device.upper()}'s own fp16 kernels"
    log.info(f"fp16: {how}; precision.emulate={str(setting).lower()}")


# How a torch file begins: a zip archive (torch.save since 1.6, Lightning's checkpoints) or, in torch's
# legacy format, a pickle (protocol 2 and up start with the PROTO opcode, 0x80).
_TORCH_MAGIC = (b"PK\x03\x04", b"\x80")
_EXPECTED_CHECKPOINT = "expected a checkpoint such as outputs/<recipe>/<precision>/<date>/checkpoints/last.ckpt"


def _check_resume(path: Path, built: Run) -> str | None:
    """Check ``ckpt_path`` before fitting from it: a one-line AppError for a file that is missing,
    unreadable, not a checkpoint, or another recipe's or precision method's. Returns the line to
    print instead of training when the checkpoint's run already reached this run's limits."""
    checkpoint = read_checkpoint(path)
    _check_same_model(path, checkpoint, built.task)
    _check_same_precision(path, checkpoint, built.trainer)
    trainer = built.trainer
    step, epochs = int(checkpoint["global_step"]), finished_epochs(checkpoint)
    limits = []
    if trainer.max_steps != -1 and step >= trainer.max_steps:
        limits.append(f"trainer.max_steps={trainer.max_steps}")
    if trainer.max_epochs not in (None, -1) and epochs >= trainer.max_epochs:
        limits.append(f"trainer.max_epochs={trainer.max_epochs}")
    if not limits:
        return None
    return (
        f"Nothing to train: the run of ckpt_path={path} already reached {' and '.join(limits)} (step {step}, "
        f"{epochs} epochs); give a larger limit to train longer (its test metrics are in that run's log)"
    )


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load a Lightning checkpoint the way a resume reads it (``torch.load(weights_only=True)``),
    after checking that the file can be one.

    Raises:
        AppError: one line naming ``path``, what is wrong with it (missing, a folder, empty, text,
            not a torch file, truncated or corrupt, objects weights-only loading refuses, not a
            Lightning checkpoint) and what was expected.
    """
    if not path.exists():
        raise AppError(f"ckpt_path={path}: no such file; {_EXPECTED_CHECKPOINT}")
    if not path.is_file():
        raise AppError(f"ckpt_path={path}: a folder, not a file; {_EXPECTED_CHECKPOINT}")
    try:
        with path.open("rb") as file:
            head = file.read(512)
    except OSError as error:
        raise AppError(f"ckpt_path={path}: cannot be read ({error.strerror}); {_EXPECTED_CHECKPOINT}") from error
    if not head:
        raise AppError(f"ckpt_path={path}: an empty file (0 bytes), not a checkpoint; {_EXPECTED_CHECKPOINT}")
    if not head.startswith(_TORCH_MAGIC):
        what = (
            "a text file, not a checkpoint" if _is_text(head) else f"not a torch file (bytes {head[:8].hex(' ')} ...)"
        )
        raise AppError(f"ckpt_path={path}: {what}; {_EXPECTED_CHECKPOINT} (a zip archive, as torch.save writes)")
    if head.startswith(_TORCH_MAGIC[0]) and not zipfile.is_zipfile(path):
        raise AppError(
            f"ckpt_path={path}: not a readable checkpoint, the file is truncated (a zip archive without its end, the "
            f"central directory: a save or copy cut short); {_EXPECTED_CHECKPOINT}"
        )
    try:
        with warnings.catch_warnings():  # a pickle's protocol warning would break the one line
            warnings.simplefilter("ignore")
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # whatever torch raises, the file is not a checkpoint it can read
        raise AppError(f"ckpt_path={path}: {_load_failure(error)}; {_EXPECTED_CHECKPOINT}") from error
    if not isinstance(checkpoint, dict) or not {"state_dict", "loops"} <= checkpoint.keys():
        what = f"keys {', '.join(map(str, checkpoint))}" if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise AppError(
            f"ckpt_path={path}: a torch file but not a Lightning checkpoint (it holds {what[:80]}, not 'state_dict' "
            "and 'loops'); expected a train.py run's last.ckpt or interrupted.ckpt"
        )
    return checkpoint


def _is_text(head: bytes) -> bool:
    """Whether a file's first bytes read as text (UTF-8 without control characters but whitespace)."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as error:
        if error.start < len(head) - 3:  # not a character cut at the end of the sample
            return False
        text = head[: error.start].decode("utf-8")
    return all(c.isprintable() or c in "\t\n\r" for c in text)


def _load_failure(error: Exception) -> str:
    """What torch.load's error says is wrong with a file that begins as a torch file."""
    message = str(error).strip()
    refused = re.search(r"WeightsUnpickler error:\s*(.+)", message)
    if refused is not None:
        reason = refused.group(1).split(" was not an allowed global")[0].split(". ")[0].strip()
        if reason.startswith("Unsupported global"):
            return (
                f"holds a Python object that weights-only loading refuses ({reason}), not only tensors and plain data"
            )
        return f"not a readable checkpoint, the file is truncated or corrupt ({reason})"
    # torch's first sentence names the fault (after the C++ assertion's location); the rest is advice.
    message = re.sub(r"^\[enforce fail at [^\]]*\][\s.]*", "", message)
    reason = message.splitlines()[0].split(". ")[0] if message else type(error).__name__
    return f"not a readable checkpoint, the file is truncated or corrupt ({reason})"


def _check_same_model(path: Path, checkpoint: dict[str, Any], task: L.LightningModule) -> None:
    """The checkpoint's weights fit this run's model: same names, same shapes."""
    saved, expected = checkpoint["state_dict"], task.state_dict()
    recipe = checkpoint.get("callbacks", {}).get("ResumeCallback", {}).get("recipe")
    origin = f"was written by recipe={recipe} and " if recipe else ""
    here = f"this run's model (recipe={_recipe_name()})" if _recipe_name() else "this run's model"
    for name, tensor in saved.items():
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
            raise AppError(
                f"ckpt_path={path} {origin}does not fit {here}: {name} is {list(tensor.shape)} in the checkpoint and "
                f"{list(expected[name].shape)} here; resume with the recipe and overrides it was trained with"
            )
    names = (sorted(set(saved) - set(expected)) or [None])[0], (sorted(set(expected) - set(saved)) or [None])[0]
    if names != (None, None):
        what = f"holds {names[0]}, which this model lacks" if names[0] else f"lacks {names[1]}"
        raise AppError(
            f"ckpt_path={path} {origin}does not fit {here}: it {what}; "
            "resume with the recipe and overrides it was trained with"
        )


def _check_same_precision(path: Path, checkpoint: dict[str, Any], trainer: L.Trainer) -> None:
    """A scaler state in the checkpoint belongs to this run's precision plugin (Lightning would drop it silently)."""
    from gs_lightning import lightning as plugins

    ours = {name for name in plugins.__all__ if name.endswith("Plugin")}
    saved = sorted(ours & checkpoint.keys())
    current = type(trainer.precision_plugin).__qualname__
    if saved and saved != [current]:
        raise AppError(
            f"ckpt_path={path} holds the scaler state of {saved[0]} but this run's precision plugin is {current}; "
            "resume with the precision it was trained with"
        )


def _run_label(run_dir: Path) -> str:
    """The run directory as the user knows it: relative to the working directory when inside it."""
    run_dir = run_dir.absolute()
    return str(run_dir.relative_to(Path.cwd())) if run_dir.is_relative_to(Path.cwd()) else str(run_dir)


def _recipe_name() -> str | None:
    """The ``recipe=`` choice of the running Hydra app (None when composed without it, as tests do)."""
    return _choice("recipe")


def _choice(group: str) -> str | None:
    """The running Hydra app's choice of a config group (None when composed without Hydra, as tests do)."""
    return HydraConfig.get().runtime.choices.get(group) if HydraConfig.initialized() else None


# What a run directory holds before anything was trained: Hydra's files and the logger's hyperparameters.
_NOT_CONTENT = {".hydra", "train.log", "hparams.yaml"}


def _remove_empty_run_directory(run_dir: Path) -> None:
    """Remove the run directory of a failed run when it holds nothing beyond what every run starts with,
    and the folders above it that Hydra made for it and that are now empty (``outputs/<recipe>/<precision>``),
    up to the working directory."""
    if not run_dir.is_dir():
        return
    files = [
        p
        for p in run_dir.rglob("*")
        if p.is_file() and not _NOT_CONTENT & {part for part in p.relative_to(run_dir).parts}
    ]
    if files:
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir, here = run_dir.resolve(), Path.cwd().resolve()
    for folder in run_dir.parents:
        if folder == here or here not in folder.parents or any(folder.iterdir()):
            return
        folder.rmdir()


def _where(trainer: L.Trainer, cfg: DictConfig | None) -> list[str]:
    """Where the run's directory, checkpoint, dataset, plots, logger files and log are."""
    places = [("Run directory", Path(trainer.default_root_dir).resolve())]
    checkpoint = trainer.checkpoint_callback
    if checkpoint is not None and getattr(checkpoint, "last_model_path", ""):
        places.append(("Checkpoint", f"{checkpoint.last_model_path}  (resume: ckpt_path=<this file>)"))
    if cfg is not None:
        places.append(("Dataset", Path(cfg.data.root).expanduser().resolve()))
    places += [("Plot", path) for callback in trainer.callbacks for path in getattr(callback, "plot_paths", [])]
    logs = getattr(trainer.logger, "log_dir", None) or getattr(
        trainer.logger, "save_dir", None
    )  # not trainer.log_dir: a collective call
    if logs is not None:
        places.append(("Logs", Path(logs).resolve()))
    results = Path(trainer.default_root_dir) / RESULTS_FILE
    if results.is_file():
        places.append(("Results", results.resolve()))
    log_file = Path(trainer.default_root_dir) / "train.log"
    if log_file.is_file():
        places.append(("Log", log_file.resolve()))
    return [f"{name + ':':<15}{place}" for name, place in places]


def _instantiate(node: DictConfig, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` with plain dicts and lists (objects store them, checkpoints hold
    them, torch's weights_only loading accepts them); a failure becomes one AppError line."""
    try:
        return instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as error:
        raise _explain(error) from error


def _explain(error: InstantiationException) -> AppError:
    """One line for a failed instantiation: the config key and what went wrong."""
    cause = error.__cause__
    key = re.search(r"full_key: (\S+)", str(error))
    key = key.group(1) if key else "config"
    target = re.search(r"target '([\w.]+)'", str(error))
    target = target.group(1) if target else ""
    if isinstance(cause, AppError | DatasetError | FileNotFoundError):
        return AppError(_as_overrides(str(cause), key, target))  # already names the file or value
    if isinstance(cause, ImportError):
        extra = _LOGGER_EXTRAS.get(target.rsplit(".", 1)[-1])
        if extra is not None:
            return AppError(
                f'{key}={extra} needs the {extra} package, which is not installed: pip install -e ".[{extra}]"'
            )
        return AppError(f"{key}: a package is not installed: {cause}")
    unknown = re.search(r"unexpected keyword argument '(\w+)'", str(cause))
    if isinstance(cause, TypeError) and unknown and target:
        valid = ", ".join(name for name in inspect.signature(get_object(target)).parameters if name != "self")
        return AppError(f"{key}: unknown setting {unknown.group(1)!r}; valid settings: {valid}")
    if cause is None:
        return AppError(f"{key}: {str(error).splitlines()[0]}")
    return AppError(f"{key}: {cause}")


def _as_overrides(message: str, key: str, target: str) -> str:
    """A message that names an argument of ``target`` as ``name=...`` names the override, ``key.name=...``."""
    try:
        names = list(inspect.signature(get_object(target)).parameters) if target else []
    except (ImportError, ValueError, TypeError):
        return message
    if not names:
        return message
    return re.sub(rf"(?<![\w.])({'|'.join(map(re.escape, names))})=", rf"{key}.\1=", message)


# Overrides that train a recipe on generated data in its dataset's on-disk layout, by datamodule;
# docs/guide/app.md ("Trying a recipe without its dataset") gives each recipe's command with them.
GENERATED_DATA = {
    "CamVidDataModule": "data.root='${paths.cache_dir}/camvid_try' "
    "'++data.synthetic={n_train: 24, n_val: 4, n_test: 4, size: [96, 128]}'",
    "ImageNetDataModule": "data.root='${paths.cache_dir}/imagenet_try' "
    "'++data.synthetic={num_classes: 10, n_train_per_class: 8, n_val_per_class: 2, size: [64, 64]}' "
    "task.num_classes=10",
    "VOCDataModule": "data.root='${paths.cache_dir}/voc_try' '++data.synthetic={n_trainval: 16, n_test: 8}'",
}


def _data_root_hint(error: Exception, cfg: DictConfig) -> str:
    """A dataset error also names the ``data.root`` setting that points at the folder, and the
    overrides that try the recipe on generated data instead."""
    if not isinstance(error, DatasetError):
        return str(error)
    root = Path(str(cfg.data.root)).expanduser().resolve()
    hint = f"{error} (data.root={root}; set data.root=/path/to/dataset or GS_DATA_DIR"
    generated = GENERATED_DATA.get(str(cfg.data.get("_target_", "")).rsplit(".", 1)[-1])
    if generated is None or cfg.data.get("synthetic") is not None:
        return hint + ")"
    return f"{hint}; to try the recipe without the dataset, on generated data: {generated}, see docs/guide/app.md)"


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


_DROP_TIPS = _DropTips()  # one instance: adding it again (another run in this process) is a no-op


# Lightning's loggers (both package names: the plugins serve either). rank_zero_info logs through
# the last imported package's "<package>.utilities.rank_zero".
_LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")


def _quiet_lightning() -> None:
    """Lightning's notices go where the app's own lines go, without its advertising tips and two
    warnings that do not apply to these runs.

    Imported before Hydra configures logging (as ``train.py`` does), Lightning prints through
    handlers of its own to stderr and keeps its records from the root logger, so ``train.log``
    missed them. Under Hydra (the root logger has handlers) they propagate to the root instead.
    """
    if logging.getLogger().handlers:
        for name in _LIGHTNING_LOGGERS:
            logger = logging.getLogger(name)
            for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
                logger.removeHandler(handler)
            logger.propagate = True
    for name in _LIGHTNING_LOGGERS[1:]:
        logging.getLogger(f"{name}.utilities.rank_zero").addFilter(_DROP_TIPS)
    # Our fp16 plugins report "16-mixed", which the model summary cannot size; fp32 is what it shows.
    warnings.filterwarnings("ignore", message="Precision 16-mixed is not supported by the model summary")
    # Lightning 2.6 calls a torch pytree API that torch 2.14 deprecates; nothing a user can act on.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
