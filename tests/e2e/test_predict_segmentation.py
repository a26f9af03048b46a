"""``gputrain predict`` of a segmentation model: the PNG masks score exactly as ``gputrain eval`` does (numpy mIoU,
computed here), images of other shapes get whole-image masks in rows and columns, output names stay unique, and 1
and 2 processes write the same files."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from forked_cli import run_gputrain
from gputrain.data.ade20k import make_ade20k
from predict_runs import QUIET, _eval, _run

torch.set_num_threads(1)


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
    from gputrain.tools.predict.run import list_inputs, write_renamed

    for name in ("a/x.png", "b/x.png", "c/x_2.png", "c/y.png", "d/x.png"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        Image.new("RGB", (4, 4)).save(tmp_path / name)
    inputs = list_inputs([str(tmp_path / d) for d in ("a", "b", "c", "d")])
    assert [(i.path.relative_to(tmp_path).as_posix(), i.stem) for i in inputs] == [
        ("a/x.png", "x"), ("b/x.png", "x_2"), ("c/x_2.png", "x_2_2"), ("c/y.png", "y"), ("d/x.png", "x_3")]
    # inputs.csv names the file of each output (a new user could not tell which frame_0000_2 was whose).
    write_renamed(inputs, tmp_path)
    rows = (tmp_path / "inputs.csv").read_text().splitlines()
    assert rows[0] == "name,file" and rows[2] == f"x_2,{tmp_path / 'b/x.png'}" and len(rows) == 6
    (tmp_path / "inputs.csv").unlink()
    write_renamed(list_inputs([str(tmp_path / "c")]), tmp_path)  # x_2.png and y.png keep their names: no file
    assert not (tmp_path / "inputs.csv").exists()


def test_two_processes_write_the_same_files(ade: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = run_gputrain(["predict", "--devices", "2", "--accelerator", "cpu", "--checkpoint",
                         str(ade / "run/checkpoints/last.pt"), "--input", str(ade / "data/images/validation"), "--out",
                         str(ade / "pred2")], env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    one = sorted(p.relative_to(ade / "pred") for p in (ade / "pred").rglob("*") if p.is_file())
    two = sorted(p.relative_to(ade / "pred2") for p in (ade / "pred2").rglob("*") if p.is_file())
    assert one == two and len(one) == 10
    assert all((ade / "pred" / p).read_bytes() == (ade / "pred2" / p).read_bytes() for p in one)
