"""``--weights ema`` through the tools: a classifier trained from the command line with ``trainer.ema_decay``,
then ``gputrain eval`` gives the run's last ``val_ema`` metrics, ``predict`` the labels that evaluation scored, and
``export onnx`` the EMA model; ``--weights ema`` of a checkpoint without an EMA is one line (the options' ranges:
tests/unit/test_config_ranges.py)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import torch

from gputrain.checkpoint import load_checkpoint
from gputrain.cli import main
from gputrain.data.classfolder import make_classfolder
from gputrain.tools.export import model_from_checkpoint
from predict_runs import QUIET, _run

torch.set_num_threads(1)


def test_eval_predict_and_export_use_the_ema_with_weights_ema(tmp_path: Path, capsys) -> None:
    make_classfolder(tmp_path / "train", classes=3, per_class=6, size=32, seed=0)
    make_classfolder(tmp_path / "val", classes=3, per_class=3, size=32, seed=1)
    run = tmp_path / "run"
    _run(["train", "imagefolder-resnet50", "--epochs", "2", "--batch-size", "6", "--out", run, *QUIET,
          f"data.root={tmp_path / 'train'}", f"data.val_root={tmp_path / 'val'}", "data.image_size=32",
          "model.name=resnet18", "optim.lr=0.05", "trainer.ema_decay=0.5", "trainer.ema_every_n_steps=1",
          "trainer.ema_adjust=false", "scheduler.warmup_steps=0"])
    assert "ema=0.5/1steps" in capsys.readouterr().out
    final = json.loads((run / "summary.json").read_text())["final"]
    assert final["val_ema/loss"] != final["val/loss"]
    checkpoint = run / "checkpoints/last.pt"
    _run(["eval", "--checkpoint", checkpoint, "--weights", "ema", "--out", tmp_path / "eval", "--accelerator", "cpu",
          "trainer.progress_bar=false"])
    evaluated = json.loads((tmp_path / "eval/eval.json").read_text())
    for key in ("loss", "accuracy", "samples"):
        assert evaluated[f"val/{key}"] == final[f"val_ema/{key}"], key
    _run(["predict", "--checkpoint", checkpoint, "--weights", "ema", "--input", tmp_path / "val", "--out",
          tmp_path / "pred", "--accelerator", "cpu"])
    rows = list(csv.DictReader((tmp_path / "pred/predictions.csv").open()))
    names = sorted(p.name for p in (tmp_path / "val").iterdir())
    assert np.mean([int(r["label"]) == names.index(Path(r["file"]).parent.name) for r in rows]) == \
        final["val_ema/accuracy"]
    model, _ = model_from_checkpoint(checkpoint, weights="ema")
    ema = load_checkpoint(checkpoint)["ema"]["weights"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ema.items())
    _run(["export", "onnx", "--checkpoint", checkpoint, "--weights", "ema", "--out", tmp_path / "model.onnx"])
    assert (tmp_path / "model.onnx").is_file()


def test_a_checkpoint_without_an_ema_and_a_monitor_of_no_metric_are_one_line(tmp_path: Path, capsys) -> None:
    make_classfolder(tmp_path / "train", classes=2, per_class=4, size=16, seed=0)
    run = tmp_path / "run"
    _run(["train", "imagefolder-resnet50", "--epochs", "1", "--batch-size", "4", "--out", run, *QUIET,
          f"data.root={tmp_path / 'train'}", "data.image_size=16", "model.name=resnet18", "data.val_fraction=0.25",
          "trainer.monitor=val/acc"])
    warned = [line for line in capsys.readouterr().err.splitlines() if "trainer.monitor" in line]
    assert warned == ["gputrain: warning: trainer.monitor=val/acc is not a metric of this run (val/accuracy, "
                      "val/loss, val/samples); no best.pt is written: set trainer.monitor to one of these"]
    assert main(["eval", "--checkpoint", str(run / "checkpoints/last.pt"), "--weights", "ema", "--accelerator",
                 "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no moving average of the weights (its run had trainer.ema_decay=0); drop " \
        "--weights ema" in err[0], err
