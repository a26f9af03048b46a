"""The body of an epoch: one optimizer step per global batch of the epoch plan, and the optimizer step itself.

One optimizer step trains on one global batch of the epoch plan. Each micro-batch's mean loss is weighted by
``samples on this rank x data-parallel size / samples in the step``: after the strategy averages gradients over
ranks, the gradient is the mean over the step's global batch, for any dataset size, world size and accumulation,
including the epoch's short last step. The functions here read the run's built objects (:class:`Loop`) and change
only what they are given: the progress (:class:`~gputrain.checkpoint.state.TrainState`) and the loss window.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from gputrain.engine.fast import to_memory_format
from gputrain.engine.state import LossWindow
from gputrain.strategies.base import MicroBatch, move_to_device

if TYPE_CHECKING:
    from gputrain.checkpoint.state import TrainState
    from gputrain.engine.setup import Loop

Hooks = Callable[..., None]
"""Calls one hook event on every hook: ``hooks("after_step", logs)``."""


def empty_like_batch(batch: Any) -> Any:
    """A zero-sample slice of a batch (tensors cut to length 0, lists emptied)."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return {k: empty_like_batch(v) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(empty_like_batch(v) for v in batch)
    if isinstance(batch, list):
        return []
    return batch


def first_sample_batch(loader: Any, key: Any) -> Any:
    """A one-sample batch of ``loader``'s dataset, for a rank that must join collectives before it read any."""
    return loader.collate_fn([loader.dataset[key]])


def run_epoch(loop: Loop, state: TrainState, window: LossWindow, hooks: Hooks, *,
              after_step: Callable[[], None], data_waits: list[float]) -> dict[str, float]:
    """Train the steps of the current epoch from ``state.step_in_epoch``; returns the epoch's metrics.

    ``after_step`` runs after each optimizer step and its hooks (the stop agreement, mid-epoch checkpoints);
    ``data_waits`` is refilled each step with the seconds each batch of it was waited for.
    """
    t, strategy, module = loop.cfg.trainer, loop.strategy, loop.module
    sampler, loader, optimizer = loop.batch_sampler, loop.train_loader, loop.optimizer
    assert sampler is not None and loader is not None and optimizer is not None, "build_training first"
    module.train()
    sampler.set_epoch(state.epoch, start_step=state.step_in_epoch)  # the framework does it, never the user
    plan, dp_rank, dp = sampler.plan, strategy.dp_rank, strategy.dp_size
    join_empty = strategy.has_forward_collectives(module)
    # The loss sum stays on the device and costs one kernel per micro-batch (no host sync); it is
    # all-reduced into host totals only on logging steps and at the end of the epoch.
    batches = iter(loader)
    last_inputs: Any = None
    start = logged_at = time.perf_counter()
    for k in range(state.step_in_epoch, loop.steps_per_epoch):
        step_start = time.perf_counter()
        micro_batches = plan.micro_batches(k)
        n_step = plan.step_size(k)
        uneven = any(not share for share in micro_batches[-1])  # some rank has nothing in the last micro-batch
        data_waits.clear()
        loop.precision.begin_step(module)
        for m, shares in enumerate(micro_batches):
            last = m == len(micro_batches) - 1
            n = len(shares[dp_rank])
            if n:
                waited = time.perf_counter()
                batch = next(batches)
                data_waits.append(time.perf_counter() - waited)
                inputs, targets = loop.task.split_batch(batch)
                inputs = move_to_device(inputs, strategy.root_device, non_blocking=True)
                targets = move_to_device(targets, loop.target_device, non_blocking=True)
                if loop.mixer is not None:  # MixUp/CutMix: pairs and draws fixed by the global step
                    inputs, targets = loop.mixer(inputs, targets, epoch=state.epoch, step=k)
                inputs = to_memory_format(inputs, loop.fast.channels_last)
                last_inputs = (inputs, targets)
            elif join_empty:
                if last_inputs is None:  # resumed straight into the short last step: no batch read yet
                    first = loop.task.split_batch(first_sample_batch(loader, (state.epoch, 0)))
                    last_inputs = (move_to_device(first[0], strategy.root_device),
                                   move_to_device(first[1], loop.target_device))
                inputs, targets = empty_like_batch(last_inputs[0]), empty_like_batch(last_inputs[1])
            else:
                inputs = targets = None
            # With forward collectives every rank joins (an empty slice where it has no samples), so the
            # normal reduction runs; otherwise a rank without samples skips, and gradients are averaged
            # by hand after the step.
            sync = last and (join_empty or not uneven)
            micro = MicroBatch(inputs=inputs, targets=targets, size=n, weight=n * dp / n_step, sync=sync)
            try:
                loss = strategy.forward_backward(module, micro, task=loop.task, precision=loop.precision)
            except ValueError as err:
                raise _explained(err, n) from None
            window.add(loss, n)
        if uneven and not join_empty:
            strategy.finish_gradients(module)
        stepped = optimizer_step(loop, state, hooks)
        if loop.ema is not None:  # after the step, as the reference: the average follows the stepped weights
            loop.ema.update(state.global_step)
        overflowing = loop.skips.count(stepped, window, state)
        if overflowing:
            raise loop.non_finite(overflowing[0], state, fix=overflowing[1])
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


def optimizer_step(loop: Loop, state: TrainState, hooks: Hooks) -> bool:
    """One optimizer step and the schedule's; returns False when the loss scaler skipped it (16-mixed overflow)."""
    clip, optimizer = loop.cfg.trainer.grad_clip_norm, loop.optimizer
    assert optimizer is not None
    hooks("before_optimizer_step")
    if clip > 0:
        loop.precision.unscale(optimizer)
        loop.strategy.clip_grad_norm(loop.module, clip)
    stepped = loop.precision.optimizer_step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        # GradScaler skipped a step on inf/NaN gradients: the schedule still counts it, and torch's
        # "lr_scheduler.step() before optimizer.step()" warning would describe our own choice.
        if not stepped:
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
        loop.scheduler.step()
    state.global_step += 1
    return stepped
