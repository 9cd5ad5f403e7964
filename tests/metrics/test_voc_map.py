"""VOC2007 11-point mAP on hand-worked cases and against a loop-by-loop devkit transcription."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gs_lightning.metrics.voc_map import VOC07MeanAveragePrecision, voc_box_iou


def _pred(boxes: list[list[float]], scores: list[float], labels: list[int]) -> dict[str, torch.Tensor]:
    return {
        "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
        "scores": torch.tensor(scores, dtype=torch.float32),
        "labels": torch.tensor(labels, dtype=torch.long),
    }


def _gt(boxes: list[list[float]], labels: list[int], difficult: list[bool] | None = None) -> dict[str, torch.Tensor]:
    target = {
        "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
        "labels": torch.tensor(labels, dtype=torch.long),
    }
    if difficult is not None:
        target["difficult"] = torch.tensor(difficult, dtype=torch.bool)
    return target


def _ap(preds: list[dict], targets: list[dict], num_classes: int = 20) -> dict[str, torch.Tensor]:
    metric = VOC07MeanAveragePrecision(num_classes=num_classes)
    metric.update(preds, targets)
    return metric.compute()


A, B = [0.0, 0.0, 9.0, 9.0], [30.0, 30.0, 39.0, 39.0]


def test_perfect_detection_and_nan_for_classes_without_gt() -> None:
    out = _ap([_pred([A, B], [0.9, 0.8], [1, 2])], [_gt([A], [1])])
    assert out["ap_per_class"][0] == 1.0
    assert torch.isnan(out["ap_per_class"][1:]).all()  # class 2 has detections but no ground truth
    assert out["map"] == 1.0  # NaN classes are left out of the mean


def test_difficult_ground_truth_is_ignored() -> None:
    # The top detection hits the difficult box: neither TP nor FP; the difficult box is not counted in recall.
    out = _ap([_pred([B, A], [0.9, 0.8], [1, 1])], [_gt([A, B], [1, 1], [False, True])])
    assert out["ap_per_class"][0] == 1.0
    # Only difficult ground truth: no positives -> NaN, like a class without ground truth.
    out = _ap([_pred([B], [0.9], [1])], [_gt([B], [1], [True])])
    assert torch.isnan(out["ap_per_class"][0]) and torch.isnan(out["map"])


def test_duplicate_detection_is_false_positive() -> None:
    # TP (A), FP (A again), TP (B): precision 1, 1/2, 2/3 at recall 1/2, 1/2, 1.
    out = _ap([_pred([A, A, B], [0.9, 0.8, 0.7], [1, 1, 1])], [_gt([A, B], [1, 1])])
    expected = (6 * 1.0 + 5 * (2 / 3)) / 11  # t = 0..0.5 -> 1; t = 0.6..1 -> 2/3
    assert out["ap_per_class"][0].item() == pytest.approx(expected, abs=1e-12)


def test_no_detections_gives_zero() -> None:
    out = _ap([_pred([B], [0.9], [2])], [_gt([A, B], [1, 2])])
    assert out["ap_per_class"][0] == 0.0 and out["ap_per_class"][1] == 1.0
    assert out["map"] == 0.5
    empty = _ap([_pred([], [], [])], [_gt([A], [1])])
    assert empty["ap_per_class"][0] == 0.0 and empty["map"] == 0.0


def test_no_fallback_to_next_best_ground_truth() -> None:
    g1, g2 = [0.0, 0.0, 9.0, 9.0], [5.0, 0.0, 14.0, 9.0]
    second = [2.0, 0.0, 11.0, 9.0]  # IoU 80/120 with g1 (taken), 70/130 >= 0.5 with g2
    iou = voc_box_iou(torch.tensor([second]), torch.tensor([g1, g2]))[0]
    assert iou[0] > iou[1] >= 0.5
    out = _ap([_pred([g1, second], [0.9, 0.8], [1, 1])], [_gt([g1, g2], [1, 1])])
    # TP then FP: recall 1/2 at most -> thresholds 0..0.5 at precision 1.
    assert out["ap_per_class"][0].item() == pytest.approx(6 / 11, abs=1e-12)


def test_plus_one_pixel_convention() -> None:
    # 10x10 px ground truth and a 5x10 px detection: IoU exactly 0.5 with "+1" (0.44 without) -> TP.
    assert voc_box_iou(torch.tensor([[0.0, 0.0, 4.0, 9.0]]), torch.tensor([A])).item() == 0.5
    out = _ap([_pred([[0.0, 0.0, 4.0, 9.0]], [0.9], [1])], [_gt([A], [1])])
    assert out["ap_per_class"][0] == 1.0
    # One pixel narrower: 40/100 < 0.5 -> FP.
    out = _ap([_pred([[0.0, 0.0, 3.0, 9.0]], [0.9], [1])], [_gt([A], [1])])
    assert out["ap_per_class"][0] == 0.0


def test_recall_thresholds_are_chainercv_arange() -> None:
    # np.arange(0., 1.1, 0.1)[3] == 0.30000000000000004 > 3 / 10: recall 0.3 does not reach t = "0.3".
    gts = [[20.0 * k, 0.0, 20.0 * k + 9, 9.0] for k in range(10)]
    far = [500.0, 500.0, 509.0, 509.0]
    boxes = gts[:3] + [far] + gts[3:]
    scores = [1.0 - 0.05 * i for i in range(11)]
    out = _ap([_pred(boxes, scores, [1] * 11)], [_gt(gts, [1] * 10)])
    expected = (3 * 1.0 + 8 * (10 / 11)) / 11
    assert out["ap_per_class"][0].item() == pytest.approx(expected, abs=1e-12)


def test_accumulates_over_updates_and_checks_labels() -> None:
    preds = [_pred([A, A, B], [0.9, 0.8, 0.7], [1, 1, 1]), _pred([B], [0.6], [3])]
    targets = [_gt([A, B], [1, 1]), _gt([B, A], [3, 3])]
    whole = _ap(preds, targets, num_classes=3)
    metric = VOC07MeanAveragePrecision(num_classes=3)
    metric.update(preds[:1], targets[:1])
    metric.update(preds[1:], targets[1:])
    torch.testing.assert_close(metric.compute()["ap_per_class"], whole["ap_per_class"], equal_nan=True)
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert math.isnan(VOC07MeanAveragePrecision(num_classes=3).compute()["map"].item())
    with pytest.raises(ValueError, match=r"1\.\.3"):
        metric.update([_pred([A], [0.5], [0])], [_gt([A], [1])])


def _devkit_ap(preds: list[dict], targets: list[dict], num_classes: int) -> np.ndarray:
    """Loop-by-loop transcription of VOCevaldet.m (VOC2007 code) with ChainerCV's thresholds."""
    ap = np.full(num_classes, np.nan)
    for c in range(1, num_classes + 1):
        gt = []
        for t in targets:
            m = t["labels"].numpy() == c
            diff = t.get("difficult", torch.zeros(len(t["labels"]), dtype=torch.bool)).numpy()[m]
            gt.append({"boxes": t["boxes"].numpy()[m], "diff": diff, "det": np.zeros(m.sum(), bool)})
        npos = sum(int((~g["diff"]).sum()) for g in gt)
        dets = [
            (score, i, box)
            for i, p in enumerate(preds)
            for box, score, label in zip(p["boxes"].numpy(), p["scores"].numpy(), p["labels"].numpy())
            if label == c
        ]
        dets.sort(key=lambda d: -d[0])
        tp, fp = np.zeros(len(dets)), np.zeros(len(dets))
        for d, (_, i, bb) in enumerate(dets):
            ovmax, jmax = -np.inf, -1
            for j, bbgt in enumerate(gt[i]["boxes"]):
                iw = min(bb[2], bbgt[2]) - max(bb[0], bbgt[0]) + 1
                ih = min(bb[3], bbgt[3]) - max(bb[1], bbgt[1]) + 1
                if iw > 0 and ih > 0:
                    ua = (bb[2] - bb[0] + 1) * (bb[3] - bb[1] + 1) + (bbgt[2] - bbgt[0] + 1) * (bbgt[3] - bbgt[1] + 1)
                    ov = iw * ih / (ua - iw * ih)
                    if ov > ovmax:
                        ovmax, jmax = ov, j
            if ovmax >= 0.5:
                if not gt[i]["diff"][jmax]:
                    if not gt[i]["det"][jmax]:
                        tp[d] = 1
                        gt[i]["det"][jmax] = True
                    else:
                        fp[d] = 1
            else:
                fp[d] = 1
        if npos == 0:
            continue
        fp, tp = np.cumsum(fp), np.cumsum(tp)
        rec = tp / npos
        with np.errstate(invalid="ignore"):
            prec = np.nan_to_num(tp / (fp + tp))
        ap[c - 1] = sum((prec[rec >= t].max() if (rec >= t).any() else 0.0) / 11 for t in np.arange(0.0, 1.1, 0.1))
    return ap


def test_matches_devkit_transcription_on_random_data() -> None:
    gen = torch.Generator().manual_seed(0)
    num_classes, preds, targets = 4, [], []
    for _ in range(12):
        n_gt = int(torch.randint(0, 5, (1,), generator=gen))
        xy = torch.randint(0, 60, (n_gt, 2), generator=gen).float()
        gt_boxes = torch.cat([xy, xy + torch.randint(5, 30, (n_gt, 2), generator=gen)], 1)
        gt_labels = torch.randint(1, num_classes + 1, (n_gt,), generator=gen)
        targets.append(_gt(gt_boxes.tolist(), gt_labels.tolist(), (torch.rand(n_gt, generator=gen) < 0.2).tolist()))
        # Jittered copies of the ground truth (some duplicated, some relabelled) plus random boxes.
        keep = torch.randint(0, n_gt, (2 * n_gt,), generator=gen) if n_gt else torch.zeros(0, dtype=torch.long)
        jitter = torch.randint(-4, 5, (len(keep), 4), generator=gen).float()
        labels = gt_labels[keep].clone()
        flip = torch.rand(len(keep), generator=gen) < 0.2
        labels[flip] = torch.randint(1, num_classes + 1, (int(flip.sum()),), generator=gen)
        xy = torch.randint(0, 60, (3, 2), generator=gen).float()
        rand_boxes = torch.cat([xy, xy + torch.randint(5, 30, (3, 2), generator=gen)], 1)
        boxes = torch.cat([gt_boxes[keep] + jitter, rand_boxes])
        labels = torch.cat([labels, torch.randint(1, num_classes + 1, (3,), generator=gen)])
        preds.append(_pred(boxes.tolist(), torch.rand(len(boxes), generator=gen).tolist(), labels.tolist()))
    ours = _ap(preds, targets, num_classes)["ap_per_class"].numpy()
    reference = _devkit_ap(preds, targets, num_classes)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-12)
    assert not np.isnan(reference).all() and (reference > 0).any() and (reference < 1).any()
