"""Every tool reads a sharded checkpoint (``parallel.sharded_checkpoint=true``), gathering its folder in one process.

issue 28 item 2: the run resumed from such checkpoints, but ``eval``, ``export onnx``, ``predict`` and ``report``
failed with "does not fit the model ... missing from the checkpoint", which sent users hunting for wrong model
settings. One FSDP run on 2 real ranks writes the checkpoint; each tool then reads it as a user runs it: the
2-process eval and the refused copy as ``gputrain`` processes, the one-process tools through ``gputrain.cli.main`` in
this process (the command's code, without its interpreter's seconds of imports).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from forked_cli import run_gputrain
from gputrain.data.imagefolder import make_frames

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
MODELS = '''
from torch import nn

def tiny_ae(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, 3, 3, padding=1))
'''
TINY = ("--accelerator", "cpu", "--batch-size", "4", "trainer.progress_bar=false", "trainer.pictures=0",
        "model.name=sharded_models:tiny_ae", "model.kwargs.width=4")


def gputrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_gputrain(args, env=ENV, cwd=cwd, timeout=600)


@pytest.fixture
def gputrain_here(capsys, monkeypatch):
    """``gputrain`` of one process run in this one (``gputrain.cli.main``, what the command runs, without a new
    interpreter's seconds of imports), in the folder ``cwd`` as :func:`gputrain` runs it: user code found there."""

    def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
        from gputrain.cli import main

        monkeypatch.chdir(cwd)
        monkeypatch.syspath_prepend(str(cwd))  # where `python -m gputrain` finds sharded_models; undone after
        capsys.readouterr()  # only this command's output
        code = main([str(a) for a in args])
        return subprocess.CompletedProcess(["gputrain", *args], code, *capsys.readouterr())

    return run


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sharded")
    make_frames(root / "data" / "frames", count=16, size=32, videos=2)
    (root / "sharded_models.py").write_text(MODELS)
    done = gputrain("train", "autoencoder", *TINY, "--strategy", "fsdp", "--devices", "2", "--epochs", "1",
                    "--out", "run", "parallel.sharded_checkpoint=true", cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (root / "run" / "checkpoints" / "epoch_0001.dcp" / ".metadata").is_file()
    return root, root / "run"


@pytest.mark.parametrize("devices", ["1", "2"])
def test_eval_of_a_sharded_checkpoint_equals_the_runs_logged_val_loss(sharded_run, devices, gputrain_here):
    root, run = sharded_run
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val_loss = [r["val/loss"] for r in logged if "val/loss" in r][-1]
    command = gputrain if devices == "2" else gputrain_here  # 2: a real launcher and its torchrun workers
    done = command("eval", "--checkpoint", run / "checkpoints" / "last.pt", "--devices", devices,
                   "--accelerator", "cpu", "--out", f"eval{devices}", cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    evaluated = json.loads((root / f"eval{devices}" / "eval.json").read_text())["val/loss"]
    if devices == "2":  # the run's own layout: the same batches, the same sums, every digit
        assert evaluated == val_loss
    else:  # one process batches the samples differently: float32 batch means differ in their last bits
        assert evaluated == pytest.approx(val_loss, rel=1e-6)


def test_export_predict_and_report_read_a_sharded_checkpoint(sharded_run, gputrain_here):
    root, run = sharded_run
    checkpoint = run / "checkpoints" / "last.pt"
    done = gputrain_here("export", "onnx", "--checkpoint", checkpoint, "--out", "model.onnx", cwd=root)
    assert done.returncode == 0 and (root / "model.onnx").stat().st_size > 0, done.stderr[-2000:]
    done = gputrain_here("predict", "--checkpoint", checkpoint, "--input", root / "data" / "frames" / "video_00",
                         "--out", "predictions", "--accelerator", "cpu", cwd=root)
    assert done.returncode == 0 and any((root / "predictions").iterdir()), done.stderr[-2000:]
    done = gputrain_here("report", run, cwd=root)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_sharded_checkpoint_copied_without_its_folder_names_the_folder(sharded_run, tmp_path):
    # A process of its own: the promise is the whole of what the user sees on stderr, warnings included.
    root, run = sharded_run
    lone = tmp_path / "last.pt"
    lone.write_bytes((run / "checkpoints" / "last.pt").read_bytes())
    done = gputrain("eval", "--checkpoint", lone, "--accelerator", "cpu", "--out", tmp_path / "eval", cwd=root)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"its weights are in the folder {tmp_path / 'epoch_0001.dcp'}, which is missing" in lines[0]
