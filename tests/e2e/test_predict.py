"""``gputrain predict``: predictions of a validation set score exactly as ``gputrain eval`` does, scored here
independently (the CSV's accuracy, numpy mIoU from the PNG masks, pycocotools mAP from the JSON); 1 and 2
processes write the same files; every refusal is one line with exit 2."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gputrain.cli import main
from gputrain.data.ade20k import make_ade20k
from gputrain.data.classfolder import make_classfolder

torch.set_num_threads(1)
QUIET = ["--accelerator", "cpu", "trainer.progress_bar=false", "trainer.loggers=[]", "trainer.pictures=0"]


def _run(args: list[str]) -> None:
    assert main([str(a) for a in args]) == 0, args


def _eval(checkpoint: Path, out: Path) -> dict[str, float]:
    _run(["eval", "--checkpoint", checkpoint, "--out", out, "--accelerator", "cpu", "trainer.progress_bar=false"])
    return json.loads((out / "eval.json").read_text())


@pytest.fixture(scope="module")
def classes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cls")
    make_classfolder(root / "train", classes=4, per_class=6, size=32, seed=0)
    make_classfolder(root / "val", classes=4, per_class=3, size=32, seed=1)
    _run(["train", "imagefolder-resnet50", "--epochs", "2", "--batch-size", "8", "--out", root / "run", *QUIET,
          f"data.root={root / 'train'}", f"data.val_root={root / 'val'}", "data.image_size=32",
          "model.name=resnet18", "model.kwargs.cifar_stem=false", "optim.lr=0.01"])
    return root


@pytest.fixture(scope="module")
def ade(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ade")
    make_ade20k(root / "data", num_classes=5, train=8, val=5, size=40, seed=0)
    _run(["train", "ade20k-deeplabv3plus", "--epochs", "1", "--batch-size", "4", "--precision", "32",
          "--out", root / "run", *QUIET, f"data.root={root / 'data'}", "data.num_classes=5", "data.image_size=0",
          "model.kwargs.backbone=resnet18", "trainer.sync_batchnorm=false"])
    _run(["predict", "--checkpoint", root / "run/checkpoints/last.pt", "--input", root / "data/images/validation",
          "--out", root / "pred", "--accelerator", "cpu"])
    return root


def test_classification_csv_scores_as_eval(classes: Path) -> None:
    from gputrain.tasks import build_task
    from gputrain.tools.from_checkpoint import config_from_checkpoint, load_for_eval

    checkpoint = classes / "run/checkpoints/last.pt"
    metrics = _eval(checkpoint, classes / "eval")
    _run(["predict", "--checkpoint", checkpoint, "--input", classes / "val", "--out", classes / "pred",
          "--accelerator", "cpu"])
    rows = list(csv.DictReader((classes / "pred/predictions.csv").open()))
    names = sorted(p.name for p in (classes / "val").iterdir())
    assert len(rows) == 12 and {"file", "label", "class", "score", "top5_labels"} <= set(rows[0])
    assert all(r["class"] == names[int(r["label"])] and len(r["top5_labels"].split()) == 4 for r in rows)
    accuracy = np.mean([int(r["label"]) == names.index(Path(r["file"]).parent.name) for r in rows])
    assert accuracy == metrics["val/accuracy"]
    # The scores are the model's on the validation set's own preprocessing, image by image.
    state = load_for_eval(checkpoint)
    cfg, _ = config_from_checkpoint(state, checkpoint, recipe=None, overrides=[])
    spec = build_task(cfg)
    spec.model.load_state_dict(state["model"])
    spec.model.eval()
    with torch.no_grad():
        probs = spec.model(torch.stack([spec.val_data[i][0] for i in range(len(rows))])).softmax(-1)
    assert [r["file"] for r in rows] == [str(p) for p, _ in spec.val_data.samples]
    assert np.allclose([float(r["score"]) for r in rows], probs.max(-1).values.numpy(), atol=2e-6)


def test_classification_csv_lists_the_top_classes_by_name_with_their_probabilities(classes: Path,
                                                                                    tmp_path: Path) -> None:
    """The top-5 columns (4 here: 4 classes) hold the model's classes in decreasing probability, named by the
    class folders, the first of them repeated in the label, class and score columns."""
    from gputrain.tasks import build_task
    from gputrain.tools.from_checkpoint import config_from_checkpoint, load_for_eval

    checkpoint = classes / "run/checkpoints/last.pt"
    _run(["predict", "--checkpoint", checkpoint, "--input", classes / "val", "--out", tmp_path / "pred",
          "--accelerator", "cpu"])
    rows = list(csv.DictReader((tmp_path / "pred/predictions.csv").open()))
    names = ["circle", "cross", "square", "triangle"]  # make_classfolder's first 4 shapes, sorted
    assert sorted(p.name for p in (classes / "val").iterdir()) == names
    state = load_for_eval(checkpoint)
    cfg, _ = config_from_checkpoint(state, checkpoint, recipe=None, overrides=[])
    spec = build_task(cfg)
    spec.model.load_state_dict(state["model"])
    spec.model.eval()
    with torch.no_grad():
        probs = spec.model(torch.stack([spec.val_data[i][0] for i in range(len(rows))])).softmax(-1)
    top = probs.topk(4)
    for row, indices, values in zip(rows, top.indices.tolist(), top.values.tolist(), strict=True):
        labels = [int(k) for k in row["top5_labels"].split()]
        assert labels == indices, row
        assert row["top5_classes"].split() == [names[k] for k in indices]
        assert np.allclose([float(v) for v in row["top5_scores"].split()], values, atol=2e-6)
        assert (int(row["label"]), row["class"], row["score"]) == (labels[0], names[labels[0]],
                                                                   row["top5_scores"].split()[0])


def test_segmentation_masks_score_as_eval(ade: Path) -> None:
    metrics = _eval(ade / "run/checkpoints/last.pt", ade / "eval")
    n = 5
    confusion = np.zeros((n, n), np.int64)
    for truth_file in sorted((ade / "data/annotations/validation").iterdir()):
        truth = np.array(Image.open(truth_file)).astype(np.int64)
        stored = np.array(Image.open(ade / "pred/masks" / truth_file.name)).astype(np.int64)
        assert stored.shape == truth.shape and stored.min() >= 1 and stored.max() <= n
        assert (ade / "pred/overlays" / f"{truth_file.stem}.jpg").is_file()
        keep = truth > 0  # stored 0 is "other": not scored
        np.add.at(confusion, (truth[keep] - 1, stored[keep] - 1), 1)
    tp = np.diag(confusion).astype(np.float64)
    union = confusion.sum(0) + confusion.sum(1) - tp
    assert np.mean(tp[union > 0] / union[union > 0]) == pytest.approx(metrics["val/mIoU"], abs=1e-12)


def test_masks_of_images_of_other_shapes_are_whole_image_predictions_in_rows_and_columns(ade: Path,
                                                                                          tmp_path: Path) -> None:
    """Wide and tall images (of different shapes in one batch) get masks of their own height and width, equal to the
    model's classes on the whole image normalized by hand, also where the run's data.image_size would crop; stems
    that repeat are numbered. Planted faults: masks written transposed, an image's size passed as (W, H), a centre
    crop before predicting, repeated stems overwriting each other."""
    from gputrain.models import build_model
    from gputrain.tools.from_checkpoint import config_from_checkpoint, load_for_eval

    source = np.array(Image.open(sorted((ade / "data/images/validation").iterdir())[0]))  # 40 x 40 x 3
    shapes = {"a/tall.png": (40, 28), "a/wide.png": (24, 40), "b/wide.png": (32, 20)}  # (H, W)
    for name, (h, w) in shapes.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        Image.fromarray(source[40 - h:, :w]).save(tmp_path / name)
    checkpoint = ade / "run/checkpoints/last.pt"
    _run(["predict", "--checkpoint", checkpoint, "--input", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "pred",
          "--accelerator", "cpu", "data.image_size=24"])
    state = load_for_eval(checkpoint)
    cfg, _ = config_from_checkpoint(state, checkpoint, recipe=None, overrides=[])
    model = build_model(cfg.model.name, **cfg.model.kwargs)
    model.load_state_dict(state["model"])
    model.eval()
    mean, std = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    for name, stem in (("a/tall.png", "tall"), ("a/wide.png", "wide"), ("b/wide.png", "wide_2")):
        pixels = torch.from_numpy(np.array(Image.open(tmp_path / name))).permute(2, 0, 1)
        with torch.no_grad():
            logits = model(((pixels.float() / 255 - mean) / std)[None])
        expected = logits.argmax(1)[0].numpy() + 1
        stored = np.array(Image.open(tmp_path / "pred/masks" / f"{stem}.png")).astype(np.int64)
        assert stored.shape == shapes[name], (name, stored.shape)
        assert np.array_equal(stored, expected), name
        with Image.open(tmp_path / "pred/overlays" / f"{stem}.jpg") as overlay:
            assert overlay.size == shapes[name][::-1]  # PIL gives (W, H)
    assert sorted(p.name for p in (tmp_path / "pred/masks").iterdir()) == ["tall.png", "wide.png", "wide_2.png"]


def test_output_names_stay_unique_where_a_numbered_stem_is_also_a_files_own(tmp_path: Path) -> None:
    """a/x.png, b/x.png, c/x_2.png and d/x.png: the second x is numbered x_2, so c's own x_2 must become x_2_2 and
    the third x x_3, never a second x_2 whose mask and overlay would overwrite b's."""
    from gputrain.tools.predict.run import list_inputs

    for name in ("a/x.png", "b/x.png", "c/x_2.png", "c/y.png", "d/x.png"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        Image.new("RGB", (4, 4)).save(tmp_path / name)
    inputs = list_inputs([str(tmp_path / d) for d in ("a", "b", "c", "d")])
    assert [(i.path.relative_to(tmp_path).as_posix(), i.stem) for i in inputs] == [
        ("a/x.png", "x"), ("b/x.png", "x_2"), ("c/x_2.png", "x_2_2"), ("c/y.png", "y"), ("d/x.png", "x_3")]


def test_two_processes_write_the_same_files(ade: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "gputrain", "predict", "--devices", "2", "--accelerator", "cpu",
                           "--checkpoint", str(ade / "run/checkpoints/last.pt"),
                           "--input", str(ade / "data/images/validation"), "--out", str(ade / "pred2")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    one = sorted(p.relative_to(ade / "pred") for p in (ade / "pred").rglob("*") if p.is_file())
    two = sorted(p.relative_to(ade / "pred2") for p in (ade / "pred2").rglob("*") if p.is_file())
    assert one == two and len(one) == 10
    assert all((ade / "pred" / p).read_bytes() == (ade / "pred2" / p).read_bytes() for p in one)


def _error(args: list[str]) -> tuple[int, list[str]]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, err.getvalue().strip().splitlines()


def test_refusals_are_one_line(classes: Path, tmp_path: Path) -> None:
    checkpoint = classes / "run/checkpoints/last.pt"
    base = ["predict", "--checkpoint", checkpoint, "--accelerator", "cpu"]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    code, lines = _error([*base, "--input", classes / "val", "--out", tmp_path / "full"])
    assert code == 2 and len(lines) == 1 and "is not empty; pass --overwrite" in lines[0]
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    code, lines = _error([*base, "--input", tmp_path / "empty", "--out", tmp_path / "o1"])
    assert code == 2 and len(lines) == 1 and f"--input {tmp_path / 'empty'} holds no images" in lines[0]
    (tmp_path / "bad.jpg").write_bytes(b"not a jpeg")
    code, lines = _error([*base, "--input", tmp_path / "bad.jpg", "--out", tmp_path / "o2"])
    assert code == 2 and len(lines) == 1 and str(tmp_path / "bad.jpg") in lines[0]
    torch.save({"model": torch.load(checkpoint, weights_only=True)["model"]}, tmp_path / "bare.pt")
    code, lines = _error(["predict", "--checkpoint", tmp_path / "bare.pt", "--input", classes / "val",
                          "--out", tmp_path / "o3"])
    assert code == 2 and len(lines) == 1 and "holds no saved config, so no task" in lines[0]
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
    code, _ = _error([*base, "--input", classes / "val", "--out", tmp_path / "full", "--overwrite"])
    assert code == 0 and (tmp_path / "full" / "notes.txt").is_file() and (tmp_path / "full/predictions.csv").is_file()


def test_predict_needs_no_training_data(classes: Path, tmp_path: Path) -> None:
    """On a machine without the training set, classes are written by index (names come from its folders)."""
    _run(["predict", "--checkpoint", classes / "run/checkpoints/last.pt", "--out", tmp_path / "pred",
          "--accelerator", "cpu", "--input", classes / "val/circle/00000.jpg",  # overrides after --input's files
          f"data.root={tmp_path / 'gone'}", f"data.val_root={tmp_path / 'gone'}"])
    (row,) = list(csv.DictReader((tmp_path / "pred/predictions.csv").open()))
    assert row["file"] == str(classes / "val/circle/00000.jpg") and row["class"] == row["label"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
def test_detection_json_scores_as_eval_with_the_annotation_ids(tmp_path: Path) -> None:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    from gputrain.data.coco_sample import make_coco

    make_coco(tmp_path / "coco", num_images=15, size=64, seed=0)
    _run(["train", "coco-maskrcnn", "--epochs", "1", "--batch-size", "2", "--out", tmp_path / "run", *QUIET,
          f"data.root={tmp_path / 'coco'}", "model.kwargs.backbone=resnet18", "model.kwargs.min_size=64",
          "model.kwargs.max_size=64", "trainer.checkpoint_every_n_epochs=0"])
    checkpoint = tmp_path / "run/checkpoints/last.pt"
    metrics = _eval(checkpoint, tmp_path / "eval")
    val_json = tmp_path / "eval/splits/instances_val.json"
    val = json.loads(val_json.read_text())
    files = [tmp_path / "coco/images" / im["file_name"] for im in sorted(val["images"], key=lambda im: im["id"])]
    _run(["predict", "--checkpoint", checkpoint, "--input", *files, "--out", tmp_path / "pred", "--accelerator", "cpu"])
    results = json.loads((tmp_path / "pred/predictions.json").read_text())
    ids = {im["id"] for im in val["images"]}
    assert results and {r["image_id"] for r in results} <= ids
    assert {r["category_id"] for r in results} <= {c["id"] for c in val["categories"]}
    assert len(list((tmp_path / "pred/overlays").iterdir())) == len(files)
    with contextlib.redirect_stdout(io.StringIO()):
        truth = COCO(str(val_json))
        for iou_type, drop in (("bbox", "segmentation"), ("segm", "bbox")):  # loadRes takes areas from boxes
            found = COCOeval(truth, truth.loadRes([{k: v for k, v in r.items() if k != drop} for r in results]),
                             iouType=iou_type)
            found.params.imgIds = sorted(ids)
            found.evaluate()
            found.accumulate()
            found.summarize()
            assert found.stats[0] == metrics[f"val/{iou_type}_mAP"]
            assert found.stats[1] == metrics[f"val/{iou_type}_mAP50"]


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
def test_detections_take_the_annotation_files_ids(tmp_path: Path) -> None:
    from torchcodec.encoders import JpegEncoder

    from gputrain.tasks.detection import DetectionTask
    from gputrain.tools.predict.run import list_inputs

    for name in ("img_3.jpg", "img_5.jpg", "new.jpg"):
        JpegEncoder(torch.full((3, 16, 16), 90, dtype=torch.uint8)).to_file(tmp_path / name)
    task = DetectionTask(tmp_path / "instances.json", {1: 7, 2: 9}, class_names=["background", "cat", "dog"],
                         image_ids={"images/img_3.jpg": 3, "img_5.jpg": 5})
    masks = torch.zeros(2, 1, 16, 16, dtype=torch.bool)
    masks[:, :, 2:8, 2:8] = True
    result = {"boxes": torch.tensor([[2.0, 2.0, 8.0, 8.0], [1.0, 1.0, 4.0, 5.0]]), "labels": torch.tensor([2, 1]),
              "scores": torch.tensor([0.9, 0.6]), "masks": masks}
    inputs = list_inputs([str(tmp_path / n) for n in ("new.jpg", "img_5.jpg", "img_3.jpg")])
    (tmp_path / "out").mkdir()
    task.write_predictions(inputs, [result, result, result], tmp_path / "out")
    entries = json.loads((tmp_path / "out/predictions.json").read_text())
    assert [e["image_id"] for e in entries] == [3, 3, 5, 5, 6, 6]  # sorted by id; new.jpg gets one past the file's
    assert [e["category_id"] for e in entries[:2]] == [9, 7]
    assert entries[0]["bbox"] == [2.0, 2.0, 6.0, 6.0] and entries[0]["segmentation"]["size"] == [16, 16]
    assert sorted(p.name for p in (tmp_path / "out/overlays").iterdir()) == ["img_3.jpg", "img_5.jpg", "new.jpg"]


def test_predict_runs_the_model_in_the_layout_the_config_resolves(classes: Path, tmp_path: Path) -> None:
    """``gputrain predict`` applies the run's speed options as ``gputrain eval`` does: with channels-last, weights
    and input batches reach the convolutions in that layout, and the predictions stay those of the default layout.
    Planted fault: predict puts the model in channels-last but hands it batches as they come."""
    checkpoint = classes / "run/checkpoints/last.pt"
    seen: list[tuple[bool, bool]] = []

    def record(module: torch.nn.Module, args: tuple) -> None:
        if isinstance(module, torch.nn.Conv2d):
            seen.append((args[0].is_contiguous(memory_format=torch.channels_last),
                         module.weight.is_contiguous(memory_format=torch.channels_last)))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        _run(["predict", "--checkpoint", checkpoint, "--input", classes / "val", "--out", tmp_path / "last",
              "--accelerator", "cpu", "trainer.channels_last=true"])
    finally:
        handle.remove()
    assert seen and seen[0] == (True, True)  # the stem sees the batch as predict delivered it
    _run(["predict", "--checkpoint", checkpoint, "--input", classes / "val", "--out", tmp_path / "plain",
          "--accelerator", "cpu"])
    last, plain = (list(csv.DictReader((tmp_path / name / "predictions.csv").open())) for name in ("last", "plain"))
    assert [r["label"] for r in last] == [r["label"] for r in plain]
    assert np.allclose([float(r["score"]) for r in last], [float(r["score"]) for r in plain], atol=1e-5)


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
def test_an_image_whose_name_the_annotation_file_holds_twice_gets_a_new_id(tmp_path: Path) -> None:
    """Two images of the file share the name img.jpg (in two folders): which one was given is unknown, so it is
    numbered past the file's ids rather than scored against either's annotations."""
    from torchcodec.encoders import JpegEncoder

    from gputrain.tasks.detection import DetectionTask
    from gputrain.tools.predict.run import list_inputs

    for name in ("img.jpg", "only.jpg"):
        JpegEncoder(torch.full((3, 16, 16), 90, dtype=torch.uint8)).to_file(tmp_path / name)
    task = DetectionTask(tmp_path / "instances.json", {1: 7}, class_names=["background", "cat"],
                         image_ids={"train/img.jpg": 4, "val/img.jpg": 7, "val/only.jpg": 2})
    result = {"boxes": torch.tensor([[2.0, 2.0, 8.0, 8.0]]), "labels": torch.tensor([1]), "scores": torch.tensor([0.9])}
    (tmp_path / "out").mkdir()
    task.write_predictions(list_inputs([str(tmp_path / "img.jpg"), str(tmp_path / "only.jpg")]), [result, result],
                           tmp_path / "out")
    entries = json.loads((tmp_path / "out/predictions.json").read_text())
    assert [(e["image_id"], e["category_id"]) for e in entries] == [(2, 7), (8, 7)]
