"""An estimate, labelled as one, of what GradientScaler adds to a training iteration on a GPU, from counts made here.

Nothing runs on a GPU. Each method's backward and the step's finiteness check run once on the CPU under a
dispatch mode that records, per aten operation (on a GPU, a kernel launch), its FLOPs (the formulas of
``torch.utils.flop_counter``) and the bytes of the tensors it reads and writes (a view moves none). The estimate
takes the GPU to run its kernels while the host dispatches the next:

    host ms   = operations x --host-us (eager PyTorch's dispatch and launch of one operation)
    device ms = sum over operations of max(FLOPs / --tflops, bytes / --bandwidth)  (each kernel at peak: a floor)
    estimate  = max(host ms, device ms)

and a run with an update every N iterations ((N - 1) replays and one update) against GradScaler's iterations,
each with the forward (the optimizer's step, the same for every method, is left out).
Not counted: Python that dispatches no operation (GS's graph walk and hook registration, measured on this CPU by
``bench/overhead.py``'s host breakdown). The defaults describe an A100-SXM4-40GB (312 dense fp16 tensor-core
TFLOPS, 1555 GB/s) and 8 us of host time per operation. Measured instead, on a GPU when one is lent:
``bash bench/gpu_check.sh`` (its overhead and full-step stages time GS against GradScaler at training sizes).

    python bench/gpu_estimate.py --json gpu_estimate.json    # ResNet-50, batch 16 at 128x128, fp16 autocast
    python bench/gpu_estimate.py --arch resnet18 --batch-size 2 --image-size 32 --no-autocast   # seconds
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F
import torchvision
from overhead import grad_scaler_check, gradient_scaling_check
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from gs_lightning import GradientScaler


@dataclass
class Counts:
    """What one iteration's backward and finiteness check dispatched."""

    operations: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    device_floor_ms: float = 0.0  # sum over operations of max(FLOPs / peak, bytes / bandwidth)


class _Counter(TorchDispatchMode):
    """Counts operations, FLOPs and bytes, and the roofline floor of each, while active."""

    def __init__(self, tflops: float, bandwidth_gbs: float) -> None:
        super().__init__()
        self.counts = Counts()
        self.peak, self.bandwidth = tflops * 1e12, bandwidth_gbs * 1e9

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
        moved = 0.0 if func.is_view else float(sum(_nbytes(t) for t in tree_leaves((args, kwargs, out))))
        counts = self.counts
        counts.operations += 1
        counts.flops += flops
        counts.bytes += moved
        counts.device_floor_ms += max(flops / self.peak, moved / self.bandwidth) * 1e3
        return out


def _nbytes(value: object) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def count(run: Callable[[], None], tflops: float, bandwidth_gbs: float) -> Counts:
    """Run ``run`` once under the counting mode: its :class:`Counts`."""
    counter = _Counter(tflops, bandwidth_gbs)
    with counter:
        run()
    return counter.counts


def estimate(counts: Counts, host_us: float) -> dict[str, float]:
    """The estimated host, device and iteration milliseconds of ``counts`` (module docstring)."""
    host = counts.operations * host_us * 1e-3
    return {"host ms": host, "device ms": counts.device_floor_ms, "estimate ms": max(host, counts.device_floor_ms)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--no-autocast", action="store_true", help="fp32 (default: fp16 autocast, as on a GPU)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--host-us", type=float, default=8.0, help="host time per operation on the GPU's host")
    parser.add_argument("--tflops", type=float, default=312.0, help="the GPU's peak TFLOPS")
    parser.add_argument("--bandwidth", type=float, default=1555.0, help="the GPU's memory bandwidth, GB/s")
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
    replay.backward(loss())  # its one update: every later backward replays it
    gradient_scaling_check(replay)

    def grad_scaler(value: torch.Tensor) -> None:
        amp.scale(value).backward()
        grad_scaler_check(amp, optimizer)

    def gradient_scaling(scaler: GradientScaler, value: torch.Tensor) -> None:
        scaler.backward(value)
        gradient_scaling_check(scaler)

    methods: dict[str, Callable[[torch.Tensor], None]] = {
        "plain backward": lambda value: value.backward(),
        "GradScaler": grad_scaler,
        "GS update iteration": partial(gradient_scaling, update),
        "GS between updates": partial(gradient_scaling, replay),
    }
    counted: dict[str, Counts] = {"forward (every method's)": count(loss, args.tflops, args.bandwidth)}
    update.backward(loss())  # its one-time work (the first analysis, caches) is no iteration's
    gradient_scaling_check(update)
    for name, backward in methods.items():
        counted[name] = count(partial(backward, loss()), args.tflops, args.bandwidth)
    rows = []
    for name, counts in counted.items():
        rows.append(
            {
                "method": name,
                "aten ops": counts.operations,
                "GFLOP": counts.flops / 1e9,
                "GB moved": counts.bytes / 1e9,
                **{f"{k} (estimate)": v for k, v in estimate(counts, args.host_us).items()},
            }
        )
    by_name = {row["method"]: row["estimate ms (estimate)"] for row in rows}
    forward = by_name["forward (every method's)"]
    runs = [
        {
            "run": f"GS, an update every {n} iterations",
            "iteration ms (estimate)": forward
            + ((n - 1) * by_name["GS between updates"] + by_name["GS update iteration"]) / n,
            "GradScaler iteration ms (estimate)": forward + by_name["GradScaler"],
        }
        for n in args.update_every
    ]
    for run in runs:
        run["÷ GradScaler (estimate)"] = run["iteration ms (estimate)"] / run["GradScaler iteration ms (estimate)"]
    settings = {
        "arch": args.arch,
        "batch size": args.batch_size,
        "image size": args.image_size,
        "autocast fp16": not args.no_autocast,
        "threads": args.threads,
        "torch": torch.__version__,
    }
    assumptions = {
        "host us per operation": args.host_us,
        "peak TFLOPS": args.tflops,
        "bandwidth GB/s": args.bandwidth,
    }
    result = {
        "settings": settings,
        "assumptions": assumptions,
        "rows": rows,
        "runs": runs,
        "counts": {k: asdict(v) for k, v in counted.items()},
    }
    print(
        f"{args.arch}, batch {args.batch_size} at {args.image_size}x{args.image_size}, "
        f"{'fp32' if args.no_autocast else 'fp16 autocast'}: an ESTIMATE for a GPU "
        f"({args.tflops:g} TFLOPS, {args.bandwidth:g} GB/s, {args.host_us:g} us per operation)\n"
    )
    for row in rows:
        print(
            f"{row['method']:22s} {row['aten ops']:6d} ops {row['GFLOP']:8.1f} GFLOP {row['GB moved']:7.2f} GB  "
            f"host {row['host ms (estimate)']:7.2f} ms  device {row['device ms (estimate)']:7.2f} ms  "
            f"-> {row['estimate ms (estimate)']:7.2f} ms"
        )
    for run in runs:
        ms, ratio = run["iteration ms (estimate)"], run["÷ GradScaler (estimate)"]
        print(f"{run['run']}: {ms:.2f} ms, {ratio:.3f}x GradScaler's")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
