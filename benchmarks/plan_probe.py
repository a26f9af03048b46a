"""The plan's step time on a CPU with large images, against steps measured at the run's own size (issue 39).

On a CPU, ``gputrain plan`` times a run whose images are larger than ``PROBE_SIDE`` mostly at that side: the fixed
part of a step (what no sample adds) from steps at the plan's batches there, and the per-sample time from one step
at the run's own size and the smallest batch (:func:`gputrain.tools.plan.timing.timed_at`). For each side this
script measures, interleaved over ``--reps`` rounds in one process:

* the reference: a step at the run's size at twice the probe batch (what a run of that batch takes);
* the plan's prediction of it (the method above), and the time that prediction took;
* the first method tried, scaling the small probe's per-sample time by the pixel ratio, for the record;
* the block shares at both sides and the two-stage split each gives.

It also tries torch's ``RuntimeEstimator`` (the other way the issue names) in a child process, and says what it gave.

Usage: ``python benchmarks/plan_probe.py [--reps 3] [--sides 256,512,1024]`` (generated data, CPU; ~15 minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gputrain.config import load_config
from gputrain.parallel.partition import partition_by_cost
from gputrain.tools.make_data import make_dataset
from gputrain.tools.plan.timing import PROBE_SIDE, block_shares, measure_step, measure_steps, timed_at
from gputrain.tools.plan.workload import Workload


def _estimate(work: Workload, batch: int) -> None:
    """In a child process: torch's RuntimeEstimator (roofline) on a fake step; prints ms."""
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    from gputrain.tools.plan.memory import fake_model

    estimator = RuntimeEstimator()
    with fake_model(work) as (model, fake):
        inputs, targets = fake(work.batch(batch))
        optimizer = work.optimizer(model)
        with estimator("operator-level-cost-model"):
            work.train_step(model, optimizer, inputs, targets)
    print(f"{estimator.total_runtime:.0f} ms (roofline)")


def runtime_estimator(args: argparse.Namespace, root: Path, side: int) -> str:
    """RuntimeEstimator's estimate, or how it failed (a child process: on a CPU it may abort the process)."""
    proc = subprocess.run([sys.executable, __file__, "--estimate", str(root), "--sides", str(side), "--batch",
                           str(args.batch), "--recipe", args.recipe], capture_output=True, text=True)
    if proc.returncode == 0:
        return proc.stdout.strip()
    last = (proc.stderr.strip().splitlines() or ["no message"])[-1][:100]
    return f"none: the process ended with status {proc.returncode} ({last})"


def workload(recipe: str, root: Path, side: int) -> Workload:
    cfg = load_config(recipe, [f"data.root='{root}'", f"data.image_size={side}"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, weights=""))
    return Workload.from_config(cfg, torch.device("cpu"), "32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sides", default="256,512,1024")
    parser.add_argument("--batch", type=int, default=2, help="probe batch (the plan's on a CPU is at most 4)")
    parser.add_argument("--recipe", default="imagefolder-resnet50")
    parser.add_argument("--estimate", default="", help=argparse.SUPPRESS)  # the child of runtime_estimator
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.estimate:
        _estimate(workload(args.recipe, Path(args.estimate), int(args.sides)), args.batch)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "classes"
        make_dataset("classfolder", root, size=64, count=16, seed=0)
        print(f"{args.recipe}, probe batch {args.batch} (and twice it), probe side {PROBE_SIDE}, CPU, "
              f"{torch.get_num_threads()} threads, median of {args.reps}")
        print(f"| side | step at batch {2 * args.batch}, measured | the plan's prediction | error | time to predict "
              "| pixel scaling's error | split (run's size / probe's) | RuntimeEstimator |")
        print("|---|---:|---:|---:|---:|---:|---|---|")
        for side in (int(s) for s in args.sides.split(",")):
            work = workload(args.recipe, root, side)
            small, ratio = timed_at(work)
            full_s, new_s, old_s, new_t = [], [], [], []
            for _ in range(args.reps):  # interleaved: the machine's load falls on all alike
                start = time.perf_counter()
                probe = measure_steps(small, args.batch)
                new_s.append(probe.with_step_at_size(measure_step(work, args.batch)).step_at(2 * args.batch))
                new_t.append(time.perf_counter() - start)
                old_s.append(probe.at_pixels(ratio).step_at(2 * args.batch))
                full_s.append(measure_step(work, 2 * args.batch).step_s)
            measured, predicted, scaled = (statistics.median(x) for x in (full_s, new_s, old_s))
            splits = [partition_by_cost(block_shares(w, args.batch).time, 2) for w in (work, small)]
            names = block_shares(work, 1).names
            split = " / ".join(names[s[0]] for s in splits)
            print(f"| {side} | {measured * 1e3:.0f} ms | {predicted * 1e3:.0f} ms | {predicted / measured - 1:+.1%} "
                  f"| {statistics.median(new_t):.1f} s | {scaled / measured - 1:+.1%} | {split} "
                  f"| {runtime_estimator(args, root, side)} |", flush=True)


if __name__ == "__main__":
    main()
