"""Semantic segmentation scores from an accumulated confusion matrix."""

from __future__ import annotations

import torch
from torchmetrics import Metric


class SegmentationMetrics(Metric):
    """Mean IoU, pixel accuracy and mean class accuracy, as ChainerCV's
    ``eval_semantic_segmentation`` (the evaluation of the SegNet CamVid experiments).

    A ``num_classes x num_classes`` confusion matrix (rows: target, columns: prediction) is
    summed over batches and, under DDP, over processes. From it:

    - IoU(c) = TP / (TP + FP + FN); ``miou`` averages over classes present in the target
      or the prediction (others are 0/0 and excluded).
    - ``pixel_accuracy`` = correct pixels / labelled pixels.
    - accuracy(c) = TP / (TP + FN); ``mean_class_accuracy`` averages over classes present in
      the target (recall is undefined for the others).

    Pixels whose target is ``ignore_index`` are left out entirely.

    Args:
        num_classes: number of classes.
        ignore_index: target value to skip (e.g. CamVid void, 11), or None.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    confmat: torch.Tensor

    def __init__(self, num_classes: int, ignore_index: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.add_state("confmat", default=torch.zeros(num_classes, num_classes, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Add a batch.

        Args:
            preds: class indices [N, H, W] or logits/scores [N, C, H, W] (argmax over C).
            target: class indices [N, H, W].
        """
        if preds.ndim == target.ndim + 1:
            preds = preds.argmax(dim=1)
        if preds.shape != target.shape:
            raise ValueError(f"preds {tuple(preds.shape)} and target {tuple(target.shape)} shapes differ")
        preds, target = preds.flatten(), target.flatten()
        if self.ignore_index is not None:
            keep = target != self.ignore_index
            preds, target = preds[keep], target[keep]
        if target.numel() == 0:
            return
        for name, values in (("target", target), ("preds", preds)):
            if values.min() < 0 or values.max() >= self.num_classes:
                raise ValueError(
                    f"{name} holds class indices outside [0, {self.num_classes}) (ignore_index={self.ignore_index})"
                )
        pairs = target.long() * self.num_classes + preds.long()
        counts = torch.bincount(pairs, minlength=self.num_classes**2)
        self.confmat += counts.reshape(self.num_classes, self.num_classes)

    def compute(self) -> dict[str, torch.Tensor]:
        """``{"miou", "pixel_accuracy", "mean_class_accuracy"}`` as float32 scalars (nan if no pixels)."""
        confmat = self.confmat.double()
        tp = confmat.diagonal()
        per_target, per_pred = confmat.sum(dim=1), confmat.sum(dim=0)
        iou = tp / (per_target + per_pred - tp)
        class_accuracy = tp / per_target
        return {
            "miou": iou.nanmean().float(),
            "pixel_accuracy": (tp.sum() / confmat.sum()).float(),
            "mean_class_accuracy": class_accuracy.nanmean().float(),
        }
