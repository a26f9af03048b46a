"""The :class:`~gputrain.engine.hooks.RunContext` of a built run: values read from it, actions bound to it."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputrain.dist import comm
from gputrain.engine.hooks import RunContext
from gputrain.tasks.base import Task

if TYPE_CHECKING:
    from gputrain.checkpoint.state import TrainState
    from gputrain.engine.setup import Loop


def build_context(loop: Loop, *, config_dict: dict[str, Any], out: Path, resumed: bool,
                  progress: Callable[[], TrainState],
                  save: Callable[[str, dict[str, float] | None], Path | None],
                  saved_at: Callable[[], float | None] = lambda: None) -> RunContext:
    """What hooks see of ``loop``: values read from it; the train state and saving through the trainer's calls."""
    group = loop.optimizer.param_groups[0] if loop.optimizer is not None else {"lr": loop.cfg.optim.lr}
    checkpointer = loop.checkpointer
    return RunContext(
        cfg=loop.cfg, config_dict=config_dict, dist=loop.dist, out=out, resumed=resumed,
        steps_per_epoch=loop.steps_per_epoch, global_batch=loop.global_batch, strategy=loop.strategy.name,
        model=loop.strategy.unwrap(loop.module), optimizer=loop.optimizer,
        initial_lr=float(group.get("initial_lr", group["lr"])),
        averaged_weights=loop.ema.local_tensors() if loop.ema is not None else (),
        _progress=progress, _save=save,
        _wait=checkpointer.wait if checkpointer is not None else lambda: None,
        _pictures=lambda count: sample_pictures(loop, count),
        _train_indices=lambda limit: _first_batches(loop, limit),
        _eval_indices=lambda: _eval_indices(loop),
        _saved_at=saved_at if checkpointer is not None else lambda: None,
        _reader_rate=loop.reader_clock.images_per_s if loop.reader_clock is not None else lambda: (0.0, 0),
    )


def sample_pictures(loop: Loop, count: int) -> list[Any] | None:
    """The sample pictures of the current model (rank 0; None elsewhere, or when this run cannot draw them)."""
    from gputrain.runs.pictures import sample_pictures as draw

    task, strategy = loop.task, loop.strategy
    val = getattr(loop.val_loader, "dataset", None)
    if not count or val is None or type(task).draw is Task.draw:
        return None
    if not comm.broadcast_object(strategy.computes_loss):  # rank 0 of a pipeline holds the first stage only
        return None
    module = strategy.eval_module(loop.module)
    pictures = draw(task, module, val, count, strategy.root_device, loop.precision.forward_context)
    loop.module.train()
    return pictures if loop.dist.is_main else None


def _first_batches(loop: Loop, limit: int) -> list[int]:
    """This rank's sample indices of the first ``limit`` batches its sampler gives now (the current epoch's)."""
    indices: list[int] = []
    for batch in itertools.islice(iter(loop.batch_sampler or ()), limit):
        indices += [int(key[1]) if isinstance(key, tuple) else int(key) for key in batch]  # (epoch, index[, repeat])
    return indices


def _eval_indices(loop: Loop) -> tuple[list[int], int] | None:
    if loop.val_loader is None:
        return None
    return [int(i) for i in loop.val_loader.sampler], len(loop.val_loader.dataset)  # type: ignore[arg-type]
