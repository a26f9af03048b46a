"""``gputrain predict`` of a classifier: the CSV's accuracy scores exactly as ``gputrain eval`` does (scored here
independently), its top classes are the model's, named by the class folders; the model runs in the layout the config
resolves; no training data is needed; every refusal is one line with exit 2."""

from __future__ import annotations

import contextlib
import csv
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from gputrain.cli import main
from gputrain.data.classfolder import make_classfolder
from predict_runs import QUIET, _eval, _run

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def classes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cls")
    make_classfolder(root / "train", classes=4, per_class=6, size=32, seed=0)
    make_classfolder(root / "val", classes=4, per_class=3, size=32, seed=1)
    _run(["train", "imagefolder-resnet50", "--epochs", "2", "--batch-size", "8", "--out", root / "run", *QUIET,
          f"data.root={root / 'train'}", f"data.val_root={root / 'val'}", "data.image_size=32",
          "model.name=resnet18", "model.kwargs.cifar_stem=false", "optim.lr=0.01"])
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
