"""Runs written by an older gputrain keep working (issue 29): the fixture is a run folder that gputrain 0.1.0 wrote
at commit 3c7c9bd, before the package was reorganised (its config still names ``trainer.checkpoint_process``,
removed since). Its checkpoint must evaluate to the metrics that version printed, and the run must resume to the
figures of that version's uninterrupted two-epoch run, bit for bit on this CPU.

How the fixture was made is in its ``expected.json``; the data is generated again here with the same seed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gputrain.cli import main
from gputrain.data.imagefolder import make_frames

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "run_of_0.1.0_3c7c9bd"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


@pytest.fixture(scope="module")
def frames(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_frames(tmp_path_factory.mktemp("old") / "frames", count=24, size=40, videos=2, seed=3)


def test_an_old_checkpoint_evaluates_to_the_metrics_its_version_printed(frames, tmp_path, capsys):
    code = main(["eval", "--checkpoint", str(FIXTURE / "checkpoints" / "last.pt"), "--data-root", str(frames),
                 "--out", str(tmp_path / "eval")])
    assert code == 0, capsys.readouterr().err
    metrics = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert metrics["val/samples"] == EXPECTED["eval"]["val/samples"]
    assert metrics["val/loss"] == pytest.approx(EXPECTED["eval"]["val/loss"], rel=1e-6)


def test_an_old_run_resumes_to_its_versions_uninterrupted_run(frames, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    (run / "expected.json").unlink()
    code = main(["train", "autoencoder", f"data.root={frames}", "--devices", "1", "--epochs", "2", "--batch-size", "4",
                 "--out", str(run), "--resume", "auto"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"gputrain: resumed from {run / 'checkpoints' / 'epoch_0001.pt'} at the start of epoch 2" in out
    final = json.loads((run / "summary.json").read_text())["final"]
    expected = EXPECTED["two_epochs_uninterrupted"]
    assert final["train/samples"] == expected["train/samples"] and final["train/steps"] == expected["train/steps"]
    assert final["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-6)
    assert final["val/loss"] == pytest.approx(expected["val/loss"], rel=1e-6)
    # The resumed run's own records say what ran now: no removed key comes back.
    assert "checkpoint_process" not in (run / "config.yaml").read_text()
