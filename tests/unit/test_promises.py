"""The README's one-process promises, each checked so that its planted fault fails it (``make mutants``).

* Checkpoints are written: the exact set of files, readable by the group like a plain ``torch.save``,
  and temporaries a killed save left behind are removed at the next start.
* A diverged run writes nothing non-finite, ends with :class:`~gputrain.errors.NonFiniteError` (exit 3)
  whether or not checkpointing is on, and names the last good checkpoint, which holds finite values; a signal's
  stop at a diverged step ends the same way, without writing that step.
* Training reads every sample once per epoch, whatever the dataset size.

Each run is a real ``Trainer.fit`` of a tiny model in this process (no workers); the planted fault a
test exists for is named in its docstring.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from gputrain import Trainer
from gputrain.config import OptimConfig, RunConfig, SchedulerConfig
from gputrain.errors import EXIT_DIVERGED, NonFiniteError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def _data(n: int, target_scale: float) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True) * target_scale)


def _fit(out: Path, *, optim: OptimConfig | None = None, scheduler: SchedulerConfig | None = None,
         n: int = 16, target_scale: float = 1.0, **trainer: Any) -> Trainer:
    cfg = RunConfig(optim=optim or OptimConfig(name="sgd", lr=0.05, momentum=0.9),
                    scheduler=scheduler or SchedulerConfig())
    options: dict[str, Any] = dict(strategy="single", accelerator="cpu", progress_bar=False, loggers=[],
                                   batch_size=8, epochs=2, out=str(out))
    # An exploding schedule (gamma > 1) is how divergence is provoked; the Trainer refuses it as a config, so it is
    # checked with gamma 1 and given the exploding one afterwards.
    explode = scheduler is not None and scheduler.gamma > 1
    if explode:
        cfg.scheduler = dataclasses.replace(cfg.scheduler, gamma=1.0)
    t = Trainer(cfg, **(options | trainer))
    if explode:
        t.cfg.scheduler.gamma = scheduler.gamma
    t.fit(_model(), _data(n, target_scale), _data(8, target_scale), loss=F.mse_loss)
    return t


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _non_finite(path: Path) -> list[str]:
    """Where ``path`` (loaded the safe way) holds NaN or inf; [] when every floating tensor is finite."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    tensors = list(_tensors(state))
    assert tensors, f"{path} holds no tensors"
    return [f"{path.name}: tensor of shape {tuple(t.shape)}" for t in tensors
            if t.is_floating_point() and not torch.isfinite(t).all()]


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)
    yield
    os.umask(previous)


# -- checkpoints are written --------------------------------------------------------------------
def test_checkpoints_are_written_with_the_expected_names(tmp_path, umask_022):
    """Faults: no checkpoint written; checkpoint files private to their writer (mode 0600)."""
    _fit(tmp_path, epochs=3, keep_last=2)
    folder = tmp_path / "checkpoints"
    # keep_last=2 retires epoch_0001; last.pt is always there. An exact set, not a loop over a glob.
    assert sorted(p.name for p in folder.iterdir()) == ["epoch_0002.pt", "epoch_0003.pt", "last.pt",
                                                         "manifest.json"]
    for path in folder.iterdir():
        assert path.stat().st_size > 0, path
        # What open(path, "w") gives under umask 022: the team can read it, as with torch.save.
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, f"{path.name}: {oct(path.stat().st_mode)}"
    state = torch.load(folder / "last.pt", weights_only=True)
    assert state["state"]["epoch"] == 3 and state["state"]["global_step"] == 6


def test_a_killed_save_leaves_no_temporary_after_the_next_start(tmp_path):
    """A worker killed mid-save leaves ``.last.pt.<random>.tmp``; the next run of the folder removes it."""
    _fit(tmp_path, epochs=1)
    stale = tmp_path / "checkpoints" / ".last.pt.1a2b3c4d.tmp"
    stale.write_bytes(b"half a checkpoint")
    _fit(tmp_path, epochs=2, resume="auto")
    assert not stale.exists()
    assert not [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.endswith(".tmp")]


def test_training_reads_every_sample_once_per_epoch(tmp_path):
    """Fault: the epoch plan repeats its first samples to fill the last step (20 samples -> 24 read)."""
    t = _fit(tmp_path, n=20, epochs=2, enable_checkpointing=False)
    assert t.steps_per_epoch == 3  # batches of 8, 8 and 4
    assert t.state.samples_seen == 40


# -- a diverged run -----------------------------------------------------------------------------
# lr 0.1 in epoch 1, 0.1 x 3e39 = 3e38 from epoch 2 on (the step schedule; still a float32, as SGD needs):
# epoch 1 trains normally, and the first update of epoch 2 (gradients in the hundreds, targets x100)
# takes the weights past float32's largest value, 3.4e38, while the loss it was computed from is finite.
EXPLODE = dict(optim=OptimConfig(name="sgd", lr=0.1, momentum=0.0), target_scale=100.0,
               scheduler=SchedulerConfig(name="step", step_epochs=1, gamma=3e39),
               log_every_n_steps=1000)  # no per-step loss check: the weights are what must be caught


def _diverge(out: Path, **trainer: Any) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        _fit(out, epochs=3, **(EXPLODE | trainer))
    assert info.value.exit_code == EXIT_DIVERGED == 3
    return info.value


def test_divergence_inside_an_epoch_writes_nothing_non_finite(tmp_path, capsys):
    """Fault: save_checkpoint writes without checking (a step checkpoint holds the overflowed weights). In the
    background (the default on a GPU) the writer thread checks its copy and skips the save with one warning."""
    error = _diverge(tmp_path, checkpoint_every_n_steps=1, async_checkpoint=True)
    skipped = [line for line in capsys.readouterr().err.splitlines() if "was not written" in line]
    assert skipped == [f"gputrain: warning: checkpoint {tmp_path / 'checkpoints' / 'step_000003.pt'} was not written: "
                       "its weights or optimizer state hold NaN/inf; the newest written checkpoint is kept, and the run "
                       "stops at its next check of the loss or the weights"]
    folder = tmp_path / "checkpoints"
    saved = sorted(p.name for p in folder.glob("*.pt"))
    assert saved == ["epoch_0001.pt", "last.pt", "step_000001.pt"]  # nothing from epoch 2
    for name in saved:
        assert _non_finite(folder / name) == []
    assert f"the last good checkpoint, {folder / 'epoch_0001.pt'}, is kept" in str(error)


def test_divergence_inside_an_epoch_stops_a_synchronous_save_before_it_writes(tmp_path):
    """With trainer.async_checkpoint=false every rank checks before writing, and the run stops at that step.
    Planted fault: save_checkpoint writes without checking."""
    error = _diverge(tmp_path, checkpoint_every_n_steps=1, async_checkpoint=False)
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.glob("*.pt")) == ["epoch_0001.pt", "last.pt", "step_000001.pt"]
    assert "the loss, weights or optimizer state became NaN/inf at epoch 2 step 3" in str(error)


def test_a_signals_stop_at_a_diverged_step_checks_before_writing_and_stops_there(tmp_path, capsys):
    """docs/checkpoints.md: the save of a signal's stop checks on every rank before writing (also with the default
    background writer) and stops at that step: the run ends with the NaN/inf error, not "interrupted" with a checkpoint
    the writer then skips. Planted fault: that save checked only in the writer thread."""
    import signal

    from gputrain.checkpoint.files import tensors_finite
    from gputrain.engine.hooks import Hook

    class SignalAtTheFirstNonFiniteStep(Hook):
        sent = False

        def after_step(self, ctx, logs):
            if not self.sent and not tensors_finite(list(ctx.model.parameters())):
                self.sent = True
                signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # the run's handler, as if SIGTERM came now

    error = _diverge(tmp_path, hooks=[SignalAtTheFirstNonFiniteStep()], async_checkpoint=True)
    assert "the loss, weights or optimizer state became NaN/inf at epoch 2 step 3" in str(error)
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.glob("*.pt")) == ["epoch_0001.pt", "last.pt"]  # no step_000003.pt
    assert "interrupted" not in capsys.readouterr().out


def test_divergence_at_the_end_of_an_epoch_keeps_the_last_good_checkpoint(tmp_path):
    """One step an epoch: the epoch's mean loss is finite, only the weights after the update are not."""
    error = _diverge(tmp_path, batch_size=16)
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.glob("*.pt")) == ["epoch_0001.pt", "last.pt"]
    for path in folder.glob("*.pt"):
        assert _non_finite(path) == []
    assert "the weights became NaN/inf at epoch 2 step 2" in str(error)
    assert str(folder / "epoch_0001.pt") in str(error)


def test_the_finiteness_check_finds_each_kind_of_non_finite_value_and_no_false_one():
    """The check before every save sums each tensor; a sum that overflows is not a NaN. Planted fault: a
    non-finite sum taken as the verdict (huge but finite state would stop a healthy run)."""
    from gputrain.checkpoint.files import tensors_finite

    huge = torch.full((8,), 3e38)  # finite, but its float32 sum is inf
    assert tensors_finite([torch.ones(3), huge, torch.full((4,), 60000.0, dtype=torch.float16)])
    assert tensors_finite([]) and tensors_finite([torch.zeros(0)])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            tensor = torch.ones(1000, dtype=dtype)
            tensor[777] = bad
            assert not tensors_finite([huge, tensor]), (bad, dtype)
    cancelling = torch.tensor([float("inf"), -float("inf")])  # its sum is NaN, not inf: still caught
    assert not tensors_finite([cancelling]) and not tensors_finite([torch.tensor([1e38, float("nan")])])


def test_divergence_without_checkpointing_still_fails(tmp_path):
    """Fault: the end-of-epoch check removed (with checkpointing off the run would end with exit 0)."""
    error = _diverge(tmp_path, batch_size=16, enable_checkpointing=False)
    assert not (tmp_path / "checkpoints").exists()
    assert "no checkpoint had been written" in str(error)


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


# -- issue 15's planted faults that only slow tests (or nothing) caught ---------------------------------
def test_segmentation_validation_loss_is_the_mean_over_labelled_pixels():
    """Fault: each batch's loss weighted by all its pixels, void ones included."""
    from gputrain.metrics.segmentation import SegmentationEvaluator

    g = torch.Generator().manual_seed(3)
    logits, targets = torch.randn(5, 4, 6, 6, generator=g), torch.randint(0, 4, (5, 6, 6), generator=g)
    for image, void_rows in enumerate((0, 1, 3, 5, 2)):  # a different number of void pixels in each image
        targets[image, :void_rows] = 255
    evaluator = SegmentationEvaluator(4)
    for batch in ([0, 1], [2, 3], [4]):
        evaluator.update(logits[batch], targets[batch], F.cross_entropy(logits[batch], targets[batch],
                                                                        ignore_index=255), len(batch))
    metrics = evaluator.compute(torch.device("cpu"))
    exact = F.cross_entropy(logits.double(), targets, ignore_index=255)  # one mean over every labelled pixel
    assert metrics["pixels"] == 5 * 36 - 6 * (0 + 1 + 3 + 5 + 2)
    assert metrics["loss"] == pytest.approx(float(exact), rel=1e-6)


def test_linear_lr_scaling_uses_the_global_batch_with_accumulation(tmp_path):
    """Fault: lr scaled from the per-device batch (8) instead of the global batch (8 x accumulation 2)."""
    optim = OptimConfig(name="sgd", lr=0.01, momentum=0.9, scale_lr="linear", reference_batch=8)
    t = _fit(tmp_path, optim=optim, epochs=1, n=32, accumulate_grad_batches=2)
    assert t.global_batch == 16
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.02)


def test_augmentation_changes_from_epoch_to_epoch_and_repeats_within_one():
    """Fault: the augmentation seed ignores the epoch (every epoch the same random crop/flip)."""
    from torch.utils.data import Dataset

    from gputrain.data.samplers import SeededSamples

    class RandomAugment(Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.rand(3)  # stands for a random transform: it draws from torch's generator

    samples = SeededSamples(RandomAugment(), seed=0)
    assert torch.equal(samples[(0, 2)], samples[(0, 2)])  # the same sample in the same epoch: the same draw
    assert not torch.equal(samples[(0, 2)], samples[(1, 2)])  # the next epoch draws anew
    assert not torch.equal(samples[(0, 2)], samples[(0, 3)])


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
