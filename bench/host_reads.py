"""Host reads of GradientScaler per iteration: in the backward and in the step, on an update iteration and on a replay.

On a GPU each host read (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``...) waits for every
kernel queued before it. This counts them by wrapping those calls (any device), with the scalar reads torch
makes by itself (a dispatch mode sees ``aten._local_scalar_dense``), and on CUDA also
counts the synchronisations torch itself reports (``torch.cuda.set_sync_debug_mode("warn")``),
next to ``torch.amp.GradScaler``'s, on ResNet-18 and a Transformer encoder under fp16 autocast:

    python bench/host_reads.py                          # CPU, small inputs
    python bench/host_reads.py --device cuda --batch-size 64
    python bench/host_reads.py --json host_reads.json   # also the rows as JSON
"""

from __future__ import annotations

import argparse
import contextlib
import json
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gs_lightning import GradientScaler

# The calls that bring a tensor's value to the host.
_TENSOR_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


class _ScalarReads(TorchDispatchMode):
    """Counts the scalar reads no wrapped call shows (indexing by a 0-dim tensor, ``int(t)`` inside torch)."""

    def __init__(self, counts: Counter, inside: list[int]) -> None:
        super().__init__()
        self.counts, self.inside = counts, inside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self.inside[0]:
            self.counts["scalar read"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_host_reads() -> Iterator[Counter]:
    """Count the calls of :data:`_TENSOR_READS` and ``torch.nonzero`` made inside the block, by name, and the scalar
    reads torch makes by itself (``aten._local_scalar_dense`` outside those calls)."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in _TENSOR_READS}
    inside = [0]  # depth of wrapped calls: their own scalar reads are counted once, by name

    def counted(name: str, original: Callable) -> Callable:
        def call(*args, **kwargs):
            counts[name] += 1
            inside[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                inside[0] -= 1

        return call

    nonzero = torch.nonzero
    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counted(name, original))
        torch.nonzero = counted("nonzero", nonzero)
        with _ScalarReads(counts, inside):
            yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.nonzero = nonzero


@contextlib.contextmanager
def counting_cuda_syncs(device: str) -> Iterator[list]:
    """On CUDA, the synchronisations torch reports inside the block (one warning each); nothing elsewhere."""
    if device != "cuda":
        yield []
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


@dataclass
class Row:
    model: str
    method: str
    iteration: str  # GS: "update" or "replay"; GradScaler: "first" or "second" (every iteration alike)
    backward_reads: int
    step_reads: int
    backward_syncs: int | None  # CUDA only
    step_syncs: int | None


def _models(batch: int, device: str) -> dict[str, tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]]:
    torch.manual_seed(0)
    images, labels = torch.randn(batch, 3, 32, 32, device=device), torch.randint(0, 10, (batch,), device=device)
    tokens, targets = torch.randn(batch, 16, 128, device=device), torch.randint(0, 10, (batch,), device=device)
    encoder = nn.Sequential(
        nn.TransformerEncoder(
            nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, dropout=0.0), 2, enable_nested_tensor=False
        ),
        nn.Flatten(),
        nn.Linear(16 * 128, 10),
    )
    return {
        "resnet18": (torchvision.models.resnet18(num_classes=10), lambda m: F.cross_entropy(m(images), labels)),
        "transformer_encoder": (encoder, lambda m: F.cross_entropy(m(tokens), targets)),
    }


def measure(name: str, model: nn.Module, loss_of: Callable, device: str, method: str) -> list[Row]:
    """Two iterations (GS: the update, then a replay; GradScaler: two alike), each counted in backward and step."""
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = GradientScaler(model) if method == "GS" else torch.amp.GradScaler(device)
    rows = []
    for iteration in ("update", "replay") if method == "GS" else ("first", "second"):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.float16):
            loss = loss_of(model)
        with counting_host_reads() as reads, counting_cuda_syncs(device) as syncs:
            scaler.scale(loss).backward()
        backward = (sum(reads.values()), len(syncs) if device == "cuda" else None)
        with counting_host_reads() as reads, counting_cuda_syncs(device) as syncs:
            scaler.step(optimizer)
            scaler.update()
        step = (sum(reads.values()), len(syncs) if device == "cuda" else None)
        rows.append(Row(name, method, iteration, backward[0], step[0], backward[1], step[1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--json", metavar="FILE", help="write the rows here as JSON")
    args = parser.parse_args()
    rows = []
    for name, (model, loss_of) in _models(args.batch_size, args.device).items():
        for method in ("GradScaler", "GS"):
            rows += measure(name, model, loss_of, args.device, method)
    print(f"Host reads per iteration ({args.device}, batch {args.batch_size}, fp16 autocast)\n")
    print(
        "| model | method | iteration | reads in backward | reads in step "
        "| CUDA syncs in backward | CUDA syncs in step |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.model} | {r.method} | {r.iteration} | {r.backward_reads} | {r.step_reads} "
            f"| {'-' if r.backward_syncs is None else r.backward_syncs} "
            f"| {'-' if r.step_syncs is None else r.step_syncs} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "rows": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
