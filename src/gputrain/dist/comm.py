"""The collectives gputrain itself needs, over the job's default process group; each a no-op in one process.

Metrics reduce their statistics, the checkpoint agrees on a save, the engine agrees on a resume point and the
run folder, all through these few functions, so no layer above needs a strategy to talk to the other ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def active() -> bool:
    """Whether this process is one of several ranks in a process group (collectives do something)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` in place over all ranks (``sum`` or ``max``) and return it."""
    if active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def gather_objects(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0, by rank (None on the other ranks)."""
    if not active():
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank, by rank."""
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if active():
        dist.barrier()
