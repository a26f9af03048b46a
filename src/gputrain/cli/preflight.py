"""What the launcher checks before any worker starts: the task's packages, data paths, precision, devices, weights.

A missing folder found by the workers costs their start-up (imports, rendezvous: tens of seconds
on a busy machine) and prints once per rank; found here it costs nothing and prints once. Every
failure is one line naming the field or package and the fix. This module imports no torch, so
the loggers and the command line can use it freely.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from gputrain.extras import require

if TYPE_CHECKING:
    from gputrain.config import RunConfig

SLOW_ON_CPU = ("16-mixed", "bf16-mixed")


def check_packages(cfg: RunConfig) -> None:
    """The optional packages the run's loggers and task need are installed."""
    for name in cfg.trainer.loggers:
        if name in ("tensorboard", "wandb"):
            require(name, f"trainer.loggers=[{name}]")
    from gputrain.tasks import TASKS, check_task_options

    check_task_options(cfg)  # before any worker: the task's own options (what it states in gputrain.tasks.TASKS)
    for module in TASKS[cfg.task].packages if cfg.task in TASKS else ():
        require(module, f"task {cfg.task}")


def check_data_paths(cfg: RunConfig) -> None:
    """``data.root`` (and ``val_root``, ``annotations`` when set) exist and are readable, for built-in tasks.

    A task of your own (``package.module:function``) reads what it likes, so it is not checked here.
    With ``data.download=true`` the data set is downloaded first (once per node: this runs in the launcher).
    """
    from gputrain.data.download import download_data
    from gputrain.tasks import BUILTIN_TASKS, sample_data_kind

    download_data(cfg)

    if cfg.task not in BUILTIN_TASKS:
        return
    kind = sample_data_kind(cfg)
    for field, value in (("data.root", cfg.data.root), ("data.val_root", cfg.data.val_root),
                         ("data.annotations", cfg.data.annotations)):
        if not value:
            continue
        path = Path(value)
        if not path.exists():
            where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
            fix = (f"make sample data with `gputrain data make {kind} --out {value}` or point --data-root at your data"
                   if field == "data.root" and kind else f"set {field} to an existing path")
            siblings = [p.name for p in path.parent.iterdir()] if path.parent.is_dir() else []
            near = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.8)
            if near:  # a typo of a folder that is there (data/frame for data/frames)
                fix = f"did you mean {path.parent / near[0]}? Else {fix}"
            raise FileNotFoundError(f"{field}={value} does not exist{where}; {fix}")
        if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
            raise ValueError(f"{field}={value} is not readable by this user; check its permissions")


def cpu_precision(precision: str, accelerator: str, *, explicit: bool) -> tuple[str, str]:
    """The precision to run and a line to print, for 16-bit precisions on a CPU.

    float16 autocast has no fast CPU kernels (the ADE20K recipe ran about 20x slower than in float32), and neither
    has bfloat16 on a CPU without native bfloat16 (AVX512-BF16 or AMX: oneDNN's answer), so a recipe's 16-bit default
    falls back to 32 there; an explicit ``--precision`` is obeyed, with a warning. bfloat16 on a CPU that has it runs
    as asked (a conv layer 1.8x faster than float32 here: docs/precision.md).
    """
    if precision not in SLOW_ON_CPU:
        return precision, ""  # decided without torch (the launcher's usual case)
    from gputrain.dist import resolve_accelerator

    if resolve_accelerator(accelerator) != "cpu":
        return precision, ""
    import torch

    if precision == "bf16-mixed" and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return precision, ""
    kind = "float16" if precision == "16-mixed" else "bfloat16 (this CPU has no native bfloat16)"
    if explicit:
        return precision, f"gputrain: warning: precision {precision} on a CPU: {kind} autocast runs many times slower " \
                          "there than 32"
    return "32", (f"gputrain: precision {precision} (from the recipe) falls back to 32 on a CPU, where {kind} autocast "
                  f"runs many times slower; pass --precision {precision} to use it anyway")


def check_accelerator(accelerator: str) -> None:
    """``trainer.accelerator=cuda`` on a machine without a CUDA device is refused before any rank starts; ``auto``
    and ``cpu`` need no check (and no torch import: the ranks start sooner)."""
    if accelerator == "cuda":
        from gputrain.dist import resolve_accelerator

        resolve_accelerator(accelerator)


def devices_note(strategy: str, devices: int, accelerator: str) -> str:
    """A line when the strategy starts fewer processes than ``--devices`` asks for (dp: one process)."""
    from gputrain.strategies import processes_per_node

    procs = processes_per_node(strategy, devices)
    if procs >= devices:
        return ""
    from gputrain.dist import resolve_accelerator

    where = ("on a CPU it uses one device" if resolve_accelerator(accelerator) == "cpu"
             else "its own options pick the GPUs it drives, e.g. trainer.dp_device_ids for dp")
    return (f"gputrain: strategy {strategy} runs {procs} process per node, so --devices {devices} starts no more "
            f"processes ({where}); use --strategy ddp for one process per device")


def check_model(cfg: RunConfig) -> None:
    """A ``model.name`` that is no model of the task's kind, refused in one line before any worker starts.

    Only a torchvision name is looked up (importing torchvision costs seconds): built-in names and
    ``package.module:function`` are checked where they are built."""
    from gputrain.tasks import model_kind

    name, kind = cfg.model.name, model_kind(cfg)
    if kind and name and ":" not in name:
        from gputrain.models import check_model_name, timm_zoo

        check_model_name(name, kind)
        if cfg.trainer.strategy not in ("model_parallel", "pipeline"):
            return  # only these split the model into a chain of blocks (and the check imports torch, torchvision)
        from gputrain.models.zoo import check_splits

        if timm_zoo.is_timm(name):
            timm_zoo.check_splits(name, cfg.trainer.strategy)
        else:
            check_splits(name, cfg.trainer.strategy, cfg.model.kwargs)


def fetch_weights(cfg: RunConfig) -> None:
    """Fetch ``model.weights`` into the torch hub cache once per node, before any worker starts.

    The launcher is one process per node, so this is the one download of the node; the workers find
    the file cached and only load it. Offline without the cached file: one line naming the file, its URL
    and the folder to put it in.
    """
    if not cfg.model.weights or not cfg.model.name:  # no name yet: the task's default model fetches when built
        return
    from gputrain.models.pretrained import fetch, weights_source

    fetch(weights_source(cfg.model.name, cfg.model.kwargs, cfg.model.weights))
