"""Exact distributed evaluation: 2 real gloo ranks give the metrics of 1 process.

Set sizes are odd (359 samples, 7 images, 5 COCO images), so the shards differ in length;
padding (DistributedSampler) would count a duplicate, which one test quantifies.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from gputrain.data.samplers import eval_shard
from gputrain.dist import DistInfo
from gputrain.metrics.classification import ClassificationEvaluator
from gputrain.metrics.detection import CocoEvaluator
from gputrain.metrics.segmentation import SegmentationEvaluator, miou_from_confusion
from multiproc import run_ranks

N_CLS, N_SEG, N_COCO = 359, 7, 5
CATEGORIES = {1: 1, 2: 3, 3: 7}  # model label -> COCO category id (non-contiguous on purpose)
W, H = 64, 48


# -- synthetic data, identical in every process ------------------------------------------
def _classification_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N_CLS, 10, generator=g), torch.randint(0, 10, (N_CLS,), generator=g)


def _segmentation_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(N_SEG, 5, 12, 10, generator=g)
    logits[:, 4] = -1e9  # class 4 is never predicted and never in GT: it must not count in mIoU
    targets = torch.randint(0, 4, (N_SEG, 12, 10), generator=g)
    targets[:, 0, :3] = 255  # void pixels
    return logits, targets


def _gt_boxes(image_id: int) -> list[tuple[int, list[float]]]:
    g = torch.Generator().manual_seed(100 + image_id)
    boxes = []
    for k in range(2 + image_id % 2):
        x, y = (
            torch.randint(0, W - 24, (1,), generator=g).item(),
            torch.randint(0, H - 20, (1,), generator=g).item(),
        )
        w, h = torch.randint(8, 24, (1,), generator=g).item(), torch.randint(8, 20, (1,), generator=g).item()
        boxes.append((1 + (image_id + k) % 3, [float(x), float(y), float(w), float(h)]))
    return boxes


def coco_gt_dict() -> dict:
    images, anns = [], []
    for i in range(1, N_COCO + 1):
        images.append({"id": i, "width": W, "height": H, "file_name": f"{i}.jpg"})
        for label, (x, y, w, h) in _gt_boxes(i):
            anns.append(
                {
                    "id": len(anns) + 1,
                    "image_id": i,
                    "category_id": CATEGORIES[label],
                    "iscrowd": 0,
                    "bbox": [x, y, w, h],
                    "area": w * h,
                    "segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]],
                }
            )
    cats = [{"id": c, "name": f"c{c}"} for c in CATEGORIES.values()]
    return {"images": images, "annotations": anns, "categories": cats}


def _detections(image_id: int) -> dict[str, torch.Tensor]:
    """GT boxes jittered by a pixel or two, random scores, soft masks, one false positive."""
    if image_id == 4:  # an image with no detections still counts as evaluated
        return {
            "boxes": torch.zeros(0, 4),
            "scores": torch.zeros(0),
            "labels": torch.zeros(0, dtype=torch.int64),
            "masks": torch.zeros(0, 1, H, W),
        }
    g = torch.Generator().manual_seed(200 + image_id)
    gt = _gt_boxes(image_id) + [(2, [40.0, 5.0, 10.0, 10.0])]
    boxes, labels, masks = [], [], []
    for label, (x, y, w, h) in gt:
        dx, dy = (torch.randint(-2, 3, (2,), generator=g)).tolist()
        x1, y1, x2, y2 = x + dx, y + dy, x + w + dx, y + h + dy
        boxes.append([x1, y1, x2, y2])
        labels.append(label)
        m = torch.full((1, H, W), 0.2)
        m[0, max(0, int(y1)) : int(y2), max(0, int(x1)) : int(x2)] = 0.8
        masks.append(m)
    return {
        "boxes": torch.tensor(boxes),
        "scores": torch.rand(len(gt), generator=g),
        "labels": torch.tensor(labels),
        "masks": torch.stack(masks),
    }


def _batches(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i : i + size] for i in range(0, len(indices), size)]


# -- the evaluation, run by 1 process in the test and by each of 2 ranks -------------------
def evaluate_all(info: DistInfo, gt_path: str, out_dir: str) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    device = info.device  # where the statistics are reduced (the collectives are gputrain.dist.comm's)
    rank, ws = info.rank, info.world_size
    out: dict[str, dict[str, float]] = {}

    logits, labels = _classification_data()
    padded = list(DistributedSampler(list(range(N_CLS)), num_replicas=ws, rank=rank, shuffle=False))
    for name, indices in (("cls", eval_shard(N_CLS, rank, ws)), ("cls_padded", padded)):
        ev = ClassificationEvaluator(10)
        for b in _batches(indices, 32):
            ev.update(logits[b], labels[b], F.cross_entropy(logits[b], labels[b]), len(b))
        out[name] = ev.compute(device)

    seg_logits, seg_targets = _segmentation_data()
    seg = SegmentationEvaluator(5)
    for b in _batches(eval_shard(N_SEG, rank, ws), 2):
        seg.update(
            seg_logits[b],
            seg_targets[b],
            F.cross_entropy(seg_logits[b], seg_targets[b], ignore_index=255),
            len(b),
        )
    out["seg"] = seg.compute(device)

    coco = CocoEvaluator(gt_path, label_to_category=CATEGORIES)
    image_ids = [i + 1 for i in eval_shard(N_COCO, rank, ws)]
    for b in _batches(image_ids, 2):
        coco.update([_detections(i) for i in b], [{"image_id": torch.tensor(i)} for i in b], None, len(b))
    out["coco"] = coco.compute(device, out_dir=out_dir)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    gt_path = root / "gt.json"
    gt_path.write_text(json.dumps(coco_gt_dict()))
    one = evaluate_all(DistInfo(), str(gt_path), str(root / "one"))
    two = run_ranks(evaluate_all, str(gt_path), str(root / "two"))
    return {"one": one, "two": two, "root": root}


def test_ranks_agree_with_each_other(runs):
    assert runs["two"][0] == runs["two"][1]


def test_classification_two_ranks_equal_one_process(runs):
    one, two = runs["one"]["cls"], runs["two"][0]["cls"]
    assert two["samples"] == one["samples"] == N_CLS
    assert two["accuracy"] == one["accuracy"] and two["top5"] == one["top5"]
    assert 0.0 < one["accuracy"] < 1.0
    assert two["loss"] == pytest.approx(
        one["loss"], rel=1e-6
    )  # float32 batch means: sharded batches round differently


def test_padded_distributed_sampler_counts_a_duplicate(runs):
    """DistributedSampler pads 359 to 360: sample 0 is evaluated twice."""
    exact, padded = runs["one"]["cls"], runs["two"][0]["cls_padded"]
    assert padded["samples"] == 360
    logits, labels = _classification_data()
    dup_correct = float(logits[0].argmax() == labels[0])
    correct = exact["accuracy"] * N_CLS
    assert padded["accuracy"] == pytest.approx((correct + dup_correct) / 360, abs=1e-15)
    assert padded["accuracy"] != exact["accuracy"]  # the error the issue asked to quantify
    assert abs(padded["accuracy"] - exact["accuracy"]) <= 1 / 360


def test_segmentation_two_ranks_equal_one_process(runs):
    one, two = runs["one"]["seg"], runs["two"][0]["seg"]
    assert two["mIoU"] == one["mIoU"] and two["pixel_acc"] == one["pixel_acc"]
    assert two["samples"] == one["samples"] == N_SEG
    assert one["pixels"] == N_SEG * (12 * 10 - 3)
    assert two["loss"] == pytest.approx(
        one["loss"], rel=1e-6
    )  # float32 batch means: sharded batches round differently


def test_coco_two_ranks_equal_one_process(runs):
    one, two = runs["one"]["coco"], runs["two"][0]["coco"]
    assert one["images"] == two["images"] == N_COCO
    for key in ("bbox_mAP", "bbox_mAP50", "segm_mAP", "segm_mAP50"):
        assert abs(one[key] - two[key]) <= 1e-9, key
        assert 0.2 < one[key] <= 1.0, key


def test_coco_map_equals_plain_pycocotools_on_written_predictions(runs):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    root, metrics = runs["root"], runs["two"][0]["coco"]
    predictions = json.loads((root / "two" / "predictions.json").read_text())
    assert {p["category_id"] for p in predictions} <= set(CATEGORIES.values())
    gt = COCO(str(root / "gt.json"))
    for iou_type, drop in (("bbox", "segmentation"), ("segm", "bbox")):
        dt = gt.loadRes([{k: v for k, v in p.items() if k != drop} for p in predictions])
        ev = COCOeval(gt, dt, iouType=iou_type)
        ev.evaluate(), ev.accumulate(), ev.summarize()
        assert abs(ev.stats[0] - metrics[f"{iou_type}_mAP"]) <= 1e-9
        assert abs(ev.stats[1] - metrics[f"{iou_type}_mAP50"]) <= 1e-9


def test_coco_empty_predictions_give_zero_map(tmp_path):
    gt_path = tmp_path / "gt.json"
    gt_path.write_text(json.dumps(coco_gt_dict()))
    ev = CocoEvaluator(str(gt_path), label_to_category=CATEGORIES)
    empty = _detections(4)
    ev.update([empty, empty], [{"image_id": 1}, {"image_id": 2}], None, 2)
    metrics = ev.compute(torch.device("cpu"), out_dir=tmp_path)
    assert metrics == {"images": 2.0, "bbox_mAP": 0.0, "bbox_mAP50": 0.0, "segm_mAP": 0.0, "segm_mAP50": 0.0}
    assert json.loads((tmp_path / "predictions.json").read_text()) == []


def test_coco_unknown_label_and_missing_masks_are_explained(tmp_path):
    gt_path = tmp_path / "gt.json"
    gt_path.write_text(json.dumps(coco_gt_dict()))
    det = _detections(1)
    with pytest.raises(KeyError, match="label 9 is not in label_to_category"):
        CocoEvaluator(str(gt_path), label_to_category=CATEGORIES).update(
            [{**det, "labels": torch.full_like(det["labels"], 9)}], [{"image_id": 1}], None, 1
        )
    no_masks = {k: v for k, v in det.items() if k != "masks"}
    with pytest.raises(KeyError, match="iou_types=\\('bbox',\\)"):
        CocoEvaluator(str(gt_path), label_to_category=CATEGORIES).update(
            [no_masks], [{"image_id": 1}], None, 1
        )
    with pytest.raises(FileNotFoundError, match="nope.json"):
        CocoEvaluator(str(tmp_path / "nope.json"))


def test_miou_from_confusion_by_hand():
    cm = torch.tensor([[3, 1, 0], [0, 2, 0], [0, 0, 0]])
    miou, per_class = miou_from_confusion(cm)
    assert per_class[0] == 3 / 4 and per_class[1] == 2 / 3 and math.isnan(per_class[2])
    assert miou == pytest.approx((3 / 4 + 2 / 3) / 2, abs=1e-15)
    assert math.isnan(miou_from_confusion(torch.zeros(2, 2, dtype=torch.int64))[0])


def test_segmentation_rejects_labels_outside_num_classes():
    ev = SegmentationEvaluator(3)
    with pytest.raises(ValueError, match="label is >= num_classes=3"):
        ev.update(torch.zeros(1, 3, 2, 2), torch.full((1, 2, 2), 3), None, 1)
