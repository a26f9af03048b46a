"""``gputrain eval``: load a checkpoint and evaluate it exactly, on any device count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gputrain.config import RunConfig
from gputrain.dist import init_distributed, teardown
from gputrain.engine.trainer import Trainer
from gputrain.tasks import build_task
from gputrain.tools.from_checkpoint import load_fitting, load_for_eval, saved_config


def evaluate_from_config(cfg: RunConfig, checkpoint: str | Path, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Evaluate ``checkpoint`` (already loaded as ``state``, or loaded here) with the task and data of ``cfg``.

    ``cfg`` is normally built from the checkpoint's own config
    (:func:`gputrain.tools.from_checkpoint.config_from_checkpoint`); a model that does not fit
    the weights fails with one line naming the differing keys and the fields that decide them.
    """
    init_distributed(cfg.trainer.accelerator)
    try:
        spec = build_task(cfg)
        if spec.val_data is None:
            raise ValueError(f"task {cfg.task!r} built no validation data; set data.val_root or data.val_fraction")
        state = state if state is not None else load_for_eval(checkpoint)
        load_fitting(spec.model, state["model"], path=checkpoint, cfg=cfg, saved=saved_config(state))
        return Trainer(cfg).validate(spec.model, spec.val_data, task=spec.task)
    finally:
        teardown()
