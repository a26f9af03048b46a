"""One memory pass of ``gputrain plan`` on fake tensors: as it was (a whole first training step for the optimizer's
state, then torch's ``MemTracker`` with its per-module peaks) against as it is (one optimizer step on zero
gradients, then the tracker keeping only the step's peak). Same count, asserted; the ratio of the two times.

Both run interleaved in one process, ``--reps`` times each, on the same workload: the medians' ratio is what the
change buys on this machine, whatever else it is doing.

Usage: ``python benchmarks/plan_pass.py [--recipe imagefolder-resnet50] [--size 224] [--batch 16] [--reps 5]``
(generated data, CPU).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from gputrain.config import load_config
from gputrain.engine.callbacks.memory import memory_parts
from gputrain.strategies.base import tensors_of
from gputrain.tools.make_data import make_dataset
from gputrain.tools.plan import memory
from gputrain.tools.plan.workload import Workload


def before(work: Workload, batch: int) -> memory.StepMemory:
    """The pass as it was up to 2026-11-26: a whole training step first, then the full MemTracker."""
    with memory.fake_model(work) as (model, fake):
        inputs, targets = fake(work.batch(batch))
        optimizer = work.optimizer(model)
        work.train_step(model, optimizer, inputs, targets)
        tracker = MemTracker()
        tracker.track_external(model, optimizer, *tensors_of((inputs, targets)))
        with tracker:
            work.train_step(model, optimizer, inputs, targets)
        return memory.StepMemory(**memory_parts(tracker.get_tracker_snapshot("peak")))


def now(work: Workload, batch: int) -> memory.StepMemory:
    return memory._fake_step_memory(work, batch, False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="imagefolder-resnet50")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "classes"
        make_dataset("classfolder", root, count=8, size=64)
        cfg = load_config(args.recipe, [f"data.root={root}", f"data.image_size={args.size}", "trainer.precision=32"])
        work = Workload.from_config(cfg, torch.device("cpu"), "32")
        times: dict[str, list[float]] = {"before": [], "now": []}
        counts = {}
        for _ in range(args.reps):
            for name, count in (("before", before), ("now", now)):
                start = time.perf_counter()
                counts[name] = count(work, args.batch)
                times[name].append(time.perf_counter() - start)
    if counts["before"] != counts["now"]:
        raise SystemExit(f"the two passes count differently: {counts}")
    b, n = statistics.median(times["before"]), statistics.median(times["now"])
    print(f"{datetime.date.today()} {platform.machine()} torch {torch.__version__} threads {torch.get_num_threads()}: "
          f"{args.recipe} {args.size} px batch {args.batch}, median of {args.reps} interleaved passes: before {b:.2f} s, "
          f"now {n:.2f} s, ratio {b / n:.2f}x; the same count ({counts['now'].peak / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
