"""gputrain: train vision models on one CPU, one GPU, many GPUs or many nodes from one recipe.

The public names are imported on first use (PEP 562), so ``import gputrain`` and the command line's ``--help``,
``--version`` and usage errors cost no torch import (seconds on a busy machine).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gputrain.config import RunConfig, load_config
    from gputrain.dist import DistInfo, init_distributed
    from gputrain.engine.hooks import Hook, RunContext
    from gputrain.engine.trainer import Trainer
    from gputrain.launcher.ranks import launch, launch_all

__version__ = "0.1.0"
__all__ = ["DistInfo", "Hook", "RunConfig", "RunContext", "Trainer", "init_distributed", "launch", "launch_all",
           "load_config"]

_HOMES = {"RunConfig": "gputrain.config", "load_config": "gputrain.config", "DistInfo": "gputrain.dist",
          "init_distributed": "gputrain.dist", "launch": "gputrain.launcher.ranks",
          "launch_all": "gputrain.launcher.ranks", "Trainer": "gputrain.engine.trainer",
          "Hook": "gputrain.engine.hooks", "RunContext": "gputrain.engine.hooks"}
"""Where each public name lives; add a name here and to ``__all__`` (and the TYPE_CHECKING imports)."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'gputrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
