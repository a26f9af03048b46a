"""``--resume auto`` in one process: it names the damaged files it skips and the one it uses, says so when a folder
holds no checkpoint, and a resumed epoch logs the loss and samples of the uninterrupted run (issues 15 and 28).

Each run is a real ``Trainer.fit`` of a tiny model in this process (tests/tiny_fit.py); the planted fault a test
exists for is named in its docstring.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tiny_fit import _fit


# -- --resume auto says what it skipped and where it continues (issue 15 item 8) ----------------------
def test_resume_auto_names_the_damaged_file_it_skips_the_one_it_uses_and_each_count(tmp_path, capsys):
    _fit(tmp_path, epochs=1, checkpoint_every_n_steps=1)  # 2 steps: step_000001.pt mid-epoch, then the epoch's end
    folder = tmp_path / "checkpoints"
    with open(folder / "last.pt", "r+b") as f:  # epoch_0001.pt is the same file (a hard link): damaged too
        f.truncate(100)
    capsys.readouterr()
    _fit(tmp_path, epochs=2, resume="auto")
    captured = capsys.readouterr()
    skipped = [line for line in captured.err.splitlines() if line.startswith("gputrain: skipping checkpoint")]
    assert {line.split()[3].rstrip(":") for line in skipped} == {str(folder / "last.pt"), str(folder / "epoch_0001.pt")}
    assert all("truncated" in line or "bytes" in line for line in skipped), skipped
    assert f"gputrain: --resume auto uses {folder / 'step_000001.pt'}, the newest intact checkpoint" in captured.err
    assert (f"gputrain: resumed from {folder / 'step_000001.pt'} at epoch 1, after step 1 of that epoch "
            "(global step 1)") in captured.out.splitlines()
    from gputrain.checkpoint.state import TrainState, resumed_line

    assert resumed_line("ck.pt", TrainState(epoch=1, global_step=2)) == \
        "gputrain: resumed from ck.pt at the start of epoch 2 (global step 2)"


def test_resume_auto_into_a_folder_without_checkpoints_says_a_new_run_starts(tmp_path, capsys):
    """issue 28 item 4: a mistyped --out in a requeue script retrained from zero without a word."""
    _fit(tmp_path / "typo", epochs=1, resume="auto")
    out = capsys.readouterr().out.splitlines()
    assert f"gputrain: --resume auto found no checkpoint in {tmp_path / 'typo' / 'checkpoints'}; a new run starts" in out
    _fit(tmp_path / "typo", epochs=2, resume="auto")  # a folder with a checkpoint: no such line
    assert "found no checkpoint" not in capsys.readouterr().out


def _records(out: Path) -> tuple[dict[int, dict[str, Any]], dict[int, float]]:
    """metrics.jsonl as (epoch -> its last epoch record, step -> its last logged train/loss)."""
    import json

    epochs, steps = {}, {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "time/epoch_s" in record:
            epochs[record["epoch"]] = record
        elif "train/loss" in record:
            steps[record["step"]] = record["train/loss"]
    return epochs, steps


@pytest.mark.parametrize("stop_after", [4, 2], ids=["on-the-epochs-last-step", "inside-a-log-window"])
def test_a_resumed_epoch_logs_the_loss_and_samples_of_the_uninterrupted_run(tmp_path, stop_after):
    """issue 28 item 3: a stop on an epoch's last step made the resumed run log train/loss=0 for that epoch (a dip
    to 0 in curves.png); a stop inside a log window lost the window's first steps. Planted faults: the checkpoint
    carries no loss sums; a resumed epoch starts its sums at 0."""
    import signal

    from gputrain.engine.hooks import Hook
    from gputrain.errors import Interrupted

    class Stop(Hook):
        def after_step(self, ctx, logs):
            if ctx.state.global_step == stop_after:
                signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # the run's handler, as if SIGTERM came now

    common = dict(n=16, batch_size=4, epochs=2, log_every_n_steps=3, loggers=["csv"])
    _fit(tmp_path / "whole", **common)
    with pytest.raises(Interrupted):
        _fit(tmp_path / "stopped", hooks=[Stop()], **common)
    _fit(tmp_path / "stopped", resume="auto", **common)
    whole, resumed = _records(tmp_path / "whole"), _records(tmp_path / "stopped")
    for epoch in (1, 2):
        for key in ("train/loss", "train/samples", "train/steps", "val/loss"):
            assert resumed[0][epoch][key] == whole[0][epoch][key], (epoch, key)
    assert resumed[0][1]["train/samples"] == 16 and resumed[0][1]["train/loss"] > 0
    assert resumed[1] == whole[1]  # every step's logged loss too
