"""Lightning task for semantic segmentation (SegNet on CamVid).

Hyperparameters follow ChainerCV's ``examples/segnet/train.py``
(https://github.com/chainer/chainercv/blob/master/examples/segnet/train.py): MomentumSGD with a
constant lr 0.1, momentum 0.9, weight decay 5e-4 on all parameters, batch 12, median-frequency
class weights and void pixels ignored.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gs_lightning.metrics.segmentation import SegmentationMetrics
from gs_lightning.tasks.sharding import ShardedTask

__all__ = ["SegmentationTask"]


class SegmentationTask(ShardedTask):
    """Train and evaluate a per-pixel classifier with weighted cross-entropy.

    Batches are ``(images [N, 3, H, W], masks [N, H, W] int64)``; uint8 images are cast to the
    model's dtype without rescaling (SegNet takes raw 0..255 values). Logs ``train/loss``,
    ``val/loss``, ``val/miou``, ``val/pixel_accuracy``, ``val/mean_class_accuracy`` and the same
    metrics under ``test/``.

    Args:
        model: network mapping images to logits [N, num_classes, H, W].
        num_classes: number of classes (CamVid: 11).
        ignore_index: target value excluded from loss and metrics (CamVid void: 11).
        class_weights: per-class loss weights [num_classes]; ``"median_frequency"`` takes them
            from the datamodule's ``class_weights`` (median frequency balancing of its training
            split) when fitting starts; None weighs all classes equally. Kept as a buffer, so
            they follow the device and the checkpoint.
        lr: SGD learning rate, constant over training as in ChainerCV.
        momentum: SGD momentum.
        weight_decay: L2 weight decay, applied to every parameter as Chainer's ``WeightDecay`` hook.
    """

    class_weights: Tensor

    def __init__(
        self,
        model: nn.Module,
        num_classes: int = 11,
        ignore_index: int = 11,
        class_weights: Tensor | Literal["median_frequency"] | None = None,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model", "class_weights"])
        self.model = model
        self._weights_from_datamodule = isinstance(class_weights, str)
        if self._weights_from_datamodule and class_weights != "median_frequency":
            raise ValueError(f"class_weights must be a tensor, 'median_frequency' or None, got {class_weights!r}")
        if class_weights is None or self._weights_from_datamodule:
            # All-ones weights give the unweighted loss and keep the checkpoint layout fixed.
            class_weights = torch.ones(num_classes)
        elif class_weights.shape != (num_classes,):
            raise ValueError(f"class_weights must have shape ({num_classes},), got {tuple(class_weights.shape)}")
        self.register_buffer("class_weights", class_weights.detach().clone().float())
        self.val_metrics = SegmentationMetrics(num_classes, ignore_index)
        self.test_metrics = SegmentationMetrics(num_classes, ignore_index)

    def setup(self, stage: str) -> None:
        """Take median-frequency class weights from the datamodule when asked to."""
        if self._weights_from_datamodule and stage == "fit":
            self.class_weights.copy_(self.trainer.datamodule.class_weights)

    def forward(self, images: Tensor) -> Tensor:
        """Logits [N, num_classes, H, W] of a batch of images."""
        if not images.is_floating_point():
            images = images.to(next(self.model.parameters()).dtype)
        return self.model(images)

    def _loss(self, logits: Tensor, masks: Tensor) -> Tensor:
        # cross_entropy runs in float32 under autocast, even for fp16 logits.
        return F.cross_entropy(logits, masks, weight=self.class_weights, ignore_index=self.hparams.ignore_index)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Weighted cross-entropy of one batch."""
        images, masks = batch
        loss = self._loss(self(images), masks)
        self.log("train/loss", loss, prog_bar=True, batch_size=images.size(0))
        return loss

    def _evaluate(self, batch: tuple[Tensor, Tensor], metrics: SegmentationMetrics, prefix: str) -> None:
        images, masks = batch
        logits = self(images)
        self.log(f"{prefix}/loss", self._loss(logits, masks), sync_dist=True, batch_size=images.size(0))
        metrics.update(logits.argmax(dim=1), masks)

    def _log_metrics(self, metrics: SegmentationMetrics, prefix: str) -> None:
        # compute() already sums the confusion matrices of all processes.
        self.log_dict({f"{prefix}/{name}": value for name, value in metrics.compute().items()})
        metrics.reset()

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """Accumulate validation loss and confusion matrix."""
        self._evaluate(batch, self.val_metrics, "val")

    def on_validation_epoch_end(self) -> None:
        self._log_metrics(self.val_metrics, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """Accumulate test loss and confusion matrix."""
        self._evaluate(batch, self.test_metrics, "test")

    def on_test_epoch_end(self) -> None:
        self._log_metrics(self.test_metrics, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD with momentum and weight decay at a constant learning rate."""
        return torch.optim.SGD(
            self.parameters(),
            lr=self.hparams.lr,
            momentum=self.hparams.momentum,
            weight_decay=self.hparams.weight_decay,
        )
