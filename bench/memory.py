"""Memory GradientScaler holds, against a plain backward and GradScaler: one iteration per method, side by side.

Each method runs one iteration from ``zero_grad(set_to_none=True)`` on the same model and batch (after
warm-up iterations of its own), and the bytes allocated above the iteration's start are taken:

* after the forward: the activations the backward will use (the same for every method);
* peak: the most allocated at once during the backward and the step's finiteness check;
* held after the backward: what stays allocated until the step. ``.grad`` for every method and, between
  GS updates with ``recompute_weight_gradients=True`` (off by default), each GEMM's saved operand and incoming
  gradient, which the replay keeps so that a weight gradient that overflows can be recomputed in fp32 at the step:
  the forward's activations then outlive the backward.

Methods, as in ``bench/overhead.py``: a plain backward, ``torch.amp.GradScaler``, a GS update iteration,
GS between updates, and GS between updates with ``recompute_weight_gradients=True``.

On a CPU there are no allocator statistics: the bytes in use come from glibc's ``mallinfo2`` (Linux,
glibc 2.33 or newer): mmap'ed blocks, and the main arena's in-use bytes, where the thread that runs the
forward and the (CPU) backward allocates; whoever allocated them. They are sampled after every aten
operation, so a peak inside one operation (a convolution's workspace) is missed, alike for every method. On CUDA
they are ``torch.cuda.memory_allocated`` and ``max_memory_allocated``.

    python bench/memory.py                          # CPU, ResNet-50, batch 16 at 128x128, fp32
    python bench/memory.py --device cuda --autocast --batch-size 64 --image-size 224
    python bench/memory.py --device cuda --autocast --arch vit_b_16 --batch-size 32 --image-size 224
    python bench/memory.py --json memory.json       # the settings and rows as JSON too (docs_results.py reads it)
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
import torchvision
from overhead import grad_scaler_check, gradient_scaling_check
from torch.utils._python_dispatch import TorchDispatchMode

from gs_lightning import GradientScaler

MIB = 2**20


class _MallocInfo(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


class _PeakSampler(TorchDispatchMode):
    """The most bytes in use after any aten operation dispatched while active (the backward's included)."""

    def __init__(self, in_use: Callable[[], int]) -> None:
        super().__init__()
        self.in_use = in_use
        self.peak = in_use()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.in_use())
        return out


class DeviceMemory:
    """Bytes allocated on ``device`` now, and the most allocated while a function runs (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._mallinfo2 = None
        if device.type == "cuda":
            return
        if device.type != "cpu":
            raise SystemExit(f"bench/memory.py: --device {device.type} is not supported; expected cpu or cuda")
        library = ctypes.CDLL(ctypes.util.find_library("c"))
        self._mallinfo2 = getattr(library, "mallinfo2", None)
        if self._mallinfo2 is None:
            raise SystemExit(
                "bench/memory.py: on a CPU the bytes in use are read from glibc's mallinfo2 (Linux, glibc 2.33 "
                "or newer), which this system's C library lacks; run it with --device cuda"
            )
        self._mallinfo2.restype = _MallocInfo

    def in_use(self) -> int:
        """Bytes allocated now: malloc's in-use bytes (heap and mmap'ed blocks) on a CPU, the caching allocator's on
        CUDA."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        info = self._mallinfo2()
        return info.uordblks + info.hblkhd

    def peak_of(self, fn: Callable[[], None]) -> int:
        """The most bytes allocated at once while ``fn`` runs."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            fn()
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        with _PeakSampler(self.in_use) as sampler:
            fn()
        return sampler.peak


@dataclass(frozen=True)
class Method:
    """A backward, then the step's finiteness check; ``scaler`` is the GradientScaler it runs, if any."""

    backward: Callable[[torch.Tensor], None]
    check: Callable[[], None]
    scaler: GradientScaler | None = None


def iteration_memory(
    memory: DeviceMemory, model: torch.nn.Module, loss: Callable[[], torch.Tensor], method: Method
) -> dict[str, float]:
    """One iteration of ``method`` on ``model`` (``loss()`` runs the forward), from ``zero_grad(set_to_none=True)``:
    MiB above its start."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    start = memory.in_use()
    value = loss()
    after_forward = memory.in_use()
    held = []

    def backward_and_check() -> None:
        method.backward(value)
        held.append(memory.in_use())
        method.check()

    peak = memory.peak_of(backward_and_check)
    return {
        "after forward MiB": (after_forward - start) / MIB,
        "peak MiB": (peak - start) / MIB,
        "held after backward MiB": (held[0] - start) / MIB,
    }


def measure(
    memory: DeviceMemory,
    model: torch.nn.Module,
    loss: Callable[[], torch.Tensor],
    method: Method,
    replay: bool,
    warmup: int = 2,
) -> dict[str, float]:
    """:func:`iteration_memory` after ``warmup`` iterations; for a GS method, of an iteration that
    replayed the scales (``replay``) or updated them, retried where the drift made a replay update."""
    for _ in range(warmup):
        iteration_memory(memory, model, loss, method)
    for _ in range(3):
        updates = method.scaler.update_iterations if method.scaler is not None else 0
        result = iteration_memory(memory, model, loss, method)
        if method.scaler is None or (method.scaler.update_iterations == updates) == replay:
            return result
    raise RuntimeError(
        f"bench/memory.py: three iterations in a row did not {'replay' if replay else 'update'} the scales"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="resnet50", help="a torchvision classifier")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--autocast", action="store_true", help="fp16 autocast forward (default: fp32; slow on a CPU)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--json", metavar="FILE", help="write the settings and the table's rows here as JSON")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    memory = DeviceMemory(device)
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.arch)(num_classes=1000).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    y = torch.randint(0, 1000, (args.batch_size,), device=device)

    def loss() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.float16, enabled=args.autocast):
            return F.cross_entropy(model(x), y)

    def gradient_scaling(**recipe_fields: object) -> Method:
        scaler = GradientScaler(model, **recipe_fields)
        return Method(scaler.backward, partial(gradient_scaling_check, scaler), scaler)

    amp = torch.amp.GradScaler(device.type)
    methods = {  # name -> (method, whether its measured iteration replays the scales)
        "plain backward": (Method(lambda value: value.backward(), lambda: None), False),
        "GradScaler": (
            Method(lambda value: amp.scale(value).backward(), partial(grad_scaler_check, amp, optimizer)),
            False,
        ),
        "GS update iteration": (gradient_scaling(update_interval=1), False),
        "GS between updates": (gradient_scaling(update_interval=10**9), True),
        "GS between updates, fp32 recompute": (
            gradient_scaling(update_interval=10**9, recompute_weight_gradients=True),
            True,
        ),
    }
    rows = []
    for name, (method, replay) in methods.items():
        rows.append({"method": name, **measure(memory, model, loss, method, replay)})
    for row in rows:
        row["peak / plain"] = row["peak MiB"] / rows[0]["peak MiB"]

    where = f"{device.type}" + (", fp16 autocast" if args.autocast else ", fp32")
    print(
        f"\n{args.arch}, batch {args.batch_size} at {args.image_size}x{args.image_size}, {where}: "
        "MiB above the iteration's start\n"
    )
    print("| method | after forward MiB | peak MiB | held after backward MiB | peak / plain |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['method']} | {row['after forward MiB']:.1f} | {row['peak MiB']:.1f} "
            f"| {row['held after backward MiB']:.1f} "
            f"| {row['peak / plain']:.3f} |"
        )
    if args.json:
        settings = {
            "arch": args.arch,
            "batch size": args.batch_size,
            "image size": args.image_size,
            "device": device.type,
            "threads": args.threads,
            "autocast fp16": args.autocast,
            "torch": torch.__version__,
            "bytes in use": "torch.cuda.memory_allocated"
            if device.type == "cuda"
            else "glibc mallinfo2, after every aten operation",
        }
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
