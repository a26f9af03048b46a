"""Stop at a step boundary on SIGINT, SIGTERM or SIGUSR1, agreed by every rank.

Ctrl-C reaches every process of the job (the launcher forwards it too), SLURM sends SIGTERM or
SIGUSR1 before it kills a job, and each rank may see the signal at a different step. So a
handler only records the signal; at each step boundary the ranks agree (one tiny all-reduce of
the largest signal number seen) and all of them stop after the same step, write one checkpoint
and leave with the exit code of that signal. The all-reduce of step k is started at step k and
read at step k+1, so no step waits for it: a stop comes one step later than the signal would
allow (the last step of an epoch is agreed at once, before evaluation), and every rank still
reads the same value at the same step. A second Ctrl-C, seconds later, aborts at once
(the launcher forwards the first one, so a worker sees it twice at the same moment).
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Installs the handlers for the duration of a ``with`` block and answers "should we stop now?"."""

    def __init__(self, world_size: int = 1) -> None:
        self.received = 0
        self._first_at = 0.0
        self.world_size = world_size
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self._pending: tuple[Any, torch.Tensor] | None = None
        """The all-reduce started at the previous step, and the tensor it reduces in place."""

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread; a notebook thread keeps defaults
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        if self.world_size > 1 and dist.is_initialized():
            # A group of its own, over gloo on the CPU even when training uses nccl: the per-step check
            # never waits for the GPU stream, and its reduction in flight never queues behind (or in front
            # of) the gradients' on the training group.
            self._group = dist.new_group(backend="gloo")
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self._pending is not None and exc_type is None:
            self._pending[0].wait()  # every rank started it; after a failure a peer may be gone, so not then
        self._pending = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.received and signum == signal.SIGINT and now - self._first_at > 2.0:
            raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait for the step
        if not self.received:
            self._first_at = now
        self.received = max(self.received, signum)

    def agreed(self, *, now: bool = False) -> int:
        """The signal every rank stops for (0: keep going); a collective, called by all ranks each step.

        With several ranks it returns what the ranks had received by the previous call (the reduction
        started then), and starts this call's. Waited for at once, it was a second synchronisation point per
        step after the gradients' all-reduce: a rank that is behind made the others wait twice. ``now``
        (the same on every rank: the epoch's last step) waits for this call's reduction too, so a signal
        never waits for an evaluation to be noticed.
        """
        if self.world_size == 1 or not dist.is_initialized():
            return self.received
        stop = 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            stop = int(flag.item())
        # Every rank reads the same value at the same call, so all of them start the next reduction or none.
        self._pending = None
        if stop:
            return stop
        flag = torch.tensor([self.received], dtype=torch.int64)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        if now:
            work.wait()
            return int(flag.item())
        self._pending = (work, flag)
        return 0
