"""Pipeline efficiency on 2 CPU ranks: measured speedup over 1 process / the ideal 2M / (M + 1) (issue 8).

Two gloo ranks, one thread each, run strategy ``pipeline`` (its own ``forward_backward``, then the
optimizer step) on a plain CNN whose two halves cost the same: a 3->C convolution and 8 CxC
convolutions at full resolution, cut before the fifth CxC one, so each stage holds four; the
activation crossing the boundary (B x C x S x S floats) is small next to the stages' compute.
The reference is one process (rank 0 alone, the other rank waiting at a barrier) training the
same model on the same batch with one thread, in the same job.

Variants are interleaved in each repetition (1 process, then M = 1, 2, 4, 8) and each figure is
the median over ``--reps`` of the per-repetition ratio, steps after a warm-up only (the first
step of a stage infers shapes). A step is timed from a barrier to a barrier, so it is the slower
rank's. CPU time of both ranks is recorded too: ``cpu_util`` = (CPU s of both ranks) / (2 x wall s),
the share of the two cores the pipeline kept busy (on a machine shared with other work a low
figure can mean the ranks waited for cores, not for each other: see docs/platform-notes.md), and
``work`` = (CPU s of both ranks) / (CPU s of one process): what splitting and sending add to the
work itself, which contention hardly disturbs; efficiency cannot exceed 1 / work.

    python benchmarks/pipeline_efficiency.py --json runs/bench/pipeline_efficiency.json
    python benchmarks/pipeline_efficiency.py --reps 3 --batch 16        # quicker
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gputrain.config import OptimConfig
from gputrain.dist import init_distributed, teardown
from gputrain.launcher.ranks import launch_all
from gputrain.precision import Precision
from gputrain.strategies.base import MicroBatch
from gputrain.strategies.pipeline import Pipeline
from gputrain.strategies.stages import SplitOptions
from gputrain.tasks.base import Task


def balanced_cnn(channels: int) -> nn.Sequential:
    """conv(3->C) + 8 x conv(CxC), ReLU after each, global pooling and a linear head; split at block "10"."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1), nn.ReLU()]
    for _ in range(8):
        layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))


SPLIT = "10"  # the fifth CxC convolution: 4 CxC (+ the cheap 3->C) | 4 CxC (+ the head)


def timed(step: Callable[[], Any], steps: int, warmup: int) -> tuple[float, float]:
    """Median wall seconds of ``steps`` steps after ``warmup``, barrier to barrier, and this rank's CPU s per step."""
    walls, cpus = [], []
    for i in range(warmup + steps):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        dist.barrier()
        if i >= warmup:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def one_process(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor, rank: int) -> tuple[float, float]:
    model = balanced_cnn(args.channels)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        if rank == 0:  # the other rank only meets the barriers
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    return timed(step, args.steps, args.warmup)


def pipelined(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor, m: int, info: Any) -> tuple[float, float]:
    options = SplitOptions(stages=2, micro_batches=m, split_points=(SPLIT,), schedule=args.schedule,
                           batch_size=args.batch)
    strategy = Pipeline(info, options=options)
    with contextlib.redirect_stdout(io.StringIO()):  # the plan, printed at every setup, is known
        module = strategy.setup_module(balanced_cnn(args.channels))
    opt = strategy.setup_optimizer(module, OptimConfig(name="sgd", lr=0.01, momentum=0.0))
    task, precision = Task(F.cross_entropy), Precision(info.device)
    micro = MicroBatch(inputs=x, targets=y, size=len(x), weight=1.0, sync=True)

    def step() -> None:
        strategy.forward_backward(module, micro, task=task, precision=precision)
        opt.step()
        opt.zero_grad()

    return timed(step, args.steps, args.warmup)


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    info = init_distributed("cpu")
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(args.batch, 3, args.size, args.size, generator=g)
        y = torch.randint(0, 10, (args.batch,), generator=g)
        reps: list[dict[str, Any]] = []
        for _ in range(args.reps):
            rep: dict[str, Any] = {"single": one_process(args, x, y, info.rank)}
            for m in args.micro:
                rep[str(m)] = pipelined(args, x, y, m, info)
            reps.append(rep)
        return {"rank": info.rank, "reps": reps}
    finally:
        teardown()


def summarize(ranks: list[dict[str, Any]], micro: list[int]) -> list[dict[str, float]]:
    reps0, reps1 = ranks[0]["reps"], ranks[1]["reps"]
    rows = []
    for m in micro:
        speedups = [r["single"][0] / r[str(m)][0] for r in reps0]
        ideal = 2 * m / (m + 1)
        pairs = list(zip(reps0, reps1, strict=True))
        util = [(a[str(m)][1] + b[str(m)][1]) / (2 * a[str(m)][0]) for a, b in pairs]
        work = [(a[str(m)][1] + b[str(m)][1]) / a["single"][1] for a, b in pairs]
        rows.append({
            "micro_batches": m,
            "single_step_s": statistics.median(r["single"][0] for r in reps0),
            "pipeline_step_s": statistics.median(r[str(m)][0] for r in reps0),
            "speedup": statistics.median(speedups),
            "ideal": ideal,
            "efficiency": statistics.median(s / ideal for s in speedups),
            "efficiency_min": min(s / ideal for s in speedups),
            "efficiency_max": max(s / ideal for s in speedups),
            "cpu_util": statistics.median(util),
            "work": statistics.median(work),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--size", type=int, default=32, help="image side (no downsampling inside the model)")
    parser.add_argument("--micro", default="1,2,4,8", help="micro-batch counts M")
    parser.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and repetition")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.micro = [int(m) for m in args.micro.split(",")]
    start = time.perf_counter()
    ranks = sorted(launch_all(_worker, args, devices=2), key=lambda r: r["rank"])
    rows = summarize(ranks, args.micro)
    print(f"pipeline_efficiency: 2 gloo ranks x 1 thread, {args.schedule}, batch {args.batch}, "
          f"{args.channels} channels, {args.size}x{args.size}, {args.reps} reps x {args.steps} steps "
          f"({time.perf_counter() - start:.0f} s)")
    print(f"{'M':>3} {'1 proc s':>9} {'pipe s':>8} {'speedup':>8} {'ideal':>6} {'efficiency':>10} "
          f"{'(min..max)':>13} {'cpu_util':>8} {'work':>5}")
    for r in rows:
        print(f"{r['micro_batches']:>3} {r['single_step_s']:>9.3f} {r['pipeline_step_s']:>8.3f} {r['speedup']:>8.3f} "
              f"{r['ideal']:>6.3f} {r['efficiency']:>10.3f} {r['efficiency_min']:>6.2f}..{r['efficiency_max']:<5.2f} "
              f"{r['cpu_util']:>8.2f} {r['work']:>5.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
