"""What the replay headroom of the overflow bounds costs in underflow.

Every overflow bound an update decides on keeps ``ScalingRecipe.replay_headroom_log2`` binades of headroom, so
that the replays until the next update survive a gradient that grows. Where an overflow bound
decides a scale, that scale is then lower by as much, and more of its gradient underflows. This
runs one fp16 update iteration of each bench network (small size) with headroom 0 and with the
default, and prints, per network, how many decisions changed and their estimated underflow rates.

    python bench/replay_headroom.py --models resnet18 ssd300 segnet
"""

from __future__ import annotations

import argparse
import math

import torch

from bench._models import MODELS, build
from gs_lightning import GradientScaler, LayerScale, ScalingRecipe


def decisions(name: str, headroom: float) -> dict[str, LayerScale]:
    """{layer: what one fp16 update iteration decided} for bench network ``name``."""
    workload = build(name, "small", torch.device("cpu"))
    loss_fn = workload.loss_fn(workload.make_batch(torch.Generator().manual_seed(1)))
    scaler = GradientScaler(workload.model, replay_headroom_log2=headroom)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(workload.model)
    scaler.backward(loss)
    return {layer.name: layer for layer in scaler.layers()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "segnet"], choices=MODELS)
    args = parser.parse_args()
    for name in args.models:
        default = ScalingRecipe().replay_headroom_log2
        without, with_ = decisions(name, 0.0), decisions(name, default)
        changed = [n for n in without if n in with_ and without[n].log2_scale != with_[n].log2_scale]
        rates = [(without[n].underflow_rate, with_[n].underflow_rate) for n in changed]
        finite = [(a, b) for a, b in rates if math.isfinite(a) and math.isfinite(b)]
        worst = max(finite, key=lambda r: r[1] - r[0], default=(math.nan, math.nan))
        mean = lambda values: sum(values) / len(values) if values else math.nan  # noqa: E731
        print(
            f"{name}: {len(changed)} of {len(without)} decisions lower with headroom {default}; "
            f"their mean underflow rate {mean([a for a, _ in finite]):.2e} -> {mean([b for _, b in finite]):.2e}, "
            f"worst {worst[0]:.2e} -> {worst[1]:.2e}; over all decisions "
            f"{mean([s.underflow_rate for s in without.values() if math.isfinite(s.underflow_rate)]):.2e} -> "
            f"{mean([s.underflow_rate for s in with_.values() if math.isfinite(s.underflow_rate)]):.2e}"
        )


if __name__ == "__main__":
    main()
