"""Epoch checkpoints, and every save on disk before the run ends (normally or not)."""

from __future__ import annotations

import sys
from typing import Any

from gputrain.engine.hooks import Hook, RunContext


class CheckpointHook(Hook):
    """``epoch_NNNN.pt`` every ``every_n_epochs`` epochs (``last.pt`` after every epoch)."""

    def __init__(self, every_n_epochs: int = 1) -> None:
        self.every_n_epochs = every_n_epochs

    def after_epoch(self, ctx: RunContext, metrics: dict[str, float]) -> None:
        epoch = ctx.state.epoch
        numbered = self.every_n_epochs > 0 and epoch % self.every_n_epochs == 0
        ctx.save(f"epoch_{epoch:04d}" if numbered else "", metrics)

    def after_fit(self, ctx: RunContext, summary: dict[str, Any]) -> None:
        ctx.wait_for_checkpoints()  # a failed last save fails the run, in one line

    def on_exception(self, ctx: RunContext, error: BaseException) -> None:
        try:
            ctx.wait_for_checkpoints()  # finish the save in flight: it is the one a resume starts from
        except Exception as failed:  # noqa: BLE001  (the run's own error is the one to raise)
            print(f"gputrain: error: {failed}", file=sys.stderr, flush=True)
