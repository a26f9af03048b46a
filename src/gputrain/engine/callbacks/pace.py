"""The pace of a run's first steps, measured (issue 42's closed loop): how long a step takes and how much of it waits
for the data loader, with the workers to set when the loader holds the steps up.

``gputrain plan`` predicts whether the loader keeps up before a run; this is the run's own answer, at no cost (the
engine already times each batch's wait). Rank 0's figures, over the steps after the first (which starts the
workers and warms the caches), up to :data:`PACE_STEPS`, or the first epoch's when it is shorter. They go to
``metrics.jsonl`` as one record (``"event": "pace"``) and to ``summary.json`` as ``"pace"``.

The workers to set: a worker reads a whole step's batches in ``r`` seconds (with ``data.num_workers=0`` that is the
wait itself; with ``W`` workers that hold the step up, a step lasts ``r / W``), while the step computes for
``c`` = step - wait. ``r / c`` workers keep up; like the plan, the suggestion adds a quarter for bursts.

Each reader of the training loader (the training process with ``data.num_workers=0``, else each worker) times its
own reads and collates (:mod:`gputrain.data.reader_clock`): the record's ``reader_images_per_s`` is one reader's
rate while it works, the run's figure for the plan's images/s per loader worker.

Set against the plan: a run that ``--strategy auto`` chose gets the plan's step time (``trainer.predicted_step_s``),
and the record holds it beside the measured compute time (the step less its data wait, what the plan times) with
the prediction's error; past :data:`OFF_LIMIT`, one line says so.
"""

from __future__ import annotations

import math
import time
from typing import Any

from gputrain.config.resolve import cores_per_process, local_processes, machine_busy
from gputrain.engine.hooks import Hook, RunContext
from gputrain.runs.records import append_record

PACE_STEPS = 20
"""Steps measured, after the first."""
WAIT_SHARE = 0.2
"""A loader that makes the steps wait more than this share of their time is named, with the workers to set."""
MIN_STEPS = 5
"""Fewer measured steps (a first epoch of a few steps) are recorded but too few to name the loader on."""
MARGIN = 1.25
"""Suggested workers give this much more than the step needs (as the plan's suggestion)."""
EVENT = "pace"
OFF_LIMIT = 0.2
"""A plan's step time more than this far from the measured one (either way) is named in one line."""


def suggested_workers(step_s: float, wait_s: float, workers: int) -> int:
    """Workers that read a step's batches while it computes (see the module's docstring)."""
    compute_s = max(step_s - wait_s, 1e-6)
    read_s = wait_s if workers == 0 else workers * step_s
    return max(1, math.ceil(read_s * MARGIN / compute_s))


def pace_line(pace: dict[str, Any], cores: int) -> str:
    """The one line a held-up run prints (empty when the loader kept up, or too few steps were measured)."""
    if pace["data_wait_share"] <= WAIT_SHARE or pace["steps"] < MIN_STEPS:
        return ""
    held = (f"gputrain: the data loader held up the first {pace['steps']} steps: {pace['data_wait_s']:.3f} s of each "
            f"{pace['step_s']:.3f} s step waited for data (data.num_workers={pace['num_workers']})")
    wanted = pace["suggested_workers"]
    if wanted > cores:
        return (f"{held}; even {cores} worker(s) (this node's cores per process) would not keep up: lighter "
                "transforms, smaller images or data.decode_on_device=true on a GPU")
    return f"{held}; set data.num_workers={wanted}"


def prediction_line(pace: dict[str, Any], busy: str = "") -> str:
    """The one line of a plan's step time more than :data:`OFF_LIMIT` from the measure (empty otherwise, or when
    too few steps were measured or nothing was predicted); ``busy`` (:func:`machine_busy`) named in it."""
    off = pace.get("step_prediction_off")
    if off is None or abs(off) <= OFF_LIMIT or pace["steps"] < MIN_STEPS:
        return ""
    return (f"gputrain: warning: the first {pace['steps']} steps computed for {pace['compute_s']:.3f} s each (data "
            f"waits aside), the plan predicted {pace['predicted_step_s']:.3f} s (prediction {off:+.0%})"
            f"{f'; {busy}' if busy else ''}; plan again on this machine when it is idle (gputrain plan) if the chosen "
            "strategy looks wrong")


class PaceHook(Hook):
    """Times rank 0's first steps and reports them once (see the module's docstring)."""

    def __init__(self) -> None:
        self.walls: list[float] = []
        self.waits: list[float] = []
        self.first_step_done = False
        self.mark: float | None = None
        self.reported = False

    def before_epoch(self, ctx: RunContext) -> None:
        self.mark = time.perf_counter()  # an evaluation between epochs is not a step's time

    def after_step(self, ctx: RunContext, logs: dict[str, float] | None) -> None:
        now = time.perf_counter()
        if self.reported or not ctx.dist.is_main or self.mark is None:
            return
        if self.first_step_done:
            self.walls.append(now - self.mark)
            self.waits.append(sum(ctx.data_waits))
        self.first_step_done = True
        self.mark = time.perf_counter()
        if len(self.walls) == PACE_STEPS:
            self._report(ctx)

    def after_epoch(self, ctx: RunContext, metrics: dict[str, float]) -> None:
        if not self.reported and self.walls and ctx.dist.is_main:
            self._report(ctx)  # a first epoch shorter than PACE_STEPS: what it had, before summary.json is written

    def _report(self, ctx: RunContext) -> None:
        self.reported = True
        step_s, wait_s = sum(self.walls) / len(self.walls), sum(self.waits) / len(self.waits)
        workers = int(ctx.cfg.data.num_workers)
        pace = {"event": EVENT, "after_step": ctx.state.global_step, "steps": len(self.walls), "step_s": round(step_s, 6),
                "data_wait_s": round(wait_s, 6), "data_wait_share": round(wait_s / max(step_s, 1e-9), 4),
                "num_workers": workers, "suggested_workers": suggested_workers(step_s, wait_s, workers)}
        rate, readers = ctx.reader_rate()
        if readers:  # what one reader gives, timed where it reads: the run's figure for the plan's rate per worker
            pace |= {"reader_images_per_s": round(rate, 1), "readers": readers}
        predicted = float(ctx.cfg.trainer.predicted_step_s)
        if predicted > 0:  # the prediction's error, from the measure (+25 %: a quarter more than measured)
            compute_s = max(step_s - wait_s, 1e-9)
            pace |= {"compute_s": round(compute_s, 6), "predicted_step_s": predicted,
                     "step_prediction_off": round(predicted / compute_s - 1, 4)}
        append_record(ctx.out / "metrics.jsonl", pace)
        busy = machine_busy(ctx.dist.device.type) if predicted > 0 else ""
        for line in (pace_line(pace, cores=cores_per_process(local_processes(ctx.dist.world_size))),
                     prediction_line(pace, busy=busy)):
            if line:
                print(line, flush=True)
