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


def _fit(out: Path, x: torch.Tensor, *, epochs: int = 2, hook: Hook | None = None, loss: Any = F.mse_loss
         ) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    y = x.clamp(-10, 10).sum(1, keepdim=True)
    trainer = Trainer(RunConfig(optim=OptimConfig(name="sgd", lr=0.05, momentum=0.9)), strategy="single",
                      accelerator="cpu", progress_bar=False, loggers=[], batch_size=4, epochs=epochs, out=str(out),
                      precision="16-mixed", log_every_n_steps=1, hooks=[hook] if hook else [])
    return trainer.fit(model, TensorDataset(x, y), TensorDataset(torch.ones(8, 4), torch.ones(8, 1)),
                       loss=loss)


def test_a_forward_that_overflows_float16_is_skipped_and_leaves_the_model_as_it_was(tmp_path, capsys):
    """Planted faults: the buffers not restored after a skipped step (BatchNorm's running mean turns NaN, and the
    epoch's check of the weights ends the run); a skipped step's inf loss kept in the logged loss (the run ends)."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    x[5] = OVERFLOW  # one sample: the step that holds it overflows in the forward
    record = Record()
    summary = _fit(tmp_path, x, hook=record)

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
    assert summary["final"]["train/samples"] == 16 and summary["final"].get("train/skipped_samples", 0) < 16
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
    assert message.startswith("the gradients of 25 steps in a row (trainer.precision=16-mixed) became NaN/inf at "
                              "epoch 1 step 25; nothing non-finite was written")
    assert "the loss itself was inf/NaN in 25 of them, so float16 overflows in the forward: use " \
           "trainer.precision=bf16-mixed on a GPU that has bfloat16, or 32" in message
    assert "lowered its scale to 0.00195" in message


def test_a_backward_that_always_gives_nan_gradients_ends_the_run_saying_the_loss_was_finite(tmp_path):
    """The other cause: a finite loss whose gradients are NaN/inf at any scale (here sqrt's slope at 0)."""

    def nan_gradients(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs, targets) + torch.sqrt((outputs - outputs.detach()).abs().sum())

    x = torch.randn(120, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteError) as info:
        _fit(tmp_path, x, epochs=1, loss=nan_gradients)
    assert "the loss was finite in each, so the backward makes NaN/inf gradients at any scale" in str(info.value)
