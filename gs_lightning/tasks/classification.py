"""Lightning task for ImageNet classification with the Goyal et al. large-minibatch recipe.

Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (2017): learning
rate ``base_lr * global_batch / 256``, linear warmup over the first 5 epochs, x0.1 at epochs
30, 60 and 80 of 90, SGD momentum 0.9, weight decay 1e-4 (not on BatchNorm parameters; here
not on biases either). PyTorch's SGD applies the lr outside the momentum buffer, so no
momentum correction is needed when the lr changes (Goyal et al., Sec. 2.2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from gs_lightning.tasks.sharding import ShardedTask

__all__ = ["ClassificationTask", "WarmupMultiStepLambda", "weight_decay_param_groups"]


@dataclass(frozen=True)
class WarmupMultiStepLambda:
    """Learning-rate factor of optimizer step ``step`` (for ``torch.optim.lr_scheduler.LambdaLR``).

    Rises linearly from ``1 / warmup_steps`` to 1 over the first ``warmup_epochs`` epochs, and is
    multiplied by ``gamma`` once the (fractional) epoch reaches each milestone. A dataclass, so
    ``LambdaLR.state_dict`` checkpoints its fields.

    Attributes:
        steps_per_epoch: optimizer steps per epoch (may be fractional).
        warmup_epochs: length of the linear warmup in epochs (0 disables it).
        milestones: epochs at which the factor is multiplied by ``gamma``.
        gamma: decay factor.
    """

    steps_per_epoch: float
    warmup_epochs: float
    milestones: tuple[float, ...]
    gamma: float

    def __call__(self, step: int) -> float:
        epoch = step / self.steps_per_epoch
        factor = self.gamma ** sum(epoch >= m for m in self.milestones)
        warmup_steps = self.warmup_epochs * self.steps_per_epoch
        if step < warmup_steps:
            factor *= min(1.0, (step + 1) / warmup_steps)
        return factor


def weight_decay_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two SGD parameter groups: conv/linear weights with ``weight_decay``, all else without.

    Everything else means BatchNorm gammas/betas and every bias.
    """
    decay: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, (nn.modules.conv._ConvNd, nn.Linear)):
            decay[id(module.weight)] = module.weight
    no_decay = [p for p in model.parameters() if id(p) not in decay]
    return [
        {"params": list(decay.values()), "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class ClassificationTask(ShardedTask):
    """Train and evaluate an image classifier (e.g. :func:`gs_lightning.models.resnet.build_resnet`).

    Batches are ``(images [N, 3, H, W] float, labels [N] int64)``. Logs ``train/loss``,
    ``val/loss``, ``val/top1`` and ``val/top5`` (top-k clamped to ``num_classes``), and the same
    under ``test/`` in ``trainer.test``.

    The schedule is defined in epochs but stepped every optimizer step: steps per epoch =
    ``trainer.estimated_stepping_batches / max_epochs``, so a run cut short with
    ``Trainer(max_steps=...)`` gets the whole schedule compressed into its length.

    Args:
        model: network mapping images to logits [N, num_classes].
        num_classes: number of classes.
        base_lr: learning rate for a global batch of ``reference_batch_size``.
        reference_batch_size: batch size at which ``base_lr`` applies (256).
        batch_size: per-device batch size; global batch = batch_size x devices x accumulation.
        momentum: SGD momentum.
        weight_decay: L2 weight decay of conv/linear weights.
        warmup_epochs: linear warmup length in epochs.
        milestones: epochs after which the lr is multiplied by ``gamma``.
        gamma: lr decay factor.
        max_epochs: training length in epochs that the schedule refers to.
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        base_lr: float = 0.1,
        reference_batch_size: int = 256,
        batch_size: int = 256,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        warmup_epochs: float = 5,
        milestones: Sequence[float] = (30, 60, 80),
        gamma: float = 0.1,
        max_epochs: int = 90,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"])
        self.model = model
        self.val_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_top5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")
        self.test_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.test_top5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")

    def forward(self, images: Tensor) -> Tensor:
        """Logits [N, num_classes] of a batch of images."""
        return self.model(images)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Cross-entropy of one batch."""
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train/loss", loss, prog_bar=True, batch_size=images.size(0))
        return loss

    def _evaluate(
        self, batch: tuple[Tensor, Tensor], prefix: str, top1: MulticlassAccuracy, top5: MulticlassAccuracy
    ) -> None:
        images, labels = batch
        logits = self(images)
        batch_size = images.size(0)
        self.log(f"{prefix}/loss", F.cross_entropy(logits, labels), sync_dist=True, batch_size=batch_size)
        top1(logits, labels)
        top5(logits, labels)
        self.log(f"{prefix}/top1", top1, prog_bar=prefix == "val", batch_size=batch_size)
        self.log(f"{prefix}/top5", top5, batch_size=batch_size)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """Loss and top-1/top-5 accuracy, aggregated over the epoch."""
        self._evaluate(batch, "val", self.val_top1, self.val_top5)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """As :meth:`validation_step`, logged under ``test/`` (for ImageNet on the validation images)."""
        self._evaluate(batch, "test", self.test_top1, self.test_top5)

    def scaled_lr(self) -> float:
        """``base_lr * global_batch / reference_batch_size`` for the attached trainer."""
        trainer = self.trainer
        global_batch = self.hparams.batch_size * trainer.world_size * trainer.accumulate_grad_batches
        return self.hparams.base_lr * global_batch / self.hparams.reference_batch_size

    def configure_optimizers(self) -> dict:
        """SGD over two weight-decay groups, with a per-step warmup + multi-step LambdaLR."""
        total_steps = self.trainer.estimated_stepping_batches
        if not math.isfinite(total_steps):
            raise ValueError("ClassificationTask needs a finite run: set Trainer(max_epochs=...) or max_steps")
        optimizer = torch.optim.SGD(
            weight_decay_param_groups(self.model, self.hparams.weight_decay),
            lr=self.scaled_lr(),
            momentum=self.hparams.momentum,
        )
        schedule = WarmupMultiStepLambda(
            steps_per_epoch=max(total_steps, 1) / self.hparams.max_epochs,
            warmup_epochs=self.hparams.warmup_epochs,
            milestones=tuple(self.hparams.milestones),
            gamma=self.hparams.gamma,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
