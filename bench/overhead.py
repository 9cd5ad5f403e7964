"""Time GradientScaler adds to one training iteration, against plain backward and GradScaler.

Measured side by side in one run, methods interleaved round by round, medians reported (with each method's
fastest and slowest round, the spread a ratio sits in):

* plain      ``loss.backward()`` (no protection against underflow)
* GradScaler ``scale(loss).backward()``, ``unscale_`` (fused unscale + inf check), ``update``
* GS update  ``GradientScaler.backward`` + ``found_inf`` on an update iteration (statistics)
* GS reuse   ``GradientScaler.backward`` + ``found_inf`` between updates (constant factors)
* GS reuse with the fp32 recompute (``recompute_weight_gradients=True``, off by default): what keeping each
  GEMM's operands and incoming gradient until the step costs (on a CPU mostly the allocator's: that memory is
  not reused within the backward); not with ``--compile``, where compiled modules keep nothing

Only the backward section and the finiteness check are timed (the forward and the step are the
same for every method; with ``--compile`` the forward is timed too, since update iterations run it
eagerly). Next to the times it prints the number of aten operations each method
dispatches (on a GPU, each is a kernel launch), counted with a dispatch mode, and times the passes over
the parameter gradients alone (:func:`gradient_passes`: GradScaler's one, GS's two). On CUDA each timed
section is synchronised, and a reuse iteration is also run under
``torch.cuda.set_sync_debug_mode("error")`` to check that only ``found_inf`` synchronises.

    python bench/overhead.py                       # CPU, one thread, ResNet-50, batch 2 at 32x32, fp32
    python bench/overhead.py --autocast            # the same under fp16 autocast (slow on a CPU)
    python bench/overhead.py --device cuda --autocast --batch-size 256 --image-size 224
    python bench/overhead.py --compile --arch resnet18   # torch.compile'd model (inductor; --backend to change)
    python bench/overhead.py --json overhead.json  # also the settings and rows as JSON (bench/docs_results.py reads it)

With ``--compile`` every method trains a ``torch.compile``d model: plain and GradScaler one
compiled copy, GS between updates another (the scaler compiles it with its scale vector), and GS
update iterations a third, whose forward runs dynamo's captured graph eagerly on every iteration
(``update_interval=1``). The first rounds compile; they are warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
import torchvision
from torch.utils._python_dispatch import TorchDispatchMode

from gs_lightning import GradientScaler
from gs_lightning.scaling.drift import largest_magnitudes
from gs_lightning.scaling.finite import unscale_
from gs_lightning.scaling.graph import walk
from gs_lightning.scaling.plan import LeafTargets


def _time(fn: Callable[[], None], device: torch.device, clock: Callable[[], float] = time.perf_counter) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = clock()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (clock() - start) * 1e3


class _OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while active (the backward's included)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def grad_scaler_check(amp: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """What ``GradScaler`` does between the backward and the optimizer's step: its fused unscale and inf check,
    and the read of the flags that ``step()`` synchronises on; ``update`` resets its per-optimizer state, as a step
    would."""
    amp.unscale_(optimizer)
    sum(flag.item() for flag in amp._found_inf_per_device(optimizer).values())
    amp.update()


def gradient_scaling_check(scaler: GradientScaler) -> None:
    """What ``GradientScaler`` does between the backward and the optimizer's step: the step's read of the gradients."""
    scaler.found_inf  # noqa: B018 - the step's finiteness check
    scaler.update()


def gradient_scaling(scaler: GradientScaler, value: torch.Tensor) -> None:
    """A GS iteration's backward and the step's read."""
    scaler.backward(value)
    gradient_scaling_check(scaler)


def backward_methods(
    amp: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, update: GradientScaler, replay: GradientScaler
) -> dict[str, Callable[[torch.Tensor], None]]:
    """Name -> what each compared method does with a loss: its backward and the check its step makes. ``update``
    decides on every backward; ``replay`` has decided once and replays."""

    def grad_scaler(value: torch.Tensor) -> None:
        amp.scale(value).backward()
        grad_scaler_check(amp, optimizer)

    return {
        "plain backward": lambda value: value.backward(),
        "GradScaler": grad_scaler,
        "GS update iteration": partial(gradient_scaling, update),
        "GS between updates": partial(gradient_scaling, replay),
    }


def count_ops(fn: Callable[[], None]) -> int:
    """Number of aten operations ``fn`` dispatches."""
    with _OpCounter() as counter:
        fn()
    return counter.count


def host_breakdown(scaler: GradientScaler, loss: torch.Tensor, repeats: int = 50) -> dict[str, float]:
    """Host-only work of an iteration between updates, in ms: the graph walk, the structure check,
    and registering and removing the hooks (the hooks' own Python calls come on top)."""

    def per_call(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats * 1e3

    graph = walk(loss.grad_fn)
    plan, analysis = scaler.graphs[-1].plans[()], scaler.graphs[-1].analyses[()]
    leaves = LeafTargets(deferred=frozenset(analysis.leaf_sources))

    def register() -> tuple[list, list]:  # the plan's factors, and what keeps operands for recomputing weight gradients
        return plan.replay(graph, leaves), scaler._read.recompute.register(graph, analysis, plan, leaves.deferred)

    def register_and_remove() -> None:
        for handle in [h for handles in register() for h in handles]:
            handle.remove()

    factors, keepers = register()
    for handle in factors + keepers:
        handle.remove()
    scaler._read.recompute.clear()
    return {
        "graph nodes": len(graph.nodes),
        "hooks": len(factors) + len(keepers),
        "of which keep operands to recompute weight gradients": len(keepers),
        "walk ms": per_call(lambda: walk(loss.grad_fn)),
        "structure check ms": per_call(lambda: scaler.graphs[-1].plans[()].matches(graph)),
        "hook register+remove ms": per_call(register_and_remove),
    }


def gradient_passes(model: torch.nn.Module, device: torch.device, rounds: int) -> dict[str, float]:
    """What the passes over the parameter gradients cost, in ms, medians of ``rounds`` interleaved rounds:
    GradScaler's one (its fused unscale and inf check, read and write), and GS's two between updates, the
    unscale after the backward (read and write) and the step's read of each gradient's largest magnitude
    (:func:`~gs_lightning.scaling.drift.largest_magnitudes`, which reads what ``.data`` wrote too). Their sum
    less GradScaler's pass is what GS adds between updates before any hook or Python of its own."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    found_inf, inv_scale = torch.zeros(1, device=device), torch.ones(1, device=device)
    passes: dict[str, Callable[[], object]] = {
        "GradScaler unscale and check ms": lambda: torch._amp_foreach_non_finite_check_and_unscale_(
            grads, found_inf, inv_scale
        ),
        "GS unscale ms": lambda: unscale_(grads, 1.0),
        "GS step read ms": lambda: largest_magnitudes(grads),
    }
    times: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(rounds):
        for name, run in passes.items():
            times[name].append(_time(run, device))
    result = {name: statistics.median(samples) for name, samples in times.items()}
    result["gradient values"] = sum(g.numel() for g in grads)
    result["GS passes less GradScaler's ms"] = (
        result["GS unscale ms"] + result["GS step read ms"] - result["GradScaler unscale and check ms"]
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--autocast", action="store_true", help="fp16 autocast forward (default: fp32)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (see above)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend with --compile")
    parser.add_argument(
        "--cpu-time", action="store_true", help="time the process's CPU time, not wall time (a shared CPU, one thread)"
    )
    parser.add_argument("--json", metavar="FILE", help="write the settings and the table's rows here as JSON")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.arch)(num_classes=1000).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    y = torch.randint(0, 1000, (args.batch_size,), device=device)

    def compiled() -> torch.nn.Module:
        return torch.compile(model, backend=args.backend) if args.compile else model

    plain_model, update_model, reuse_model = compiled(), compiled(), compiled()

    def loss(forward: torch.nn.Module = plain_model) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16, enabled=args.autocast):
            return F.cross_entropy(forward(x), y)

    amp = torch.amp.GradScaler(device.type)
    gs_update = GradientScaler(update_model, update_interval=1)
    gs_reuse = GradientScaler(reuse_model, update_interval=10**9)
    gs_reuse.backward(loss(reuse_model))  # its one update; every later backward replays it
    forward_of = {"GS update iteration": update_model, "GS between updates": reuse_model}
    gs_keeping = None
    if not args.compile:
        gs_keeping = GradientScaler(model, update_interval=10**9, recompute_weight_gradients=True)
        gs_keeping.backward(loss())

    methods = backward_methods(amp, optimizer, gs_update, gs_reuse)
    if gs_keeping is not None:
        methods["GS between updates, fp32 recompute"] = partial(gradient_scaling, gs_keeping)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for round_ in range(args.rounds + 2):
        for name, backward in methods.items():
            forward = forward_of.get(name, plain_model)
            clock = time.process_time if args.cpu_time else time.perf_counter
            if args.compile:  # the forward too: an update iteration runs it eagerly
                elapsed = _time(lambda: backward(loss(forward)), device, clock)  # noqa: B023 - called at once
            else:
                elapsed = _time(partial(backward, loss(forward)), device, clock)
            if round_ >= 2:  # warm-up rounds (and compilation)
                times[name].append(elapsed)
    ops = {}
    for name, backward in methods.items():
        value = loss(forward_of.get(name, plain_model))
        ops[name] = count_ops(partial(backward, value))

    if device.type == "cuda":
        value = loss(reuse_model)
        torch.cuda.set_sync_debug_mode("error")
        try:
            gs_reuse.backward(value)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        print("GS between updates: no host-device synchronisation (sync debug mode 'error' passed)")

    breakdown = host_breakdown(gs_reuse, loss(reuse_model)) if not args.compile else {}
    loss().backward()
    passes = gradient_passes(model, device, args.rounds)
    plain = statistics.median(times["plain backward"])
    compiled_with = f", torch.compile(backend={args.backend!r})" if args.compile else ""
    clock_name = "CPU time" if args.cpu_time else "wall time"
    print(
        f"\n{args.arch}, batch {args.batch_size}, {args.image_size}x{args.image_size}, {device.type}{compiled_with}, "
        f"{clock_name}, median of {args.rounds} interleaved rounds\n"
    )
    timed = "forward+backward" if args.compile else "backward"
    print(
        f"| method | {timed} ms | fastest, slowest round (ms) | added vs plain (ms) | ratio vs plain | "
        "aten ops (backward) | ops added vs plain |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name, samples in times.items():
        median, fastest, slowest = statistics.median(samples), min(samples), max(samples)
        added = ops[name] - ops["plain backward"]
        print(
            f"| {name} | {median:.1f} | {fastest:.1f}, {slowest:.1f} | {median - plain:+.2f} | "
            f"{median / plain:.3f} | {ops[name]} | {added:+d} |"
        )
        rows.append(
            {
                "method": name,
                f"{timed} ms": median,
                "fastest round ms": fastest,
                "slowest round ms": slowest,
                "added vs plain (ms)": median - plain,
                "ratio vs plain": median / plain,
                "aten ops (backward)": ops[name],
                "ops added vs plain": added,
            }
        )
    reuse, amp_ms = statistics.median(times["GS between updates"]), statistics.median(times["GradScaler"])
    best_reuse, best_amp = min(times["GS between updates"]), min(times["GradScaler"])
    print(
        f"\nGS between updates vs GradScaler: median {reuse - amp_ms:+.2f} ms ({reuse / amp_ms:.3f}x), "
        f"best of {args.rounds} {best_reuse - best_amp:+.2f} ms ({best_reuse / best_amp:.3f}x), "
        f"{ops['GS between updates'] - ops['GradScaler']:+d} aten ops"
    )
    if breakdown:
        print("\nHost-side work of GS between updates (no kernels):")
    for name, value in breakdown.items():
        print(f"- {name}: {value:.3f}" if isinstance(value, float) else f"- {name}: {value}")
    print("\nPasses over the parameter gradients (one backward's; medians):")
    for name, value in passes.items():
        print(f"- {name}: {value:.3f}" if isinstance(value, float) else f"- {name}: {value}")
    if args.json:
        settings = {
            "arch": args.arch,
            "batch size": args.batch_size,
            "image size": args.image_size,
            "device": device.type,
            "threads": args.threads,
            "autocast fp16": args.autocast,
            "rounds": args.rounds,
            "clock": clock_name,
            "torch.compile backend": args.backend if args.compile else None,
            "torch": torch.__version__,
        }
        with open(args.json, "w") as f:
            json.dump(
                {"settings": settings, "rows": rows, "host breakdown": breakdown, "gradient passes": passes},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
