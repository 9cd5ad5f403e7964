"""Time GradientScaler adds to one training iteration, against plain backward and GradScaler.

Measured side by side in one run, methods interleaved round by round, medians reported:

* plain      fp16 autocast, ``loss.backward()`` (no protection against underflow)
* GradScaler ``scaler.scale(loss).backward(); scaler.unscale_(opt)`` (dynamic loss scaling)
* GS update  ``GradientScaler.backward`` on an update iteration (statistics, one sync per decision)
* GS reuse   ``GradientScaler.backward`` between updates (constant factors, no sync)

Only the backward section is timed (the forward is the same for every method). On CUDA each
timed section is synchronised, and a reuse iteration is also run under
``torch.cuda.set_sync_debug_mode("error")`` to prove it never synchronises with the device.

    python bench/overhead.py                       # CPU, ResNet-50, tiny input
    python bench/overhead.py --device cuda --batch-size 256 --image-size 224
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
import torchvision

from gs_lightning import GradientScaler
from gs_lightning.scaling.graph import walk
from gs_lightning.scaling.scaler import _scale_grad_inputs, _scale_grad_outputs


def _time(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def host_breakdown(scaler: GradientScaler, loss: torch.Tensor, repeats: int = 50) -> dict[str, float]:
    """Host-only work of an iteration between updates, in ms: the graph walk, the structure check,
    and registering and removing the hooks (the hooks' own Python calls come on top)."""
    def per_call(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats * 1e3

    graph = walk(loss.grad_fn)
    hooks = scaler._plan.hook_factors(graph)

    def register_and_remove() -> None:
        handles = []
        for i, pre, post in hooks:
            if pre is not None:
                handles.append(graph.nodes[i].register_prehook(partial(_scale_grad_outputs, pre)))
            if post is not None:
                handles.append(graph.nodes[i].register_hook(partial(_scale_grad_inputs, post)))
        for handle in handles:
            handle.remove()

    return {
        "graph nodes": len(graph.nodes),
        "hooked nodes": len(hooks),
        "walk ms": per_call(lambda: walk(loss.grad_fn)),
        "structure check ms": per_call(lambda: graph.same_structure(scaler._plan.names, scaler._plan.edges)),
        "hook register+remove ms": per_call(register_and_remove),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.arch)(num_classes=1000).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    y = torch.randint(0, 1000, (args.batch_size,), device=device)

    def loss() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16):
            return F.cross_entropy(model(x), y)

    amp = torch.amp.GradScaler(device.type)
    gs_update = GradientScaler(model, update_interval=1)
    gs_reuse = GradientScaler(model, update_interval=10**9)
    gs_reuse.backward(loss())  # its one update; every later backward replays it

    def grad_scaler(value: torch.Tensor) -> None:
        amp.scale(value).backward()
        amp.unscale_(optimizer)
        amp.update()  # resets the per-optimizer unscale state, as a real step would

    methods: dict[str, Callable[[torch.Tensor], None]] = {
        "plain backward": lambda value: value.backward(),
        "GradScaler": grad_scaler,
        "GS update iteration": gs_update.backward,
        "GS between updates": gs_reuse.backward,
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for round_ in range(args.rounds + 2):
        for name, backward in methods.items():
            value = loss()
            elapsed = _time(lambda: backward(value), device)
            if round_ >= 2:  # warm-up rounds
                times[name].append(elapsed)

    if device.type == "cuda":
        value = loss()
        torch.cuda.set_sync_debug_mode("error")
        try:
            gs_reuse.backward(value)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        print("GS between updates: no host-device synchronisation (sync debug mode 'error' passed)")

    breakdown = host_breakdown(gs_reuse, loss())
    plain = statistics.median(times["plain backward"])
    print(
        f"\n{args.arch}, batch {args.batch_size}, {args.image_size}x{args.image_size}, {device.type}, "
        f"median of {args.rounds} interleaved rounds\n"
    )
    print("| method | backward ms | added vs plain (ms) | ratio vs plain |")
    print("|---|---|---|---|")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"| {name} | {median:.1f} | {median - plain:+.2f} | {median / plain:.3f} |")
    ratio = statistics.median(times["GS between updates"]) / statistics.median(times["GradScaler"])
    print(f"\nGS between updates / GradScaler: {ratio:.3f}")
    print("\nHost-side work of GS between updates (no kernels):")
    for name, value in breakdown.items():
        print(f"- {name}: {value:.3f}" if isinstance(value, float) else f"- {name}: {value}")


if __name__ == "__main__":
    main()
