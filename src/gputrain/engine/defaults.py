"""The hooks every run gets, assembled outside the loop (the loop imports no concrete hook)."""

from __future__ import annotations

from gputrain.config.schema import RunConfig
from gputrain.engine.callbacks.checkpoint import CheckpointHook
from gputrain.engine.callbacks.logging import LoggingHook
from gputrain.engine.callbacks.memory import MemoryHook
from gputrain.engine.callbacks.pace import PaceHook
from gputrain.engine.callbacks.pictures import PicturesHook
from gputrain.engine.callbacks.progress import ProgressHook
from gputrain.engine.hooks import Hook


def default_hooks(cfg: RunConfig) -> list[Hook]:
    """Memory measuring when asked, progress, logging, the first steps' pace, epoch checkpoints when enabled, and pictures last (after the loggers closed their files)."""
    t = cfg.trainer
    hooks: list[Hook] = [ProgressHook(bar=t.progress_bar), LoggingHook(list(t.loggers)), PaceHook()]
    if t.measure_memory:
        hooks.insert(0, MemoryHook())  # first in, so it sees the steps before any other hook's work
    if t.enable_checkpointing:
        hooks.append(CheckpointHook(t.checkpoint_every_n_epochs))
    return [*hooks, PicturesHook()]
