"""Samplers the framework owns, so that data order never depends on rank or worker RNG.

Training order is a permutation drawn from ``(seed, epoch)`` alone and dealt to ranks by
stride, so ``W`` ranks with batch ``B`` see, step by step, exactly the samples that one
process with batch ``W*B`` sees. Evaluation shards without padding: every sample is
evaluated once, whatever the world size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The global sample order of one epoch; depends on ``(seed, epoch)`` only."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def train_shard(order: list[int], rank: int, world_size: int, drop_last: bool) -> list[int]:
    """Rank ``rank``'s slice of ``order``: every ``world_size``-th index from ``rank``.

    Without ``drop_last`` the order is padded with its own head (as DistributedSampler
    does) so that every rank runs the same number of steps; with it, the tail that does not
    fill every rank is dropped.
    """
    n = len(order)
    if drop_last:
        per_rank = n // world_size
    else:
        per_rank = math.ceil(n / world_size)
    total = per_rank * world_size
    if total > n:
        reps = math.ceil(total / max(n, 1))
        order = (order * reps)[:total]
    else:
        order = order[:total]
    return order[rank:total:world_size]


def eval_shard(n: int, rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s evaluation indices: strided, no padding, no duplicates.

    Shards differ in length by at most one; together they cover ``range(n)`` exactly once.
    """
    return list(range(rank, n, world_size))


class TrainSampler(Sampler[int]):
    """Deterministic, rank-sharded training order; the loop calls :meth:`set_epoch`."""

    def __init__(
        self, length: int, *, rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if length == 0:
            raise ValueError("the training dataset is empty; check data.root and the split")
        self.length, self.rank, self.world_size = length, rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order = epoch_permutation(self.length, self.seed, self.epoch, self.shuffle)
        return iter(train_shard(order, self.rank, self.world_size, self.drop_last))

    def __len__(self) -> int:
        if self.drop_last:
            return self.length // self.world_size
        return math.ceil(self.length / self.world_size)


class EvalSampler(Sampler[int]):
    """Exact evaluation shard: each sample on exactly one rank, none repeated."""

    def __init__(self, length: int, *, rank: int = 0, world_size: int = 1) -> None:
        self.indices = eval_shard(length, rank, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
