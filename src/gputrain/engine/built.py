"""What a :class:`~gputrain.engine.trainer.Trainer` trains with, read-only once it is built: the model as the strategy
wrapped it, the optimizer, strategy and precision plugins, the steps and global batch, the resolved speed options and
the checkpoints, all read from its :class:`~gputrain.engine.setup.Loop`.
"""

from __future__ import annotations

import torch
from torch import nn

from gputrain.checkpoint.checkpointer import Checkpointer
from gputrain.config.resolve import FastPath
from gputrain.engine import setup
from gputrain.precision import Precision
from gputrain.strategies.base import Strategy


class BuiltRun:
    """The Trainer's properties that read its built run; each raises until :meth:`fit` (or :meth:`validate`) built it."""

    loop: setup.Loop | None

    # -- what the run trains with (read-only, once built) ---------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The model as the strategy wrapped it (after :meth:`fit`)."""
        return self._built().module

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._built().optimizer

    @property
    def strategy(self) -> Strategy:
        return self._built().strategy

    @property
    def precision(self) -> Precision:
        return self._built().precision

    @property
    def steps_per_epoch(self) -> int:
        return self._built().steps_per_epoch

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks: batch size x data-parallel ranks x accumulation."""
        return self._built().global_batch

    @property
    def fast(self) -> FastPath:
        """The speed options as they were resolved for this run."""
        return self._built().fast

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The run's checkpoints (None when ``trainer.enable_checkpointing=false``)."""
        return self._built().checkpointer

    def _built(self) -> setup.Loop:
        if self.loop is None:
            raise RuntimeError("the run is built by fit() (or validate()); call it first")
        return self.loop
