"""Parallel strategies, one file each, behind :class:`~gputrain.strategies.base.Strategy`.

The config names a strategy (``trainer.strategy``); this registry is the one place that maps the
name to its class. Everything else asks the class (processes per node, options) or the instance.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from gputrain.dist import DistInfo
from gputrain.strategies.base import MicroBatch, Strategy
from gputrain.strategies.ddp import DDP
from gputrain.strategies.dp import DataParallel
from gputrain.strategies.single import SingleDevice

if TYPE_CHECKING:
    from gputrain.config import RunConfig

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (SingleDevice, DDP, DataParallel)}
"""The strategies imported so far, by name; :data:`LAZY` ones are added the first time a run names one."""

LAZY: dict[str, tuple[str, str]] = {
    "model_parallel": ("gputrain.strategies.model_parallel", "ModelParallel"),
    "pipeline": ("gputrain.strategies.pipeline", "Pipeline"),
    "fsdp": ("gputrain.strategies.fsdp", "FSDP"),
}
"""Strategies whose modules are imported only when named: the pipeline's imports torch.distributed.pipelining
and with it torch._dynamo and DTensor, about 1.6 s (as much as torch itself) in the launcher of every run, before
it starts the ranks, and in each rank that does not import torchvision (which loads dynamo itself)."""


def strategy_names() -> list[str]:
    """Every name ``trainer.strategy`` accepts."""
    return sorted({*STRATEGIES, *LAZY})


def strategy_class(name: str) -> type[Strategy]:
    """The class registered as ``name``; a one-line error lists the valid names."""
    if name not in STRATEGIES and name in LAZY:
        module, cls_name = LAZY[name]
        try:
            STRATEGIES[name] = getattr(importlib.import_module(module), cls_name)
        except ModuleNotFoundError as err:
            if err.name == module:  # a build of gputrain without this strategy: unknown, as below
                return _imported(name)
            import torch

            raise ValueError(f"trainer.strategy={name} needs {err.name}, which torch {torch.__version__} does not "
                             "have; install the torch version in requirements.txt") from err
    return _imported(name)


def _imported(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise ValueError(f"trainer.strategy={name!r} is unknown; choose one of {', '.join(strategy_names())}")
    return STRATEGIES[name]


def available(name: str) -> bool:
    """Whether ``name``'s strategy can run with this installation (its module and torch's features import)."""
    try:
        strategy_class(name)
    except ValueError:
        return False
    return True


def build_strategy(cfg: RunConfig, dist_info: DistInfo) -> Strategy:
    """The strategy the config names, for this process."""
    cls = strategy_class(cfg.trainer.strategy)
    # The launcher (torchrun, SLURM) decided the process count, not trainer.devices: ask the class
    # whether it can run on that many processes at all.
    if dist_info.world_size > 1 and cls.processes_per_node(dist_info.world_size) == 1:
        raise ValueError(
            f"strategy {cls.name} runs one process but {dist_info.world_size} were started; "
            "use --strategy ddp for one process per device"
        )
    return cls.from_config(dist_info, cfg)


__all__ = ["DDP", "LAZY", "DataParallel", "MicroBatch", "SingleDevice", "Strategy", "STRATEGIES", "available",
           "build_strategy", "strategy_class", "strategy_names"]
