"""Lightning task for SSD on PASCAL VOC: multibox loss, SGD + step decay, VOC07 11-point mAP.

Hyperparameters follow the original SSD (Liu et al., ECCV 2016, Sec. 3.1: VOC2007+2012 trainval,
SGD lr 1e-3, momentum 0.9, weight decay 5e-4, batch 32 (the gradient-scaling paper also uses 8),
lr x0.1 after 80k and 100k of 120k iterations) and ChainerCV's ``examples/ssd/train.py``
(https://github.com/chainer/chainercv/blob/master/examples/ssd/train.py), including its bias rule:
biases get twice the learning rate and no weight decay (Caffe's ``lr_mult: 2, decay_mult: 0``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gs_lightning.metrics.voc_map import VOC07MeanAveragePrecision
from gs_lightning.models.multibox import MultiboxLoss
from gs_lightning.tasks.sharding import ShardedTask

__all__ = ["DetectionTask"]


class DetectionTask(ShardedTask):
    """Train and evaluate an SSD detector (e.g. :func:`gs_lightning.models.ssd.build_ssd`).

    The model must return ``(cls_logits, bbox_regression)`` in training mode and per-image
    detections (``boxes`` in input pixels, ``scores``, ``labels``) in eval mode, and expose
    ``default_boxes`` ``[A, 4]``. Batches are ``(images [B, 3, S, S], targets)`` as built by
    :class:`gs_lightning.data.voc.VOCDataModule`. For evaluation, detections and ground truth are
    mapped back to each image's ``orig_size`` before the VOC07 metric, as ChainerCV evaluates in
    original image coordinates.

    Logs ``train/loss``, ``train/loc_loss``, ``train/conf_loss``, ``val/map`` and ``test/map``.

    Args:
        model: the SSD network.
        num_classes: classes including background (21 for VOC).
        lr: base learning rate (1e-3).
        momentum: SGD momentum (0.9).
        weight_decay: L2 weight decay of the weights (5e-4); biases get none.
        milestones: optimizer steps after which the lr is multiplied by ``gamma`` (80k, 100k).
        gamma: lr decay factor (0.1).
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int = 21,
        lr: float = 1e-3,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        milestones: Sequence[int] = (80000, 100000),
        gamma: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"])
        self.model = model
        self.loss_fn = MultiboxLoss()
        self.val_map = VOC07MeanAveragePrecision(num_classes=num_classes - 1)
        self.test_map = VOC07MeanAveragePrecision(num_classes=num_classes - 1)

    def forward(self, images: Tensor) -> Any:
        """Run the wrapped model."""
        return self.model(images)

    def training_step(self, batch: tuple[Tensor, list[dict[str, Tensor]]], batch_idx: int) -> Tensor:
        """Multibox loss of one batch."""
        images, targets = batch
        cls_logits, bbox_regression = self.model(images)
        losses = self.loss_fn(cls_logits, bbox_regression, targets, self.model.default_boxes)
        batch_size = images.size(0)
        self.log("train/loss", losses["loss"], prog_bar=True, batch_size=batch_size)
        self.log("train/loc_loss", losses["loc_loss"], batch_size=batch_size)
        self.log("train/conf_loss", losses["conf_loss"], batch_size=batch_size)
        return losses["loss"]

    def _evaluate(self, batch: tuple[Tensor, list[dict[str, Tensor]]], metric: VOC07MeanAveragePrecision) -> None:
        images, targets = batch
        detections = self.model(images)
        in_h, in_w = images.shape[-2:]
        preds, gts = [], []
        for det, target in zip(detections, targets):
            orig_h, orig_w = target["orig_size"].tolist()
            scale = torch.tensor([orig_w / in_w, orig_h / in_h] * 2, device=images.device)
            preds.append({**det, "boxes": det["boxes"] * scale})
            gts.append(
                {
                    "boxes": target["boxes"].as_subclass(Tensor) * scale,
                    "labels": target["labels"],
                    "difficult": target["difficult"],
                }
            )
        metric.update(preds, gts)

    def validation_step(self, batch: tuple[Tensor, list[dict[str, Tensor]]], batch_idx: int) -> None:
        """Accumulate detections for the VOC07 mAP."""
        self._evaluate(batch, self.val_map)

    def on_validation_epoch_end(self) -> None:
        """Log ``val/map`` and reset the metric."""
        self.log("val/map", self.val_map.compute()["map"].float(), prog_bar=True)
        self.val_map.reset()

    def test_step(self, batch: tuple[Tensor, list[dict[str, Tensor]]], batch_idx: int) -> None:
        """Accumulate detections for the VOC07 mAP."""
        self._evaluate(batch, self.test_map)

    def on_test_epoch_end(self) -> None:
        """Log ``test/map`` and reset the metric."""
        self.log("test/map", self.test_map.compute()["map"].float())
        self.test_map.reset()

    def configure_optimizers(self) -> dict[str, Any]:
        """SGD (biases: 2x lr, no decay) with MultiStepLR stepped every optimizer step."""
        hp = self.hparams
        weights, biases = [], []
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                (biases if name.endswith(".bias") else weights).append(param)
        optimizer = torch.optim.SGD(
            [
                {"params": weights, "weight_decay": hp.weight_decay},
                {"params": biases, "lr": 2 * hp.lr, "weight_decay": 0.0},
            ],
            lr=hp.lr,
            momentum=hp.momentum,
        )
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(hp.milestones), gamma=hp.gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
