"""What a run records about itself besides checkpoints and logs, and what it removes when it never started.

``summary.json`` when training ends; the config of a run started from Python (which used no recipe);
the answer to resuming a finished run; and the cleanup after a fresh run that failed before its
first step, so that its folder is not later taken for a run to continue.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gputrain.config import RunConfig

if TYPE_CHECKING:
    from gputrain.loop import Trainer


def describe_python_run(cfg: RunConfig, model: nn.Module) -> RunConfig:
    """A run from the Python API saves a config that says so, not the defaults of a recipe it never used."""
    cls = type(model)
    return dataclasses.replace(cfg, task="custom",
                               model=dataclasses.replace(cfg.model, name=f"{cls.__module__}:{cls.__qualname__}"),
                               data=dataclasses.replace(cfg.data, root=""))


def training_options(cfg: RunConfig, *, checkpoints: str, frozen_share: float = 0.0) -> str:
    """The start-up line's words for what else changes what or how the run trains: only what is on.

    ``checkpoints``: how checkpoints are written (``background`` or ``synchronous``; empty when off);
    ``frozen_share``: the share of the model's parameters that do not train.
    """
    from gputrain.data.synthetic import SYNTHETIC_SAMPLES

    d, m, t = cfg.data, cfg.model, cfg.trainer
    words = [f"workers={d.num_workers}"]
    if d.synthetic:
        words.append(f"data=synthetic(the first {SYNTHETIC_SAMPLES} samples repeated)")
    if frozen_share:
        words.append(f"frozen={','.join(m.freeze) or 'parameters'}({frozen_share:.0%} of the parameters)")
    flags = (("decode_on_device", d.decode_on_device), ("frozen_batchnorm", m.frozen_batchnorm),
             ("sync_batchnorm", t.sync_batchnorm), ("drop_last", t.drop_last))
    words += [name for name, on in flags if on]
    values = (("weights", m.weights),
              ("accumulate", t.accumulate_grad_batches if t.accumulate_grad_batches > 1 else 0),
              ("grad_clip_norm", t.grad_clip_norm), ("max_steps_per_epoch", t.max_steps_per_epoch),
              ("checkpoints", checkpoints))
    words += [f"{name}={value}" for name, value in values if value]
    return " ".join(words)


def discard_untrained_run(out: Path, existed: bool) -> None:
    """Remove what a fresh run wrote into ``out`` (which was empty, or cleared by --overwrite, when it began)."""
    for path in (list(out.iterdir()) if existed and out.is_dir() else []):
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    if not existed:
        shutil.rmtree(out, ignore_errors=True)
        latest = out.parent / "latest"
        if latest.is_symlink() and not latest.exists():
            latest.unlink()  # it pointed to the folder just removed


def already_finished(trainer: Trainer) -> dict[str, Any]:
    """Resuming a finished run changes nothing: say so and return its summary."""
    path = trainer.out / "summary.json"
    if trainer.dist.is_main:
        print(f"gputrain: {trainer.out} is finished (epoch {trainer.state.epoch} of {trainer.cfg.trainer.epochs}); "
              "nothing was changed. To train longer, resume with a larger --epochs", flush=True)
    return json.loads(path.read_text()) if path.is_file() else {"epochs": trainer.state.epoch}


def write_summary(trainer: Trainer, metrics: dict[str, float], wall_s: float, train_s: float,
                  samples: float) -> dict[str, Any]:
    """The run's ``summary.json`` (rank 0 writes it); every rank returns it."""
    t = trainer.cfg.trainer
    val_iters = len(trainer.val_loader) if trainer.val_loader is not None else 0
    summary = {
        "final": metrics,
        "world_size": trainer.dist.world_size,
        "strategy": trainer.strategy.name,
        "precision": trainer.precision.name,
        "device": str(trainer.dist.device),
        "batch_size_per_device": t.batch_size,
        "global_batch": trainer.global_batch,
        "iters_per_epoch": {"train": len(trainer.train_loader), "val": val_iters,
                            "total": len(trainer.train_loader) + val_iters},
        "epochs": trainer.state.epoch,
        "global_step": trainer.state.global_step,
        "samples_seen": trainer.state.samples_seen,
        "wall_s": wall_s,
        "train_s": train_s,
        "images_per_s": samples / train_s if train_s > 0 else 0.0,
        "peak_memory_bytes": peak_memory_bytes(trainer.dist.device),
        "fast": trainer.fast.describe().removeprefix("fast="),
        # The run's first optimizer step: with trainer.compile it holds the compile time (bench throughput
        # reports compile_s = first step - a steady step).
        "first_step_s": trainer.first_step_s,
    }
    if trainer.dist.is_main:
        from gputrain.hooks.logging import strict_json

        (trainer.out / "summary.json").write_text(strict_json(summary, indent=2))
    return summary


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: CUDA's allocator peak on a GPU, the peak resident set size on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
