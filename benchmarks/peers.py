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
import functools
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
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Dataset

from gputrain.data.samplers import StepBatchSampler
from gputrain.models.vision import ConvAutoencoder

MODELS = {"resnet18": dict(images=1024, size=32, batch=32, lr=0.05),
          "autoencoder": dict(images=1024, size=80, batch=32, lr=0.5)}
VARIANTS = {1: ("hand", "hand_tuned", "lightning", "gputrain"), 2: ("hand_ddp", "hand_ddp_tuned", "lightning", "gputrain")}


# -- the job every variant runs ---------------------------------------------------------------------
class Keyed(Dataset):
    """In-memory samples addressed by gputrain's ``(epoch, index)`` keys (what its batch sampler yields)."""

    def __init__(self, model: str) -> None:
        spec = MODELS[model]
        g = torch.Generator().manual_seed(123)
        self.x = torch.rand(spec["images"], 3, spec["size"], spec["size"], generator=g)
        self.y = torch.randint(0, 10, (spec["images"],), generator=g)
        self.model = model

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, key: Any) -> Any:
        i = key[1] if isinstance(key, tuple) else key
        return (self.x[i], self.y[i]) if self.model == "resnet18" else (self.x[i], self.x[i])


def build_model(model: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10) if model == "resnet18" else ConvAutoencoder()


def loss_fn(model: str) -> Any:
    return F.cross_entropy if model == "resnet18" else F.mse_loss


def batch_sampler(data: Dataset, model: str, rank: int, world: int) -> StepBatchSampler:
    return StepBatchSampler(len(data), dp_rank=rank, dp_size=world,  # type: ignore[arg-type]
                            batch_size=MODELS[model]["batch"] // world, seed=0)


class EpochAwareBatches(StepBatchSampler):
    """The same batches, with ``.sampler`` pointing at itself: where Lightning looks for ``set_epoch`` each epoch."""

    @property
    def sampler(self) -> StepBatchSampler:
        return self


def optimizer(params: Any, model: str) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=MODELS[model]["lr"], momentum=0.9)


class Clock:
    """Epoch times, the end of the first step (seconds since the process started) and the epoch's loss."""

    def __init__(self, started: float) -> None:
        self.started, self.epochs, self.first_step, self.loss = started, [], None, float("nan")
        self._t = 0.0

    def epoch_start(self) -> None:
        self._t = time.perf_counter()

    def epoch_end(self) -> None:
        self.epochs.append(time.perf_counter() - self._t)

    def step(self) -> None:
        if self.first_step is None:
            self.first_step = time.time() - self.started


def mean_loss(total: torch.Tensor, count: int, world: int) -> float:
    stats = torch.tensor([float(total), float(count)], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(stats)
    return float(stats[0] / stats[1])


def run_hand(model_name: str, epochs: int, clock: Clock, rank: int, world: int, tuned: bool = False) -> None:
    if tuned:
        try:
            from gputrain.engine.fast import keep_freed_host_memory
        except ImportError:  # a gputrain from before issue 29 (--baseline runs of this script)
            from gputrain.fast_path import keep_freed_host_memory  # type: ignore[no-redef]

        keep_freed_host_memory()
    data = Keyed(model_name)
    model = build_model(model_name)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt, loss_of = optimizer(model.parameters(), model_name), loss_fn(model_name)
    sampler = batch_sampler(data, model_name, rank, world)
    loader = DataLoader(data, batch_sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        clock.epoch_start()
        total, count = torch.zeros(()), 0
        for x, y in loader:
            loss = loss_of(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            total += loss.detach() * len(x)
            count += len(x)
            clock.step()
        clock.epoch_end()
        clock.loss = mean_loss(total, count, world)


def run_lightning(model_name: str, epochs: int, clock: Clock, rank: int, world: int) -> None:
    try:
        import lightning as L  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise SystemExit("benchmarks/peers.py: Lightning is not installed; pip install -r requirements-bench.txt") from None

    class Module(L.LightningModule):  # type: ignore[misc,name-defined,unused-ignore]
        def __init__(self) -> None:
            super().__init__()
            self.net, self.loss_of = build_model(model_name), loss_fn(model_name)
            self.total, self.count = torch.zeros(()), 0

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            loss = self.loss_of(self.net(x), y)
            self.total += loss.detach() * len(x)
            self.count += len(x)
            return loss

        def on_train_epoch_start(self) -> None:
            self.total, self.count = torch.zeros(()), 0
            clock.epoch_start()

        def on_train_batch_end(self, *args: Any) -> None:
            clock.step()

        def on_train_epoch_end(self) -> None:
            clock.epoch_end()
            clock.loss = mean_loss(self.total, self.count, world)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer(self.parameters(), model_name)

    data = Keyed(model_name)
    batches = EpochAwareBatches(len(data), dp_rank=rank, dp_size=world, batch_size=MODELS[model_name]["batch"] // world,
                                seed=0)
    loader = DataLoader(data, batch_sampler=batches)
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0)
    trainer.fit(Module(), loader)


def run_gputrain(model_name: str, epochs: int, clock: Clock, rank: int, world: int) -> None:
    from gputrain import Trainer
    from gputrain.config import OptimConfig, RunConfig
    from gputrain.tasks.base import Task

    try:
        from gputrain.engine.hooks import Hook
    except ImportError:  # a gputrain from before issue 29, whose hooks lived in gputrain.hooks
        from gputrain.hooks.base import Hook  # type: ignore[no-redef]

    class Timing(Hook):
        def before_epoch(self, trainer: Any) -> None:
            clock.epoch_start()

        def after_step(self, trainer: Any, logs: Any) -> None:
            clock.step()

        def after_epoch(self, trainer: Any, metrics: dict[str, float]) -> None:
            clock.epoch_end()
            clock.loss = metrics["train/loss"]

    spec = MODELS[model_name]
    cfg = RunConfig(optim=OptimConfig(name="sgd", lr=spec["lr"], momentum=0.9))
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(cfg, hooks=[Timing()], strategy="ddp" if world > 1 else "single", devices=world,
                          accelerator="cpu", batch_size=spec["batch"] // world, epochs=epochs, out=f"{out}/run",
                          progress_bar=False, loggers=[], enable_checkpointing=False, pictures=0,
                          log_every_n_steps=0)
        trainer.fit(build_model(model_name), Keyed(model_name), None, task=Task(loss_fn(model_name)))


RUNNERS = {"hand": run_hand, "hand_ddp": run_hand, "hand_tuned": functools.partial(run_hand, tuned=True),
           "hand_ddp_tuned": functools.partial(run_hand, tuned=True), "lightning": run_lightning,
           "gputrain": run_gputrain}


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
