"""PASCAL VOC2007 11-point mean average precision, as the VOC devkit computes it.

Matches ChainerCV's ``eval_detection_voc(..., use_07_metric=True)`` (the evaluation of ChainerCV's
SSD VOC results). torchmetrics' ``MeanAveragePrecision`` is the COCO metric, not this one.

Rules, per class:

* Boxes use the VOC integer-pixel convention: ``(x1, y1, x2, y2)`` are inclusive pixel indices,
  so a box is ``x2 - x1 + 1`` wide (the "+1" convention), for detections and ground truth alike.
* In each image, detections are taken by decreasing score; each is compared with the ground truth
  box of highest IoU in that image (first one on ties) and with no other: no fallback to the
  next-best box when that one is taken.
* IoU >= ``iou_thresh`` (0.5) with a difficult box: ignored (neither TP nor FP). With a
  non-difficult box not yet taken: TP, and the box is taken. Already taken, or IoU below the
  threshold (or no ground truth of the class in the image): FP.
* Over all images, detections sorted by score give precision/recall; AP is the mean over the recall
  thresholds ``t = 0, 0.1, ..., 1`` of the largest precision at recall >= t (0 where none).
  Thresholds are ``k * 0.1`` in float64, exactly as ChainerCV's ``np.arange(0., 1.1, 0.1)``.
* A class with no non-difficult ground truth has AP NaN and is left out of the mean (as
  ChainerCV). A class with ground truth but no detections has AP 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["VOC07MeanAveragePrecision", "voc_box_iou"]


def voc_box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """IoU ``[N, M]`` of XYXY boxes with the VOC "+1" pixel convention (widths = x2 - x1 + 1)."""
    area1 = (boxes1[:, 2] - boxes1[:, 0] + 1) * (boxes1[:, 3] - boxes1[:, 1] + 1)
    area2 = (boxes2[:, 2] - boxes2[:, 0] + 1) * (boxes2[:, 3] - boxes2[:, 1] + 1)
    lt = torch.maximum(boxes1[:, None, :2], boxes2[None, :, :2])
    rb = torch.minimum(boxes1[:, None, 2:], boxes2[None, :, 2:])
    wh = (rb - lt + 1).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    return inter / (area1[:, None] + area2[None, :] - inter)


class VOC07MeanAveragePrecision(Metric):
    """VOC2007 11-point mAP at IoU 0.5 (see the module docstring for the exact rules).

    ``update`` matches each image's detections at once and stores only ``(score, label, match)``
    per detection plus the per-class count of non-difficult ground truth, so ``compute`` works
    the same on one process or after a DDP gather (list states reduced with ``cat``).

    Args:
        num_classes: number of foreground classes; labels are 1..num_classes (0 is background).
        iou_thresh: IoU needed for a match (0.5 in VOC).
        kwargs: passed to ``torchmetrics.Metric`` (e.g. ``dist_sync_on_step``).
    """

    full_state_update = False
    higher_is_better = True
    is_differentiable = False

    def __init__(self, num_classes: int = 20, iou_thresh: float = 0.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.iou_thresh = iou_thresh
        self.add_state("det_scores", default=[], dist_reduce_fx="cat")
        self.add_state("det_labels", default=[], dist_reduce_fx="cat")
        self.add_state("det_matches", default=[], dist_reduce_fx="cat")  # 1 TP, 0 FP, -1 ignored
        self.add_state("gt_counts", default=[], dist_reduce_fx="cat")  # [num_classes] per update

    def _check_labels(self, labels: Tensor, what: str) -> None:
        if labels.numel() and (labels.min() < 1 or labels.max() > self.num_classes):
            raise ValueError(f"{what} labels must be in 1..{self.num_classes}, got {labels.unique().tolist()}")

    def update(self, preds: list[dict[str, Tensor]], targets: list[dict[str, Tensor]]) -> None:
        """Add a batch.

        Args:
            preds: per image ``boxes`` ``[N, 4]`` XYXY, ``scores`` ``[N]``, ``labels`` ``[N]``.
            targets: per image ``boxes`` ``[M, 4]`` XYXY, ``labels`` ``[M]`` and optionally
                ``difficult`` ``[M]`` bool (all False when absent). Same pixel frame as ``preds``.
        """
        if len(preds) != len(targets):
            raise ValueError(f"got {len(preds)} predictions for {len(targets)} targets")
        # Matching is sequential and per image: done on CPU, one state entry per update.
        gt_counts = torch.zeros(self.num_classes, dtype=torch.long)
        all_scores, all_labels, all_matches = [], [], []
        for pred, target in zip(preds, targets):
            p_scores = pred["scores"].detach().cpu().double().reshape(-1)
            p_labels = pred["labels"].detach().cpu().long().reshape(-1)
            g_labels = target["labels"].detach().cpu().long().reshape(-1)
            difficult = target.get("difficult")
            g_difficult = (
                torch.zeros_like(g_labels, dtype=torch.bool)
                if difficult is None
                else difficult.detach().cpu().bool().reshape(-1)
            )
            self._check_labels(p_labels, "predicted")
            self._check_labels(g_labels, "ground-truth")
            gt_counts += torch.bincount(g_labels[~g_difficult] - 1, minlength=self.num_classes)
            matches = self._match_image(
                _boxes(pred["boxes"]), p_scores, p_labels, _boxes(target["boxes"]), g_labels, g_difficult
            )
            all_scores.append(p_scores)
            all_labels.append(p_labels)
            all_matches.append(matches)
        self.det_scores.append(torch.cat(all_scores).to(self.device))
        self.det_labels.append(torch.cat(all_labels).to(self.device))
        self.det_matches.append(torch.cat(all_matches).to(self.device))
        self.gt_counts.append(gt_counts.to(self.device))

    def _match_image(
        self,
        p_boxes: Tensor,
        p_scores: Tensor,
        p_labels: Tensor,
        g_boxes: Tensor,
        g_labels: Tensor,
        g_difficult: Tensor,
    ) -> Tensor:
        """Per detection of one image: 1 TP, 0 FP, -1 ignored (matched a difficult box)."""
        matches = torch.zeros_like(p_labels, dtype=torch.int8)
        for label in p_labels.unique().tolist():
            det_idx = torch.where(p_labels == label)[0]
            det_idx = det_idx[p_scores[det_idx].argsort(descending=True, stable=True)]
            gt_idx = torch.where(g_labels == label)[0]
            if gt_idx.numel() == 0:
                continue  # every detection of this class is a FP
            best_iou, best = voc_box_iou(p_boxes[det_idx], g_boxes[gt_idx]).max(dim=1)  # first max on ties
            is_difficult = g_difficult[gt_idx].tolist()
            taken = [False] * gt_idx.numel()
            for det, ov, g in zip(det_idx.tolist(), best_iou.tolist(), best.tolist()):
                if ov < self.iou_thresh:
                    continue
                if is_difficult[g]:
                    matches[det] = -1
                elif not taken[g]:
                    matches[det] = 1
                    taken[g] = True
        return matches

    def compute(self) -> dict[str, Tensor]:
        """Return ``{"map": scalar, "ap_per_class": [num_classes]}`` (float64; NaN as documented)."""
        scores = _cat(self.det_scores, torch.float64, self.device)
        labels = _cat(self.det_labels, torch.long, self.device)
        matches = _cat(self.det_matches, torch.int8, self.device)
        n_pos = _cat(self.gt_counts, torch.long, self.device).view(-1, self.num_classes).sum(dim=0)

        thresholds = torch.tensor([k * 0.1 for k in range(11)], dtype=torch.float64, device=self.device)
        ap = torch.full((self.num_classes,), float("nan"), dtype=torch.float64, device=self.device)
        for c in range(self.num_classes):
            if n_pos[c] == 0:
                continue
            keep = (labels == c + 1) & (matches >= 0)  # ignored detections change neither TP nor FP
            if not keep.any():
                ap[c] = 0.0
                continue
            order = scores[keep].argsort(descending=True, stable=True)
            match = matches[keep][order]
            tp = torch.cumsum(match == 1, dim=0).double()
            fp = torch.cumsum(match == 0, dim=0).double()
            precision = tp / (tp + fp)
            recall = tp / n_pos[c].double()
            reached = recall[None, :] >= thresholds[:, None]  # [11, D]
            best = torch.where(reached, precision[None, :], torch.zeros_like(precision)[None, :]).amax(dim=1)
            ap[c] = best.sum() / 11
        return {"map": ap.nanmean(), "ap_per_class": ap}


def _boxes(boxes: Tensor) -> Tensor:
    return boxes.detach().as_subclass(Tensor).cpu().double().reshape(-1, 4)


def _cat(state: list[Tensor] | Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    # After a DDP sync a list state is already one tensor; before any update it is an empty list.
    if isinstance(state, Tensor):
        return state.to(dtype)
    return torch.cat(state).to(dtype) if state else torch.zeros(0, dtype=dtype, device=device)
