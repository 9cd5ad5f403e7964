"""The paper's SSD setting at CPU scale: a pretrained backbone, fresh heads, batch 8 (issue 18).

Table 2 of Zhao et al. puts the dynamic loss scale 7 mAP points behind GS on SSD300 at batch 8,
because one loss scale cannot serve a pretrained backbone and freshly initialised detection
heads at once. This bench builds that setting small, under CPU emulation of fp16:

1. A VGG16-style SSD backbone (``gs_lightning.models.ssd``, conv1_1..conv7, width
   ``--width``) is **pretrained in fp32** to classify crops of the generated VOC objects (a
   separate generated set, seed 1), and cached on disk (seeded; rebuilt if missing).
2. Per seed, SSD300 is built with that backbone and **freshly initialised** extra layers,
   L2Norm and multibox heads (Xavier, as Caffe SSD), and the whole detector is trained at
   batch 8 with the multibox loss, the same batches and steps for every method.

Methods (``compare_training``'s, plus the fixed-scale sweep 2^3, 2^7, 2^12): fp32; fp16
gradients with fixed loss scales, the dynamic loss scale (``GradScaler`` defaults) and GS
(defaults); the same with e5m2 gradients, plus per-tensor amax scaling (Transformer Engine's
delayed scaling). Besides ``compare_training``'s columns it records, per run, the steps it
skipped, the loss scale (Dyn-LS) or the accumulated GS scales of the fresh layers ("heads":
extras and multibox heads) and of the pretrained ones ("backbone"), and the GEMM-gradient
underflow of each group.

    python bench/ssd_finetune.py --quick                       # every method, tiny, < 3 min
    python bench/ssd_finetune.py --json ssd_ft.json             # the full run
    python bench/ssd_finetune.py --report ssd_ft.json --plots docs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _training_tasks import Task, _load
from compare_training import E5M2, METHODS, Method, Run, _final_loss, _mean_std, add_run_arguments, report, train
from torch import Tensor, nn

from gs_lightning import GradientScaler
from gs_lightning.data import VOCDetection, collate_detection, ssd_eval_transforms, write_synthetic_voc
from gs_lightning.metrics import VOC07MeanAveragePrecision
from gs_lightning.models import MultiboxLoss, build_ssd
from gs_lightning.simulate import UnderflowMeter
from gs_lightning.simulate.methods import DynamicLossScale, FixedLossScale

NUM_CLASSES = 4  # the generator's object classes (SSD adds background)
CROP = 64  # side of the pretraining crops
GROUPS = ("heads", "backbone")


def _fixed(grads: str, scale_log2: int) -> Method:
    """Fixed loss scale 2^``scale_log2`` with ``grads`` gradients (``"fp16"`` or ``"e5m2"``)."""
    return Method(
        f"{grads}-fixed{2**scale_log2}",
        grads,
        f"fixed loss scale 2^{scale_log2}",
        torch.float16,
        True,
        E5M2 if grads == "e5m2" else None,
        lambda m: FixedLossScale(2.0**scale_log2),
    )


FIXED_SCALES_LOG2 = (3, 7, 12)
SWEEP = {m.key: m for grads in ("fp16", "e5m2") for m in (_fixed(grads, s) for s in FIXED_SCALES_LOG2)}
ALL_METHODS: dict[str, Method] = {**METHODS, **SWEEP}
DEFAULT_METHODS = (
    "fp32",
    *(f"fp16-fixed{2**s}" for s in FIXED_SCALES_LOG2),
    "fp16-dynamic",
    "fp16-gs",
    *(f"e5m2-fixed{2**s}" for s in FIXED_SCALES_LOG2),
    "e5m2-dynamic",
    "e5m2-amax",
    "e5m2-gs",
)


@dataclass(frozen=True)
class Size:
    """How big the experiment is.

    Attributes:
        width: Channel-width multiplier of SSD300's VGG16 (1.0 = the real network).
        n_train: Generated training images (96x128, resized to 300x300).
        n_test: Generated test images.
        n_pretrain: Generated images whose object crops pretrain the backbone.
        pretrain_epochs: fp32 epochs over those crops.
        lr: SGD learning rate of the detector (momentum 0.9, weight decay 5e-4).
    """

    width: float
    n_train: int
    n_test: int
    n_pretrain: int
    pretrain_epochs: int
    lr: float


FULL = Size(width=1 / 16, n_train=256, n_test=64, n_pretrain=512, pretrain_epochs=20, lr=3e-3)
QUICK = Size(width=1 / 32, n_train=16, n_test=8, n_pretrain=32, pretrain_epochs=1, lr=3e-3)


# --- data --------------------------------------------------------------------------------------


def _voc(cache: Path, n_trainval: int, n_test: int, seed: int) -> tuple[tuple[Tensor, list], tuple[Tensor, list]]:
    """Generated VOC-format images (96x128, 4 classes) resized to 300x300 and standardised."""
    root = write_synthetic_voc(
        cache / f"voc_{n_trainval}_{n_test}_s{seed}",
        years=("2007",),
        n_trainval=n_trainval,
        n_test=n_test,
        size=(96, 128),
        seed=seed,
    )
    transform = ssd_eval_transforms(300)
    train = collate_detection(
        _load(VOCDetection(root, [("2007", "trainval")], transforms=transform, keep_difficult=True))
    )
    test = collate_detection(_load(VOCDetection(root, [("2007", "test")], transforms=transform, keep_difficult=True)))
    return train, test


def object_crops(images: Tensor, targets: list[dict[str, Tensor]]) -> tuple[Tensor, Tensor]:
    """Every object of ``images`` cropped with a margin of half its size, resized to CROP x CROP; labels 0..3."""
    crops, labels = [], []
    for image, target in zip(images, targets):
        for box, label in zip(target["boxes"].as_subclass(Tensor), target["labels"]):
            x0, y0, x1, y1 = box.tolist()
            mx, my = (x1 - x0) / 2, (y1 - y0) / 2
            left, top = int(max(0, x0 - mx)), int(max(0, y0 - my))
            right, bottom = int(min(image.shape[-1], x1 + mx)) + 1, int(min(image.shape[-2], y1 + my)) + 1
            crops.append(F.interpolate(image[None, :, top:bottom, left:right], size=(CROP, CROP), mode="bilinear"))
            labels.append(int(label) - 1)
    return torch.cat(crops), torch.tensor(labels)


# --- the pretrained backbone -------------------------------------------------------------------


def _classifier(backbone: nn.Module) -> nn.Sequential:
    """The backbone's pretrained part (conv1_1..conv7) under global pooling and a linear classifier."""
    return nn.Sequential(
        backbone.conv4_3,
        backbone.conv5_3,
        backbone.fc,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(backbone.out_channels[1], NUM_CLASSES),
    )


def pretrained_backbone(size: Size, cache: Path, weights_dir: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """conv1_1..conv7 weights pretrained in fp32 on object crops (seed 0): loaded from ``weights_dir`` or trained and
    saved.

    Returns the state_dict of those layers (``conv4_3.*``, ``conv5_3.*``, ``fc.*`` keys of
    ``SSDVGG16.backbone``) and what the pretraining reached (crop accuracy, seconds).
    """
    recipe = {
        "width": size.width,
        "n_pretrain": size.n_pretrain,
        "epochs": size.pretrain_epochs,
        "crop": CROP,
        "seed": 0,
    }
    digest = hashlib.sha1(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    path = weights_dir / f"ssd_finetune_backbone_{digest}.pt"
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        return saved["state_dict"], saved["info"]
    start = time.perf_counter()
    (images, targets), (test_images, test_targets) = _voc(cache, size.n_pretrain, max(8, size.n_pretrain // 8), seed=1)
    crops, labels = object_crops(images, targets)
    test_crops, test_labels = object_crops(test_images, test_targets)
    torch.manual_seed(0)
    backbone = build_ssd(300, num_classes=NUM_CLASSES + 1, width_mult=size.width).backbone
    classifier = _classifier(backbone)
    optimizer = torch.optim.Adam(classifier.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(size.pretrain_epochs):
        for index in torch.randperm(len(crops), generator=generator).split(32):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(classifier(crops[index]), labels[index]).backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = float((classifier(test_crops).argmax(1) == test_labels).float().mean())
    state_dict = {k: v for k, v in backbone.state_dict().items() if k.split(".")[0] in ("conv4_3", "conv5_3", "fc")}
    info = {
        **recipe,
        "crops": len(crops),
        "test_crops": len(test_crops),
        "crop_accuracy": accuracy,
        "seconds": time.perf_counter() - start,
    }
    weights_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": state_dict, "info": info}, path)
    return state_dict, info


# --- underflow of the fresh layers and of the pretrained ones ----------------------------------


class GroupedUnderflowMeter(UnderflowMeter):
    """An :class:`UnderflowMeter` that also splits the tensors between the heads and the backbone.

    SSD's backward runs every fresh layer (multibox heads, extras) before the first pretrained
    one: the pretrained conv7 needs the complete gradient of its output, which the extras and
    the level-1 heads produce. A hook on that gradient marks the switch; :meth:`watch` installs it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.group = GROUPS[0]
        self._groups: list[str] = []
        self.history: dict[str, list[float]] = {g: [] for g in GROUPS}
        self.counts: dict[str, int] = {g: 0 for g in GROUPS}  # tensors per group in the last collected pass
        self._handle: Any = None

    def watch(self, model: nn.Module) -> None:
        """Follow ``model`` (an ``SSDVGG16``): reset to "heads" at each forward, "backbone" once conv7's output
        gradient is complete."""
        if self._handle is not None:
            self._handle.remove()

        def on_backbone_forward(module: nn.Module, inputs: Any, features: list[Tensor]) -> None:
            self.group = GROUPS[0]
            if features[1].requires_grad:
                features[1].register_hook(lambda grad: setattr(self, "group", GROUPS[1]))

        self._handle = model.backbone.register_forward_hook(on_backbone_forward)

    def reset(self) -> None:
        """Forget the history (a new run)."""
        self.history = {g: [] for g in GROUPS}

    def add(self, exact: Tensor, rounded: Tensor) -> None:
        """Record one gradient, tagged with the group whose backward is running."""
        super().add(exact, rounded)
        self._groups.append(self.group)

    def collect_with_oracle(self) -> tuple[list[float], list[float]]:
        """Per-tensor underflow (and the oracle's) since the last call; also appends each group's mean to
        :attr:`history`."""
        groups, self._groups = self._groups, []
        fractions, oracle = super().collect_with_oracle()
        for group in GROUPS:
            mine = [f for f, g in zip(fractions, groups) if g == group]
            self.counts[group] = len(mine)
            if mine:
                self.history[group].append(statistics.fmean(mine))
        return fractions, oracle


def is_head(layer_name: str) -> bool:
    """Whether a layer of ``SSDVGG16`` is freshly initialised (multibox heads, extras, L2Norm)."""
    return layer_name.startswith(("head.", "backbone.extras.", "backbone.l2norm"))


def log2_scales(trainer: Any) -> dict[str, float] | None:
    """log2 of the scale each group's gradients carry: the loss scale, or GS's median accumulated scale per group."""
    if isinstance(trainer, GradientScaler):
        layers = [layer for layer in trainer.layers() if layer.kind == "gemm"]
        if not layers:
            return None
        by_group = {
            GROUPS[0]: [layer.log2_total for layer in layers if is_head(layer.name)],
            GROUPS[1]: [layer.log2_total for layer in layers if not is_head(layer.name)],
        }
        return {g: float(statistics.median(v)) for g, v in by_group.items() if v}
    if isinstance(trainer, DynamicLossScale):
        scale = trainer.scaler.get_scale()
    elif isinstance(trainer, FixedLossScale):
        scale = trainer.scale
    else:
        return None
    return {g: math.log2(scale) for g in GROUPS}


# --- the task and its runs ---------------------------------------------------------------------


@dataclass
class FinetuneRun(Run):
    """A :class:`compare_training.Run` plus what this bench records over time."""

    skipped_at: list[int] = field(default_factory=list, repr=False)  # steps whose update was skipped
    scale_steps: list[int] = field(default_factory=list, repr=False)  # steps where scales were recorded
    log2_scale: dict[str, list[float]] = field(default_factory=dict, repr=False)  # group -> log2 scale at those steps
    underflow_groups: dict[str, float | None] = field(default_factory=dict)  # group -> mean GEMM-gradient underflow


def finetune_task(
    size: Size, cache: Path, weights_dir: Path, meter: GroupedUnderflowMeter
) -> tuple[Task, dict[str, Any]]:
    """SSD300 (4 classes) with the pretrained backbone and fresh heads, batch 8; metric VOC07 test mAP."""
    backbone_state, pretrain_info = pretrained_backbone(size, cache, weights_dir)
    train_set, test = _voc(cache, size.n_train, size.n_test, seed=0)
    criterion = MultiboxLoss()

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)  # the fresh layers' initialisation
        model = build_ssd(300, num_classes=NUM_CLASSES + 1, width_mult=size.width)
        missing = model.backbone.load_state_dict(backbone_state, strict=False).missing_keys
        assert all(is_head(f"backbone.{k}") for k in missing), missing
        meter.watch(model)
        return model

    def loss(model: nn.Module, images: Tensor, targets: list[dict[str, Tensor]]) -> Tensor:
        cls_logits, regression = model(images)
        return criterion(cls_logits, regression, targets, model.default_boxes)["loss"]

    def evaluate(model: nn.Module) -> float:
        metric = VOC07MeanAveragePrecision(num_classes=NUM_CLASSES)
        images, targets = test
        with torch.no_grad():
            for start in range(0, len(images), 8):
                metric.update(model(images[start : start + 8]), targets[start : start + 8])
        return float(metric.compute()["map"])

    return Task("ssd-finetune", "mAP", 8, size.lr, 5e-4, train_set, build, loss, evaluate), pretrain_info


def run_one(
    task: Task, meter: GroupedUnderflowMeter, method: Method, seed: int, steps: int, underflow_every: int
) -> FinetuneRun:
    """Train one (method, seed) and record skips, scales and grouped underflow over time."""
    skipped_at: list[int] = []
    scale_steps: list[int] = []
    log2_scale: dict[str, list[float]] = {g: [] for g in GROUPS}

    def on_step(step: int, trainer: Any) -> None:
        if trainer.skipped_steps > len(skipped_at):
            skipped_at.append(step)
        scales = log2_scales(trainer)
        if scales is not None and len(scales) == len(GROUPS):
            scale_steps.append(step)
            for group, value in scales.items():
                log2_scale[group].append(value)

    meter.reset()
    run = train(task, method, seed, steps, underflow_every, meter=meter, on_step=on_step)
    groups = {g: (statistics.fmean(v) if v else None) for g, v in meter.history.items()} if method.emulated else {}
    return FinetuneRun(
        **asdict(run), skipped_at=skipped_at, scale_steps=scale_steps, log2_scale=log2_scale, underflow_groups=groups
    )


# --- report ------------------------------------------------------------------------------------


def _percent(values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    return f"{100 * statistics.fmean(present):.2f}%" if present else "—"


def table(runs: list[FinetuneRun]) -> str:
    """Markdown table: one row per method, seeds aggregated; the best fixed loss scale per format marked."""
    lines = [
        "| gradients | method | mAP (mean ± std) | final train loss | skipped steps | first skip | "
        "GEMM-gradient underflow: all | heads | backbone | s / run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_method = {key: [r for r in runs if r.method == key] for key in dict.fromkeys(r.method for r in runs)}
    mean_map = {key: statistics.fmean(r.metric for r in rs) for key, rs in by_method.items()}
    best_fixed = {}
    for key, rs in by_method.items():
        grads = ALL_METHODS[key].grads
        if "fixed" in key and (grads not in best_fixed or mean_map[key] > mean_map[best_fixed[grads]]):
            best_fixed[grads] = key
    for key, rs in by_method.items():
        method = ALL_METHODS[key]
        label = method.label + (" (best fixed)" if best_fixed.get(method.grads) == key else "")
        firsts = [r.skipped_at[0] for r in rs if r.skipped_at]
        lines.append(
            f"| {method.grads} | {label} | {_mean_std([r.metric for r in rs])} "
            f"| {_mean_std([_final_loss(r) for r in rs])} "
            f"| {statistics.fmean(r.skipped_steps for r in rs):.1f} | {min(firsts) if firsts else '—'} "
            f"| {_percent([r.underflow for r in rs])} | "
            + " | ".join(_percent([r.underflow_groups.get(g) for r in rs]) for g in GROUPS)
            + f" | {statistics.fmean(r.seconds for r in rs):.0f} |"
        )
    return "\n".join(lines)


def plot(runs: list[FinetuneRun], folder: Path) -> list[Path]:
    """Two PNGs: cumulative skipped steps per method; log2 scale of heads vs backbone over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = len(runs[0].losses)
    keys = list(dict.fromkeys(r.method for r in runs))
    colours = {key: plt.get_cmap("tab10")(i % 10) for i, key in enumerate(k for k in keys if not k.startswith("e5m2"))}
    colours |= {key: plt.get_cmap("tab10")(i % 10) for i, key in enumerate(k for k in keys if k.startswith("e5m2"))}

    def name(key: str) -> str:
        method = ALL_METHODS[key]
        return method.label if method.grads == "fp32" else f"{method.grads} {method.label}"

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, grads in zip(axes, ("fp16", "e5m2")):
        for key in keys:
            if ALL_METHODS[key].grads != grads:
                continue
            skips = torch.zeros(steps)
            rs = [r for r in runs if r.method == key]
            for r in rs:
                skips[r.skipped_at] += 1
            ax.step(
                range(steps),
                (skips.cumsum(0) / len(rs)).numpy(),
                where="post",
                label=name(key),
                color=colours[key],
                linestyle=":" if "fixed" in key else "-",
                linewidth=2.5 if key.endswith("-gs") else 1.5,
            )
        ax.set_title(f"{grads} gradients: cumulative skipped steps (mean over seeds)")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("skipped steps")
    fig.tight_layout()
    skips_path = folder / "ssd_finetune_skips.png"
    fig.savefig(skips_path, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, group in zip(axes, GROUPS):
        for key in keys:
            r = next((r for r in runs if r.method == key and r.seed == 0 and r.scale_steps), None)
            if r is None or "fixed" in key:  # fixed scales are flat lines at their value
                continue
            ax.step(
                r.scale_steps,
                r.log2_scale[group],
                where="post",
                label=name(key),
                color=colours[key],
                linestyle="--" if ALL_METHODS[key].grads == "e5m2" else "-",
            )
        ax.set_title(f"{group}: loss scale or GS median accumulated scale (seed 0)")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("log2 scale")
    fig.tight_layout()
    scales_path = folder / "ssd_finetune_scales.png"
    fig.savefig(scales_path, dpi=110)
    plt.close(fig)
    return [skips_path, scales_path]


def main(argv: list[str] | None = None) -> list[FinetuneRun]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="tiny data, width x1/32, 6 steps, 1 seed: every method in < 3 min"
    )
    parser.add_argument("--methods", nargs="+", choices=list(ALL_METHODS), default=list(DEFAULT_METHODS))
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 2; --quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 80; --quick 6)")
    parser.add_argument("--width", type=float, default=None, help=f"VGG16 width multiplier (default {FULL.width:g})")
    parser.add_argument("--lr", type=float, default=None, help=f"detector SGD learning rate (default {FULL.lr:g})")
    parser.add_argument("--n-train", type=int, default=None, help=f"training images (default {FULL.n_train})")
    parser.add_argument(
        "--weights",
        type=Path,
        default=Path.home() / ".cache" / "gs_lightning",
        help="where the pretrained backbone is cached",
    )
    add_run_arguments(parser, cache="gs_lightning_ssd_finetune")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.report is not None:
        runs = [FinetuneRun(**run) for path in args.report for run in json.loads(path.read_text())]
        return report(runs, args.plots, table, plot)
    size = QUICK if args.quick else FULL
    size = replace(
        size, **{k: v for k, v in (("width", args.width), ("lr", args.lr), ("n_train", args.n_train)) if v is not None}
    )
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 2)
    steps = args.steps if args.steps is not None else (6 if args.quick else 80)
    if seeds < 1 or steps < 1:
        parser.error(f"--seeds and --steps must be positive, got {seeds} and {steps}")

    meter = GroupedUnderflowMeter()
    task, pretrain = finetune_task(size, args.cache, args.weights, meter)
    print(
        f"{size}; pretrained backbone: crop accuracy {pretrain['crop_accuracy']:.3f} "
        f"on {pretrain['test_crops']} held-out crops "
        f"({pretrain['seconds']:.0f} s when built)",
        flush=True,
    )
    runs: list[FinetuneRun] = []
    total = time.perf_counter()
    for seed in range(seeds):  # seed-major: an interrupted table still has every method
        for key in args.methods:
            run = run_one(task, meter, ALL_METHODS[key], seed, steps, args.underflow_every)
            runs.append(run)
            groups = ", ".join(f"{g} {v:.4f}" for g, v in run.underflow_groups.items() if v is not None)
            print(
                f"{key:16s} seed {seed}: mAP {run.metric:.4f}, loss {_final_loss(run):.3f}, "
                f"skipped {run.skipped_steps}, "
                f"underflow {groups or '-'}, {run.seconds:.0f} s",
                flush=True,
            )
            if args.json is not None:
                args.json.write_text(json.dumps([asdict(r) for r in runs]))
    print(f"\n{len(runs)} runs, {steps} steps each, {seeds} seed(s), {time.perf_counter() - total:.0f} s in all\n")
    return report(runs, args.plots, table, plot)


if __name__ == "__main__":
    main()
