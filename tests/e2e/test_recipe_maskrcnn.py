"""The coco-maskrcnn recipe learns on its generated data, end to end through the CLI, on CPU; ``gputrain predict``
of its checkpoint scores as ``gputrain eval`` does; and the Mask R-CNN backbone option that lets it run there.

The run is a real ``gputrain`` process with real torchrun workers on 2 ranks, shrunk (recipe_runs.py) until it takes
tens of seconds on a shared 2-core machine. Checked: the loss halves, box and mask mAP50 end well above chance, and
``gputrain eval`` of the final checkpoint gives the same mAP on 1 and 2 processes over a validation set of odd
size, with predictions in the COCO results format that pycocotools alone scores the same. The predict test lives
here, not in test_predict_detection.py, to score that same checkpoint and evaluation: a Mask R-CNN of its own would
cost as much again, and would score near zero where this one is well above chance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision
from recipe_runs import COCO, Trained, _epochs, _trained, assert_loss_halves, evaluate_here_and_on_2

from gputrain.models.vision import maskrcnn
from predict_runs import _run

pytestmark = [
    pytest.mark.slow,
    # pycocotools 2.0 under numpy 2, when make_coco decodes masks in this process; harmless.
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
]


# -- coco-maskrcnn: DDP Mask R-CNN on 2 ranks, COCO mAP ---------------------------------------


@pytest.fixture(scope="module")
def coco(tmp_path_factory) -> Trained:
    return _trained(COCO, tmp_path_factory)


@pytest.fixture(scope="module")
def coco_eval(coco, tmp_path_factory) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """``gputrain eval`` of the run's checkpoint on 1 and on 2 processes: both eval.json, and their folder."""
    out = tmp_path_factory.mktemp("coco-eval")
    return (*evaluate_here_and_on_2(COCO, coco, out), out)


def test_coco_maskrcnn_learns_on_2_processes(coco):
    last = assert_loss_halves(coco.run, _epochs(COCO))
    assert json.loads((coco.run / "summary.json").read_text())["world_size"] == 2
    assert last["val/images"] == COCO.val_size
    # Chance is 0: random boxes and masks of 64 px images essentially never reach IoU 0.5.
    assert last["val/bbox_mAP50"] > 0.1
    assert last["val/segm_mAP50"] > 0.1


def _coco_bbox_map(gt_json: Path, predictions: list[dict[str, Any]]) -> float:
    """bbox mAP of COCO results by pycocotools alone, as a user would re-score ``predictions.json``."""
    import contextlib
    import io

    from pycocotools.coco import COCO as CocoApi
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = CocoApi(str(gt_json))
        # Without masks: loadRes takes an entry's area from its mask when it has one.
        dt = gt.loadRes([{k: v for k, v in p.items() if k != "segmentation"} for p in predictions])
        ev = COCOeval(gt, dt, iouType="bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return float(ev.stats[0])


def test_coco_eval_is_exact_on_1_and_2_processes_and_writes_coco_results(coco_eval):
    one, two, out = coco_eval
    gt_json = out / "eval2" / "splits" / "instances_val.json"
    gt_images = json.loads(gt_json.read_text())["images"]
    assert len(gt_images) == COCO.val_size and COCO.val_size % 2 == 1
    assert one["val/images"] == two["val/images"] == COCO.val_size
    for key in ("bbox_mAP", "bbox_mAP50", "segm_mAP", "segm_mAP50"):
        assert one[f"val/{key}"] == pytest.approx(two[f"val/{key}"], abs=1e-9), key
    assert two["val/bbox_mAP"] > 0

    predictions = json.loads((out / "eval2" / "predictions.json").read_text())
    assert predictions, "no detections written"
    categories = {c["id"] for c in json.loads(gt_json.read_text())["categories"]}
    image_ids = {im["id"] for im in gt_images}
    for p in predictions:  # the COCO results format
        assert {"image_id", "category_id", "bbox", "score", "segmentation"} <= p.keys()
        assert p["image_id"] in image_ids and p["category_id"] in categories
        assert len(p["bbox"]) == 4 and 0.0 <= p["score"] <= 1.0
        assert {"size", "counts"} <= p["segmentation"].keys()
    assert _coco_bbox_map(gt_json, predictions) == pytest.approx(two["val/bbox_mAP"], abs=1e-9)


# -- gputrain predict of the run's checkpoint -------------------------------------------------


def test_detection_json_scores_as_eval_with_the_annotation_ids(coco, coco_eval, tmp_path: Path) -> None:
    """``gputrain predict`` of a detection model: the JSON scores exactly as ``gputrain eval`` (1 process) does
    (pycocotools mAP, computed here) and takes the image ids of the annotation file."""
    import contextlib
    import io

    from pycocotools.coco import COCO as CocoApi
    from pycocotools.cocoeval import COCOeval

    metrics, _, out = coco_eval
    val_json = out / "eval1" / "splits" / "instances_val.json"
    val = json.loads(val_json.read_text())
    files = [coco.data / "images" / im["file_name"] for im in sorted(val["images"], key=lambda im: im["id"])]
    _run(["predict", "--checkpoint", coco.checkpoint, "--input", *files, "--out", tmp_path / "pred",
          "--accelerator", "cpu"])
    results = json.loads((tmp_path / "pred/predictions.json").read_text())
    ids = {im["id"] for im in val["images"]}
    assert results and {r["image_id"] for r in results} <= ids
    assert {r["category_id"] for r in results} <= {c["id"] for c in val["categories"]}
    assert len(list((tmp_path / "pred/overlays").iterdir())) == len(files)
    with contextlib.redirect_stdout(io.StringIO()):
        truth = CocoApi(str(val_json))
        for iou_type, drop in (("bbox", "segmentation"), ("segm", "bbox")):  # loadRes takes areas from boxes
            found = COCOeval(truth, truth.loadRes([{k: v for k, v in r.items() if k != drop} for r in results]),
                             iouType=iou_type)
            found.params.imgIds = sorted(ids)
            found.evaluate()
            found.accumulate()
            found.summarize()
            assert found.stats[0] == metrics[f"val/{iou_type}_mAP"]
            assert found.stats[1] == metrics[f"val/{iou_type}_mAP50"]


# -- Mask R-CNN's backbone option (what lets the detection recipe run on CPU) -----------------


def test_maskrcnn_default_is_torchvisions_resnet50_fpn():
    torch.manual_seed(0)
    ours = maskrcnn(4, min_size=64, max_size=64)
    torch.manual_seed(0)
    ref = torchvision.models.detection.maskrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=4, min_size=64, max_size=64
    )
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_maskrcnn_resnet18_backbone_trains_and_detects():
    torch.manual_seed(0)
    model = maskrcnn(3, backbone="resnet18", min_size=64, max_size=64)
    body = model.backbone.body
    assert isinstance(body.layer1[0], torchvision.models.resnet.BasicBlock)
    # As maskrcnn_resnet50_fpn without pretrained weights: plain BatchNorm, every layer trainable.
    assert type(body.bn1) is torch.nn.BatchNorm2d
    assert all(p.requires_grad for p in model.parameters())
    images = [torch.rand(3, 64, 64), torch.rand(3, 64, 64)]
    masks = torch.zeros(1, 64, 64, dtype=torch.uint8)
    masks[0, 10:40, 12:30] = 1
    target = {"boxes": torch.tensor([[12.0, 10.0, 30.0, 40.0]]), "labels": torch.tensor([1]), "masks": masks}
    losses = model(images, [target, target])
    assert {"loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness", "loss_rpn_box_reg"} == losses.keys()
    sum(losses.values()).backward()
    assert body.conv1.weight.grad is not None
    with torch.no_grad():
        out = model.eval()(images[:1])
    assert {"boxes", "labels", "scores", "masks"} <= out[0].keys()

    frozen = maskrcnn(3, backbone="resnet18", trainable_backbone_layers=2)
    assert not frozen.backbone.body.layer2[0].conv1.weight.requires_grad
    assert frozen.backbone.body.layer3[0].conv1.weight.requires_grad
    with pytest.raises(ValueError, match=r"backbone='vgg16'.*resnet18"):
        maskrcnn(3, backbone="vgg16")
