"""SegmentationMetrics on hand-worked confusion matrices."""

import math

import pytest
import torch

from gs_lightning.metrics.segmentation import SegmentationMetrics


def _scores(preds: list[int], target: list[int], num_classes: int = 3, ignore_index: int | None = 11) -> dict:
    metric = SegmentationMetrics(num_classes, ignore_index)
    metric.update(torch.tensor([preds]), torch.tensor([target]))
    return {name: value.item() for name, value in metric.compute().items()}


def _assert_scores(scores: dict, miou: float, pixel_accuracy: float, mean_class_accuracy: float) -> None:
    assert scores["miou"] == pytest.approx(miou)
    assert scores["pixel_accuracy"] == pytest.approx(pixel_accuracy)
    assert scores["mean_class_accuracy"] == pytest.approx(mean_class_accuracy)


def test_perfect() -> None:
    _assert_scores(_scores([0, 1, 2, 2], [0, 1, 2, 2]), 1.0, 1.0, 1.0)


def test_one_class_partly_wrong() -> None:
    # Rows target, columns prediction: [[2,0,0],[0,1,1],[0,0,2]].
    # IoU = 1, 1/2, 2/3; accuracy = 1, 1/2, 1.
    scores = _scores([0, 0, 1, 2, 2, 2], [0, 0, 1, 1, 2, 2])
    _assert_scores(scores, (1 + 1 / 2 + 2 / 3) / 3, 5 / 6, (1 + 1 / 2 + 1) / 3)


def test_ignore_index_pixels_are_skipped() -> None:
    with_void = _scores([0, 0, 1, 2, 2, 2, 0, 1], [0, 0, 1, 1, 2, 2, 11, 11])
    _assert_scores(with_void, (1 + 1 / 2 + 2 / 3) / 3, 5 / 6, (1 + 1 / 2 + 1) / 3)


def test_absent_class_is_excluded_from_the_means() -> None:
    # 4 classes; class 2 appears nowhere, class 3 only in the prediction.
    # Rows [[1,0,0,1],[0,2,0,0],[0,0,0,0],[0,0,0,0]]: IoU = 1/2, 1, nan, 0 -> mean 1/2;
    # accuracy = 1/2, 1, nan, nan -> mean 3/4.
    scores = _scores([0, 3, 1, 1], [0, 0, 1, 1], num_classes=4)
    _assert_scores(scores, 0.5, 0.75, 0.75)


def test_logits_batches_accumulate_and_reset() -> None:
    metric = SegmentationMetrics(num_classes=3, ignore_index=11)
    target = torch.tensor([[[0, 1], [2, 11]]])
    logits = torch.nn.functional.one_hot(torch.tensor([[[0, 1], [1, 0]]]), 3).permute(0, 3, 1, 2).float()
    metric.update(logits, target)
    metric.update(target.clamp(max=2), target)
    # Confusion [[2,0,0],[0,2,0],[0,1,1]]: IoU 1, 2/3, 1/2; accuracy 1, 1, 1/2; 5 of 6 right.
    _assert_scores({k: v.item() for k, v in metric.compute().items()}, (1 + 2 / 3 + 1 / 2) / 3, 5 / 6, 5 / 6)
    metric.reset()
    assert metric.confmat.sum() == 0
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert all(math.isnan(v.item()) for v in metric.compute().values())


def test_states_merge_by_sum_as_under_ddp() -> None:
    whole, first, second = (SegmentationMetrics(3, 11) for _ in range(3))
    preds, target = torch.tensor([[0, 0, 1, 2, 2, 2]]), torch.tensor([[0, 0, 1, 1, 2, 2]])
    whole.update(preds, target)
    first.update(preds[:, :3], target[:, :3])
    second.update(preds[:, 3:], target[:, 3:])
    first.merge_state(second)
    assert torch.equal(first.confmat, whole.confmat)
    merged, reference = first.compute(), whole.compute()
    assert all(torch.equal(merged[name], reference[name]) for name in reference)


def test_bad_input() -> None:
    metric = SegmentationMetrics(3, ignore_index=11)
    with pytest.raises(ValueError, match="outside"):
        metric.update(torch.tensor([[0, 1]]), torch.tensor([[0, 5]]))
    with pytest.raises(ValueError, match="shapes differ"):
        metric.update(torch.tensor([[0, 1, 2]]), torch.tensor([[0, 1]]))
