"""SSD multibox loss (Liu et al., ECCV 2016, Sec. 2.2), computed in fp32.

Matching: each ground-truth box takes its best default box (forced), and every other default
box with IoU >= 0.5 to some ground truth takes the best of them (torchvision's ``SSDMatcher``).
Positives are encoded with variances (0.1, 0.2). The loss is smooth L1 on positives plus
cross-entropy on positives and hard negatives (per image, the ``3 x num_positives`` negatives
with the largest background loss), both divided by the number of positives of the batch
(nothing to divide when there is none: the loss is then 0). As in Caffe SSD and ChainerCV's
``multibox_loss``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models.detection._utils import BoxCoder, SSDMatcher
from torchvision.ops import box_iou

__all__ = ["MultiboxLoss", "hard_negative_mask"]


def hard_negative_mask(background_loss: Tensor, positive: Tensor, neg_pos_ratio: float = 3.0) -> Tensor:
    """Pick the hard negatives of each image.

    Args:
        background_loss: ``[B, A]`` loss of classifying each default box as background.
        positive: ``[B, A]`` bool, default boxes matched to a ground truth.
        neg_pos_ratio: negatives per positive (3 in SSD).

    Returns:
        ``[B, A]`` bool: per image the ``floor(neg_pos_ratio * num_positives)`` non-positive default
        boxes with the largest ``background_loss`` (all of them if there are fewer).
    """
    loss = background_loss.detach().masked_fill(positive, -float("inf"))
    num_pos = positive.sum(dim=1, keepdim=True)
    num_neg = torch.minimum((num_pos * neg_pos_ratio).floor().long(), positive.size(1) - num_pos)
    rank = loss.argsort(dim=1, descending=True).argsort(dim=1)
    return rank < num_neg


class MultiboxLoss(nn.Module):
    """SSD multibox loss: ``loss = loc_loss + conf_loss``, both normalised by the positives.

    Args:
        iou_thresh: IoU from which a default box is matched to a ground truth (0.5).
        neg_pos_ratio: hard negatives per positive (3).
        variances: SSD's box-encoding variances (centre, size).
    """

    def __init__(
        self, iou_thresh: float = 0.5, neg_pos_ratio: float = 3.0, variances: tuple[float, float] = (0.1, 0.2)
    ) -> None:
        super().__init__()
        self.matcher = SSDMatcher(iou_thresh)
        self.neg_pos_ratio = neg_pos_ratio
        v_center, v_size = variances
        self.box_coder = BoxCoder(weights=(1 / v_center, 1 / v_center, 1 / v_size, 1 / v_size))

    @torch.no_grad()
    def match(self, targets: list[dict[str, Tensor]], default_boxes: Tensor) -> tuple[Tensor, Tensor]:
        """Assign ground truth to the default boxes.

        Args:
            targets: per image ``boxes`` ``[N, 4]`` (XYXY, same pixels as ``default_boxes``) and
                ``labels`` ``[N]`` (1..C-1).
            default_boxes: ``[A, 4]`` XYXY.

        Returns:
            ``labels [B, A]`` (0 = background) and encoded ``regression targets [B, A, 4]``
            (meaningful on positives only).
        """
        labels, regression = [], []
        anchors = default_boxes.float()
        for target in targets:
            gt_boxes = target["boxes"].as_subclass(Tensor).to(anchors)
            gt_labels = target["labels"].to(anchors.device, torch.long)
            if gt_boxes.numel() == 0:
                labels.append(torch.zeros(anchors.size(0), dtype=torch.long, device=anchors.device))
                regression.append(torch.zeros_like(anchors))
                continue
            matched = self.matcher(box_iou(gt_boxes, anchors))
            index = matched.clamp(min=0)
            labels.append(torch.where(matched >= 0, gt_labels[index], 0))
            regression.append(self.box_coder.encode_single(gt_boxes[index], anchors))
        return torch.stack(labels), torch.stack(regression)

    def forward(
        self, cls_logits: Tensor, bbox_regression: Tensor, targets: list[dict[str, Tensor]], default_boxes: Tensor
    ) -> dict[str, Tensor]:
        """Compute the loss.

        Args:
            cls_logits: ``[B, A, C]`` class logits (fp16 under autocast; cast to fp32 here).
            bbox_regression: ``[B, A, 4]`` predicted offsets.
            targets: per image ``boxes`` and ``labels`` (see :meth:`match`).
            default_boxes: ``[A, 4]`` XYXY default boxes (``SSDVGG16.default_boxes``).

        Returns:
            ``{"loss", "loc_loss", "conf_loss"}`` scalars (fp32).
        """
        with torch.autocast(device_type=cls_logits.device.type, enabled=False):
            cls_logits = cls_logits.float()
            bbox_regression = bbox_regression.float()
            labels, regression_targets = self.match(targets, default_boxes)
            positive = labels > 0
            num_pos = positive.sum().clamp(min=1)

            loc_loss = F.smooth_l1_loss(
                bbox_regression[positive], regression_targets[positive], reduction="sum", beta=1.0
            )
            # For non-positives the label is 0, so this is their background loss.
            ce = F.cross_entropy(cls_logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
            selected = positive | hard_negative_mask(ce, positive, self.neg_pos_ratio)
            conf_loss = ce[selected].sum()

            loc_loss = loc_loss / num_pos
            conf_loss = conf_loss / num_pos
        return {"loss": loc_loss + conf_loss, "loc_loss": loc_loss, "conf_loss": conf_loss}
