"""The input pipeline in the plan (issue 42): can the data loader keep up with the chosen plan's step?

Input starvation is the commonest reason an accelerator waits, and no tool in the field predicts it before a run.
The plan reads a few samples of the user's own training set with the recipe's transforms (decode and augment, in
this process: what one loader worker does) and times them, then compares what ``data.num_workers`` workers give a
process with what the chosen plan's step consumes there. Workers run in parallel on separate cores, so the rate
scales with them up to the cores the node gives each process (``data.num_workers=auto`` takes all of them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from gputrain.config import RunConfig
from gputrain.config.resolve import cores_per_process, resolve_num_workers, usable_cores

SAMPLES = 16
"""Samples timed, spread over the training set (after one warm read: first reads open files and caches)."""
BUDGET_S = 3.0
"""At most this long timing reads; a slower set is timed on fewer samples."""
MARGIN = 1.25
"""Suggested workers give this much more than the step needs: loaders are bursty, and the estimate is one process's."""


def time_reads(data: Any, collate: Callable[[list[Any]], Any] | None = None, batch_size: int = 1,
               count: int = SAMPLES, budget_s: float = BUDGET_S) -> float:
    """Seconds a worker spends on one sample of ``data``: ``dataset[i]`` (decode, transforms) and its share of
    ``collate`` over batches of ``batch_size`` (what a worker does; for small, quickly read samples the collate is
    most of it: without it the plan over-predicted a loader of 80 px frames 2.7x)."""
    n = len(data)
    indices = sorted({k * n // count for k in range(min(count, n))})
    data[indices[0]]  # warm: opens, lazy set-up
    started, timed = time.perf_counter(), 0
    for first in range(0, len(indices), max(batch_size, 1)):
        batch = [data[i] for i in indices[first:first + max(batch_size, 1)]]
        if collate is not None:
            collate(batch)
        timed += len(batch)
        if time.perf_counter() - started > budget_s:
            break
    return (time.perf_counter() - started) / timed


WORKER_SAMPLES = 64
"""Samples a real loader worker reads for the plan, or three batches where they are more (its first batch left out,
as a run's reader clock does), within :data:`BUDGET_S`."""


def time_worker_reads(data: Any, collate: Callable[[list[Any]], Any], batch_size: int,
                      count: int = WORKER_SAMPLES, budget_s: float = BUDGET_S) -> float | None:
    """Seconds one real loader worker spends on a sample of ``data`` (reads, transforms, collate), by the clock a
    run's readers keep (:mod:`gputrain.data.reader_clock`); None when it read too little to tell (a set of a
    few samples) or no worker could start (a dataset a spawned worker cannot receive).

    A worker is timed, not this process: on the 2-core test machine a worker read CIFAR-10 samples 3x slower than
    the same reads in the training process, and a run's worker measured within 25 % of this (benchmarks.md)."""
    import pickle

    from torch.utils.data import DataLoader

    from gputrain.data.reader_clock import ReaderClock, TimedCollate, TimedReads

    n, step = len(data), max(batch_size, 1)
    want = max(count, 3 * step)  # three batches at least: the first is left out
    indices = sorted({k * n // want for k in range(min(want, n))})
    step = min(step, max(1, len(indices) // 3))  # a small set: smaller batches, still three of them
    clock = ReaderClock(1)
    loader = DataLoader(TimedReads(data, clock), batch_sampler=[indices[i:i + step] for i in range(0, len(indices), step)],
                        num_workers=1, collate_fn=TimedCollate(collate, clock))
    started = time.perf_counter()
    try:
        for _ in loader:
            if time.perf_counter() - started > budget_s:
                break
    except (RuntimeError, pickle.PicklingError, AttributeError, TypeError):  # no worker: the in-process figure
        return None
    rate, readers = clock.images_per_s()
    return 1.0 / rate if readers else None


@dataclass
class InputPlan:
    images_per_s_per_worker: float
    """One loader worker's rate, timed in a worker of its own (:func:`time_worker_reads`)."""
    images_per_s_in_process: float
    """The same reads in the training process (``data.num_workers=0``: in series with each step)."""
    workers: int
    """``data.num_workers`` as the run would resolve it on this node (0: the training process reads)."""
    suggested_workers: int
    images_per_s: float
    """What the configured workers give one process (0 workers: one reader, in series with the step)."""
    needed_per_s: float
    """What the chosen plan's step consumes in one process."""
    keeps_up: bool
    cores_per_process: int

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    def auto_workers(self) -> int:
        """``data.num_workers=auto`` in a run that ``--strategy auto`` planned: the fewest workers that keep up with
        the chosen plan's step, never more than ``auto`` gives without a plan (:attr:`workers`, the node's cores per
        process). On a CPU, workers beyond what the step consumes take cores from the step itself."""
        return min(self.suggested_workers, self.workers)

    def auto_override(self) -> tuple[str, str]:
        """``--strategy auto`` with ``data.num_workers=auto``: the override, and what its line says about it."""
        workers = self.auto_workers()
        return f"data.num_workers={workers}", (
            f"data.num_workers=auto: {workers} loader worker(s) per process ({self.images_per_s_per_worker:.0f} "
            f"images/s each; the plan's step needs {self.needed_per_s:.0f})")

    def line(self) -> str:
        rate = (f"input: {self.images_per_s_per_worker:.0f} images/s per loader worker (decode and augment, timed in a "
                f"worker on this training set); the chosen plan needs {self.needed_per_s:.0f} per process")
        given = (f"{self.workers} worker(s) give {self.images_per_s:.0f}" if self.workers
                 else f"data.num_workers=0 reads {self.images_per_s_in_process:.0f} in the training process, in series "
                      "with each step")
        if self.keeps_up:
            return f"{rate}; {given}: the loader keeps up"
        if self.suggested_workers > self.cores_per_process:
            return (f"{rate}; {given}: input-bound, and even {self.cores_per_process} worker(s) (this node's cores per "
                    f"process) give {self.images_per_s_per_worker * self.cores_per_process:.0f}: lighter "
                    "transforms, smaller images or data.decode_on_device=true on a GPU")
        return f"{rate}; {given}: input-bound; set data.num_workers={self.suggested_workers}"


def input_plan(cfg: RunConfig, strategy: str, devices: int, images_per_s: float, seconds_per_sample: float, *,
               processes_per_node: int, seconds_in_process: float | None = None) -> InputPlan:
    """The loader against a plan of ``strategy`` on ``devices`` training ``images_per_s``: each data-parallel process
    reads its share of every step. ``seconds_per_sample`` is a worker's, ``seconds_in_process`` the training
    process's (the worker's when not given)."""
    loaders = devices if strategy in ("ddp", "fsdp") else 1
    needed = images_per_s / loaders
    per_worker = 1.0 / max(seconds_per_sample, 1e-9)
    in_process = 1.0 / max(seconds_in_process or seconds_per_sample, 1e-9)
    cores = cores_per_process(processes_per_node)
    workers = resolve_num_workers(cfg.data.num_workers, cores=usable_cores(), local_processes=processes_per_node)
    given = per_worker * workers if workers else in_process
    suggested = max(1, math.ceil(needed * MARGIN / per_worker))
    # Without workers the reads add to each step: fine while they are a tenth of it or less.
    keeps_up = given >= needed if workers else in_process >= 10 * needed
    return InputPlan(images_per_s_per_worker=per_worker, images_per_s_in_process=in_process, workers=workers,
                     suggested_workers=suggested, images_per_s=given, needed_per_s=needed, keeps_up=keeps_up,
                     cores_per_process=cores)
