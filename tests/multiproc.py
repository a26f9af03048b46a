"""Run a test body in real worker processes (gloo on CPU), started by torchrun's elastic agent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gputrain.dist import init_distributed, teardown
from gputrain.launch import launch_all


def _entry(fn: Callable[..., Any], args: tuple[Any, ...], accelerator: str) -> Any:
    torch.set_num_threads(1)
    info = init_distributed(accelerator)
    try:
        return fn(info, *args)
    finally:
        teardown()


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, accelerator: str = "cpu") -> list[Any]:
    """``fn(dist_info, *args)`` on each of ``world_size`` ranks; results listed by rank.

    ``fn`` must be a module-level function of an importable module (workers are spawned).
    """
    return launch_all(_entry, fn, args, accelerator, devices=world_size)
