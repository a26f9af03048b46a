"""One optimizer step's micro-batches, as the epoch plan deals them to this rank, and the optimizer step.

The loop (:mod:`gputrain.engine.epoch`) reads them step after step; the replay of a step that went non-finite
(:mod:`gputrain.engine.forensics`) reads the same step again, from the same keys, through the same code.
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gputrain.engine.fast import to_memory_format
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


@dataclass
class StepReader:
    """This rank's micro-batches of an epoch from ``start_step`` on, read from one pass of the training loader."""

    loop: Loop
    epoch: int
    start_step: int
    data_waits: list[float] = field(default_factory=list)
    """The seconds each batch of the last step read was waited for."""

    def __post_init__(self) -> None:
        sampler = self.loop.batch_sampler
        assert sampler is not None and self.loop.train_loader is not None, "build_training first"
        sampler.set_epoch(self.epoch, start_step=self.start_step)  # the framework does it, never the user
        self.plan = sampler.plan
        self.join_empty = self.loop.strategy.has_forward_collectives(self.loop.module)
        self._batches = iter(self.loop.train_loader)
        self._last_inputs: Any = None

    def micro_batches(self, k: int) -> Iterator[tuple[MicroBatch, list[tuple[int, ...]]]]:
        """Step ``k``'s micro-batches for this rank, each with its samples' keys ``(epoch, index[, repeat])``.

        Read one at a time, as the forward needs them. With forward collectives a rank without samples in a
        micro-batch joins with an empty slice; otherwise it gets ``inputs=None`` and skips it.
        """
        loop, strategy = self.loop, self.loop.strategy
        dp_rank, dp = strategy.dp_rank, strategy.dp_size
        shares_of = self.plan.micro_keys(k)
        n_step = self.plan.step_size(k)
        uneven = any(not share for share in shares_of[-1])  # some rank has nothing in the last micro-batch
        self.data_waits.clear()
        for m, shares in enumerate(shares_of):
            last = m == len(shares_of) - 1
            n = len(shares[dp_rank])
            if n:
                waited = time.perf_counter()
                batch = next(self._batches)
                self.data_waits.append(time.perf_counter() - waited)
                inputs, targets = loop.task.split_batch(batch)
                inputs = move_to_device(inputs, strategy.root_device, non_blocking=True)
                targets = move_to_device(targets, loop.target_device, non_blocking=True)
                if loop.mixer is not None:  # MixUp/CutMix: pairs and draws fixed by the global step
                    inputs, targets = loop.mixer(inputs, targets, epoch=self.epoch, step=k)
                inputs = to_memory_format(inputs, loop.fast.channels_last)
                self._last_inputs = (inputs, targets)
            elif self.join_empty:
                if self._last_inputs is None:  # resumed straight into the short last step: no batch read yet
                    first = loop.task.split_batch(first_sample_batch(loop.train_loader, (self.epoch, 0)))
                    self._last_inputs = (move_to_device(first[0], strategy.root_device),
                                         move_to_device(first[1], loop.target_device))
                inputs, targets = empty_like_batch(self._last_inputs[0]), empty_like_batch(self._last_inputs[1])
            else:
                inputs = targets = None
            # With forward collectives every rank joins (an empty slice where it has no samples), so the
            # normal reduction runs; otherwise a rank without samples skips, and gradients are averaged
            # by hand after the step.
            sync = last and (self.join_empty or not uneven)
            keys = [(self.epoch, *key) for key in shares[dp_rank]]
            yield MicroBatch(inputs=inputs, targets=targets, size=n, weight=n * dp / n_step, sync=sync), keys

    def finishes_by_hand(self, k: int) -> bool:
        """Whether step ``k``'s gradients are averaged after its backward (a rank had no samples to sync with)."""
        return not self.join_empty and any(not share for share in self.plan.micro_keys(k)[-1])


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
