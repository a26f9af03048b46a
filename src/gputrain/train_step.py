"""The body of an epoch and of an evaluation pass, kept apart from the Trainer's setup.

One optimizer step trains on one global batch of the epoch plan. Each micro-batch's mean loss
is weighted by ``samples on this rank x data-parallel size / samples in the step``: after the
strategy averages gradients over ranks, the gradient is the mean over the step's global batch,
for any dataset size, world size and accumulation, including the epoch's short last step.
"""

from __future__ import annotations

import math
import re
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any

import torch

from gputrain.fast_path import to_memory_format
from gputrain.loop_state import LossWindow
from gputrain.resume import all_finite, raise_non_finite
from gputrain.strategies.base import MicroBatch, move_to_device

if TYPE_CHECKING:
    from gputrain.loop import Trainer


def _empty_like(batch: Any) -> Any:
    """A zero-sample slice of a batch (tensors cut to length 0, lists emptied)."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return {k: _empty_like(v) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_empty_like(v) for v in batch)
    if isinstance(batch, list):
        return []
    return batch


def _first_sample_batch(loader: Any, key: Any) -> Any:
    """A one-sample batch of ``loader``'s dataset, for a rank that must join collectives before it read any."""
    return loader.collate_fn([loader.dataset[key]])


def run_epoch(trainer: Trainer) -> dict[str, float]:
    """Train the steps of the current epoch from ``state.step_in_epoch``; returns the epoch's metrics."""
    t, strategy, state = trainer.cfg.trainer, trainer.strategy, trainer.state
    module = trainer.module
    module.train()
    sampler = trainer.batch_sampler
    sampler.set_epoch(state.epoch, start_step=state.step_in_epoch)  # the framework does it, never the user
    plan, dp_rank, dp = sampler.plan, strategy.dp_rank, strategy.dp_size
    join_empty = strategy.has_forward_collectives(module)
    # The loss sum stays on the device and costs one kernel per micro-batch (no host sync); it is
    # all-reduced into host totals only on logging steps and at the end of the epoch.
    # A resumed epoch continues the loss sums its checkpoint carried, so it logs what the uninterrupted run logs.
    window = LossWindow(strategy, trainer.carried_loss if state.step_in_epoch else None)
    trainer.carried_loss, trainer.loss_window = None, window
    batches = iter(trainer.train_loader)
    last_inputs: Any = None
    start = logged_at = time.perf_counter()
    for k in range(state.step_in_epoch, trainer.steps_per_epoch):
        step_start = time.perf_counter()
        micro_batches = plan.micro_batches(k)
        n_step = plan.step_size(k)
        uneven = any(not share for share in micro_batches[-1])  # some rank has nothing in the last micro-batch
        for m, shares in enumerate(micro_batches):
            last = m == len(micro_batches) - 1
            n = len(shares[dp_rank])
            if n:
                inputs, targets = trainer.task.split_batch(next(batches))
                inputs = to_memory_format(move_to_device(inputs, strategy.root_device, non_blocking=True),
                                          trainer.fast.channels_last)
                targets = move_to_device(targets, trainer.target_device, non_blocking=True)
                last_inputs = (inputs, targets)
            elif join_empty:
                if last_inputs is None:  # resumed straight into the short last step: no batch read yet
                    first = trainer.task.split_batch(_first_sample_batch(trainer.train_loader, (state.epoch, 0)))
                    last_inputs = (move_to_device(first[0], strategy.root_device),
                                   move_to_device(first[1], trainer.target_device))
                inputs, targets = _empty_like(last_inputs[0]), _empty_like(last_inputs[1])
            else:
                inputs = targets = None
            # With forward collectives every rank joins (an empty slice where it has no samples), so the
            # normal reduction runs; otherwise a rank without samples skips, and gradients are averaged
            # by hand after the step.
            sync = last and (join_empty or not uneven)
            micro = MicroBatch(inputs=inputs, targets=targets, size=n, weight=n * dp / n_step, sync=sync)
            loss = strategy.forward_backward(module, micro, task=trainer.task, precision=trainer.precision)
            window.add(loss, n)
        if uneven and not join_empty:
            strategy.finish_gradients(module)
        optimizer_step(trainer)
        if trainer.first_step_s is None:  # with trainer.compile, the compile time is in here
            trainer.first_step_s = time.perf_counter() - step_start
        state.samples_seen += n_step
        state.step_in_epoch = k + 1
        logs = None
        if t.log_every_n_steps and state.global_step % t.log_every_n_steps == 0:
            mean_loss, now = window.flush(), time.perf_counter()
            logs = {"train/loss": mean_loss, "lr": trainer.optimizer.param_groups[0]["lr"],
                    "train/images_per_s": window.flushed_samples / (now - logged_at) if now > logged_at else 0.0}
            logged_at = now
            if not math.isfinite(logs["train/loss"]):  # all-reduced, so every rank agrees
                raise_non_finite(trainer, "the training loss")
        trainer._call("after_step", logs)
        trainer.after_optimizer_step()
    window.flush()
    trainer.loss_window = None  # the epoch is over: a checkpoint from here on carries no partial sums
    train_s = time.perf_counter() - start
    epoch_loss = window.epoch_loss_sum / max(window.epoch_samples, 1)
    trained_here = window.epoch_samples - window.carried_samples  # for throughput: not the samples before a resume
    # Always, whatever the checkpoint settings: a diverged run ends here with a clear error.
    if not math.isfinite(epoch_loss) or not all_finite(trainer):
        raise_non_finite(trainer, "the training loss" if not math.isfinite(epoch_loss) else "the weights")
    return {
        "train/loss": epoch_loss,
        "train/samples": window.epoch_samples,
        "train/steps": state.step_in_epoch,
        "time/train_s": train_s,
        "train/images_per_s": trained_here / train_s if train_s > 0 else 0.0,
    }


def optimizer_step(trainer: Trainer) -> None:
    clip = trainer.cfg.trainer.grad_clip_norm
    # First, before anything changes the weights: calling the hooks settles the checkpoint writer, whose thread may
    # still be copying the weights of the last save (Trainer._call, _settle_checkpoint).
    trainer._call("before_optimizer_step")
    if clip > 0:
        trainer.precision.unscale(trainer.optimizer)
        trainer.strategy.clip_grad_norm(trainer.module, clip)
    stepped = trainer.precision.optimizer_step(trainer.optimizer)
    trainer.optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        # GradScaler skipped a step on inf/NaN gradients: the schedule still counts it, and torch's
        # "lr_scheduler.step() before optimizer.step()" warning would describe our own choice.
        if not stepped:
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
        trainer.scheduler.step()
    trainer.state.global_step += 1


@torch.no_grad()
def evaluate_batches(trainer: Trainer) -> dict[str, float]:
    """Run the validation loader through the model and reduce the task's evaluator over ranks."""
    strategy, task = trainer.strategy, trainer.task
    assert trainer.val_loader is not None
    model = strategy.eval_module(trainer.module)
    model.eval()
    evaluator = task.evaluator()
    done, last_inputs, total = 0, None, len(trainer.val_loader)
    most = total
    if strategy.eval_in_lockstep:
        # Forward issues collectives (FSDP gathers parameters), so every rank must run as many forwards:
        # agree on the count first (after the loop a rank would wait while another is still in a forward).
        most = int(strategy.all_reduce(torch.tensor([total], device=strategy.root_device), op="max"))
    for batch in trainer.val_loader:
        inputs, targets = task.split_batch(batch)
        inputs = to_memory_format(move_to_device(inputs, strategy.root_device, non_blocking=True),
                                  trainer.fast.channels_last)
        targets = move_to_device(targets, trainer.target_device, non_blocking=True)
        with trainer.precision.forward_context():
            outputs, loss = task.evaluate_batch(model, inputs, targets)
        if strategy.computes_loss:
            evaluator.update(outputs, targets, loss, task.batch_size(inputs))
        done, last_inputs = done + 1, inputs
        trainer._call("after_eval_batch", done, total)
    # A rank with a shorter shard runs empty forwards until it has run as many as the others;
    # nothing it computes reaches a metric.
    for _ in range(most - done):
        if last_inputs is None:  # this rank's shard is empty: shape an empty input from the first sample
            first = task.split_batch(_first_sample_batch(trainer.val_loader, 0))[0]
            last_inputs = move_to_device(first, strategy.root_device)
        with trainer.precision.forward_context():
            model(_empty_like(last_inputs))
    metrics = evaluator.compute(strategy, trainer.out)
    warn_non_finite(metrics, trainer.state.epoch, is_main=trainer.dist.is_main)
    return metrics


def warn_non_finite(metrics: dict[str, float], epoch: int, *, is_main: bool) -> None:
    """One warning line per validation metric that is inf or NaN (JSON writes it as null), on rank 0.

    Such a value is usually real, not a bug: e.g. an untrained ResNet-50 whose BatchNorm running
    statistics come from a few 2-sample micro-batches overflows in eval mode (issue 15).
    """
    bad = {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}
    if not bad or not is_main:
        return
    when = f"after epoch {epoch}" if epoch else "in evaluation"
    for name, value in bad.items():
        print(f"gputrain: warning: val/{name}={value} {when} is not finite: the model's eval-mode outputs overflow "
              "(BatchNorm running statistics from too few or too small batches?); train longer, use larger "
              "batches or a lower learning rate", file=sys.stderr, flush=True)
