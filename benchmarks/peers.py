"""gputrain side by side with a hand-written loop, a hand-written DDP loop and Lightning: one model, data, seed.

Issue 16 items 5 and 6. For ResNet-18 (torchvision, 10 classes, 32x32 images) and the conv autoencoder, each
variant trains the same in-memory data from the same initial weights, in the same sample order (gputrain's
epoch plan: the hand loops and Lightning read its batches through the same batch sampler), at 1 and 2
processes (gloo on CPU; 2 processes are started by torchrun for every variant, so Lightning and gputrain
find a ready process group and no one pays for spawning):

  hand       plain PyTorch, 1 process          hand_ddp   DistributedDataParallel by hand, 2 processes
  hand_tuned, hand_ddp_tuned                   the same loops with glibc's allocator set as gputrain sets it
                                               (``trainer.reuse_host_memory``, on by default): the reference
                                               for what gputrain's loop itself costs
  lightning  Lightning 2.6.6 (1 and 2)         gputrain   gputrain.Trainer (1 and 2), defaults, checkpoints off

Checkpoints, logging, validation and progress bars are off everywhere, so all do the same work. Variants run
in rotated order over ``--reps`` rounds (no variant always first). Reported per variant: the median epoch time
(epochs after the first), the median over rounds of its ratio to the hand-written loop of the same process
count in that round (and to the tuned hand-written loop), start-up (process start to the end of the first step), peak resident memory of rank 0, and
the last epoch's mean training loss (all variants must agree to ~1e-5: they compute the same thing).

    pip install -r requirements-bench.txt       # lightning==2.6.6, for this script only
    python benchmarks/peers.py --reps 5 --json runs/bench/peers.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peers_loops import MODELS, RUNNERS, Clock  # the job every variant runs, and the variants

VARIANTS = {1: ("hand", "hand_tuned", "lightning", "gputrain"), 2: ("hand_ddp", "hand_ddp_tuned", "lightning", "gputrain")}


def worker(args: argparse.Namespace) -> None:
    started = float(os.environ["PEERS_STARTED"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(args.threads)
    if world > 1 and args.variant.startswith("hand_ddp"):
        dist.init_process_group("gloo")
    clock = Clock(started)
    RUNNERS[args.variant](args.model, args.epochs, clock, rank, world)
    if rank == 0:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        Path(args.result).write_text(json.dumps({"epochs": clock.epochs, "first_step_s": clock.first_step,
                                                 "loss": clock.loss, "peak_rss": peak}))
    if dist.is_initialized():
        dist.destroy_process_group()


# -- the driver -------------------------------------------------------------------------------------
def launch(variant: str, model: str, procs: int, epochs: int, threads: int, folder: Path) -> dict[str, Any]:
    result = folder / f"{variant}-{model}-{procs}.json"
    me = [str(Path(__file__).resolve()), "--worker", variant, "--model", model, "--epochs", str(epochs),
          "--threads", str(threads), "--result", str(result)]
    cmd = [sys.executable, *me] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs), *me]
    env = {**os.environ, "PEERS_STARTED": repr(time.time()), "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{variant} ({model}, {procs} processes) failed:\n{done.stderr[-3000:]}")
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--procs", nargs="+", type=int, default=[1, 2], choices=[1, 2])
    parser.add_argument("--json")
    parser.add_argument("--worker", dest="variant", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        return worker(args)
    cores = len(os.sched_getaffinity(0))
    jobs = [(m, p, v) for m in args.models for p in args.procs for v in VARIANTS[p]]
    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {job: [] for job in jobs}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for m, p, v in jobs[rep % len(jobs):] + jobs[:rep % len(jobs)]:
                done = launch(v, m, p, args.epochs, max(cores // p, 1), Path(tmp))
                done["epoch_s"] = statistics.median(done["epochs"][1:])
                runs[(m, p, v)].append(done)
                print(f"round {rep + 1}: {m} {p} proc {v}: epochs {[round(e, 2) for e in done['epochs']]} "
                      f"loss {done['loss']:.7f}", flush=True)

    def per_round(m: str, p: int, v: str, base: str) -> list[float]:
        """The ratio of ``v``'s median epoch to ``base``'s, round by round (both ran in each round)."""
        return [a["epoch_s"] / b["epoch_s"] for a, b in zip(runs[(m, p, v)], runs[(m, p, base)], strict=True)]

    rows = []
    for m, p, v in jobs:
        done, to_hand = runs[(m, p, v)], per_round(m, p, v, VARIANTS[p][0])
        rows.append({"model": m, "processes": p, "variant": v,
                     "epoch_s": statistics.median(e for r in done for e in r["epochs"][1:]),
                     "ratio_to_hand": statistics.median(to_hand), "ratio_range": [min(to_hand), max(to_hand)],
                     "ratio_to_tuned_hand": statistics.median(per_round(m, p, v, VARIANTS[p][1])),
                     "ratio_to_lightning": statistics.median(per_round(m, p, v, "lightning")),
                     "startup_s": statistics.median(r["first_step_s"] for r in done),
                     "peak_rss_mib": max(r["peak_rss"] for r in done) / 2**20,
                     "loss": done[-1]["loss"]})
    print(f"\n{datetime.date.today()} {platform.node()}: {cores} cores, torch {torch.__version__}, "
          f"{args.reps} rounds, {args.epochs} epochs (first not timed), threads per process = cores / processes")
    print("| model | procs | variant | epoch s | x hand (min..max) | x tuned hand | x Lightning | start-up s "
          "| peak RSS MiB | last-epoch loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        low, high = r["ratio_range"]
        print(f"| {r['model']} | {r['processes']} | {r['variant']} | {r['epoch_s']:.3f} | {r['ratio_to_hand']:.3f} "
              f"({low:.2f}..{high:.2f}) | {r['ratio_to_tuned_hand']:.3f} | {r['ratio_to_lightning']:.3f} | "
              f"{r['startup_s']:.2f} | {r['peak_rss_mib']:.0f} | {r['loss']:.7f} |")
    for m in args.models:
        for p in args.procs:
            losses = [r["loss"] for r in rows if r["model"] == m and r["processes"] == p]
            print(f"{m} {p} proc: losses agree to {max(losses) - min(losses):.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": str(datetime.date.today()), "cores": cores,
                                               "torch": torch.__version__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
