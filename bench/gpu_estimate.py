"""An estimate, labelled as one, of what GradientScaler adds to a training iteration on a GPU, from counts made here.

Nothing runs on a GPU. The forward and each method's backward and finiteness check run once on the CPU under a
dispatch mode that records, per aten operation (on a GPU, a kernel launch), its FLOPs (the formulas of
``torch.utils.flop_counter``) and the bytes of the tensors it reads and writes (a view moves none). The estimate
takes the GPU to run its kernels while the host dispatches the next:

    host ms   = operations x --host-us (eager PyTorch's dispatch and launch of one operation)
    device ms = sum over operations of max(FLOPs / peak, bytes / bandwidth)  (each kernel at peak: a floor)
    estimate  = max(host ms, device ms)

per GPU of :data:`GPUS` (their data sheets' dense fp16 tensor-core TFLOPS and memory bandwidth; V100 and T4 have
no bf16, the GPUs fp16 training is for), and a run with an update every N iterations ((N - 1) replays and one
update, the forward included; the optimizer's step, the same for every method, left out) against GradScaler's.
Not counted: Python that dispatches no operation (GS's graph walk and hook registration, measured on this CPU by
``bench/overhead.py``'s host breakdown). Measured instead, on a GPU when one is lent: ``bash bench/gpu_check.sh``
(its overhead and full-step stages time GS against GradScaler at training sizes).

    python bench/gpu_estimate.py --json gpu_estimate.json    # ResNet-50, batch 16 at 128x128, fp16 autocast
    python bench/gpu_estimate.py --arch resnet18 --batch-size 2 --image-size 32 --no-autocast   # seconds
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from unittest.mock import patch

import torch
import torch.nn.functional as F
import torchvision
from overhead import backward_methods, gradient_scaling_check
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from gs_lightning import GradientScaler
from gs_lightning.scaling import drift


@dataclass(frozen=True)
class GPU:
    """A GPU as the estimate sees it: dense fp16 tensor-core TFLOPS and memory bandwidth, from its data sheet."""

    tflops: float
    bandwidth_gbs: float


GPUS = {
    "A100-SXM4-40GB": GPU(312.0, 1555.0),
    "V100-SXM2-32GB": GPU(125.0, 900.0),
    "T4": GPU(65.0, 320.0),
}


@dataclass
class Counts:
    """What a section of an iteration dispatched: per operation, its FLOPs and the bytes it moved."""

    flops: list[float] = field(default_factory=list)
    bytes: list[float] = field(default_factory=list)

    @property
    def operations(self) -> int:
        return len(self.flops)

    def device_floor_ms(self, gpu: GPU) -> float:
        """Sum over operations of max(FLOPs / peak, bytes / bandwidth): each kernel at the GPU's peak."""
        peak, bandwidth = gpu.tflops * 1e12, gpu.bandwidth_gbs * 1e9
        return sum(max(f / peak, b / bandwidth) for f, b in zip(self.flops, self.bytes)) * 1e3

    def estimate_ms(self, gpu: GPU, host_us: float) -> float:
        """The longer of the host's dispatch (``host_us`` per operation) and the device's floor."""
        return max(self.operations * host_us * 1e-3, self.device_floor_ms(gpu))


class _Counter(TorchDispatchMode):
    """Records each operation's FLOPs and the bytes of the tensors it reads and writes, while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = Counts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        self.counts.flops.append(float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0)
        moved = 0 if func.is_view else sum(_nbytes(t) for t in tree_leaves((args, kwargs, out)))
        self.counts.bytes.append(float(moved))
        return out


def _nbytes(value: object) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def count(run: Callable[[], object]) -> Counts:
    """Run ``run`` once under the counting mode, down the paths a GPU takes: its :class:`Counts`.

    The one path of GS that depends on the device, the step's maxima of the gradients, takes a GPU's fused
    norm here too (a CPU takes each gradient's ``aminmax``: one operation per gradient more)."""
    counter = _Counter()
    with counter, patch.object(drift, "fused_inf_norm", lambda device: True):
        run()
    return counter.counts


def estimates(counted: dict[str, Counts], gpus: dict[str, GPU], host_us: float, every: list[int]) -> list[dict]:
    """Per GPU: each section's estimated ms, and per N of ``every`` a run's iteration with an update every N
    iterations against GradScaler's (module docstring)."""
    rows = []
    for name, gpu in gpus.items():
        ms = {section: counts.estimate_ms(gpu, host_us) for section, counts in counted.items()}
        forward, amp = ms["forward"], ms["forward"] + ms["GradScaler"]
        row = {"GPU": name, **{f"{section} ms": value for section, value in ms.items()}}
        for n in every:
            gs = forward + ((n - 1) * ms["GS between updates"] + ms["GS update iteration"]) / n
            row[f"GS ÷ GradScaler, an update every {n}"] = gs / amp
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--no-autocast", action="store_true", help="fp32 (default: fp16 autocast, as on a GPU)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--host-us", type=float, default=8.0, help="host time per operation on the GPU's host")
    parser.add_argument("--update-every", type=int, nargs="+", default=[100, 8], help="runs to estimate")
    parser.add_argument("--json", metavar="FILE", help="write the settings, counts and estimates here as JSON")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.arch)(num_classes=1000)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    y = torch.randint(0, 1000, (args.batch_size,))

    def loss() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=not args.no_autocast):
            return F.cross_entropy(model(x), y)

    amp = torch.amp.GradScaler("cpu")
    update = GradientScaler(model, update_interval=1)
    replay = GradientScaler(model, update_interval=10**9)
    for scaler in (replay, update):  # the replay's one update; the update's one-time work (analysis, caches)
        scaler.backward(loss())
        gradient_scaling_check(scaler)

    methods = backward_methods(amp, optimizer, update, replay)
    counted = {"forward": count(loss)}
    counted.update({name: count(partial(backward, loss())) for name, backward in methods.items()})
    host_us = args.host_us
    counts = [
        {
            "section": section,
            "aten ops": c.operations,
            "GFLOP": sum(c.flops) / 1e9,
            "GB moved": sum(c.bytes) / 1e9,
            "host ms (estimate)": c.operations * host_us * 1e-3,
        }
        for section, c in counted.items()
    ]
    rows = estimates(counted, GPUS, host_us, args.update_every)
    result = {
        "settings": {
            "arch": args.arch,
            "batch size": args.batch_size,
            "image size": args.image_size,
            "autocast fp16": not args.no_autocast,
            "threads": args.threads,
            "torch": torch.__version__,
        },
        "assumptions": {
            "host us per operation": host_us,
            "GPUs": {name: {"peak TFLOPS": g.tflops, "bandwidth GB/s": g.bandwidth_gbs} for name, g in GPUS.items()},
        },
        "counts": counts,
        "estimates": rows,
    }
    precision = "fp32" if args.no_autocast else "fp16 autocast"
    print(f"{args.arch}, batch {args.batch_size} at {args.image_size}x{args.image_size}, {precision}: counted here\n")
    for row in counts:
        print(
            f"{row['section']:22s} {row['aten ops']:6d} ops {row['GFLOP']:8.1f} GFLOP {row['GB moved']:7.2f} GB  "
            f"host {row['host ms (estimate)']:7.2f} ms at {host_us:g} us an operation"
        )
    print("\nESTIMATED for a GPU (ms: the longer of host and device):\n")
    for row in rows:
        print("  ".join(f"{k} {v:.3g}" if isinstance(v, float) else str(v) for k, v in row.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
