"""Hooks: what happens around the loop (checkpoints, logging, progress, pictures, diagnosis) without living in it.

A hook receives a :class:`RunContext`, a read-only view of the run: the resolved config, where this rank sits,
the run folder, where training is, and a few actions (save a checkpoint, draw sample pictures). It never gets
the :class:`~gputrain.engine.trainer.Trainer`, so it cannot replace a loader or rewrite the config: what it may
do is what the view offers. Every rank calls every method; rank-0-only work checks ``ctx.dist.is_main``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gputrain.checkpoint.state import TrainState
    from gputrain.config.schema import RunConfig
    from gputrain.dist import DistInfo


@dataclass(frozen=True, kw_only=True)
class RunContext:
    """What a hook sees of the run (built once by the engine; every value is read, none replaced)."""

    cfg: RunConfig
    """The run's config with every ``auto`` resolved (what ``config.yaml`` records)."""
    config_dict: dict[str, Any]
    """The same as plain containers (what checkpoints and W&B's run config hold)."""
    dist: DistInfo
    out: Path
    """The run folder."""
    resumed: bool
    steps_per_epoch: int
    global_batch: int
    strategy: str
    """The strategy's name."""
    model: nn.Module
    """The user's model inside whatever wrapper the strategy added: to read or attach probes to, not to replace."""
    optimizer: torch.optim.Optimizer | None
    """The run's optimizer (None in evaluation alone): to read, not to step or replace."""
    initial_lr: float
    """The first parameter group's learning rate before any schedule (after ``optim.scale_lr``)."""
    averaged_weights: tuple[torch.Tensor, ...]
    """This rank's tensors of the EMA of the weights (``trainer.ema_decay``; empty without): to read, not to change."""
    _progress: Callable[[], TrainState]
    _save: Callable[[str, dict[str, float] | None], Path | None]
    _wait: Callable[[], None]
    _pictures: Callable[[int], list[Any] | None]
    _train_indices: Callable[[int], list[int]]
    _eval_indices: Callable[[], tuple[list[int], int] | None]
    _saved_at: Callable[[], float | None] = lambda: None  # noqa: E731  (a run without checkpoints saves nothing)
    _reader_rate: Callable[[], tuple[float, int]] = lambda: (0.0, 0)  # noqa: E731  (a run without a training loader)
    data_waits: list[float] = field(default_factory=list)
    """Seconds the last optimizer step waited for each of its batches (refilled by the engine every step)."""

    @property
    def seconds_since_checkpoint(self) -> float | None:
        """Seconds since this process last handed a checkpoint over (since the start before the first); None when
        the run writes none."""
        saved = self._saved_at()
        return None if saved is None else time.monotonic() - saved

    @property
    def state(self) -> TrainState:
        """Where training is now (a copy: changing it changes nothing)."""
        return dataclasses.replace(self._progress())

    def save(self, name: str, metrics: dict[str, float] | None = None) -> Path | None:
        """Write checkpoint ``name`` (``""``: ``last.pt`` alone); a collective: every rank calls it. None when the run
        writes no checkpoints."""
        return self._save(name, metrics)

    def wait_for_checkpoints(self) -> None:
        """Until every checkpoint handed to the background writer is on disk; a failed one raises its one line."""
        self._wait()

    def sample_pictures(self, count: int) -> list[Any] | None:
        """``count`` validation images drawn with the current model's predictions (rank 0; None elsewhere, or when
        this run cannot draw); every rank must call it (a strategy's forward may need all of them)."""
        return self._pictures(count)

    def train_indices(self, limit: int) -> list[int]:
        """The sample indices of this rank's first ``limit`` batches of the current epoch (the framework's order)."""
        return self._train_indices(limit)

    def reader_rate(self) -> tuple[float, int]:
        """(one training-loader reader's images/s, reads and collates timed where they ran, over everything read
        so far; the readers that read: the training process, or each loader worker). (0, 0) before any batch."""
        return self._reader_rate()

    def eval_indices(self) -> tuple[list[int], int] | None:
        """This rank's evaluation indices and the validation set's length (None without validation data)."""
        return self._eval_indices()


class Hook:
    """Override what you need; each method receives the :class:`RunContext`."""

    def before_fit(self, ctx: RunContext) -> None: ...

    def before_epoch(self, ctx: RunContext) -> None: ...

    def before_optimizer_step(self, ctx: RunContext) -> None:
        """After the step's backward passes, before clipping and the optimizer: gradients are readable."""

    def after_step(self, ctx: RunContext, logs: dict[str, float] | None) -> None:
        """After each optimizer step; ``logs`` holds rank-reduced metrics on logging steps, else None."""

    def after_epoch(self, ctx: RunContext, metrics: dict[str, float]) -> None:
        """After training and evaluation of an epoch; ``metrics`` are reduced over ranks."""

    def after_eval_batch(self, ctx: RunContext, done: int, total: int) -> None:
        """After each validation batch of this rank (``done`` of its ``total``)."""

    def after_fit(self, ctx: RunContext, summary: dict[str, Any]) -> None: ...

    def on_exception(self, ctx: RunContext, error: BaseException) -> None: ...
