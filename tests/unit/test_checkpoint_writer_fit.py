"""Checkpoints written in a background thread (trainer.async_checkpoint) during ``Trainer.fit``: same content,
same safety.

* Async and sync runs write checkpoints that load to the same state, file for file, also when a hook edits the
  weights in place after the epoch's save.
* ``fit`` returns with every checkpoint on disk and the writer idle, and leaves no temporary whether it ends or
  fails; a resume from an async checkpoint ends bitwise equal to the uninterrupted run.
* A failed last save fails the end of training with one line naming the file.
* A signal's stop names its checkpoint only once the file is on disk.

Runs are real ``Trainer.fit`` calls of a tiny model in this process; the writer on its own:
test_checkpoint_writer.py.
"""

from __future__ import annotations

import io
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from checkpoint_helpers import assert_same_state
from gputrain import Trainer
from gputrain.checkpoint import load_checkpoint
from gputrain.checkpoint.manifest import read_manifest
from gputrain.checkpoint.snapshot import CheckpointWriteError
from gputrain.config import OptimConfig, RunConfig
from gputrain.engine.hooks import Hook, RunContext


def _fit(out: Path, model: nn.Module | None = None, **trainer: Any) -> Trainer:
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 4, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    options: dict[str, Any] = dict(strategy="single", accelerator="cpu", progress_bar=False, loggers=[],
                                   batch_size=8, epochs=2, out=str(out), checkpoint_every_n_steps=1, keep_last=10)
    t = Trainer(RunConfig(optim=OptimConfig(name="sgd", lr=0.05, momentum=0.9)), **(options | trainer))
    t.fit(model, data, TensorDataset(x[:8], x[:8].sum(1, keepdim=True)), loss=F.mse_loss)
    return t


def test_async_and_sync_checkpoints_load_to_the_same_state(tmp_path):
    fast = _fit(tmp_path / "async", async_checkpoint=True)
    slow = _fit(tmp_path / "sync", async_checkpoint=False)
    assert fast.checkpointer.writer.asynchronous and not slow.checkpointer.writer.asynchronous
    names = sorted(p.name for p in (tmp_path / "async" / "checkpoints").glob("*.pt"))
    assert names == sorted(p.name for p in (tmp_path / "sync" / "checkpoints").glob("*.pt"))
    assert names == ["epoch_0001.pt", "epoch_0002.pt", "last.pt", "step_000001.pt", "step_000002.pt",
                     "step_000004.pt", "step_000005.pt"]
    for name in names:
        a = load_checkpoint(tmp_path / "async" / "checkpoints" / name)
        b = load_checkpoint(tmp_path / "sync" / "checkpoints" / name)
        config_a, config_b = a.pop("config"), b.pop("config")
        assert_same_state(a, b)
        for config in (config_a, config_b):  # the only differences: where, and which way, it was written
            for key in ("out", "async_checkpoint"):
                config["trainer"].pop(key)
        assert config_a == config_b
    listed = [{n: (e["seq"], e["step"], e["epoch"], e.get("same_as")) for n, e in read_manifest(folder)["files"].items()}
              for folder in (tmp_path / "async" / "checkpoints", tmp_path / "sync" / "checkpoints")]
    assert listed[0] == listed[1]  # the same saves, in the same order, under the same names


def test_fit_returns_with_every_checkpoint_on_disk(tmp_path):
    """Planted fault: the end of training does not wait for the writer."""
    t = _fit(tmp_path, async_checkpoint=True)
    assert t.checkpointer.writer.idle  # the last save was collected, its error (if any) raised
    manifest = read_manifest(tmp_path / "checkpoints")
    assert manifest["pending"] == {} and manifest["files"]["last.pt"]["step"] == t.state.global_step == 6
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["state"]["global_step"] == 6


def test_resume_from_an_async_checkpoint_equals_the_uninterrupted_run(tmp_path):
    whole = _fit(tmp_path / "whole", async_checkpoint=True)
    middle = tmp_path / "whole" / "checkpoints" / "step_000004.pt"  # epoch 2, after its first step
    assert load_checkpoint(middle)["state"]["step_in_epoch"] == 1
    resumed = _fit(tmp_path / "resumed", async_checkpoint=True, resume=str(middle))
    assert resumed.state.global_step == whole.state.global_step
    for key, value in whole.module.state_dict().items():
        assert torch.equal(value, resumed.module.state_dict()[key]), key


class _BreakTheLastEpochsSave(Hook):
    """Before the last epoch, move the checkpoint folder away and leave a file in its place (no folder can be made)."""

    def before_epoch(self, ctx: RunContext) -> None:
        if ctx.state.epoch == ctx.cfg.trainer.epochs - 1:
            ctx.wait_for_checkpoints()  # epoch 1's save is on disk before its folder moves
            (ctx.out / "checkpoints").rename(ctx.out / "moved")
            (ctx.out / "checkpoints").write_text("")


def test_a_failed_last_save_fails_the_end_of_training_in_one_line(tmp_path):
    """Planted fault: the end of training does not wait for the writer (its error would be lost)."""
    with pytest.raises(CheckpointWriteError) as caught:
        _fit(tmp_path, async_checkpoint=True, checkpoint_every_n_steps=0, hooks=[_BreakTheLastEpochsSave()])
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint {tmp_path / 'checkpoints' / 'epoch_0002.pt'} was not written")
    assert load_checkpoint(tmp_path / "moved" / "epoch_0001.pt")["state"]["epoch"] == 1  # the one before


class _FailAfter(Hook):
    def __init__(self, step: int) -> None:
        self.step = step

    def after_step(self, ctx: RunContext, logs: Any) -> None:
        if ctx.state.global_step == self.step:
            raise RuntimeError("planted failure")


def test_no_temporary_is_left_behind_when_training_ends_or_fails(tmp_path):
    """Every file of a save is renamed into place or removed: a fit that ends, normally or not, leaves no hidden
    temporary in the folder. Planted fault: the end of fit does not wait for the save in flight."""
    _fit(tmp_path / "ends", async_checkpoint=True, keep_last=2, epochs=3)
    assert not [p.name for p in (tmp_path / "ends" / "checkpoints").iterdir() if p.name.startswith(".")]
    with pytest.raises(RuntimeError, match="planted failure"):
        _fit(tmp_path / "fails", async_checkpoint=True, keep_last=2, epochs=3, hooks=[_FailAfter(7)])
    folder = tmp_path / "fails" / "checkpoints"
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]
    assert load_checkpoint(folder / "last.pt")["state"]["global_step"] == 6


class _RescaleAfterEachEpoch(Hook):
    """A user hook that edits the weights in place after each epoch (weight clipping, an EMA swap)."""

    def after_epoch(self, ctx: RunContext, metrics: Any) -> None:
        with torch.no_grad():
            for p in ctx.model.parameters():
                p.mul_(0.5)


def test_a_hook_that_edits_the_weights_after_the_epoch_checkpoint_does_not_reach_that_checkpoint(tmp_path):
    """The epoch checkpoint is saved by the checkpoint hook and written by the thread; a user hook after it halves
    the weights in place. The file holds the weights of the save, as a synchronous save writes them. Planted fault:
    the state is handed to the thread without a copy."""
    fast = _fit(tmp_path / "async", async_checkpoint=True, hooks=[_RescaleAfterEachEpoch()])
    slow = _fit(tmp_path / "sync", async_checkpoint=False, hooks=[_RescaleAfterEachEpoch()])
    for name in ("epoch_0001.pt", "epoch_0002.pt"):
        a = load_checkpoint(tmp_path / "async" / "checkpoints" / name)
        b = load_checkpoint(tmp_path / "sync" / "checkpoints" / name)
        assert_same_state(a["model"], b["model"])
    assert fast.state.global_step == slow.state.global_step


class _SignalAtStep(Hook):
    def __init__(self, step: int) -> None:
        self.step = step

    def after_step(self, ctx: RunContext, logs: Any) -> None:
        if ctx.state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)  # what SLURM sends before it kills a job; the loop's handler is set


class _CheckpointOnDiskWhenNamed(io.StringIO):
    """stdout that notes, as each line naming a checkpoint is printed, whether that file is on disk yet."""

    def __init__(self) -> None:
        super().__init__()
        self.named: list[tuple[Path, bool]] = []

    def write(self, text: str) -> int:
        found = re.search(r"; checkpoint (\S+);", text)
        if found:
            self.named.append((Path(found[1]), Path(found[1]).exists()))
        return super().write(text)


def test_a_signal_stop_names_its_checkpoint_only_once_the_file_is_on_disk(tmp_path, monkeypatch):
    """The "interrupted ...; checkpoint PATH; ..." line tells the user (and SLURM's grace period) that it is safe to
    go: the file must be there when it is printed. The thread's write is held 0.3 s so that a line printed
    without waiting comes first. Planted fault: the signal's save not waited for."""
    import time

    from gputrain.checkpoint import files
    from gputrain.errors import Interrupted

    write = files.write_temporary

    def late_write(state: Any, folder: Path, name: str) -> Any:
        time.sleep(0.3)
        return write(state, folder, name)

    monkeypatch.setattr(files, "write_temporary", late_write)  # what every writer of the run uses
    stdout = _CheckpointOnDiskWhenNamed()
    monkeypatch.setattr(sys, "stdout", stdout)
    with pytest.raises(Interrupted) as caught:
        _fit(tmp_path, async_checkpoint=True, checkpoint_every_n_steps=0, hooks=[_SignalAtStep(2)])
    saved = tmp_path / "checkpoints" / "step_000002.pt"
    assert caught.value.signum == signal.SIGUSR1 and f"; checkpoint {saved};" in str(caught.value)
    assert stdout.named == [(saved, True)]  # printed once, with the file already there
    assert load_checkpoint(saved)["state"]["global_step"] == 2
