"""How fast the training loader's readers read, measured where they read (issue 42: the run's own answer to the
plan's images/s per loader worker).

A reader is the training process itself (``data.num_workers=0``) or one loader worker. Each times its reads
(``dataset[i]``: decode and transforms) and its collate of each batch, the two things a worker does, on its own
clock: what it gives is its rate while it works, whatever the training step does meanwhile. Each reader's first
batch is left out, as the plan leaves out its first read: it opens files and warms caches (and a worker's threads).

A reader keeps its own sum in a plain float and publishes it once a batch to a slot of its own in shared memory, so
the cost is two clock reads a sample and a few writes a batch (a tensor op a sample would add a quarter to
CIFAR-10's 20 µs reads), and no two processes write the same slot.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset, get_worker_info


class ReaderClock:
    """Seconds and samples per reader: slot 0 the training process, slot ``k + 1`` loader worker ``k``."""

    def __init__(self, workers: int) -> None:
        # A raw shared array: inherited by forked workers, and handed to spawned ones with the dataset at their start.
        self._slots = multiprocessing.RawArray("d", 2 * (workers + 1))
        self._seconds = 0.0  # this process's reads since its last batch (each process has its own copy)
        self._warm = False  # this process's first batch is not counted: it opens files, caches, a worker's threads

    def read(self, seconds: float) -> None:
        self._seconds += seconds

    def batch(self, samples: int, seconds: float) -> None:
        """One batch collated in ``seconds``, after ``samples`` reads: both go to this reader's slot."""
        if not self._warm:  # as the plan's timing leaves out its first read
            self._warm, self._seconds = True, 0.0
            return
        info = get_worker_info()
        slot = 0 if info is None else info.id + 1
        self._slots[2 * slot] += self._seconds + seconds
        self._slots[2 * slot + 1] += samples
        self._seconds = 0.0

    def images_per_s(self) -> tuple[float, int]:
        """(one reader's images/s over everything read so far, the readers that read); (0, 0) before any batch."""
        seconds, samples = sum(self._slots[0::2]), self._slots[1::2]
        return (sum(samples) / seconds if seconds > 0 else 0.0), sum(1 for n in samples if n)


class TimedReads(Dataset):
    """``dataset`` with each read's time added to ``clock``."""

    def __init__(self, dataset: Dataset, clock: ReaderClock) -> None:
        self.dataset, self.clock = dataset, clock

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.dataset[key]
        finally:
            self.clock.read(time.perf_counter() - started)


class TimedCollate:
    """``collate`` with each batch's collate time, and the batch's reads, published to ``clock``."""

    def __init__(self, collate: Callable[[list[Any]], Any], clock: ReaderClock) -> None:
        self.collate, self.clock = collate, clock

    def __call__(self, batch: list[Any]) -> Any:
        started = time.perf_counter()
        out = self.collate(batch)
        self.clock.batch(len(batch), time.perf_counter() - started)
        return out
