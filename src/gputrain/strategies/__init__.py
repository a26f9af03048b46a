"""Parallel strategies, one file each, behind :class:`~gputrain.strategies.base.Strategy`.

The config names a strategy (``trainer.strategy``); this registry is the one place that maps the
name to its class. Everything else asks the class (processes per node, options) or the instance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gputrain.dist import DistInfo
from gputrain.strategies.base import MicroBatch, Strategy
from gputrain.strategies.ddp import DDP
from gputrain.strategies.dp import DataParallel
from gputrain.strategies.single import SingleDevice

if TYPE_CHECKING:
    from gputrain.config import RunConfig

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (SingleDevice, DDP, DataParallel)}


def _register_optional() -> None:
    """Strategies whose modules import torch features that older torch builds lack; added when importable."""
    import importlib

    for module, cls_name in (("gputrain.strategies.model_parallel", "ModelParallel"),
                             ("gputrain.strategies.pipeline", "Pipeline"),
                             ("gputrain.strategies.fsdp", "FSDP")):
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
            continue
        STRATEGIES[cls.name] = cls


_register_optional()


def strategy_class(name: str) -> type[Strategy]:
    """The class registered as ``name``; a one-line error lists the valid names."""
    if name not in STRATEGIES:
        raise ValueError(f"trainer.strategy={name!r} is unknown; choose one of {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[name]


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


__all__ = ["DDP", "DataParallel", "MicroBatch", "SingleDevice", "Strategy", "STRATEGIES", "build_strategy",
           "strategy_class"]
