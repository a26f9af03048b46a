"""Parallel strategies, one file each, behind :class:`~gputrain.strategies.base.Strategy`.

The config names a strategy (``trainer.strategy``); :data:`STRATEGIES` is the one place that registers it: where
its class lives, imported the first time a run names it (the pipeline's module imports
``torch.distributed.pipelining`` and with it dynamo and DTensor, about as long as torch itself), and whether one
process drives all of a node's devices. That one fact sits in the registration rather than the class because the
launcher needs it before it starts the ranks, and importing any strategy imports torch (seconds the ranks would
wait); the class answers :meth:`~gputrain.strategies.base.Strategy.processes_per_node` from it. Everything else
asks the class: how many data-parallel shares a step has, its options
(:meth:`~gputrain.strategies.base.Strategy.from_config`). Importing this package imports no strategy and no torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gputrain.config.schema import RunConfig
    from gputrain.dist import DistInfo
    from gputrain.strategies.base import Strategy

@dataclass(frozen=True)
class Registered:
    """A strategy as registered: where its class lives and how many processes a node starts for it."""

    home: str
    """``module:Class``."""
    one_process: bool = False
    """One process drives all of a node's devices (single, dp, model_parallel); otherwise one process per device."""


STRATEGIES: dict[str, Registered] = {
    "single": Registered("gputrain.strategies.single:SingleDevice", one_process=True),
    "ddp": Registered("gputrain.strategies.ddp:DDP"),
    "dp": Registered("gputrain.strategies.dp:DataParallel", one_process=True),
    "pipeline": Registered("gputrain.strategies.pipeline:Pipeline"),
    "fsdp": Registered("gputrain.strategies.fsdp:FSDP"),
    "model_parallel": Registered("gputrain.strategies.model_parallel:ModelParallel", one_process=True),
}
"""Every name ``trainer.strategy`` accepts (``gputrain parity`` runs a mode of each, in this order)."""


def strategy_names() -> list[str]:
    """Every name ``trainer.strategy`` accepts."""
    return sorted(STRATEGIES)


def registered(name: str) -> Registered:
    """The registration of ``name``; a one-line error lists the valid names."""
    if name not in STRATEGIES:
        raise ValueError(f"trainer.strategy={name!r} is unknown; choose one of {', '.join(strategy_names())}")
    return STRATEGIES[name]


def processes_per_node(name: str, devices: int) -> int:
    """How many processes a node starts for strategy ``name`` on ``devices`` (no torch import)."""
    return 1 if registered(name).one_process else devices


def strategy_class(name: str) -> type[Strategy]:
    """The class registered as ``name``; a one-line error lists the valid names."""
    module, _, cls_name = registered(name).home.partition(":")
    try:
        return getattr(importlib.import_module(module), cls_name)  # type: ignore[no-any-return]
    except ModuleNotFoundError as err:
        import torch

        raise ValueError(f"trainer.strategy={name} needs {err.name}, which torch {torch.__version__} does not "
                         "have; install the torch version in requirements.txt") from err


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
