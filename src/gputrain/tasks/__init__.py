"""Built-in tasks, each a module with ``build(cfg) -> TaskSpec``; a recipe may name ``package.module:function`` instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gputrain.config import RunConfig
from gputrain.extras import resolve
from gputrain.tasks.spec import TaskSpec

BUILTIN_TASKS: dict[str, str] = {
    "autoencoder": "gputrain.tasks.autoencoder:build",
    "classification": "gputrain.tasks.classification:build",
    "segmentation": "gputrain.tasks.segmentation:build",
    "detection": "gputrain.tasks.detection:build",
}


def build_task(cfg: RunConfig) -> TaskSpec:
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
