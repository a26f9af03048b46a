"""Train from a resolved config: build the task, fit, tear down."""

from __future__ import annotations

import dataclasses
import shlex
import sys
import time
from typing import Any

from gputrain.config import RunConfig
from gputrain.dist import init_distributed, teardown
from gputrain.engine.state import seed_everything
from gputrain.engine.trainer import Trainer
from gputrain.tasks import build_task

# Flags whose value the resume command replaces or drops (they would clear or move the run).
_REPLACED = {"--resume", "--out", "--overwrite"}


def resume_command(argv: list[str], out: str) -> str:
    """The command line that continues this run: the same one with ``--resume auto --out OUT``."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in _REPLACED or flag in {"trainer.resume", "trainer.out", "trainer.overwrite"}:
            skip = "=" not in arg and flag != "--overwrite"
            continue
        kept.append(arg)
    return shlex.join(["gputrain", *kept, "--resume", "auto", "--out", out])


def train_from_config(cfg: RunConfig) -> dict[str, Any]:
    """Run one training job in this process (one rank of it, under a launcher)."""
    init_distributed(cfg.trainer.accelerator, timeout_s=cfg.trainer.timeout_s)  # first: building data may barrier
    seed_everything(cfg.trainer.seed)  # before the model is built: same initial weights on every rank and run
    try:
        argv = sys.argv[1:]
        trainer = Trainer(cfg, resume_command=lambda out: resume_command(argv, str(out)))
        # The run folder first (checked, and new by default): a task may write into it (COCO's split).
        out = trainer.prepare(for_training=True)
        seed_everything(cfg.trainer.seed)  # the model is built next: the same initial weights on every rank
        try:
            spec = build_task(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, out=str(out))))
        except BaseException:
            trainer.discard_untrained_run()  # bad data: leave no half-made run folder behind
            raise
        return trainer.fit(spec.model, spec.train_data, spec.val_data, task=spec.task)
    except BaseException as err:
        # When it failed, before teardown makes the other ranks fail too: the launcher shows the first.
        err.gputrain_time = time.time()  # type: ignore[attr-defined]
        raise
    finally:
        teardown()
