"""Checkpoint at the end of every epoch: ``last.pt`` always, ``epoch_NNNN.pt`` every n epochs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gputrain.hooks.base import Hook
from gputrain.resume import save_checkpoint

if TYPE_CHECKING:
    from gputrain.loop import Trainer


class CheckpointHook(Hook):
    """Saving itself (finiteness agreed by all ranks, atomic write, rotation) lives in :mod:`gputrain.resume`."""

    def __init__(self, every_n_epochs: int) -> None:
        self.every_n_epochs = every_n_epochs

    def after_epoch(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        epoch = trainer.state.epoch
        numbered = self.every_n_epochs > 0 and epoch % self.every_n_epochs == 0
        save_checkpoint(trainer, f"epoch_{epoch:04d}" if numbered else "", metrics)
