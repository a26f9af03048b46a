"""``gputrain eval``: load a checkpoint and evaluate it exactly, on any device count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gputrain.checkpoint import model_weights
from gputrain.config import RunConfig
from gputrain.dist import init_distributed, teardown
from gputrain.loop import Trainer
from gputrain.tasks import build_task


def evaluate_from_config(cfg: RunConfig, checkpoint: str | Path) -> dict[str, Any]:
    init_distributed(cfg.trainer.accelerator)
    try:
        spec = build_task(cfg)
        if spec.val_data is None:
            raise ValueError(f"recipe task {cfg.task!r} built no validation data; set data.val_root or data.val_fraction")
        spec.model.load_state_dict(model_weights(checkpoint))
        return Trainer(cfg).validate(spec.model, spec.val_data, task=spec.task)
    finally:
        teardown()
