"""Time per training step of ResNet-18 with each fp16 precision plugin, side by side.

Target: between scale updates, a step with GradientScalingPlugin costs at most 5% more than one with
DynamicLossScalingPlugin on the same model. Every plugin trains its own ResNet-18 (10 classes, random
32×32 images, batch 8) on CPU, and on CUDA when available. The plugins take turns for ``--rounds``
rounds of ``--steps`` steps, so that load from elsewhere on the machine hits them alike; each round
is a fresh Trainer on the same model and plugin, and its first step is not timed. A step is timed
from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, optimizer step).
GradientScalingPlugin's only update in the run is its first iteration, which is never timed.

    python bench/plugin_overhead.py [--rounds 3] [--steps 5] [--threads 1]

On CPU it runs one thread by default: on a shared machine OpenMP threads that lose their core
spin, and multi-threaded timings swing by a factor of two or more (``--threads 0`` keeps torch's
default).

Prints a markdown table: median and least wall ms/step, median process-CPU ms/step, skipped steps, and
the ratios to Dyn-LS.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
import torchvision
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from gs_lightning import (
    DynamicLossScalingPlugin,
    FP16MixedPrecision,
    FP16Plugin,
    GradientScalingPlugin,
    LossScalingPlugin,
)

UPDATE_INTERVAL = 100  # the paper's setting; a run here stays well below it

PLUGINS: dict[str, Callable[[], FP16MixedPrecision]] = {
    "FP16 (no scaling)": FP16Plugin,
    "Fixed-LS 128": lambda: LossScalingPlugin(scale=128),
    "Dyn-LS": DynamicLossScalingPlugin,
    "GS": lambda: GradientScalingPlugin(update_interval=UPDATE_INTERVAL),
}


class ResNet18(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = torchvision.models.resnet18(num_classes=10)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StepTimer(Callback):
    """Wall and process CPU time of every training step but a fit's first; counts the optimizer steps that ran.

    Process CPU time counts only this process's work, so it is the steadier measure when other
    programs load the machine; on CUDA it is host time only.
    """

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.batches = 0
        self.optimizer_steps = 0
        self._start = (0.0, 0.0)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.optimizers[0].register_step_post_hook(self._count_step)

    def _count_step(self, *_: object) -> None:
        self.optimizer_steps += 1

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        _synchronize(pl_module.device)
        self._start = (time.perf_counter(), time.process_time())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        _synchronize(pl_module.device)
        self.batches += 1
        if batch_idx > 0:
            self.wall.append(time.perf_counter() - self._start[0])
            self.cpu.append(time.process_time() - self._start[1])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(accelerator: str, rounds: int, steps: int, batch_size: int, image_size: int) -> list[tuple[str, StepTimer]]:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(batch_size * steps, 3, image_size, image_size, generator=generator),
        torch.randint(0, 10, (batch_size * steps,), generator=generator),
    )
    runs = []
    for name, make in PLUGINS.items():
        torch.manual_seed(0)
        runs.append((name, make(), ResNet18(), StepTimer()))
    for _ in range(rounds):
        for _, plugin, model, timer in runs:
            trainer = L.Trainer(
                accelerator=accelerator,
                devices=1,
                max_epochs=1,
                plugins=[plugin],
                callbacks=[timer],
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            trainer.fit(model, DataLoader(data, batch_size=batch_size))
    return [(name, timer) for name, _, _, timer in runs]


def table(accelerator: str, results: list[tuple[str, StepTimer]]) -> str:
    """Per plugin: median and least wall time per step, median process CPU time, and each as a ratio to Dyn-LS.

    The least time is the step least disturbed by other programs; on a shared machine it and the
    CPU time are steadier than the median wall time.
    """
    measures = {
        "wall median": {name: statistics.median(timer.wall) for name, timer in results},
        "wall min": {name: min(timer.wall) for name, timer in results},
        "CPU median": {name: statistics.median(timer.cpu) for name, timer in results},
    }
    lines = [
        f"### {accelerator}",
        "",
        "| plugin | "
        + " | ".join(f"{m} ms/step" for m in measures)
        + " | timed steps | skipped steps | "
        + " | ".join(f"{m} / Dyn-LS" for m in measures)
        + " |",
        "|---|" + "---:|" * (2 * len(measures) + 2),
    ]
    for name, timer in results:
        times = " | ".join(f"{1e3 * m[name]:.1f}" for m in measures.values())
        ratios = " | ".join(f"{m[name] / m['Dyn-LS']:.3f}" for m in measures.values())
        lines.append(f"| {name} | {times} | {len(timer.wall)} | {timer.batches - timer.optimizer_steps} | {ratios} |")
    summary = ", ".join(f"{m} {v['GS'] / v['Dyn-LS']:.3f}" for m, v in measures.items())
    lines += ["", f"GS / Dyn-LS: {summary} (target ≤ 1.05)", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="turns each plugin takes")
    parser.add_argument("--steps", type=int, default=5, help="steps per turn (the first is not timed)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (0: torch's default)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=32)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: a turn's first step is not timed")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no banner for every fit
    accelerators = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    print(
        f"ResNet-18, batch {args.batch_size}, {args.image_size}×{args.image_size}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads; {args.rounds} rounds × {args.steps - 1} timed steps per plugin\n"
    )
    for accelerator in accelerators:
        print(
            table(accelerator, run(accelerator, args.rounds, args.steps, args.batch_size, args.image_size)), flush=True
        )


if __name__ == "__main__":
    main()
