"""torchvision raft_small trained under fp16 autocast: steps GS skips vs steps unscaled fp16 finds non-finite (issue
19).

RAFT reuses its update block's convolutions across flow iterations; autocast casts each weight
once, so their fp16 weight gradients meet in one sum. Random image pairs and flow targets,
batch 1, SGD; every step's gradients are checked (unscaled: plain backward under autocast).

    python -m bench.raft_fp16 --steps 20 --size 128 --run unscaled gs
"""

from __future__ import annotations

import argparse
import time

import torch
import torchvision

from gs_lightning import GradientScaler


def train(scaled: bool, batches: list[tuple[torch.Tensor, ...]], flow_updates: int) -> list[bool]:
    """Per step: whether its gradients were finite (unscaled) or GS stepped."""
    torch.manual_seed(0)
    model = torchvision.models.optical_flow.raft_small(weights=None).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    scaler = GradientScaler(model) if scaled else None
    finite = []
    for step, (first, second, flow) in enumerate(batches):
        start = time.time()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            predictions = model(first, second, num_flow_updates=flow_updates)
        loss = sum((p.float() - flow).abs().mean() for p in predictions)
        if scaler is not None:
            scaler.backward(loss)
            ok = scaler.step(optimizer)
        else:
            loss.backward()
            ok = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
            if ok:
                optimizer.step()
        finite.append(ok)
        print(
            f"{'gs' if scaled else 'unscaled'} step {step}: {'ok' if ok else 'NON-FINITE / skipped'} "
            f"({time.time() - start:.0f} s)",
            flush=True,
        )
    return finite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=128, help="image height and width (a multiple of 8, at least 128)")
    parser.add_argument("--flow-updates", type=int, default=12)
    parser.add_argument("--run", nargs="+", choices=["unscaled", "gs"], default=["unscaled", "gs"])
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    shape = (1, 3, args.size, args.size)
    batches = [
        (
            torch.rand(shape, generator=generator) * 2 - 1,
            torch.rand(shape, generator=generator) * 2 - 1,
            torch.randn(1, 2, args.size, args.size, generator=generator),
        )
        for _ in range(args.steps)
    ]
    for run in args.run:
        finite = train(run == "gs", batches, args.flow_updates)
        print(f"{run}: non-finite or skipped steps {[k for k, ok in enumerate(finite) if not ok]} of {args.steps}")


if __name__ == "__main__":
    main()
