"""Run a test body in real worker processes (gloo on CPU), started by torchrun's elastic agent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gputrain.dist import init_distributed, teardown
from gputrain.launcher.ranks import launch_all


def _entry(fn: Callable[..., Any], args: tuple[Any, ...], accelerator: str, timeout_s: float) -> Any:
    torch.set_num_threads(1)
    info = init_distributed(accelerator, timeout_s=timeout_s)
    try:
        return fn(info, *args)
    finally:
        teardown()


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, accelerator: str = "cpu",
              timeout_s: float = 600.0) -> list[Any]:
    """``fn(dist_info, *args)`` on each of ``world_size`` ranks; results listed by rank.

    ``fn`` must be a module-level function of an importable module (workers are spawned). ``timeout_s``: how long a
    collective may wait for the other ranks (a test whose planted fault leaves a rank waiting sets it short).
    """
    return launch_all(_entry, fn, args, accelerator, timeout_s, devices=world_size)
