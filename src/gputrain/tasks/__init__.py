"""Built-in tasks, each a module with ``build(cfg) -> TaskSpec``; a recipe may name ``package.module:function`` instead."""

from __future__ import annotations

from gputrain.config import RunConfig
from gputrain.imports import resolve
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
