"""SegmentationTask and ClassificationTask: fast_dev_run fits and tests, loss, lr schedule, weight decay."""

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch import nn

from gs_lightning.data.camvid import CamVidDataModule
from gs_lightning.data.imagenet import ImageNetDataModule
from gs_lightning.models.resnet import build_resnet
from gs_lightning.models.segnet import SegNetBasic
from gs_lightning.tasks.classification import (
    ClassificationTask,
    WarmupMultiStepLambda,
    weight_decay_param_groups,
)
from gs_lightning.tasks.segmentation import SegmentationTask


def _trainer() -> L.Trainer:
    return L.Trainer(
        fast_dev_run=True,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )


def _tiny_classifier(num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, num_classes),
    )


def test_segmentation_fast_dev_run(tmp_path: Path) -> None:
    synthetic = {"n_train": 2, "n_val": 2, "n_test": 2, "size": (24, 32)}
    dm = CamVidDataModule(tmp_path / "camvid", batch_size=2, num_workers=0, synthetic=synthetic)
    task = SegmentationTask(SegNetBasic(num_classes=11, width=8), class_weights=dm.class_weights)
    trainer = _trainer()
    trainer.fit(task, datamodule=dm)
    metrics = trainer.callback_metrics
    for name in ("train/loss", "val/loss", "val/miou", "val/pixel_accuracy", "val/mean_class_accuracy"):
        assert torch.isfinite(metrics[name]), name
    trainer.test(task, datamodule=dm)
    for name in ("test/miou", "test/pixel_accuracy", "test/mean_class_accuracy"):
        assert 0 <= trainer.callback_metrics[name] <= 1, name
    assert torch.equal(task.state_dict()["class_weights"], dm.class_weights)
    assert "class_weights" not in task.hparams and "model" not in task.hparams


def test_segmentation_loss_is_weighted_and_ignores_void() -> None:
    weights = torch.tensor([1.0, 3.0])
    task = SegmentationTask(nn.Identity(), num_classes=2, ignore_index=11, class_weights=weights)
    logits = torch.randn(1, 2, 2, 2)
    masks = torch.tensor([[[0, 1], [11, 11]]])
    expected = nn.functional.cross_entropy(logits[..., 0, :], masks[..., 0, :], weight=weights)
    torch.testing.assert_close(task._loss(logits, masks), expected)
    changed = logits.clone()
    changed[..., 1, :] = 100.0
    torch.testing.assert_close(task._loss(changed, masks), expected)


def test_segmentation_task_checks_weight_shape_and_uses_constant_lr_sgd() -> None:
    with pytest.raises(ValueError, match=r"shape \(11,\)"):
        SegmentationTask(nn.Identity(), class_weights=torch.ones(12))
    task = SegmentationTask(nn.Conv2d(3, 11, 1))
    optimizer = task.configure_optimizers()
    assert isinstance(optimizer, torch.optim.SGD)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.1, 0.9, 5e-4)
    torch.testing.assert_close(task.class_weights, torch.ones(11))


def test_classification_fast_dev_run(tmp_path: Path) -> None:
    synthetic = {"num_classes": 3, "n_train_per_class": 2, "n_val_per_class": 2, "size": (20, 20)}
    dm = ImageNetDataModule(
        tmp_path / "imagenet", batch_size=4, num_workers=0, image_size=16, val_resize=18, synthetic=synthetic
    )
    task = ClassificationTask(_tiny_classifier(dm.num_classes), num_classes=dm.num_classes, batch_size=4)
    trainer = _trainer()
    trainer.fit(task, datamodule=dm)
    metrics = trainer.callback_metrics
    for name in ("train/loss", "val/loss", "val/top1", "val/top5"):
        assert torch.isfinite(metrics[name]), name
    assert metrics["val/top5"] == 1.0, "top-5 clamped to top-3 of 3 classes always hits"
    (tested,) = trainer.test(task, datamodule=dm, verbose=False)  # ImageNet's test split: its val images
    assert sorted(tested) == ["test/loss", "test/top1", "test/top5"] and tested["test/top5"] == 1.0


def test_warmup_multistep_lambda() -> None:
    schedule = WarmupMultiStepLambda(steps_per_epoch=10, warmup_epochs=5, milestones=(30, 60, 80), gamma=0.1)
    assert schedule(0) == pytest.approx(1 / 50)
    assert schedule(24) == pytest.approx(25 / 50)
    assert schedule(49) == pytest.approx(1.0)
    assert schedule(50) == schedule(299) == 1.0
    assert schedule(300) == pytest.approx(0.1)
    assert schedule(600) == pytest.approx(0.01)
    assert schedule(899) == pytest.approx(0.001)
    assert WarmupMultiStepLambda(10, 0, (30,), 0.1)(0) == 1.0


def test_classification_lr_scaling_and_schedule() -> None:
    task = ClassificationTask(_tiny_classifier(4), num_classes=4, base_lr=0.1, batch_size=64)
    # 2 devices x 4 accumulation x 64 = global batch 512 -> lr 0.2; 900 steps / 90 epochs = 10 per epoch.
    task.trainer = SimpleNamespace(world_size=2, accumulate_grad_batches=4, estimated_stepping_batches=900)
    config = task.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert config["lr_scheduler"]["interval"] == "step"
    assert optimizer.param_groups[0]["initial_lr"] == pytest.approx(0.2)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2 / 50)
    for _ in range(50):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    for _ in range(250):
        optimizer.step()
        scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.02, 0.02])


def test_weight_decay_only_on_conv_and_linear_weights() -> None:
    model = _tiny_classifier(4)
    decay, no_decay = weight_decay_param_groups(model, 1e-4)
    assert decay["weight_decay"] == 1e-4 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[5].weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model[1].weight), id(model[1].bias), id(model[5].bias)}
    resnet = build_resnet("resnet18", num_classes=10)
    decay, no_decay = weight_decay_param_groups(resnet, 1e-4)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(resnet.parameters()))
    assert all(p.ndim > 1 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])


def test_build_resnet() -> None:
    resnet18 = build_resnet("resnet18", num_classes=10)
    assert resnet18.fc.out_features == 10
    assert all((block.bn2.weight == 0).all() for block in resnet18.layer1)
    resnet50 = build_resnet("resnet50")
    assert resnet50.fc.out_features == 1000 and (resnet50.layer4[2].bn3.weight == 0).all()
    assert (build_resnet("resnet18", zero_init_residual=False).layer1[0].bn2.weight == 1).all()
    with pytest.raises(ValueError, match=r"\['resnet18', 'resnet50'\]"):
        build_resnet("resnet1000")
