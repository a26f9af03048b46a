"""Off a terminal (a log, a pipe, a batch job) tqdm hides the training bar; a long epoch then said nothing until its
end (found by a new user, round 5: 125 s of silence). A plain line every ``ProgressHook.LINE_EVERY_S`` instead."""

from __future__ import annotations

import re

from gputrain.cli import main
from gputrain.data.imagefolder import make_frames
from gputrain.engine.callbacks.progress import ProgressHook


def test_a_training_epoch_off_a_terminal_prints_plain_progress_lines(tmp_path, monkeypatch, capsys):
    frames = make_frames(tmp_path / "frames", count=16, size=40, videos=1)
    monkeypatch.setattr(ProgressHook, "LINE_EVERY_S", 0.0)  # a line after every step (60 s in a run)
    assert main(["train", "autoencoder", "--data-root", str(frames), "--accelerator", "cpu", "--epochs", "1",
                 "--batch-size", "4", "--out", str(tmp_path / "run"), "trainer.pictures=0",
                 "data.val_fraction=0.25", "trainer.log_every_n_steps=1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if re.match(r"epoch 1/1: step \d", line)]
    assert [int(re.search(r"step (\d+)/3", line).group(1)) for line in lines] == [1, 2, 3], lines
    assert "steps/s, about " in lines[0] and " s left, loss " in lines[0], lines[0]
    assert " s left" not in lines[-1]  # the last step: nothing left


def test_a_run_that_asks_for_no_progress_bar_prints_no_progress_lines(tmp_path, monkeypatch, capsys):
    frames = make_frames(tmp_path / "frames", count=8, size=40, videos=1)
    monkeypatch.setattr(ProgressHook, "LINE_EVERY_S", 0.0)
    assert main(["train", "autoencoder", "--data-root", str(frames), "--accelerator", "cpu", "--epochs", "1",
                 "--batch-size", "4", "--out", str(tmp_path / "run"), "trainer.pictures=0",
                 "trainer.progress_bar=false"]) == 0
    assert "epoch 1/1: step" not in capsys.readouterr().out
