"""16-mixed: a step the loss scaler skips is not a diverged run (issue 31: DeepLabv3+'s NaN at 16-mixed).

Under float16 a GradScaler skips a step whose gradients hold inf/NaN, the usual cause being a scale still too high,
sometimes a forward that overflowed float16 (the loss itself inf). gputrain used to end the run at the first logged
inf loss. Now such a step leaves the model exactly as it was (the weights by the scaler, BatchNorm's running
statistics restored, since the forward changed them before the scaler decided), is left out of the logged loss, and
is counted (``train/skipped_steps``, with ``train/loss_scale``); only 25 skipped steps in a row end the run, in one
line saying whether the forward or only the gradients overflowed. Real ``Trainer.fit`` runs on the CPU, whose
float16 autocast and GradScaler are the same code paths as CUDA's, on a tiny model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from gputrain import Hook, Trainer
from gputrain.config import OptimConfig, RunConfig
from gputrain.errors import NonFiniteError

OVERFLOW = 1e5
"""Above float16's largest value (65,504): an input of this size makes the forward's first layer inf."""


class Record(Hook):
    """The model's state before the run and after every step, and each step's logs."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []
        self.logs: list[dict[str, float]] = []

    def _keep(self, model: nn.Module) -> None:
        self.states.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    def before_fit(self, ctx: Any) -> None:
        self._keep(ctx.model)

    def after_step(self, ctx: Any, logs: dict[str, float] | None) -> None:
        self._keep(ctx.model)
        self.logs.append(dict(logs or {}))


def _fit(out: Path, x: torch.Tensor, *, epochs: int = 2, hook: Hook | None = None, loss: Any = F.mse_loss,
         model: nn.Module | None = None, **trainer: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    y = x.clamp(-10, 10).sum(1, keepdim=True)
    options: dict[str, Any] = dict(strategy="single", accelerator="cpu", progress_bar=False, loggers=[], batch_size=4,
                                   epochs=epochs, out=str(out), precision="16-mixed", log_every_n_steps=1,
                                   hooks=[hook] if hook else [])
    run = Trainer(RunConfig(optim=OptimConfig(name="sgd", lr=0.05, momentum=0.9)), **(options | trainer))
    return run.fit(model, TensorDataset(x, y), TensorDataset(torch.ones(8, 4), torch.ones(8, 1)), loss=loss)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_forward_that_overflows_float16_is_skipped_and_leaves_the_model_as_it_was(tmp_path, capsys, accumulate):
    """Planted faults: the buffers not restored after a skipped step (BatchNorm's running mean turns NaN, and the
    epoch's check of the weights ends the run), or restored to where the step's last micro-batch began (with
    accumulation the first micro-batch's statistics stay); a skipped step's inf loss kept in the logged loss (the
    run ends); a skipped step's samples left out of images/s."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    x[5] = OVERFLOW  # one sample: the step that holds it overflows in the forward
    record = Record()
    summary = _fit(tmp_path, x, hook=record, accumulate_grad_batches=accumulate, batch_size=4 // accumulate)

    skipped = [i for i, logs in enumerate(record.logs) if logs["train/skipped_steps"] == 1.0]
    assert skipped, "the overflowing sample's step was not skipped"
    for i in skipped:  # state i is before step i (state 0: before the run), state i + 1 after it
        before, after = record.states[i], record.states[i + 1]
        assert all(torch.equal(before[k], after[k]) for k in before), f"step {i + 1} was skipped but changed the model"
        assert "train/loss" not in record.logs[i]  # a step skipped alone has no loss to log
    assert all(torch.isfinite(v).all() for v in record.states[-1].values() if v.is_floating_point())
    trained = [logs for logs in record.logs if logs["train/skipped_steps"] == 0.0]
    assert trained and all(torch.isfinite(torch.tensor(logs["train/loss"])) for logs in trained)
    scales = [logs["train/loss_scale"] for logs in record.logs]
    assert scales[0] == 2.0**15 and all(b == a / 2 for a, b, logs in zip(scales, scales[1:], record.logs[1:],
                                                                          strict=False) if logs["train/skipped_steps"])
    assert all(logs["train/images_per_s"] > 0 for logs in record.logs)  # a skipped step's samples were trained
    epoch_2_skipped = sum(logs["train/skipped_steps"] for logs in record.logs[4:])
    assert summary["final"]["train/samples"] == 16
    assert summary["final"].get("train/skipped_samples", 0) == 4 * epoch_2_skipped
    warnings = [line for line in capsys.readouterr().err.splitlines() if "overflowed float16" in line]
    assert len(warnings) == 1 and warnings[0].startswith("gputrain: warning: the loss overflowed float16 at epoch 1")


def test_a_skipped_step_is_left_out_of_the_logged_loss_not_averaged_in(tmp_path):
    """The mean a logging step reports is over the steps that trained. Planted fault: skipped samples counted in the
    loss's denominator (the logged loss shrinks by the skipped share)."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    record = Record()
    _fit(tmp_path, x, epochs=1, hook=record)
    # The epoch's loss, from the windows that trained, must equal the sample-weighted mean of the logged losses.
    trained = [logs["train/loss"] for logs in record.logs if "train/loss" in logs]
    summary = (tmp_path / "metrics.jsonl").read_text()
    assert trained and '"train/skipped_steps": 1.0' in summary  # the first steps calibrate the scale: skipped
    epoch = [line for line in summary.splitlines() if '"epoch": 1' in line and '"train/samples"' in line][-1]
    import json

    assert json.loads(epoch)["train/loss"] == pytest.approx(sum(trained) / len(trained), rel=1e-6)


def test_a_forward_that_always_overflows_ends_the_run_in_one_line_naming_the_cause(tmp_path):
    """25 skipped steps in a row end the run (exit 3), naming float16's overflow in the forward and the fix."""
    x = torch.full((120, 4), OVERFLOW)
    with pytest.raises(NonFiniteError) as info:
        _fit(tmp_path, x, epochs=1)
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 3
    # The replay of the streak's first step names the module, and the fix (issue 41).
    assert message.startswith("the gradients of 25 steps in a row (trainer.precision=16-mixed) became NaN/inf at "
                              "epoch 1 step 25; replay of step 1 (epoch 1) at precision 16-mixed: the first non-finite "
                              "value is in 0 (Linear): its output became ")
    assert "float32 makes the step finite; fix: trainer.fp32_modules=[0] (or --precision bf16-mixed); nothing " \
           "non-finite was written (no checkpoint had been written)" in message


def test_a_backward_that_always_gives_nan_gradients_ends_the_run_saying_the_loss_was_finite(tmp_path):
    """The other cause: a finite loss whose gradients are NaN/inf at any scale (here sqrt's slope at 0)."""

    def nan_gradients(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs, targets) + torch.sqrt((outputs - outputs.detach()).abs().sum())

    x = torch.randn(120, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteError) as info:
        _fit(tmp_path, x, epochs=1, loss=nan_gradients)
    assert "the loss of rank 0 is finite but its backward sends a NaN/inf gradient into the model (at the output of " \
           "2;" in str(info.value)
    assert "float32 does not make it finite, so precision is not the cause; fix: make the loss's gradient finite" \
           in str(info.value)


def test_a_window_mixing_trained_and_skipped_steps_logs_the_mean_of_the_trained_ones(tmp_path):
    """The same run logged every step and every 2 steps: each 2-step window's loss is the mean of its trained steps'
    losses, and a window with one skipped step still logs one. Planted faults: skipped samples in the mean's
    denominator; a window with any skipped step logging no loss."""
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(2))
    x[[3, 17]] = OVERFLOW
    every, pairs = Record(), Record()
    _fit(tmp_path / "every", x, epochs=1, hook=every)
    _fit(tmp_path / "pairs", x, epochs=1, hook=pairs, log_every_n_steps=2)
    windows = [every.logs[i:i + 2] for i in range(0, len(every.logs), 2)]
    mixed = 0
    for window, logged in zip(windows, [logs for logs in pairs.logs if logs], strict=True):
        trained = [logs["train/loss"] for logs in window if "train/loss" in logs]
        assert logged["train/skipped_steps"] == 2 - len(trained)
        if trained:
            assert logged["train/loss"] == pytest.approx(sum(trained) / len(trained), rel=1e-9)
        else:
            assert "train/loss" not in logged
        mixed += len(trained) == 1
    assert mixed >= 1, "no window held one trained and one skipped step: the data no longer tests the mix"


def test_an_epoch_whose_every_step_was_skipped_logs_no_loss_and_the_run_goes_on(tmp_path):
    """The scale's calibration skips the first steps; with 2 steps an epoch, the whole first epoch. Its record has
    no train/loss, the epoch's checkpoint is written, the next epoch trains. Planted faults: the epoch's NaN mean
    kept (the checkpoint refuses it and the run ends); the end-of-epoch check ignoring that no step trained."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    record = Record()
    summary = _fit(tmp_path, x, epochs=3, hook=record)
    import json

    epochs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if '"train/samples"' in line]
    assert [e.get("train/skipped_samples", 0) for e in epochs][0] == 8 and "train/loss" not in epochs[0]
    assert "train/loss" in epochs[-1] and summary["final"]["train/loss"] == epochs[-1]["train/loss"]
    assert (tmp_path / "checkpoints" / "epoch_0001.pt").is_file()


def test_only_25_skipped_steps_in_a_row_end_a_run_not_25_in_all():
    """Planted fault: the count of steps in a row not reset by a step that trained."""
    from types import SimpleNamespace

    from gputrain.engine.state import LossWindow, SkippedSteps
    from gputrain.precision import build_precision

    skips = SkippedSteps(True, build_precision("16-mixed", torch.device("cpu")))
    window, where = LossWindow(torch.device("cpu")), SimpleNamespace(epoch=0, global_step=1)
    for stepped in [False] * 24 + [True] + [False] * 24:
        assert skips.count(stepped, window, where) is None
    what, fix = skips.count(False, window, where) or ("", "")  # the 25th skipped step since the one that trained
    assert what == "the gradients of 25 steps in a row (trainer.precision=16-mixed)"
    assert fix.startswith("the loss scaler skipped each and lowered its scale to ")


class ReplacesItsBuffer(nn.Module):
    """A layer whose forward assigns a new tensor to its buffer (a running mean kept by hand), not an update in place."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen = 0.9 * self.seen + 0.1 * x.detach().float().mean(0)
        return self.linear(x)


def test_a_buffer_the_forward_replaces_is_restored_after_a_skipped_step(tmp_path):
    """Planted fault: the restore copies into the tensors the module held before the step (the stale list), so the
    module keeps its new, overflowed buffer."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    x[5] = OVERFLOW
    record = Record()
    _fit(tmp_path, x, hook=record, model=ReplacesItsBuffer())
    skipped = [i for i, logs in enumerate(record.logs) if logs["train/skipped_steps"] == 1.0]
    assert skipped
    for i in skipped:
        assert torch.equal(record.states[i]["seen"], record.states[i + 1]["seen"]), i
    assert torch.isfinite(record.states[-1]["seen"]).all()


def test_a_window_resumed_mid_way_logs_its_loss_even_if_every_step_after_the_resume_was_skipped():
    """The loss window carried by a checkpoint: the steps trained before the resume still give the window its loss,
    as the uninterrupted run logs it. Planted fault: the window's loss decided on this process's steps alone."""
    from gputrain.engine.state import LossWindow

    uninterrupted = LossWindow(torch.device("cpu"))
    uninterrupted.add(torch.tensor(2.0), 4)
    uninterrupted.end_step(stepped=True)
    carried = uninterrupted.carry()
    for window in (uninterrupted, resumed := LossWindow(torch.device("cpu"), carried)):
        window.add(torch.tensor(float("inf")), 4)
        window.end_step(stepped=False)
    assert uninterrupted.flush() == resumed.flush() == 2.0
    assert uninterrupted.flushed_counted == resumed.flushed_counted == 4
    assert uninterrupted.flushed_skipped_steps == resumed.flushed_skipped_steps == 1


def test_a_short_run_whose_steps_the_scaler_skips_while_finding_its_scale_trains_on(tmp_path):
    """A run shorter than the limit ends early only when every step overflowed in the forward (issue 41): skips whose
    loss was finite are the scaler lowering its first scale, as in the one-step runs docs/precision.md shows."""
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)) * 100
    summary = _fit(tmp_path, x, epochs=1)
    assert summary["global_step"] == 1 and summary["final"].get("train/skipped_samples") == 4
