"""COCO mAP against answers worked out by hand, not against a second call of the same code.

The evaluator's path (``detections_to_coco`` -> ``coco_stats`` -> pycocotools) is scored on a
ground truth built here, with detections whose AP follows from COCO's definition:

* 10 IoU thresholds 0.50, 0.55, ..., 0.95; a detection matches a ground-truth box when IoU >= t.
* Per threshold, detections are ranked by score; precision and recall are taken at each rank,
  precision is made monotone from the right (interpolated), and AP is the mean of that precision
  at the 101 recall points 0.00, 0.01, ..., 1.00 (the first rank whose recall reaches the point).
* ``bbox_mAP`` is the mean over the 10 thresholds, ``bbox_mAP50`` the value at 0.50.

Boxes are in pixels, continuous coordinates (pycocotools adds no +1 to widths).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pycocotools")

from gputrain.dist import DistInfo  # noqa: E402
from gputrain.metrics.detection import CocoEvaluator, detections_to_coco  # noqa: E402
from gputrain.strategies.single import SingleDevice  # noqa: E402

# Ground truth: image 1 holds two boxes of category 1, xywh; area 100 and 200.
GT_XYWH = [[10.0, 10.0, 10.0, 10.0], [40.0, 20.0, 20.0, 10.0]]


def _coco_gt(boxes: list[list[float]]):
    from pycocotools.coco import COCO

    coco = COCO()
    coco.dataset = {
        "images": [{"id": 1, "width": 100, "height": 80, "file_name": "1.jpg"}],
        "annotations": [{"id": k + 1, "image_id": 1, "category_id": 1, "iscrowd": 0, "bbox": b,
                         "area": b[2] * b[3]} for k, b in enumerate(boxes)],
        "categories": [{"id": 1, "name": "thing"}],
    }
    coco.createIndex()
    return coco


def _xyxy(b: list[float]) -> list[float]:
    return [b[0], b[1], b[0] + b[2], b[1] + b[3]]


def _score(gt: list[list[float]], dets: list[tuple[list[float], float]]) -> dict[str, float]:
    """mAP of ``dets`` (xywh box, score) on ``gt`` through CocoEvaluator, as the trainer computes it."""
    evaluator = CocoEvaluator(_coco_gt(gt), iou_types=("bbox",))
    output = {
        "boxes": torch.tensor([_xyxy(b) for b, _ in dets], dtype=torch.float32).reshape(-1, 4),
        "scores": torch.tensor([s for _, s in dets]),
        "labels": torch.ones(len(dets), dtype=torch.int64),
    }
    evaluator.update([output], [{"image_id": torch.tensor(1)}], None, 1)
    return evaluator.compute(SingleDevice(DistInfo()))


def test_boxes_convert_from_xyxy_to_xywh_exactly():
    output = {"boxes": torch.tensor([[10.0, 20.0, 30.0, 25.0]]), "scores": torch.tensor([0.5]),
              "labels": torch.tensor([1])}
    (entry,) = detections_to_coco(output, 7, None, with_masks=False)
    assert entry["bbox"] == [10.0, 20.0, 20.0, 5.0]  # width = x2 - x1, no +1
    assert (entry["image_id"], entry["category_id"], entry["score"]) == (7, 1, 0.5)


def test_detections_equal_to_the_ground_truth_give_one():
    metrics = _score(GT_XYWH, [(GT_XYWH[0], 0.9), (GT_XYWH[1], 0.3)])
    assert metrics["images"] == 1.0
    assert metrics["bbox_mAP"] == pytest.approx(1.0, abs=1e-9)
    assert metrics["bbox_mAP50"] == pytest.approx(1.0, abs=1e-9)


def test_false_positive_with_the_highest_score():
    # Ranked: FP (0.95), TP (0.9), TP (0.3) at every threshold (the true boxes are exact).
    # precision per rank 0/1, 1/2, 2/3; recall 0, 1/2, 1. Interpolated (max to the right): 2/3, 2/3, 2/3.
    # Every one of the 101 recall points reads 2/3, so AP = 2/3 at each threshold and mAP = 2/3.
    false_positive = [70.0, 50.0, 10.0, 10.0]  # overlaps nothing
    metrics = _score(GT_XYWH, [(false_positive, 0.95), (GT_XYWH[0], 0.9), (GT_XYWH[1], 0.3)])
    assert metrics["bbox_mAP"] == pytest.approx(2 / 3, abs=1e-9)
    assert metrics["bbox_mAP50"] == pytest.approx(2 / 3, abs=1e-9)


def test_false_positive_between_two_true_positives():
    # Ranked: TP (0.9), FP (0.5), TP (0.3): precision 1, 1/2, 2/3; recall 1/2, 1/2, 1.
    # Interpolated: 1, 2/3, 2/3. Recall points 0.00..0.50 (51 of them) first reach recall at rank 1 -> 1;
    # points 0.51..1.00 (50) at rank 3 -> 2/3. AP = (51 * 1 + 50 * 2/3) / 101 = 253/303 = 0.834983...
    false_positive = [70.0, 50.0, 10.0, 10.0]
    metrics = _score(GT_XYWH, [(GT_XYWH[0], 0.9), (false_positive, 0.5), (GT_XYWH[1], 0.3)])
    assert metrics["bbox_mAP"] == pytest.approx(253 / 303, abs=1e-9)
    assert metrics["bbox_mAP50"] == pytest.approx(253 / 303, abs=1e-9)


def test_a_box_shifted_by_one_pixel_misses_the_strict_thresholds():
    # GT 10x10 at (10, 10); the detection moved right by 1 px: intersection 9x10 = 90, union 110,
    # IoU = 9/11 = 0.818. It matches at 0.50 ... 0.80 (7 thresholds, AP 1 each) and not at 0.85, 0.90,
    # 0.95 (AP 0: the only detection is a false positive there). mAP = 7/10, mAP50 = 1.
    gt = [GT_XYWH[0]]
    metrics = _score(gt, [([11.0, 10.0, 10.0, 10.0], 0.9)])
    assert metrics["bbox_mAP"] == pytest.approx(0.7, abs=1e-9)
    assert metrics["bbox_mAP50"] == pytest.approx(1.0, abs=1e-9)


def test_no_detections_score_zero():
    metrics = _score(GT_XYWH, [])
    assert metrics["bbox_mAP"] == 0.0 and metrics["images"] == 1.0
