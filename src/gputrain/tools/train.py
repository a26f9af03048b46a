"""Train from a resolved config: build the task, fit, tear down."""

from __future__ import annotations

from typing import Any

from gputrain.config import RunConfig
from gputrain.dist import init_distributed, teardown
from gputrain.loop import Trainer
from gputrain.loop_state import seed_everything
from gputrain.tasks import build_task


def train_from_config(cfg: RunConfig) -> dict[str, Any]:
    """Run one training job in this process (one rank of it, under a launcher)."""
    init_distributed(cfg.trainer.accelerator)  # first, so that building the data may use a barrier
    seed_everything(cfg.trainer.seed)  # before the model is built: same initial weights on every rank and run
    spec = build_task(cfg)
    try:
        return Trainer(cfg).fit(spec.model, spec.train_data, spec.val_data, task=spec.task)
    finally:
        teardown()
