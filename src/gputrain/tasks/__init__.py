"""Built-in tasks, each a module with ``build(cfg) -> TaskSpec``; a recipe may name ``package.module:function`` instead."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gputrain.config import RunConfig
from gputrain.extras import resolve
from gputrain.tasks.spec import TaskSpec


@dataclass(frozen=True)
class Registered:
    """What a built-in task states about itself, read where it is needed (no torch import)."""

    module: str
    """The module holding ``build(cfg) -> TaskSpec`` and ``for_prediction(cfg, annotations=...)``."""
    sample_data: dict[str, str]
    """The ``gputrain data make`` kind that writes sample data for it, by ``data.format`` ("": any format)."""
    packages: tuple[str, ...] = ()
    """Optional packages it needs (data loading, evaluation): checked before any worker starts."""
    uint8_batches: bool = True
    """Whether it can send its training images as ``uint8`` to be normalised on the device (data.normalize_on_device)."""
    model_kind: str = ""
    """The kind of torchvision model ``model.name`` may name for it (classification, detection, segmentation)."""


TASKS: dict[str, Registered] = {
    "autoencoder": Registered("gputrain.tasks.autoencoder", {"": "imagefolder"}),
    "classification": Registered("gputrain.tasks.classification", {"cifar10": "cifar10", "classfolder": "classfolder"},
                                 model_kind="classification"),
    "segmentation": Registered("gputrain.tasks.segmentation", {"": "ade20k"}, model_kind="segmentation"),
    "detection": Registered("gputrain.tasks.detection", {"": "coco"}, packages=("pycocotools",),
                            model_kind="detection"),
}
"""The built-in tasks, each one line: adding a task is a module with ``build`` (and ``for_prediction``) and its line
here (docs/architecture.md)."""

BUILTIN_TASKS: dict[str, str] = {name: f"{task.module}:build" for name, task in TASKS.items()}
"""Each built-in task's ``build`` function, as a recipe's ``task: package.module:function`` names one."""


def sample_data_kind(cfg: RunConfig) -> str:
    """The ``gputrain data make`` kind of the run's task and ``data.format``, or "" (a task of your own)."""
    task = TASKS.get(cfg.task)
    return "" if task is None else task.sample_data.get(cfg.data.format or "", task.sample_data.get("", ""))


def model_kind(cfg: RunConfig) -> str:
    """The kind of torchvision model the run's task trains ("" for a task of your own, or the autoencoder)."""
    task = TASKS.get(cfg.task)
    return "" if task is None else task.model_kind


def check_task_options(cfg: RunConfig) -> None:
    """Options that only some tasks honour, refused in one line before the task is built."""
    task = TASKS.get(cfg.task)
    if cfg.data.normalize_on_device is True and (task is None or not task.uint8_batches):
        takes = ", ".join(name for name, t in TASKS.items() if t.uint8_batches)
        raise ValueError(f"data.normalize_on_device=true changes the batches of the built-in tasks ({takes}), and "
                         f"task {cfg.task} makes its own; set data.normalize_on_device=auto (your task's collate "
                         "decides) or false")


def build_task(cfg: RunConfig) -> TaskSpec:
    check_task_options(cfg)
    target = BUILTIN_TASKS.get(cfg.task, cfg.task)
    if ":" not in target:
        raise ValueError(f"task={cfg.task!r} is unknown; built-in: {sorted(BUILTIN_TASKS)}, or package.module:function")
    spec = resolve(target, field="task")(cfg)
    if not isinstance(spec, TaskSpec):
        raise TypeError(f"task={cfg.task!r} returned {type(spec).__name__}, not a gputrain.tasks.spec.TaskSpec")
    return spec


def prediction_task(cfg: RunConfig, *, annotations: str = "") -> tuple[Any, Callable[[Any], Any]]:
    """``(task, preprocess)`` for ``gputrain predict``: a task module's ``for_prediction(cfg, annotations=...)``.

    A task named ``package.module:build`` takes part by defining ``for_prediction`` beside ``build``.
    """
    target = BUILTIN_TASKS.get(cfg.task, cfg.task)
    module = target.split(":")[0]
    try:
        make = resolve(f"{module}:for_prediction", field="task")
    except (ImportError, AttributeError, ValueError):
        raise ValueError(f"task={cfg.task!r} cannot predict: its module {module} defines no for_prediction(cfg, "
                         f"annotations=...); built-in tasks that can: {sorted(BUILTIN_TASKS)}") from None
    return make(cfg, annotations=annotations)
