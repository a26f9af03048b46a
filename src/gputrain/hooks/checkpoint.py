"""Write ``last.pt`` every epoch (and ``epoch_NNNN.pt`` every n), from rank 0, atomically."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from gputrain.checkpoint import atomic_save
from gputrain.hooks.base import Hook

if TYPE_CHECKING:
    from gputrain.loop import Trainer


class NonFiniteLossError(ValueError):
    """Training produced NaN/inf; the last good checkpoint is kept."""


class CheckpointHook(Hook):
    def __init__(self, folder: Path, every_n_epochs: int) -> None:
        self.folder = folder
        self.every_n_epochs = every_n_epochs

    def after_epoch(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        loss = metrics.get("train/loss", 0.0)
        if not math.isfinite(loss):
            # Never let a diverged run overwrite a good checkpoint.
            last = self.folder / "last.pt"
            kept = f"the last good one, {last}, is kept" if last.is_file() else "none had been written yet"
            raise NonFiniteLossError(
                f"train/loss is {loss} after epoch {trainer.state.epoch}; no checkpoint was written ({kept}); "
                "lower optim.lr or set trainer.grad_clip_norm"
            )
        state = trainer.checkpoint_state()  # collective-free, but every rank builds it (FSDP will gather)
        if trainer.dist.is_main:
            atomic_save(state, self.folder / "last.pt")
            epoch = trainer.state.epoch
            if self.every_n_epochs > 0 and epoch % self.every_n_epochs == 0:
                atomic_save(state, self.folder / f"epoch_{epoch:04d}.pt")
        trainer.strategy.barrier()
