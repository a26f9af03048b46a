"""The launcher's side of ``gputrain predict``: what is checked (and cleared) before any worker starts."""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gputrain.config import RunConfig
from gputrain.tools.predict.run import OUTPUTS, check_readable, list_inputs

RUN_HERE = ("trainer.strategy=ddp", "trainer.sync_batchnorm=false", "trainer.loggers=[]")
"""Prediction needs no model split, no BatchNorm statistics and no logger: one whole model per process."""


def split_overrides(args: argparse.Namespace) -> None:
    """``--input a.jpg key=value``: --input takes every word after it, so hand back those that are overrides."""
    overrides = [p for p in args.input if "=" in p and not Path(p).exists()]
    args.input = [p for p in args.input if p not in overrides]
    args.overrides = [*args.overrides, *overrides]
    if not args.input:
        raise ValueError("--input names no image file or folder; give at least one before any key=value override")


def check_out(out: Path, *, overwrite: bool) -> None:
    """Refuse a non-empty --out unless asked; with --overwrite remove only what predict writes."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder for the predictions")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"--out {out} is not empty; pass --overwrite to replace its predictions, or choose "
                             "another --out")
        for name in OUTPUTS:
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()


def prepare_predict(args: argparse.Namespace, overrides: list[str]) -> tuple[RunConfig, Any, Callable[[RunConfig], Any]]:
    """The config to predict with, the checkpoint's state, and the function each process runs."""
    from gputrain.tools.from_checkpoint import config_from_checkpoint, load_for_eval, saved_config
    from gputrain.tools.predict.run import predict_from_config

    state = load_for_eval(args.checkpoint, args.weights)
    if saved_config(state) is None:
        raise ValueError(f"checkpoint {args.checkpoint} holds no saved config, so no task to predict with; predict "
                         "with a checkpoint written by gputrain train (RUN/checkpoints/last.pt)")
    if args.batch_size is not None:
        overrides = [*overrides, f"trainer.eval_batch_size={args.batch_size}"]
    cfg, _ = config_from_checkpoint(state, args.checkpoint, recipe=None, overrides=[*RUN_HERE, *overrides],
                                    command="predict")
    out = Path(args.out)
    cfg.trainer.out = str(out)  # where eval would write; no dated run folder is made

    def run(c: RunConfig) -> None:
        predict_from_config(c, args.checkpoint, state, args.input, out, annotations=args.annotations)

    return cfg, state, run


def check_predict(cfg: RunConfig, args: argparse.Namespace, state: Any) -> None:
    """Before any rank starts: the inputs, the task, the model's fit and ``--out``, each a one-line error."""
    from gputrain.tasks import prediction_task
    from gputrain.tools.from_checkpoint import build_fitting_model

    check_readable(list_inputs(args.input))
    prediction_task(cfg, annotations=args.annotations)  # a task that cannot predict, a missing --annotations
    build_fitting_model(cfg, state, args.checkpoint)  # a misfit is one line here, not N ranks' tracebacks
    out = Path(args.out)
    check_out(out, overwrite=args.overwrite)
    out.mkdir(parents=True, exist_ok=True)
