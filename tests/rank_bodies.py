"""A rank body for benchmarks/rank_launch.py: join the group, all-reduce once (module level: ranks import it)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_once(info) -> float:
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t)
    return float(t)
