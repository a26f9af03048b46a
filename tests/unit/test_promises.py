"""The README's one-process promises, each checked so that its planted fault fails it (``make mutants``).

* Checkpoints are written: the exact set of files, readable by the group like a plain ``torch.save``,
  and temporaries a killed save left behind are removed at the next start.
* A diverged run writes nothing non-finite, ends with :class:`~gputrain.errors.NonFiniteError` (exit 3)
  whether or not checkpointing is on, and names the last good checkpoint, which holds finite values; a signal's
  stop at a diverged step ends the same way, without writing that step.
* Training reads every sample once per epoch, whatever the dataset size.

Each run is a real ``Trainer.fit`` of a tiny model in this process (no workers; tests/tiny_fit.py); the planted
fault a test exists for is named in its docstring. What ``--resume auto`` says: test_resume_auto.py; issue 15's
faults that only slow tests caught: test_issue_15_faults.py.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gputrain.config import OptimConfig, SchedulerConfig
from gputrain.errors import EXIT_DIVERGED, NonFiniteError
from tiny_fit import _fit


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
