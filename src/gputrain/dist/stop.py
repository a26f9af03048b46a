"""Stop at a step boundary on SIGINT, SIGTERM or SIGUSR1, agreed by every rank.

Ctrl-C reaches every process of the job (the launcher forwards it too), SLURM sends SIGTERM or
SIGUSR1 before it kills a job, and each rank may see the signal at a different step. So a
handler only records the signal; at each step boundary the ranks agree (one tiny all-reduce of
the largest signal number seen) and all of them stop after the same step, write one checkpoint
and leave with the exit code of that signal. The ranks agree about every 0.2 s of training (every
step when steps are slower than that, at most every 100 steps) and at the last step of each epoch,
always at the same steps on every rank. A second Ctrl-C, seconds later, aborts at once
(the launcher forwards the first one, so a worker sees it twice at the same moment).
"""

from __future__ import annotations

import math
import signal
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
AGREE_EVERY_S = 0.2
"""Seconds of training between two agreements of the ranks on whether to stop."""
PROBE_STEPS = 8
"""Steps timed before the interval is chosen (agreement every step until then)."""
MAX_EVERY = 100


class StopRequest:
    """Installs the handlers for the duration of a ``with`` block and answers "should we stop now?"."""

    def __init__(self, world_size: int = 1) -> None:
        self.received = 0
        self._first_at = 0.0
        self.world_size = world_size
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self.every = 1
        """Steps between two agreements (several ranks); set once, from the pace of the first steps."""
        self._calls = 0
        self._first_call = 0.0
        self.save_due = False
        """Set by :meth:`agreed`: some rank found a time-based checkpoint due, so every rank saves after this step."""

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread; a notebook thread keeps defaults
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        if self.world_size > 1 and dist.is_initialized():
            # A group of its own, over gloo on the CPU even when training uses nccl: the check never
            # waits for the GPU stream nor queues behind the gradients' all-reduce on the training group.
            self._group = dist.new_group(backend="gloo")
        return self

    def __exit__(self, *exc: object) -> None:
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

    def agreed(self, *, now: bool = False, due: bool = False) -> int:
        """The signal every rank stops for (0: keep going); a collective, called by all ranks each step.

        With several ranks the ranks agree every :attr:`every` calls, a count they agree on after
        :data:`PROBE_STEPS` steps so that agreements come about :data:`AGREE_EVERY_S` of training apart;
        ``now`` (the same on every rank: the epoch's last step) agrees at once, so a signal never waits
        for an evaluation. Why not every step: even started asynchronously, a gloo all-reduce per step
        needs both ranks' communication threads scheduled beside the training threads, and cost 8 % of a
        20 ms autoencoder step on 2 CPU ranks (benchmarks/peers.py, docs/benchmarks.md).

        ``due``: this rank finds a time-based checkpoint due (``trainer.checkpoint_every_n_minutes``); the agreement
        carries it too, and :attr:`save_due` says whether any rank did, the same on every rank.
        """
        self.save_due = False
        if self.world_size == 1 or not dist.is_initialized():
            self.save_due = due
            return self.received
        self._calls += 1
        if self._calls == 1:
            self._first_call = time.monotonic()
        probe = self._calls == PROBE_STEPS and self.every == 1
        if not (now or probe or self._calls % self.every == 0):
            return 0
        # Each rank's seconds per step since its first call: the slowest rank sets the pace for all.
        pace = (time.monotonic() - self._first_call) / (PROBE_STEPS - 1) if probe else 0.0
        agreed = torch.tensor([float(self.received), pace, float(due)], dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._group)
        signum, slowest, self.save_due = int(agreed[0]), float(agreed[1]), bool(agreed[2])
        if probe:  # every rank computes the same interval from the same reduced value
            self.every = max(1, min(MAX_EVERY, math.ceil(AGREE_EVERY_S / max(slowest, 1e-9))))
        return signum
