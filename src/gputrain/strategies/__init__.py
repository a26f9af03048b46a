"""Parallel strategies, one file each, behind :class:`~gputrain.strategies.base.Strategy`."""

from __future__ import annotations

from typing import Any

from gputrain.dist import DistInfo
from gputrain.strategies.base import Strategy
from gputrain.strategies.ddp import DDP
from gputrain.strategies.dp import DataParallel
from gputrain.strategies.single import SingleDevice

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (SingleDevice, DDP, DataParallel)}


def build_strategy(name: str, dist_info: DistInfo, **options: Any) -> Strategy:
    """The strategy called ``name`` (single, ddp, dp) for this process."""
    if name not in STRATEGIES:
        raise ValueError(f"trainer.strategy={name!r} is unknown; choose one of {sorted(STRATEGIES)}")
    if name == "single" and dist_info.world_size > 1:
        raise ValueError(
            f"strategy single runs one process but {dist_info.world_size} were started; use --strategy ddp"
        )
    return STRATEGIES[name](dist_info, **options)


__all__ = ["DDP", "DataParallel", "SingleDevice", "Strategy", "STRATEGIES", "build_strategy"]
