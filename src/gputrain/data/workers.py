"""How many DataLoader workers a process gets when the recipe says ``data.num_workers=auto``.

Each process of a node decodes and augments its own share of the batches, so the node's cores are
split between its processes: ``cores // local processes``, at most :data:`MAX_AUTO_WORKERS` (past a
few dozen, workers cost shared memory and start-up time for little gain; see docs/data.md for how
many images/s one worker gives). Fewer cores than processes gives 0: loading in the process itself.
"""

from __future__ import annotations

import os

MAX_AUTO_WORKERS = 32


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which SLURM and taskset set), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity masks
        return os.cpu_count() or 1


def resolve_num_workers(value: int | str, *, cores: int, local_processes: int) -> int:
    """``value`` as a worker count: an int as given, ``auto`` as ``cores // local_processes`` capped."""
    if value == "auto":
        return min(cores // max(local_processes, 1), MAX_AUTO_WORKERS)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError(f"data.num_workers={value!r} must be a count of at least 0 or auto (the cores of the node "
                     "divided by its processes)")
