"""Skipped steps on SSD300 with and without the overflow bound on weight gradients.

The paper's model bounds the gradient a GEMM sends on (∇X) but not the weight gradient it
computes in fp16, a sum over batch × positions. This trains a narrow SSD300 on generated VOC
data for a few steps with every iteration an update, once with the bound and once without
(``ScalingRecipe.weight_grad_bounds``), and prints how many steps each lost to non-finite gradients.

    python bench/weight_grad_overflow.py --steps 12
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from gs_lightning import GradientScaler
from gs_lightning.data.voc import VOCDataModule
from gs_lightning.models import MultiboxLoss, build_ssd


def skipped_steps(steps: int, data_root: str, weight_grad_bounds: bool) -> int:
    torch.manual_seed(0)
    datamodule = VOCDataModule(
        data_root,
        size=300,
        batch_size=4,
        num_workers=0,
        synthetic={"years": ["2007"], "n_trainval": 32, "n_test": 8, "size": [96, 128], "seed": 0},
    )
    datamodule.prepare_data()
    datamodule.setup("fit")
    model = build_ssd(300, 21, width_mult=1 / 16).train()
    criterion = MultiboxLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scaler = GradientScaler(model, update_interval=1, weight_grad_bounds=weight_grad_bounds)
    batches = iter(datamodule.train_dataloader())
    for _ in range(steps):
        images, targets = next(batches, None) or next(batches := iter(datamodule.train_dataloader()))
        with torch.autocast("cpu", dtype=torch.float16):
            cls_logits, bbox_regression = model(images)
        scaler.backward(criterion(cls_logits, bbox_regression, targets, model.default_boxes)["loss"])
        scaler.step(optimizer)
        optimizer.zero_grad()
    return scaler.skipped_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        with_bound = skipped_steps(args.steps, root, weight_grad_bounds=True)
        without_bound = skipped_steps(args.steps, root, weight_grad_bounds=False)
    print("| weight-gradient bound | skipped steps |\n|---|---|")
    print(
        f"| on (default) | {with_bound} / {args.steps} |\n| off (the paper's model) | {without_bound} / {args.steps} |"
    )


if __name__ == "__main__":
    main()
