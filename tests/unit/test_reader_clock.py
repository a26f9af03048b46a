"""Each reader of the training loader times its own reads and collates (issue 42: the run's images/s per loader
worker, set against the plan's): in the training process and in each worker, a slot of its own."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from gputrain.data.names import sample_file
from gputrain.data.reader_clock import ReaderClock, TimedCollate, TimedReads
from gputrain.data.samplers import SeededSamples

READ_S, COLLATE_S, BATCH = 0.002, 0.04, 4  # a sample costs 2 ms to read and 10 ms of its batch's collate
FIRST_S = 1.0  # the first read of each process (files opened, caches warmed)


class Sleepy(Dataset):
    """Reads of ``READ_S``, and ``FIRST_S`` more for the first read of each process."""

    samples = [(f"img{i}.jpg", 0) for i in range(32)]
    opened = False

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        if not self.opened:
            self.opened = True
            time.sleep(FIRST_S)
        time.sleep(READ_S)
        return torch.full((2,), float(i))


def _slow_collate(batch):
    time.sleep(COLLATE_S)
    return default_collate(batch)


@pytest.mark.parametrize("workers", [0, 2])
def test_each_reader_counts_its_reads_and_its_collates_in_a_slot_of_its_own(workers):
    clock = ReaderClock(workers)
    assert clock.images_per_s() == (0.0, 0)
    loader = DataLoader(TimedReads(Sleepy(), clock), batch_size=BATCH, num_workers=workers,
                        collate_fn=TimedCollate(_slow_collate, clock))
    batches = list(loader)
    assert torch.cat(batches).shape == (32, 2)  # the data themselves pass through unchanged
    rate, readers = clock.images_per_s()
    assert readers == max(workers, 1)
    # Bounds that a loaded machine keeps (it only slows the reads): collates left out would give 500/s, past the
    # top; a first batch counted (files opened: 1 s) would give each worker about 13/s, under the bottom.
    expected = 1 / (READ_S + COLLATE_S / BATCH)
    assert expected / 4 <= rate <= expected * 1.25


def test_a_samples_file_is_found_through_the_clock():
    clock = ReaderClock(0)
    assert sample_file(TimedReads(SeededSamples(Sleepy(), seed=0), clock), 3) == "img3.jpg"
