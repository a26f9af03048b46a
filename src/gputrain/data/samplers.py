"""Sampling the framework owns: which samples each rank reads at each step, from (seed, epoch) alone.

An epoch is a permutation drawn from ``(seed, epoch)`` and cut into global batches of
``G = batch_size x data-parallel size x accumulation``. Global batch ``k`` is cut into
micro-batches of ``batch_size x dp`` consecutive samples, and each micro-batch is dealt to ranks
by stride. So ``W`` ranks with batch ``B`` see, step by step, exactly the samples one process
with batch ``W*B`` sees, whatever the dataset size: the last global batch is trained as it
comes (some ranks may get fewer samples, or none), never padded with repeats. Because a step's
samples depend only on ``(seed, epoch, k, G)``, a checkpoint that records ``k`` resumes on any
world size that keeps ``G``.

Augmentation randomness follows the same rule: :class:`SeededSamples` draws each sample's
transforms from ``(seed, epoch, index)``, not from a worker's or rank's generator.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The global sample order of one epoch; depends on ``(seed, epoch)`` only."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


class EpochPlan:
    """The global batches of one epoch and how each is cut into micro-batches and rank shares.

    ``unit=2`` deals the samples of a micro-batch by stride in pairs of consecutive samples, each pair to one rank
    (MixUp and CutMix mix a pair's two images, :mod:`gputrain.data.mix`); ``repeats=k`` trains each pair of the
    permutation k times in a row, the epoch keeping ``n`` samples (the reference's repeated augmentation).
    """

    def __init__(self, n: int, *, seed: int, epoch: int, dp_size: int, batch_size: int, accumulate: int = 1,
                 drop_last: bool = False, shuffle: bool = True, unit: int = 1, repeats: int = 1) -> None:
        if n <= 0:
            raise ValueError("the training dataset is empty; check data.root and the split")
        self.order = epoch_permutation(n, seed, epoch, shuffle)
        self.repeats = repeats
        if repeats > 1:
            self.order, self._repeat = _repeated(self.order, repeats, n)
        self.unit = unit
        self.dp_size, self.batch_size, self.accumulate = dp_size, batch_size, accumulate
        self.global_batch = batch_size * dp_size * accumulate
        usable = (n // self.global_batch) * self.global_batch if drop_last else n
        self.num_samples = usable
        self.num_steps = math.ceil(usable / self.global_batch)

    def step_size(self, k: int) -> int:
        """Samples in global batch ``k`` (all ranks, all micro-batches)."""
        return min(self.global_batch, self.num_samples - k * self.global_batch)

    def micro_batches(self, k: int) -> list[list[list[int]]]:
        """``[micro][dp_rank] -> indices`` of global batch ``k``; a short last batch has fewer or emptier entries."""
        return [[[self.order[p] for p in share] for share in micro] for micro in self._positions(k)]

    def micro_keys(self, k: int) -> list[list[list[tuple[int, ...]]]]:
        """:meth:`micro_batches` as the loader's keys: ``(index,)``, or ``(index, repeat)`` with repeats, the repeat
        being which of the sample's trainings in the epoch this is (so each is augmented anew)."""
        if self.repeats == 1:
            return [[[(self.order[p],) for p in share] for share in micro] for micro in self._positions(k)]
        return [[[(self.order[p], self._repeat[p]) for p in share] for share in micro] for micro in self._positions(k)]

    def _positions(self, k: int) -> list[list[list[int]]]:
        """``[micro][dp_rank] -> positions in the epoch's order`` of global batch ``k``: each micro-batch of
        ``batch_size x dp`` consecutive positions dealt to ranks by stride, in units of ``unit`` positions."""
        start = k * self.global_batch
        end = start + self.step_size(k)
        chunk, u, dp = self.batch_size * self.dp_size, self.unit, self.dp_size
        return [[[p for first in range(m + r * u, min(m + chunk, end), u * dp) for p in range(first, min(first + u, end))]
                 for r in range(dp)] for m in range(start, end, chunk)]

    def samples_before(self, k: int) -> int:
        """Samples of the epoch consumed by the first ``k`` steps (the global sample cursor)."""
        return min(k * self.global_batch, self.num_samples)


def _repeated(order: list[int], repeats: int, n: int) -> tuple[list[int], list[int]]:
    """``order`` with each pair of consecutive samples trained ``repeats`` times in a row (``a b a b a b``), cut to
    ``n``; and which repetition each position is. By pairs, so that MixUp and CutMix, which mix a pair, never mix a
    sample with its own repetition."""
    repeated: list[int] = []
    repetition: list[int] = []
    for j in range(0, len(order), 2):
        pair = order[j:j + 2]
        for r in range(repeats):
            repeated += pair
            repetition += [r] * len(pair)
    return repeated[:n], repetition[:n]


class StepBatchSampler(Sampler[list[tuple[int, ...]]]):
    """This rank's non-empty micro-batches of an epoch, from a start step, as ``(epoch, index)`` keys.

    The loop calls :meth:`set_epoch` before each epoch (with the step to start from on a
    mid-epoch resume) and reads :attr:`plan` to know which micro-batches are empty on which rank.
    """

    def __init__(self, length: int, *, dp_rank: int, dp_size: int, batch_size: int, accumulate: int = 1,
                 seed: int = 0, drop_last: bool = False, shuffle: bool = True, unit: int = 1,
                 repeats: int = 1) -> None:
        self.length, self.dp_rank = length, dp_rank
        self.options = dict(seed=seed, dp_size=dp_size, batch_size=batch_size, accumulate=accumulate,
                            drop_last=drop_last, shuffle=shuffle, unit=unit, repeats=repeats)
        self.epoch, self.start_step = 0, 0
        self.plan = EpochPlan(length, epoch=0, **self.options)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch, self.start_step = epoch, start_step
        self.plan = EpochPlan(self.length, epoch=epoch, **self.options)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[tuple[int, ...]]]:
        for k in range(self.start_step, self.plan.num_steps):
            for micro in self.plan.micro_keys(k):
                if micro[self.dp_rank]:
                    yield [(self.epoch, *key) for key in micro[self.dp_rank]]

    def __len__(self) -> int:
        return sum(1 for k in range(self.start_step, self.plan.num_steps)
                   for micro in self.plan._positions(k) if micro[self.dp_rank])


class SeededSamples(Dataset):
    """Reads ``dataset[index]`` with torch's generator seeded from ``(seed, epoch, index)``.

    Random transforms then depend on the sample, not on which rank or worker reads it, so a run
    resumed on another world size or worker count augments every sample as before. The caller's
    generator state is restored afterwards (dropout keeps its own stream).
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, ...]) -> Any:
        epoch, index, *repeat = key  # a repeated sample's key carries which repetition it is (data.repeated_augment)
        # The CPU generator alone, by hand: torch.manual_seed also seeds every accelerator backend and
        # fork_rng adds its own bookkeeping; together they cost ~0.3 ms a sample, this ~7 us.
        saved = torch.get_rng_state()
        mixed = ((self.seed * 1_000_003 + epoch) * 2_147_483_647 + index) % 2**63
        if repeat:
            mixed = (mixed * 1_000_033 + repeat[0] + 1) % 2**63
        torch.default_generator.manual_seed(mixed)
        try:
            return self.dataset[index]
        finally:
            torch.set_rng_state(saved)


def eval_shard(n: int, rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s evaluation indices: strided, no padding, no duplicates.

    Shards differ in length by at most one; together they cover ``range(n)`` exactly once.
    """
    return list(range(rank, n, world_size))


class EvalSampler(Sampler[int]):
    """Exact evaluation shard: each sample on exactly one rank, none repeated."""

    def __init__(self, length: int, *, rank: int = 0, world_size: int = 1) -> None:
        self.indices = eval_shard(length, rank, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
