"""Speed of emulated fp16 (``gs_lightning.simulate.emulate``) against real fp16 on the CPU.

One training step's forward and backward (no optimizer) of small CNNs under each precision:

* fp32                 no autocast
* bf16 (real)          ``torch.autocast("cpu", dtype=torch.bfloat16)``: PyTorch's CPU kernels
* fp16 (real)          ``torch.autocast("cpu", dtype=torch.float16)``: PyTorch's CPU kernels
* fp16 (emulated)      the same under ``emulate(torch.float16)``
* fp16 + e5m2 grads    the same under ``emulate(torch.float16, grad_dtype=torch.float8_e5m2)``

Workloads: the issue's two-conv block (conv-BN-ReLU twice, 32 channels, batch 8 at 32x32) and
SegNet-basic as the demo trains it (3x3, width 16, batch 8 at 48x64). Rounds interleave the
precisions; medians are printed with the ratio real fp16 / emulated fp16 (issue 11: ≥ 5).

    python bench/emulation_speed.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from gs_lightning.models import SegNetBasic
from gs_lightning.simulate import emulate

PRECISIONS: dict[str, Callable[[], object]] = {
    "fp32": nullcontext,
    "bf16 (real)": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "fp16 (real)": lambda: torch.autocast("cpu", dtype=torch.float16),
    "fp16 (emulated)": lambda: _stack(emulate(torch.float16), torch.autocast("cpu", dtype=torch.float16)),
    "fp16 + e5m2 grads (emulated)": lambda: _stack(
        emulate(torch.float16, grad_dtype=torch.float8_e5m2), torch.autocast("cpu", dtype=torch.float16)
    ),
}


class _stack:
    """Enter context managers in order, leave them in reverse."""

    def __init__(self, *managers: object) -> None:
        self.managers = managers

    def __enter__(self) -> None:
        for manager in self.managers:
            manager.__enter__()

    def __exit__(self, *exc: object) -> None:
        for manager in reversed(self.managers):
            manager.__exit__(*exc)


def _two_conv_block() -> tuple[nn.Module, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    labels = torch.randint(0, 10, (8,))
    return model, torch.randn(8, 3, 32, 32), lambda out: F.cross_entropy(out.float(), labels)


def _segnet() -> tuple[nn.Module, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    labels = torch.randint(0, 11, (8, 48, 64))
    model = SegNetBasic(num_classes=11, width=16, kernel_size=3)
    return model, torch.rand(8, 3, 48, 64) * 255, lambda out: F.cross_entropy(out.float(), labels)


WORKLOADS = {"two-conv block, batch 8, 32x32": _two_conv_block, "SegNet-basic 3x3 w16, batch 8, 48x64": _segnet}


def _step(model: nn.Module, x: torch.Tensor, loss_fn: Callable[[torch.Tensor], torch.Tensor], precision: str) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with PRECISIONS[precision]():
        loss = loss_fn(model(x))
        loss.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one untimed)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.rounds} rounds, "
        "forward + backward\n"
    )
    print("| workload | precision | seconds | vs fp32 | real fp16 / this |")
    print("|---|---|---|---|---|")
    for name, make in WORKLOADS.items():
        torch.manual_seed(0)
        model, x, loss_fn = make()
        times: dict[str, list[float]] = {p: [] for p in PRECISIONS}
        for round_ in range(args.rounds + 1):
            for precision in PRECISIONS:
                elapsed = _step(model, x, loss_fn, precision)
                if round_:
                    times[precision].append(elapsed)
        median = {p: statistics.median(t) for p, t in times.items()}
        for precision, seconds in median.items():
            print(
                f"| {name} | {precision} | {seconds:.4f} | {seconds / median['fp32']:.2f}x "
                f"| {median['fp16 (real)'] / seconds:.1f}x |"
            )


if __name__ == "__main__":
    main()
