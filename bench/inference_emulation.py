"""Emulated fp16 inference on the CPU: ``torch.inference_mode`` against ``torch.no_grad``.

Lightning validates and tests under ``torch.inference_mode``, where autograd does not decompose
``conv2d`` / ``linear`` / ``matmul`` before ``gs_lightning.simulate.emulate``'s dispatch mode;
the mode decomposes them itself, so the same fp32-computed, fp16-rounded GEMMs run as under
``no_grad`` (before it did, the CPU's own fp16 convolutions ran: 78.8 s against 0.63 s for one
512->512 3x3 conv at 38x38, batch 2). This times SSD's evaluation forward (VGG16 backbone, heads,
then the decoding and NMS validation runs) in eval mode under fp16 autocast and the emulation,
in both contexts, rounds interleaved; prints medians, the ratio inference_mode / no_grad (the
target: within 2x) and whether the detections are bit-identical.

    python bench/inference_emulation.py                             # SSD300, batch 2
    python bench/inference_emulation.py --size 512 --json inference_emulation.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from gs_lightning.models import build_ssd
from gs_lightning.simulate import emulate

CONTEXTS: dict[str, Callable[[], object]] = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@dataclass
class InferenceTiming:
    """Median seconds of one evaluation forward per context, their ratio and whether the outputs agree."""

    size: int
    width_mult: float
    batch_size: int
    rounds: int
    threads: int
    no_grad_s: float
    inference_mode_s: float
    ratio: float  # inference_mode / no_grad
    identical: bool  # the same detections, bit for bit


def _forward(model: nn.Module, images: torch.Tensor, context: str) -> tuple[float, list[dict[str, torch.Tensor]]]:
    start = time.perf_counter()
    with CONTEXTS[context](), emulate(torch.float16), torch.autocast("cpu", dtype=torch.float16):
        detections = model(images)
    return time.perf_counter() - start, detections


def _same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def measure(size: int = 300, width_mult: float = 1.0, batch_size: int = 2, rounds: int = 3) -> InferenceTiming:
    """Time SSD``size``'s evaluation forward under the emulation in both contexts (one untimed round first).

    Raises:
        ValueError: ``rounds`` or ``batch_size`` below 1 (``build_ssd`` checks ``size`` and ``width_mult``).
    """
    if rounds < 1 or batch_size < 1:
        raise ValueError(f"rounds and batch_size must be at least 1, got rounds={rounds}, batch_size={batch_size}")
    torch.manual_seed(0)
    model = build_ssd(size=size, num_classes=21, width_mult=width_mult).eval()
    images = torch.rand(batch_size, 3, size, size)
    times: dict[str, list[float]] = {c: [] for c in CONTEXTS}
    outputs: dict[str, list[dict[str, torch.Tensor]]] = {}
    for round_ in range(rounds + 1):
        for context in CONTEXTS:
            elapsed, outputs[context] = _forward(model, images, context)
            if round_:
                times[context].append(elapsed)
    median = {c: statistics.median(t) for c, t in times.items()}
    return InferenceTiming(
        size=size,
        width_mult=width_mult,
        batch_size=batch_size,
        rounds=rounds,
        threads=torch.get_num_threads(),
        no_grad_s=median["no_grad"],
        inference_mode_s=median["inference_mode"],
        ratio=median["inference_mode"] / median["no_grad"],
        identical=_same(outputs["no_grad"], outputs["inference_mode"]),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=300, choices=(300, 512), help="SSD300 or SSD512")
    parser.add_argument("--width-mult", type=float, default=1.0, help="channel width multiplier (1.0: the real SSD)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (after one untimed)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", metavar="FILE", help="write the row here as JSON")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    r = measure(args.size, args.width_mult, args.batch_size, args.rounds)
    print(
        f"torch {torch.__version__}, {r.threads} threads, median of {r.rounds} rounds, SSD{r.size} "
        f"(width x{r.width_mult}) eval forward with decoding and NMS, batch {r.batch_size}, emulated fp16\n"
    )
    print("| no_grad s | inference_mode s | inference_mode / no_grad | same detections |")
    print("|---|---|---|---|")
    print(f"| {r.no_grad_s:.3f} | {r.inference_mode_s:.3f} | {r.ratio:.2f}x | {'yes' if r.identical else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "rows": [asdict(r)]}, f, indent=1)


if __name__ == "__main__":
    main()
