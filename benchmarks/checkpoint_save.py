"""Checkpoint save time: CheckpointStore.save (checksum, manifest, last.pt, rotation) vs a plain torch.save.

Figures (issue 11): for a ResNet-50 state with SGD momentum (about 205 MB) and a small conv
autoencoder state with Adam, the median over interleaved trials of

  * ``torch.save(state, path)``: no fsync, no checksum (the baseline the aim is stated against);
  * ``durable``: torch.save to a temporary, fsync, rename, fsync the folder (gputrain's atomic_save
    before the store): what durability alone costs;
  * ``CheckpointStore.save``: that, plus CRC-32 while writing, ``last.pt`` as a hard link, the
    manifest written twice (intent, commit) and rotation (keep_last=2, so every save also deletes one);
  * ``recycled``: the same store as the trainer builds it (``recycle=True``), which overwrites the file
    rotation retired instead of deleting it and creating a new one;

and the median of per-trial ratios. Each variant writes a new file and the previous one is deleted,
so none overwrites in place; ``os.sync()`` runs (untimed) after each, so no variant pays for the
writeback of another's dirty pages. A second table gives checksum throughput, which is why the
store uses CRC-32. 1 torch thread; wall and CPU time (``time.process_time``) both reported.

    python benchmarks/checkpoint_save.py --pairs 7 --dir runs/bench --json runs/bench/checkpoint_save.json

``--training`` (issue 16) times whole ``Trainer.fit`` runs of ResNet-18 (16x16 images, batch 8, Adam; 3 epochs
of ``--steps-per-epoch`` steps), each in a new process, without checkpoints, with a synchronous checkpoint every 4
steps, and with a background one written by a thread (``trainer.checkpoint_process=false``, the default) or by the
writer process (``true``), in rotated order, and gives the medians of per-round ratios: of the whole ``fit`` (which
includes starting the writer process and the wait for the last save at the end), and of the mean step time of the
epochs after the first, where the steady cost per save shows without the end's one-time wait.

    python benchmarks/checkpoint_save.py --training --pairs 8 --dir runs/bench

``--alternate BLOCKS`` measures the steady cost per step alone, for the thread and the process: in one
``Trainer.fit``, blocks of 32 steps without saves and with the Trainer's save every 4 steps alternate, so the
machine's slow drifts fall on both alike (``--pairs`` runs of each writer, in rotation, each in a new process).

    python benchmarks/checkpoint_save.py --alternate 24 --pairs 4 --dir runs/bench
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchvision

from gputrain.checkpoint import CheckpointStore, rng_state
from gputrain.models.vision import ConvAutoencoder


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a gputrain checkpoint holds, after one step so the optimizer has its buffers."""
    model(torch.rand(2, 3, 80, 80)).float().mean().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": {"0": rng_state()},
            "state": {"epoch": 1, "global_step": 100, "samples_seen": 3200, "step_in_epoch": 0}, "world_size": 1}


def states() -> dict[str, dict[str, Any]]:
    resnet = torchvision.models.resnet50()
    small = ConvAutoencoder()
    return {
        "ResNet-50 + SGD momentum": training_state(resnet, torch.optim.SGD(resnet.parameters(), lr=0.1, momentum=0.9)),
        "conv autoencoder + Adam": training_state(small, torch.optim.Adam(small.parameters())),
    }


def durable_save(obj: Any, path: Path) -> None:
    """gputrain's atomic_save before the store: temporary, fsync, rename, fsync the folder; no checksum."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def compare(state: dict[str, Any], folder: Path, pairs: int) -> dict[str, Any]:
    store = CheckpointStore(folder / "store", keep_last=2)
    recycled = CheckpointStore(folder / "recycled", keep_last=2, recycle=True)  # what the trainer uses
    plain, durable = folder / "plain", folder / "durable"
    plain.mkdir()
    durable.mkdir()
    times: dict[str, list[tuple[float, float]]] = {"torch.save": [], "durable": [], "store.save": [], "recycled": []}
    for i in range(pairs + 1):  # the first round warms caches and allocators and is dropped
        rounds: dict[str, Callable[[], Any]] = {
            "torch.save": functools.partial(torch.save, state, plain / f"{i}.pt"),
            "durable": functools.partial(durable_save, state, durable / f"{i}.pt"),
            "store.save": functools.partial(store.save, state, name=f"step_{i:06d}"),
            "recycled": functools.partial(recycled.save, state, name=f"step_{i:06d}"),
        }
        order = list(rounds) if i % 2 else list(reversed(rounds))  # alternate who goes first
        for name in order:
            result = timed(rounds[name])
            os.sync()
            if i:
                times[name].append(result)
        for old in (plain / f"{i}.pt", durable / f"{i}.pt"):
            old.unlink()
    recycled.discard_spare()
    size = (folder / "store" / "last.pt").stat().st_size
    median = {name: statistics.median(w for w, _ in rows) for name, rows in times.items()}
    cpu = {name: statistics.median(c for _, c in rows) for name, rows in times.items()}

    def ratio(a: str, b: str, which: int = 0) -> float:
        return statistics.median(x[which] / y[which] for x, y in zip(times[a], times[b], strict=True))

    return {"bytes": size, "pairs": pairs, "wall_s": median, "cpu_s": cpu,
            "store/torch.save": ratio("store.save", "torch.save"),
            "store/durable": ratio("store.save", "durable"),
            "durable/torch.save": ratio("durable", "torch.save"),
            "recycled/store": ratio("recycled", "store.save"), "cpu recycled/store": ratio("recycled", "store.save", 1),
            "cpu store/torch.save": ratio("store.save", "torch.save", 1),
            "cpu store/durable": ratio("store.save", "durable", 1)}


def checksum_speeds(megabytes: int = 256) -> dict[str, float]:
    data = os.urandom(megabytes << 20)
    algorithms: dict[str, Callable[[bytes], Any]] = {
        "zlib.crc32": zlib.crc32,
        "hashlib.sha256": lambda b: hashlib.sha256(b).digest(),
        "hashlib.blake2b": lambda b: hashlib.blake2b(b).digest(),
        "hashlib.md5": lambda b: hashlib.md5(b).digest(),
    }
    speeds = {}
    for name, fn in algorithms.items():
        best = min(timed(functools.partial(fn, data))[0] for _ in range(3))
        speeds[name] = (megabytes << 20) / 1e9 / best
    return speeds


TRAINING_VARIANTS = ("none", "sync", "thread", "process")
"""No checkpoints; a synchronous save every 4 steps; a background save written by a thread of the training process
(``trainer.checkpoint_process=false``, the default); a background save written by the writer process (``true``)."""


def training_run(out: Path, variant: str, steps_per_epoch: int, epochs: int) -> dict[str, float]:
    """A ResNet-18 ``Trainer.fit`` (16x16 images, batch 8, Adam), checkpointing every 4 steps or not: wall seconds
    of the whole ``fit`` and the mean step time after the first epoch, and how many saves the writer process wrote."""
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from gputrain import Trainer
    from gputrain.hooks.base import Hook

    class StepTimes(Hook):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.last = 0.0

        def before_epoch(self, trainer: Any) -> None:
            self.last = time.perf_counter()

        def after_step(self, trainer: Any, logs: Any) -> None:
            # The save of a checkpointing step runs after this hook, so it is counted in the next step's time.
            now = time.perf_counter()
            if trainer.state.epoch > 0:
                self.times.append(now - self.last)
            self.last = now

    g = torch.Generator().manual_seed(0)
    n = 8 * steps_per_epoch
    data = TensorDataset(torch.rand(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g))
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    every_4 = dict(checkpoint_every_n_steps=4, checkpoint_every_n_epochs=0)
    checkpoints: dict[str, Any] = {
        "none": dict(enable_checkpointing=False),
        "sync": dict(every_4, async_checkpoint=False),
        "thread": dict(every_4, async_checkpoint=True, checkpoint_process=False),
        "process": dict(every_4, async_checkpoint=True, checkpoint_process=True),
    }[variant]
    steps = StepTimes()
    trainer = Trainer(strategy="single", accelerator="cpu", progress_bar=False, loggers=[], batch_size=8,
                      epochs=epochs, out=str(out), overwrite=True, pictures=0, hooks=[steps], **checkpoints)
    start = time.perf_counter()
    trainer.fit(model, data, loss=F.cross_entropy)
    fit_s = time.perf_counter() - start
    writer = trainer.checkpoint_writer
    # Mean, not median: one step in four carries the save, and a median would hide it.
    return {"fit_s": fit_s, "step_s": statistics.fmean(steps.times),
            "process_writes": float(writer.process_writes if writer is not None else 0)}


def _run_in_a_new_process(out: Path, variant: str, steps_per_epoch: int, epochs: int) -> dict[str, float]:
    """:func:`training_run` in a fresh interpreter, as a user's run is: no heap, staging buffers, spare files or writer
    process left by the run before (the figures before 2026-11-25's tenth session ran every fit in one process)."""
    done = subprocess.run([sys.executable, __file__, "--one-run", variant, str(out), str(steps_per_epoch), str(epochs)],
                          capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"the {variant} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def compare_training(folder: Path, pairs: int, steps_per_epoch: int = 8, epochs: int = 3) -> dict[str, Any]:
    """Interleaved rounds of every variant (rotated so none always goes first), each fit in a new process; medians of
    per-round ratios to the run without checkpoints."""
    times: dict[str, list[dict[str, float]]] = {v: [] for v in TRAINING_VARIANTS}
    for i in range(pairs + 1):  # round 0 warms up (the disk, the page cache of torch's files) and is dropped
        k = i % len(TRAINING_VARIANTS)
        for variant in TRAINING_VARIANTS[k:] + TRAINING_VARIANTS[:k]:
            out = folder / f"{variant}-{i}"
            result = _run_in_a_new_process(out, variant, steps_per_epoch, epochs)
            shutil.rmtree(out)  # outside the timing
            os.sync()
            if i:
                times[variant].append(result)

    def ratios(variant: str, key: str) -> list[float]:
        return [x[key] / y[key] for x, y in zip(times[variant], times["none"], strict=True)]

    return {"pairs": pairs, "steps": steps_per_epoch * epochs,
            "rounds": {f"{key} {v}/none": ratios(v, key) for v in TRAINING_VARIANTS[1:] for key in ("fit_s", "step_s")},
            "fit_s": {v: statistics.median(r["fit_s"] for r in t) for v, t in times.items()},
            "step_s": {v: statistics.median(r["step_s"] for r in t) for v, t in times.items()},
            "process_writes": {v: statistics.median(r["process_writes"] for r in t) for v, t in times.items()},
            **{f"{key} {v}/none": statistics.median(ratios(v, key)) for v in TRAINING_VARIANTS[1:]
               for key in ("fit_s", "step_s")}}


def alternating_blocks(folder: Path, process: bool, blocks: int, block: int = 32) -> dict[str, Any]:
    """The steady cost of background saves per step, in one ``Trainer.fit``: blocks of ``block`` ResNet-18 steps
    (16x16, batch 8, Adam) without saves and with a save every 4 steps alternate (A B B A A B ...), so the machine's
    slow drifts fall on both alike.

    The saves are the Trainer's own (``gputrain.resume.save_checkpoint`` from a hook after the step, as
    ``trainer.checkpoint_every_n_steps`` makes them), written by a thread or by the writer process (started with the
    run and waited for, so its start-up is not counted). The first 4 steps of a block without saves are not counted:
    the last save of the block before may still be in flight there. Median over block pairs of (mean step with saves
    / mean step without).
    """
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from gputrain import Trainer
    from gputrain.hooks.base import Hook
    from gputrain.resume import save_checkpoint


    class Blocks(Hook):
        def __init__(self) -> None:
            self.without: list[float] = []
            self.with_saves: list[float] = []
            self.times: list[float] = []
            self.last = 0.0

        def before_epoch(self, trainer: Any) -> None:
            if process and not trainer.checkpoint_writer.process_ready(timeout=120):
                raise SystemExit("the checkpoint writer process did not start")
            self.last = time.perf_counter()

        def after_step(self, trainer: Any, logs: Any) -> None:
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now  # a save's own time in the step lands in the next step, as with checkpoint_every_n_steps
            k = trainer.state.global_step - 1 - 3 * block  # steps after the warm-up
            pair, i = divmod(k, 2 * block) if k >= 0 else (0, -1)
            saving = k < 0 or ((i < block) == (pair % 2 == 0))  # A B, then B A, ...
            if k >= 0 and i % block == block - 1:  # a block ends: its mean step
                times = self.times[-block:]
                (self.with_saves if saving else self.without).append(
                    statistics.fmean(times) if saving else statistics.fmean(times[4:]))
            if saving and trainer.state.global_step % 4 == 0:
                save_checkpoint(trainer, f"step_{trainer.state.global_step:06d}")

    steps = (3 + 2 * blocks) * block
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(8 * steps, 3, 16, 16, generator=g), torch.randint(0, 10, (8 * steps,), generator=g))
    torch.manual_seed(0)
    hook = Blocks()
    trainer = Trainer(strategy="single", accelerator="cpu", progress_bar=False, loggers=[], batch_size=8, epochs=1,
                      out=str(folder), overwrite=True, pictures=0, hooks=[hook], checkpoint_every_n_steps=0,
                      checkpoint_process=process)
    trainer.fit(torchvision.models.resnet18(num_classes=10), data, loss=F.cross_entropy)
    ratios = [b / a for a, b in zip(hook.without, hook.with_saves, strict=True)]
    return {"blocks": blocks, "step_without_s": statistics.median(hook.without),
            "step_with_saves_s": statistics.median(hook.with_saves), "ratio": statistics.median(ratios),
            "quartiles": statistics.quantiles(ratios), "process_writes": trainer.checkpoint_writer.process_writes}


def report_alternate(args: argparse.Namespace) -> None:
    """``--alternate BLOCKS``: thread and process, ``--pairs`` rounds each in rotation, one new process per run."""
    rows: dict[str, list[dict[str, Any]]] = {"thread": [], "process": []}
    with tempfile.TemporaryDirectory(prefix="gputrain-ckpt-alt-", dir=args.dir or None) as tmp:
        for i in range(args.pairs):
            for kind in ("thread", "process") if i % 2 == 0 else ("process", "thread"):
                out = Path(tmp) / f"{kind}-{i}"
                done = subprocess.run([sys.executable, __file__, "--one-alternate", kind, str(out), str(args.alternate)],
                                      capture_output=True, text=True, check=False)
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode or not lines:
                    raise SystemExit(f"the {kind} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
                rows[kind].append(json.loads(lines[-1].removeprefix("RESULT ")))
                shutil.rmtree(out, ignore_errors=True)
    print(f"| writer | step without saves | step with a save every 4 | with / without, per run ({args.alternate} block "
          "pairs of 32 steps) | median of runs |")
    print("|---|---:|---:|---|---:|")
    for kind, runs in rows.items():
        per_run = ", ".join(f"{r['ratio']:.3f}" for r in runs)
        print(f"| {kind} | {statistics.median(r['step_without_s'] for r in runs) * 1e3:.1f} ms "
              f"| {statistics.median(r['step_with_saves_s'] for r in runs) * 1e3:.1f} ms | {per_run} "
              f"| {statistics.median(r['ratio'] for r in runs):.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=7, help="interleaved trials per state (at least 5)")
    parser.add_argument("--dir", default="", help="where to write (default: the system temporary folder)")
    parser.add_argument("--json", default="")
    parser.add_argument("--training", action="store_true",
                        help="instead: ResNet-18 training with a checkpoint every 4 steps: none / sync / thread / process")
    parser.add_argument("--steps-per-epoch", type=int, default=32, help="with --training: steps in each of 3 epochs")
    parser.add_argument("--alternate", type=int, default=0, metavar="BLOCKS",
                        help="instead: the steady cost per step, thread vs process, in alternating blocks (one process "
                             "each, run --pairs times in rotation)")
    parser.add_argument("--one-run", nargs=4, metavar=("VARIANT", "OUT", "STEPS", "EPOCHS"), help=argparse.SUPPRESS)
    parser.add_argument("--one-alternate", nargs=3, metavar=("WRITER", "OUT", "BLOCKS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.one_run:
        variant, out, steps, epochs = args.one_run
        print("RESULT " + json.dumps(training_run(Path(out), variant, int(steps), int(epochs))), flush=True)
        return
    if args.one_alternate:
        kind, out, blocks = args.one_alternate
        print("RESULT " + json.dumps(alternating_blocks(Path(out), kind == "process", int(blocks))), flush=True)
        return
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    if args.alternate:
        report_alternate(args)
        return
    if args.training:
        with tempfile.TemporaryDirectory(prefix="gputrain-ckpt-train-", dir=args.dir or None) as tmp:
            r = compare_training(Path(tmp), args.pairs, steps_per_epoch=args.steps_per_epoch)
        f, st = r["fit_s"], r["step_s"]
        print("| ResNet-18, 16x16, batch 8, Adam | no checkpoint | sync every 4 | thread every 4 | process every 4 "
              "| sync / none | thread / none | process / none |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        print(f"| whole fit, {r['steps']} steps | {f['none']:.2f} s | {f['sync']:.2f} s | {f['thread']:.2f} s "
              f"| {f['process']:.2f} s | {r['fit_s sync/none']:.3f} | {r['fit_s thread/none']:.3f} "
              f"| {r['fit_s process/none']:.3f} |")
        print(f"| mean step, epochs 2-3 | {st['none'] * 1e3:.1f} ms | {st['sync'] * 1e3:.1f} ms "
              f"| {st['thread'] * 1e3:.1f} ms | {st['process'] * 1e3:.1f} ms | {r['step_s sync/none']:.3f} "
              f"| {r['step_s thread/none']:.3f} | {r['step_s process/none']:.3f} |")
        spread = {k: f"{min(v):.3f}..{max(v):.3f}" for k, v in r["rounds"].items()}
        print(f"\nMedians of {args.pairs} rotated rounds, each fit in a new process; ratios are medians of per-round "
              f"ratios (per-round min..max: {spread}). Saves the writer process wrote per fit (median): "
              f"{r['process_writes']['process']:.0f}.")
        if args.json:
            Path(args.json).write_text(json.dumps(r, indent=2))
        return
    results: dict[str, Any] = {"save": {}, "checksum_GB_per_s": checksum_speeds()}
    with tempfile.TemporaryDirectory(prefix="gputrain-ckpt-bench-", dir=args.dir or None) as tmp:
        for label, state in states().items():
            folder = Path(tmp) / label.split()[0].lower()
            folder.mkdir()
            results["save"][label] = compare(state, folder, args.pairs)

    print("| state | size | torch.save | durable | store.save | recycled | store / torch.save | store / durable "
          "| recycled / store | CPU: store / torch.save | CPU: store / durable | CPU: recycled / store |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in results["save"].items():
        w = r["wall_s"]
        print(f"| {label} | {r['bytes'] / 1e6:.1f} MB | {w['torch.save'] * 1e3:.1f} ms | {w['durable'] * 1e3:.1f} ms "
              f"| {w['store.save'] * 1e3:.1f} ms | {w['recycled'] * 1e3:.1f} ms | {r['store/torch.save']:.2f}x "
              f"| {r['store/durable']:.2f}x | {r['recycled/store']:.2f}x | {r['cpu store/torch.save']:.2f}x "
              f"| {r['cpu store/durable']:.2f}x | {r['cpu recycled/store']:.2f}x |")
    print(f"\nMedians of {args.pairs} interleaved trials; ratios are medians of per-trial ratios.\n")
    print("| checksum | GB/s |")
    print("|---|---:|")
    for name, speed in results["checksum_GB_per_s"].items():
        print(f"| {name} | {speed:.2f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
