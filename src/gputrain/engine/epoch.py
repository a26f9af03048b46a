"""The body of an epoch: one optimizer step per global batch of the epoch plan.

One optimizer step trains on one global batch of the epoch plan. Each micro-batch's mean loss is weighted by
``samples on this rank x data-parallel size / samples in the step``: after the strategy averages gradients over
ranks, the gradient is the mean over the step's global batch, for any dataset size, world size and accumulation,
including the epoch's short last step. The functions here read the run's built objects (:class:`Loop`) and change
only what they are given: the progress (:class:`~gputrain.checkpoint.state.TrainState`) and the loss window.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gputrain.engine.state import LossWindow
from gputrain.engine.step import Hooks, StepReader, optimizer_step

if TYPE_CHECKING:
    from gputrain.checkpoint.state import TrainState
    from gputrain.engine.setup import Loop


def run_epoch(loop: Loop, state: TrainState, window: LossWindow, hooks: Hooks, *,
              after_step: Callable[[], None], data_waits: list[float]) -> dict[str, float]:
    """Train the steps of the current epoch from ``state.step_in_epoch``; returns the epoch's metrics.

    ``after_step`` runs after each optimizer step and its hooks (the stop agreement, mid-epoch checkpoints);
    ``data_waits`` is refilled each step with the seconds each batch of it was waited for.
    """
    t, strategy, module, optimizer = loop.cfg.trainer, loop.strategy, loop.module, loop.optimizer
    assert optimizer is not None, "build_training first"
    module.train()
    reader = StepReader(loop, state.epoch, state.step_in_epoch, data_waits)
    # The loss sum stays on the device and costs one kernel per micro-batch (no host sync); it is
    # all-reduced into host totals only on logging steps and at the end of the epoch.
    start = logged_at = time.perf_counter()
    for k in range(state.step_in_epoch, loop.steps_per_epoch):
        step_start = time.perf_counter()
        n_step = reader.plan.step_size(k)
        loop.precision.begin_step(module)
        for micro, _keys in reader.micro_batches(k):
            try:
                loss = strategy.forward_backward(module, micro, task=loop.task, precision=loop.precision)
            except ValueError as err:
                raise _explained(err, micro.size) from None
            window.add(loss, micro.size)
        if reader.finishes_by_hand(k):
            strategy.finish_gradients(module)
        stepped = optimizer_step(loop, state, hooks)
        if loop.ema is not None:  # after the step, as the reference: the average follows the stepped weights
            loop.ema.update(state.global_step)
        overflowing = loop.skips.count(stepped, window, state)
        if overflowing:
            streak = loop.non_finite(overflowing[0], state, fix=overflowing[1])
            streak.streak = loop.skips.in_a_row  # the replay starts from the live state, before the streak
            raise streak
        window.end_step(stepped=stepped)
        if loop.first_step_s is None:  # with trainer.compile, the compile time is in here
            loop.first_step_s = time.perf_counter() - step_start
        state.samples_seen += n_step
        state.step_in_epoch = k + 1
        logs = None
        if t.log_every_n_steps and state.global_step % t.log_every_n_steps == 0:
            mean_loss, now = window.flush(), time.perf_counter()
            logs = {"lr": optimizer.param_groups[0]["lr"],
                    "train/images_per_s": window.flushed_samples / (now - logged_at) if now > logged_at else 0.0,
                    **loop.precision.log_values(window.flushed_skipped_steps)}
            logged_at = now
            if window.flushed_counted > 0:  # else the scaler skipped every step of the window: no loss to log
                if not math.isfinite(mean_loss):  # all-reduced, so every rank agrees
                    raise loop.non_finite("the training loss", state)
                logs = {"train/loss": mean_loss, **logs}
        hooks("after_step", logs)
        after_step()
    window.flush()
    train_s = time.perf_counter() - start
    epoch_loss = window.epoch_loss
    trained_here = window.epoch_samples - window.carried_samples  # for throughput: not the samples before a resume
    # Always, whatever the checkpoint settings: a diverged run ends here with a clear error.
    if not math.isfinite(epoch_loss) and window.epoch_skipped < window.epoch_samples or not loop.all_finite():
        raise loop.non_finite("the training loss" if not math.isfinite(epoch_loss) else "the weights", state)
    metrics = {
        "train/loss": epoch_loss,
        "train/samples": window.epoch_samples,
        "train/steps": state.step_in_epoch,
        "time/train_s": train_s,
        "train/images_per_s": trained_here / train_s if train_s > 0 else 0.0,
    }
    if window.epoch_skipped:
        metrics["train/skipped_samples"] = window.epoch_skipped
    if not math.isfinite(epoch_loss):  # the scaler skipped every step of the epoch: there is no loss to report
        del metrics["train/loss"]
    return metrics


def _explained(err: ValueError, samples: int) -> ValueError:
    """torch's BatchNorm refusing a batch of one value per channel, with the fix (a short last batch, usually)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "Expected more than 1 value per channel when training" not in text:
        return err
    return ValueError(f"{text}: a training micro-batch of {samples} sample(s) reached BatchNorm, which needs 2 "
                      "values per channel (the epoch's short last batch, or a small image at the last stage); set "
                      "trainer.drop_last=true, or a batch size or data.image_size that leaves at least 2")
