"""Time of full fp16 training steps with GradientScaler, against torch.amp.GradScaler.

A step is forward under fp16 autocast, backward and optimizer step (SGD, momentum 0.9):

* GradScaler           ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``
* GS between updates   ``GradientScaler(update_interval=10**9)`` after its one update: replays
                       constant per-layer factors, no statistics and no synchronisation
* GS update iteration  ``GradientScaler(update_interval=1)``: statistics at every GEMM and cast

Each method trains its own copy of the network (same initial weights) on one fixed batch
(``bench/_models.py``); rounds interleave the methods and medians are reported. Untimed rounds
come first, until GradScaler and GS between updates have settled (a round with no skipped step).
On CUDA each step is synchronised before and after. Steps skipped for non-finite gradients are
counted: a skipped step also makes GS's next iteration an update.

    python bench/step_time.py --device cpu --size small            # about 3 min on 2 cores
    python bench/step_time.py --device cuda                        # SegNet-basic 360x480 b12, SSD512 b8
"""

from __future__ import annotations

import argparse
import copy
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from _models import MODELS, SIZES, Workload, build
from torch import Tensor, nn

from gs_lightning.scaling import GradientScaler

WARMUP_ROUNDS = 2  # not timed: allocator and kernel warm-up, GS's one update
# Untimed rounds go on (up to this many) while GradScaler or GS between updates skips steps: both
# start from scales that overflow on some networks (GradScaler from 2^16) and back off one step
# per skip, and a skipped step makes GS's next iteration an update. GS update iteration is left
# out of the test: with update_interval=1 it may keep probing a scale that overflows.
MAX_WARMUP_ROUNDS = 30
SETTLING = ("GradScaler", "GS between updates")
AMORTISED_INTERVAL = 100  # the paper's (and GradientScaler's default) update interval


@dataclass
class Method:
    """One way of running a step, with its own model copy and optimizer."""

    name: str
    model: nn.Module
    backward_and_step: Callable[[Tensor], None]
    skipped: Callable[[], int]
    times: list[float]
    skipped_before: int = 0  # skipped in the untimed rounds


def _grad_scaler(name: str, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> Method:
    scaler = torch.amp.GradScaler(device.type)
    skipped, last_scale = [0], [scaler.get_scale()]

    def run(loss: Tensor) -> None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        # GradScaler halves its scale exactly when it skips. Reading it synchronises, but only
        # after step(), which has synchronised already (and the timer synchronises anyway).
        scale = scaler.get_scale()
        skipped[0] += scale < last_scale[0]
        last_scale[0] = scale

    return Method(name, model, run, lambda: skipped[0], [])


def _gradient_scaler(name: str, model: nn.Module, optimizer: torch.optim.Optimizer, update_interval: int) -> Method:
    scaler = GradientScaler(model, update_interval=update_interval)

    def run(loss: Tensor) -> None:
        scaler.backward(loss)
        scaler.step(optimizer)

    return Method(name, model, run, lambda: scaler.skipped_steps, [])


def _methods(workload: Workload) -> list[Method]:
    methods = []
    for name in ("GradScaler", "GS between updates", "GS update iteration"):
        model = copy.deepcopy(workload.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=workload.lr, momentum=0.9)
        if name == "GradScaler":
            methods.append(_grad_scaler(name, model, optimizer, workload.device))
        else:
            interval = 10**9 if name == "GS between updates" else 1
            methods.append(_gradient_scaler(name, model, optimizer, interval))
    return methods


def _step(method: Method, loss_fn: Callable[[nn.Module], Tensor], device: torch.device) -> float:
    """One training step; returns its wall time in ms."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    method.model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.float16):
        loss = loss_fn(method.model)
    method.backward_and_step(loss)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def time_steps(workload: Workload, rounds: int, seed: int) -> tuple[list[Method], int]:
    """Interleaved steps of every method on one fixed batch; returns the methods and the untimed rounds."""
    loss_fn = workload.loss_fn(workload.make_batch(torch.Generator().manual_seed(seed)))
    methods = _methods(workload)
    settling = [m for m in methods if m.name in SETTLING]
    warmup = 0
    while warmup < MAX_WARMUP_ROUNDS:
        before = [m.skipped() for m in settling]
        for method in methods:
            _step(method, loss_fn, workload.device)
        warmup += 1
        if warmup >= WARMUP_ROUNDS and before == [m.skipped() for m in settling]:
            break
    for method in methods:
        method.skipped_before = method.skipped()
    for _ in range(rounds):
        for method in methods:
            method.times.append(_step(method, loss_fn, workload.device))
    return methods, warmup


def table(results: list[tuple[Workload, list[Method], int]]) -> str:
    """Markdown table: ms/step and ratio to GradScaler, plus GS amortised over its update interval."""
    lines = [
        "| model | settings | method | ms/step | vs GradScaler | skipped steps (untimed + timed) |",
        "|---|---|---|---|---|---|",
    ]
    for workload, methods, _ in results:
        medians = {m.name: statistics.median(m.times) for m in methods}
        base = medians["GradScaler"]
        for method in methods:
            lines.append(
                f"| {workload.title} | {workload.settings} | {method.name} | {medians[method.name]:.1f} "
                f"| {medians[method.name] / base:.3f} | {method.skipped_before} + "
                f"{method.skipped() - method.skipped_before} |"
            )
        amortised = (
            (AMORTISED_INTERVAL - 1) * medians["GS between updates"] + medians["GS update iteration"]
        ) / AMORTISED_INTERVAL
        lines.append(
            f"| {workload.title} | {workload.settings} | GS, 1 update per {AMORTISED_INTERVAL} "
            f"| {amortised:.1f} | {amortised / base:.3f} | |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["segnet", "ssd512"])
    parser.add_argument("--size", choices=SIZES, help="default: realistic on cuda, small on cpu")
    parser.add_argument("--rounds", type=int, help="timed rounds (default: 20 on cuda, 3 on cpu)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    size = args.size or ("realistic" if args.device == "cuda" else "small")
    rounds = args.rounds or (20 if args.device == "cuda" else 3)
    device = torch.device(args.device)

    started = time.perf_counter()
    results = []
    for name in args.models:
        workload = build(name, size, device, args.seed)
        methods, untimed = time_steps(workload, rounds, args.seed)
        results.append((workload, methods, untimed))
        print(f"{workload.title}: done", file=sys.stderr, flush=True)
    print(f"Command: python {shlex.join(sys.argv)}\n")
    print(
        f"{size} size on {args.device}, torch {torch.__version__}, fp16 autocast, SGD momentum 0.9, "
        f"median of {rounds} interleaved rounds after untimed ones ("
        + ", ".join(f"{workload.title}: {untimed}" for workload, _, untimed in results)
        + f"); took {time.perf_counter() - started:.0f} s.\n"
    )
    print(table(results))


if __name__ == "__main__":
    main()
