"""A torchvision model by name through every tool, one per task kind besides the built-ins: it trains from the
recipe with ``model.name`` changed, ``gputrain eval`` of its checkpoint gives what the run's last validation gave,
``gputrain predict`` gives what evaluation scored, and ONNX equals PyTorch (1e-4), or is refused in one line.

MobileNetV3-Small classifies, DeepLabv3-MobileNetV3 segments with its auxiliary head (trained at weight 0.5,
evaluated on the main output), Faster R-CNN-MobileNetV3 detects boxes alone (box mAP, no mask mAP).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gputrain.cli import main
from gputrain.data.ade20k import make_ade20k
from gputrain.data.classfolder import make_classfolder
from gputrain.data.coco_sample import make_coco
from gputrain.tools.export import export_onnx
from predict_runs import QUIET, _eval, _run

torch.set_num_threads(1)


def _final(run: Path) -> dict[str, float]:
    return {k: v for k, v in json.loads((run / "summary.json").read_text())["final"].items() if k.startswith("val/")}


def _same_scores(evaluated: dict[str, float], final: dict[str, float]) -> None:
    assert evaluated.keys() - {"time/val_s", "world_size"} == final.keys()
    for key, value in final.items():
        assert evaluated[key] == pytest.approx(value, abs=1e-9), key


def test_a_classifier_evaluates_predicts_and_exports_as_it_trained(tmp_path: Path) -> None:
    make_classfolder(tmp_path / "train", classes=4, per_class=6, size=32, seed=0)
    make_classfolder(tmp_path / "val", classes=4, per_class=3, size=32, seed=1)
    run = tmp_path / "run"
    _run(["train", "imagefolder-resnet50", "--epochs", "1", "--batch-size", "8", "--out", run, *QUIET,
          f"data.root={tmp_path / 'train'}", f"data.val_root={tmp_path / 'val'}", "data.image_size=32",
          "model.name=mobilenet_v3_small", "optim.lr=0.01"])
    checkpoint = run / "checkpoints/last.pt"
    metrics = _eval(checkpoint, tmp_path / "eval")
    _same_scores(metrics, _final(run))
    _run(["predict", "--checkpoint", checkpoint, "--input", tmp_path / "val", "--out", tmp_path / "pred",
          "--accelerator", "cpu"])
    rows = list(csv.DictReader((tmp_path / "pred/predictions.csv").open()))
    names = sorted(p.name for p in (tmp_path / "val").iterdir())
    assert len(rows) == 12
    assert np.mean([int(r["label"]) == names.index(Path(r["file"]).parent.name) for r in rows]) == \
        metrics["val/accuracy"]
    assert export_onnx(checkpoint, tmp_path / "model.onnx") <= 1e-4


def test_a_segmenter_with_an_auxiliary_head_evaluates_predicts_and_exports_its_main_output(tmp_path: Path) -> None:
    make_ade20k(tmp_path / "data", num_classes=5, train=8, val=5, size=40, seed=0)
    run = tmp_path / "run"
    _run(["train", "ade20k-deeplabv3plus", "--epochs", "1", "--batch-size", "4", "--precision", "32", "--out", run,
          *QUIET, f"data.root={tmp_path / 'data'}", "data.num_classes=5", "data.image_size=0",
          "model.name=deeplabv3_mobilenet_v3_large", "trainer.sync_batchnorm=false"])
    saved = torch.load(run / "checkpoints/last.pt", weights_only=True)
    assert saved["config"]["model"]["kwargs"] == {"num_classes": 5, "weights_backbone": None, "aux_loss": True}
    assert any(k.startswith("aux_classifier.") for k in saved["model"])  # the recipe's backbone option was dropped
    checkpoint = run / "checkpoints/last.pt"
    metrics = _eval(checkpoint, tmp_path / "eval")
    _same_scores(metrics, _final(run))
    _run(["predict", "--checkpoint", checkpoint, "--input", tmp_path / "data/images/validation", "--out",
          tmp_path / "pred", "--accelerator", "cpu"])
    confusion = np.zeros((5, 5), np.int64)
    for truth_file in sorted((tmp_path / "data/annotations/validation").iterdir()):
        truth = np.array(Image.open(truth_file)).astype(np.int64)
        stored = np.array(Image.open(tmp_path / "pred/masks" / truth_file.name)).astype(np.int64)
        keep = truth > 0
        np.add.at(confusion, (truth[keep] - 1, stored[keep] - 1), 1)
    tp = np.diag(confusion).astype(np.float64)
    union = confusion.sum(0) + confusion.sum(1) - tp
    assert np.mean(tp[union > 0] / union[union > 0]) == pytest.approx(metrics["val/mIoU"], abs=1e-12)
    assert export_onnx(checkpoint, tmp_path / "model.onnx") <= 1e-4


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
def test_a_box_detector_scores_boxes_alone_and_predicts_what_eval_scored(tmp_path: Path, capsys) -> None:
    make_coco(tmp_path / "coco", num_images=12, size=64, seed=0)
    run = tmp_path / "run"
    _run(["train", "coco-maskrcnn", "--epochs", "1", "--batch-size", "2", "--precision", "32", "--out", run, *QUIET,
          f"data.root={tmp_path / 'coco'}", "model.name=fasterrcnn_mobilenet_v3_large_320_fpn",
          "model.kwargs.min_size=64", "model.kwargs.max_size=64"])
    checkpoint = run / "checkpoints/last.pt"
    metrics = _eval(checkpoint, tmp_path / "eval")
    assert {"val/bbox_mAP", "val/bbox_mAP50"} <= metrics.keys() and not any("segm" in k for k in metrics)
    _same_scores(metrics, _final(run))
    val = json.loads((tmp_path / "eval/splits/instances_val.json").read_text())
    files = [tmp_path / "coco/images" / im["file_name"] for im in val["images"]]
    _run(["predict", "--checkpoint", checkpoint, "--input", *files, "--out", tmp_path / "pred", "--accelerator", "cpu"])
    predicted = json.loads((tmp_path / "pred/predictions.json").read_text())
    scored = json.loads((tmp_path / "eval/predictions.json").read_text())

    def key(entry: dict) -> tuple:
        return entry["image_id"], -entry["score"]

    assert predicted and len(predicted) == len(scored) and not any("segmentation" in p for p in predicted)
    for p, s in zip(sorted(predicted, key=key), sorted(scored, key=key), strict=True):
        assert (p["image_id"], p["category_id"]) == (s["image_id"], s["category_id"])
        assert p["score"] == pytest.approx(s["score"], abs=1e-5)
        assert p["bbox"] == pytest.approx(s["bbox"], abs=1e-3)
    capsys.readouterr()
    assert main(["export", "onnx", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "detection model (fasterrcnn_mobilenet_v3_large_320_fpn)" in err[0]


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
def test_a_name_that_cannot_train_is_one_line_and_exit_2_before_any_worker_starts(tmp_path: Path, capsys) -> None:
    make_classfolder(tmp_path / "cls", classes=2, per_class=2, size=32, seed=0)
    make_coco(tmp_path / "coco", num_images=4, size=64, seed=0)
    cls = ["imagefolder-resnet50", f"data.root={tmp_path / 'cls'}", "data.image_size=32"]
    cases = {
        "is not a classification model gputrain knows; closest: resnet34": [*cls, "model.name=resnet_34"],
        "is a torchvision classification model, and this recipe's task trains a detection model": [
            "coco-maskrcnn", f"data.root={tmp_path / 'coco'}", "model.name=resnet34"],
        "is not a weights name of torchvision's mobilenet_v3_small; valid: IMAGENET1K_V1, DEFAULT": [
            *cls, "model.name=mobilenet_v3_small", "model.weights=COCO_V1"],
        "strategy pipeline cannot split torchvision's vit_b_32 into a chain of blocks": [
            *cls, "model.name=vit_b_32", "--strategy", "pipeline", "--devices", "2"],
        "with its auxiliary head (it reads an earlier feature); set model.kwargs.aux_loss=false to split it": [
            "ade20k-deeplabv3plus", f"data.root={tmp_path / 'cls'}", "model.name=deeplabv3_resnet50",
            "--strategy", "model_parallel"],
        "Keypoint R-CNN trains on keypoint targets": [
            "coco-maskrcnn", f"data.root={tmp_path / 'coco'}", "model.name=keypointrcnn_resnet50_fpn"],
    }
    for expected, args in cases.items():
        capsys.readouterr()
        assert main(["train", *args, "--out", str(tmp_path / "run"), "--accelerator", "cpu"]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("gputrain: error: ") and expected in err[0], err
        assert not (tmp_path / "run").exists()
