"""Checkpoint at the end of every epoch: ``last.pt`` always, ``epoch_NNNN.pt`` every n epochs."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from gputrain.hooks.base import Hook
from gputrain.resume import save_checkpoint

if TYPE_CHECKING:
    from gputrain.loop import Trainer


class CheckpointHook(Hook):
    """Saving itself (finiteness agreed by all ranks, atomic write, rotation) lives in :mod:`gputrain.resume`.

    With ``trainer.async_checkpoint`` a save returns while a thread writes it; this hook waits for that
    thread when training ends, normally or not, so ``fit`` never returns with a checkpoint half written.
    """

    def __init__(self, every_n_epochs: int) -> None:
        self.every_n_epochs = every_n_epochs

    def after_epoch(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        epoch = trainer.state.epoch
        numbered = self.every_n_epochs > 0 and epoch % self.every_n_epochs == 0
        save_checkpoint(trainer, f"epoch_{epoch:04d}" if numbered else "", metrics)

    def after_fit(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        if trainer.checkpoint_writer is not None:
            try:
                trainer.checkpoint_writer.wait()  # a failed last save fails the run, in one line
            finally:
                trainer.checkpoints.discard_spare()  # no next save to reuse a retired file's blocks

    def on_exception(self, trainer: Trainer, error: BaseException) -> None:
        if trainer.checkpoint_writer is None:
            return
        try:
            trainer.checkpoint_writer.wait()  # finish the save in flight: it is the one a resume starts from
        except Exception as failed:  # noqa: BLE001  (the run's own error is the one to raise)
            print(f"gputrain: error: {failed}", file=sys.stderr, flush=True)
        finally:
            trainer.checkpoints.discard_spare()
