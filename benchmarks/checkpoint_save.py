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
of ``--steps-per-epoch`` steps) without checkpoints, with a synchronous checkpoint every 4 steps, and with an
asynchronous one (``trainer.async_checkpoint``), in rotated order, and gives the medians of per-round ratios:
of the whole ``fit`` (which includes the wait for the last save at the end), and of the median step time of
the epochs after the first, where the steady cost per save shows without the end's one-time wait.

    python benchmarks/checkpoint_save.py --training --pairs 5 --dir runs/bench
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import statistics
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


def training_run(out: Path, variant: str, steps_per_epoch: int, epochs: int) -> tuple[float, float]:
    """(wall seconds of the whole ``fit``, median seconds per step after the first epoch) of a ResNet-18
    ``Trainer.fit`` (16x16 images, batch 8), checkpointing every 4 steps or not."""
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
    checkpoints: dict[str, Any] = {
        "none": dict(enable_checkpointing=False),
        "sync": dict(checkpoint_every_n_steps=4, checkpoint_every_n_epochs=0, async_checkpoint=False),
        "async": dict(checkpoint_every_n_steps=4, checkpoint_every_n_epochs=0, async_checkpoint=True),
    }[variant.removesuffix("-page-cache")]
    steps = StepTimes()
    trainer = Trainer(strategy="single", accelerator="cpu", progress_bar=False, loggers=[], batch_size=8,
                      epochs=epochs, out=str(out), overwrite=True, pictures=0, hooks=[steps], **checkpoints)
    from gputrain import checkpoint_io

    direct_file_systems = checkpoint_io.DIRECT_IO_FILE_SYSTEMS
    if variant.endswith("-page-cache"):  # as before 2026-11-25: every checkpoint written through the page cache
        checkpoint_io.DIRECT_IO_FILE_SYSTEMS = frozenset()
    start = time.perf_counter()
    try:
        trainer.fit(model, data, loss=F.cross_entropy)
    finally:
        checkpoint_io.DIRECT_IO_FILE_SYSTEMS = direct_file_systems
    # Mean, not median: one step in four carries the save, and a median would hide it.
    return time.perf_counter() - start, statistics.fmean(steps.times)


def compare_training(folder: Path, pairs: int, steps_per_epoch: int = 8, epochs: int = 3,
                     page_cache: bool = False) -> dict[str, Any]:
    """Interleaved rounds of none / sync / async (rotated so none always goes first); medians of per-round ratios.

    ``page_cache``: also sync and async with every file written through the page cache (no O_DIRECT)."""
    variants = ["none", "sync", "async"] + (["sync-page-cache", "async-page-cache"] if page_cache else [])
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    for i in range(pairs + 1):  # round 0 warms up and is dropped
        for variant in variants[i % len(variants):] + variants[:i % len(variants)]:
            # A new folder per run, the last one deleted outside the timing: clearing a previous run's checkpoints
            # (overwrite=True) cost about 90 ms at the start of each run that had written some, which no
            # variant without checkpoints paid.
            out = folder / f"{variant}-{i}"
            seconds = training_run(out, variant, steps_per_epoch, epochs)
            shutil.rmtree(out)
            os.sync()
            if i:
                times[variant].append(seconds)

    def ratios(a: str, b: str, which: int = 0) -> list[float]:
        return [x[which] / y[which] for x, y in zip(times[a], times[b], strict=True)]

    def ratio(a: str, b: str, which: int = 0) -> float:
        return statistics.median(ratios(a, b, which))

    extra = {f"{k} {v}/none": ratio(v, "none", int(k == "step")) for v in variants[3:] for k in ("fit", "step")}
    return {**extra, "pairs": pairs, "steps": steps_per_epoch * epochs,
            "rounds": {"async/none": ratios("async", "none"), "step async/none": ratios("async", "none", 1),
                       "sync/none": ratios("sync", "none"), "step sync/none": ratios("sync", "none", 1)},
            "wall_s": {v: statistics.median(w for w, _ in t) for v, t in times.items()},
            "step_s": {v: statistics.median(s for _, s in t) for v, t in times.items()},
            "sync/none": ratio("sync", "none"), "async/none": ratio("async", "none"),
            "async/sync": ratio("async", "sync"),
            "step sync/none": ratio("sync", "none", 1), "step async/none": ratio("async", "none", 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=7, help="interleaved trials per state (at least 5)")
    parser.add_argument("--dir", default="", help="where to write (default: the system temporary folder)")
    parser.add_argument("--json", default="")
    parser.add_argument("--training", action="store_true",
                        help="instead: ResNet-18 training with a checkpoint every 4 steps, none / sync / async")
    parser.add_argument("--page-cache", action="store_true",
                        help="with --training: also sync and async through the page cache (no O_DIRECT), interleaved")
    parser.add_argument("--steps-per-epoch", type=int, default=32, help="with --training: steps in each of 3 epochs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    if args.training:
        with tempfile.TemporaryDirectory(prefix="gputrain-ckpt-train-", dir=args.dir or None) as tmp:
            r = compare_training(Path(tmp), args.pairs, steps_per_epoch=args.steps_per_epoch, page_cache=args.page_cache)
        w, st = r["wall_s"], r["step_s"]
        print("| ResNet-18, 16x16, batch 8 | no checkpoint | sync every 4 | async every 4 | sync / none "
              "| async / none | async / sync |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        print(f"| whole fit, {r['steps']} steps | {w['none']:.2f} s | {w['sync']:.2f} s | {w['async']:.2f} s "
              f"| {r['sync/none']:.3f} | {r['async/none']:.3f} | {r['async/sync']:.3f} |")
        print(f"| mean step, epochs 2-3 | {st['none'] * 1e3:.1f} ms | {st['sync'] * 1e3:.1f} ms "
              f"| {st['async'] * 1e3:.1f} ms | {r['step sync/none']:.3f} | {r['step async/none']:.3f} | |")
        for variant in ("sync-page-cache", "async-page-cache"):
            if variant in w:
                print(f"| {variant}: whole fit {w[variant]:.2f} s ({r[f'fit {variant}/none']:.3f} of none), mean step "
                      f"{st[variant] * 1e3:.1f} ms ({r[f'step {variant}/none']:.3f}) | | | | | | |")
        spread = {k: f"{min(v):.3f}..{max(v):.3f}" for k, v in r["rounds"].items()}
        print(f"\nMedians of {args.pairs} rotated rounds; ratios are medians of per-round ratios "
              f"(per-round min..max: {spread}).")
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
