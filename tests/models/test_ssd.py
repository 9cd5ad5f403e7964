"""SSD300/SSD512 model, multibox loss and the Lightning detection task (tiny widths, CPU)."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from gs_lightning.data.voc import VOCDataModule
from gs_lightning.models.multibox import MultiboxLoss, hard_negative_mask
from gs_lightning.models.ssd import L2Norm, build_ssd
from gs_lightning.tasks.detection import DetectionTask


@pytest.mark.parametrize(
    ("size", "grids", "num_boxes"),
    [(300, [38, 19, 10, 5, 3, 1], 8732), (512, [64, 32, 16, 8, 4, 2, 1], 24564)],
)
def test_default_boxes_and_grids(size: int, grids: list[int], num_boxes: int) -> None:
    torch.manual_seed(0)
    model = build_ssd(size, num_classes=21, width_mult=1 / 16)
    assert model.default_boxes.shape == (num_boxes, 4)
    with torch.no_grad():
        features = model.backbone(torch.zeros(1, 3, size, size))
        out = model.head(features)
    cls_logits, bbox_regression = out["cls_logits"], out["bbox_regression"]
    assert [f.shape[-1] for f in features] == grids
    assert [f.shape[-2] for f in features] == grids
    assert cls_logits.shape == (1, num_boxes, 21) and bbox_regression.shape == (1, num_boxes, 4)

    detections = model.postprocess(cls_logits, bbox_regression)
    assert len(detections) == 1 and set(detections[0]) == {"boxes", "scores", "labels"}
    det = detections[0]
    assert 0 < det["boxes"].shape[0] <= 200
    assert det["boxes"].min() >= 0 and det["boxes"].max() <= size
    assert (det["scores"] > 0.01).all() and det["labels"].min() >= 1 and det["labels"].max() <= 20


def test_default_boxes_match_original_ssd300() -> None:
    boxes = build_ssd(300, width_mult=1 / 32).default_boxes
    # First location of conv4_3 (step 8, centre 4): min size 30, sqrt(30 * 60), then ratio 2 and 1/2.
    s, sp = 30.0, math.sqrt(30 * 60)
    w2, h2 = 30 * math.sqrt(2), 30 / math.sqrt(2)
    expected = torch.tensor(
        [
            [4 - s / 2, 4 - s / 2, 4 + s / 2, 4 + s / 2],
            [4 - sp / 2, 4 - sp / 2, 4 + sp / 2, 4 + sp / 2],
            [4 - w2 / 2, 4 - h2 / 2, 4 + w2 / 2, 4 + h2 / 2],
            [4 - h2 / 2, 4 - w2 / 2, 4 + h2 / 2, 4 + w2 / 2],
        ]
    )
    torch.testing.assert_close(boxes[:4], expected)
    # Last box: the 1x1 map (step 300, centre 150), ratio 1/2 of min size 264, not clipped.
    w, h = 264 / math.sqrt(2), 264 * math.sqrt(2)
    torch.testing.assert_close(boxes[-1], torch.tensor([150 - w / 2, 150 - h / 2, 150 + w / 2, 150 + h / 2]))


def test_forward_train_and_eval_outputs() -> None:
    model = build_ssd(300, num_classes=5, width_mult=1 / 32)
    images = torch.randn(2, 3, 300, 300)
    with torch.no_grad():
        cls_logits, bbox_regression = model.train()(images)
        assert cls_logits.shape == (2, 8732, 5) and bbox_regression.shape == (2, 8732, 4)
        detections = model.eval()(images)
    assert len(detections) == 2
    with pytest.raises(ValueError, match=r"\[B, 3, 300, 300\]"):
        model(torch.zeros(1, 3, 320, 320))


def test_pretrained_missing_file_says_where_to_put_it(tmp_path) -> None:
    old_dir = torch.hub.get_dir()
    torch.hub.set_dir(str(tmp_path / "hub"))
    try:
        with pytest.raises(FileNotFoundError) as info:
            build_ssd(300, pretrained=True)
    finally:
        torch.hub.set_dir(old_dir)
    message = str(info.value)
    assert str(tmp_path / "hub" / "checkpoints" / "vgg16_features-amdegroot-88682ab5.pth") in message
    assert "https://download.pytorch.org/models/vgg16_features-amdegroot-88682ab5.pth" in message
    with pytest.raises(FileNotFoundError, match="nowhere.pth"):
        build_ssd(300, pretrained=tmp_path / "nowhere.pth")
    with pytest.raises(ValueError, match="width_mult"):
        build_ssd(300, pretrained=tmp_path / "nowhere.pth", width_mult=0.5)


def test_vgg16_state_dict_maps_to_backbone() -> None:
    source = build_ssd(300, width_mult=1 / 32).backbone
    target = build_ssd(300, width_mult=1 / 32).backbone
    layers = list(source.conv4_3) + list(source.conv5_3)
    # torchvision vgg16 key layout: features.<index in vgg16().features>.weight
    state = {f"features.{i}.{k}": v for i, m in enumerate(layers) for k, v in m.state_dict().items()}
    state["classifier.0.weight"] = torch.full((2, 2), float("nan"))  # ignored, as in IMAGENET1K_FEATURES
    assert len(state) == 2 * 13 + 1
    target.load_vgg16_state_dict(state)
    torch.testing.assert_close(target.conv5_3[-2].weight, source.conv5_3[-2].weight)  # conv5_3
    torch.testing.assert_close(target.conv4_3[0].bias, source.conv4_3[0].bias)  # conv1_1
    del state["features.28.weight"]
    with pytest.raises(ValueError, match="features.28.weight"):
        target.load_vgg16_state_dict(state)


def test_l2norm_is_fp32_inside() -> None:
    # Sum of squares 512 * 300^2 = 4.6e7 overflows fp16 (max 65504).
    x = torch.full((1, 512, 2, 2), 300.0, dtype=torch.float16)
    out = L2Norm(512)(x)
    assert out.dtype == torch.float16
    expected = torch.full(out.shape, 20 / math.sqrt(512))
    torch.testing.assert_close(out.float(), expected, rtol=1e-3, atol=0)  # fp16 output rounding


# --- multibox loss ---------------------------------------------------------------------------

# One positive default box (index 0, IoU 100/120 with the ground truth) and 7 far away negatives.
_ANCHORS = torch.tensor([[0.0, 0.0, 10.0, 10.0]] + [[20.0 + 12 * k, 0.0, 30.0 + 12 * k, 10.0] for k in range(7)])
_GT = {"boxes": torch.tensor([[0.0, 0.0, 12.0, 10.0]]), "labels": torch.tensor([2])}
_BG_LOGITS = [0.0, 2.0, -1.0, 0.5, -2.0, 1.0, 0.0, -0.5]  # smallest -> largest background loss: 4, 2, 7


def _logits() -> torch.Tensor:
    logits = torch.zeros(8, 3)
    logits[:, 0] = torch.tensor(_BG_LOGITS)
    logits[0] = torch.tensor([0.0, 0.0, 1.0])
    return logits


def test_multibox_loss_hand_case() -> None:
    regression = torch.zeros(2, 8, 4)
    regression[0, 0] = torch.tensor([0.5, 0.0, 0.0, 0.0])
    regression[1] = 7.0  # image without ground truth: no positives, no negatives
    logits = torch.stack([_logits(), torch.full((8, 3), 5.0) * torch.tensor([-1.0, 1.0, 1.0])])
    losses = MultiboxLoss()(logits, regression, [_GT, {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0)}], _ANCHORS)

    # Target of the positive with variances (0.1, 0.2): dx = (6 - 5) / (10 * 0.1), dw = log(12 / 10) / 0.2.
    dx, dw = 1.0, math.log(1.2) / 0.2
    smooth_l1 = 0.5 * (0.5 - dx) ** 2 + 0.5 * dw**2  # both |differences| < 1: quadratic branch
    positive_ce = math.log(2 + math.e) - 1.0
    background = [math.log(math.exp(b) + 2) - b for b in _BG_LOGITS]
    hard = background[4] + background[2] + background[7]  # the 3 = 3 x 1 largest
    torch.testing.assert_close(losses["loc_loss"], torch.tensor(smooth_l1))
    torch.testing.assert_close(losses["conf_loss"], torch.tensor(positive_ce + hard))
    torch.testing.assert_close(losses["loss"], losses["loc_loss"] + losses["conf_loss"])


def test_multibox_loss_normalised_by_positives_and_fp32() -> None:
    regression = torch.zeros(1, 8, 4)
    single = MultiboxLoss()(_logits()[None], regression, [_GT], _ANCHORS)
    # Two identical images: sums double, so do the positives.
    double = MultiboxLoss()(_logits()[None].repeat(2, 1, 1).half(), regression.repeat(2, 1, 1), [_GT, _GT], _ANCHORS)
    assert double["loss"].dtype == torch.float32
    torch.testing.assert_close(double["loss"], single["loss"], rtol=1e-3, atol=1e-3)  # fp16 logits rounding


def test_multibox_loss_without_positives_is_zero() -> None:
    logits = torch.randn(2, 8, 3, requires_grad=True)
    empty = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)}
    losses = MultiboxLoss()(logits, torch.zeros(2, 8, 4), [empty, empty], _ANCHORS)
    assert losses["loss"].item() == 0.0
    losses["loss"].backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_hard_negative_mask_per_image() -> None:
    background = torch.tensor([[5.0, 1.0, 4.0, 3.0, 2.0, 0.5, 6.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]])
    positive = torch.tensor([[True, False, False, False, False, False, False], [False] * 5 + [True, True]])
    mask = hard_negative_mask(background, positive, 3.0)
    # Image 0: 1 positive -> 3 negatives with the largest loss, the positive (5.0) excluded.
    assert mask[0].nonzero().flatten().tolist() == [2, 3, 6]
    # Image 1: 2 positives -> 6 wanted, only 5 negatives exist.
    assert mask[1].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert not (mask & positive).any()


def test_multibox_matching_forces_best_default_box() -> None:
    # A ground truth with IoU < 0.5 everywhere still gets its best default box.
    gt = {"boxes": torch.tensor([[0.0, 0.0, 4.0, 10.0]]), "labels": torch.tensor([1])}
    labels, _ = MultiboxLoss().match([gt], _ANCHORS)
    assert labels[0].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]


def test_loss_is_fp32_under_autocast() -> None:
    torch.manual_seed(0)
    model = build_ssd(300, width_mult=1 / 32)
    targets = [{"boxes": torch.tensor([[30.0, 40.0, 150.0, 200.0]]), "labels": torch.tensor([7])}]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cls_logits, bbox_regression = model(torch.randn(1, 3, 300, 300))
        losses = MultiboxLoss()(cls_logits, bbox_regression, targets, model.default_boxes)
    assert cls_logits.dtype == torch.bfloat16
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in losses.values())
    losses["loss"].backward()
    assert torch.isfinite(model.backbone.l2norm.weight.grad).all()


# --- Lightning task --------------------------------------------------------------------------


def test_detection_task_fast_dev_run(tmp_path) -> None:
    torch.manual_seed(0)
    data = VOCDataModule(
        tmp_path, size=300, batch_size=2, num_workers=0, synthetic={"n_trainval": 2, "n_test": 2, "size": (48, 64)}
    )
    task = DetectionTask(build_ssd(300, num_classes=21, width_mult=1 / 32), milestones=(1,))
    trainer = L.Trainer(
        fast_dev_run=True, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(task, datamodule=data)
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"])
    assert {"train/loc_loss", "train/conf_loss", "val/map"} <= set(metrics)
    assert 0.0 <= metrics["val/map"] <= 1.0
    # lr x0.1 after the first optimizer step (interval "step"); biases at 2x lr.
    optimizer = task.optimizers().optimizer
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-4, 2e-4])
    trainer.test(task, datamodule=data)
    assert "test/map" in trainer.callback_metrics
