"""Checkpoint save time: CheckpointStore.save (checksum, manifest, last.pt, rotation) vs a plain torch.save.

Figures (issue 11): for a ResNet-50 state with SGD momentum (about 205 MB) and a small conv
autoencoder state with Adam, the median over interleaved trials of

  * ``torch.save(state, path)``: no fsync, no checksum (the baseline the aim is stated against);
  * ``durable``: torch.save to a temporary, fsync, rename, fsync the folder (gputrain's atomic_save
    before the store): what durability alone costs;
  * ``CheckpointStore.save``: that, plus the zip's CRC-32 record in the manifest, ``last.pt`` as a hard
    link, the manifest written twice (intent, commit) and rotation (keep_last=2, so every save also deletes one);

and the median of per-trial ratios. Each variant writes a new file and the previous one is deleted,
so none overwrites in place; ``os.sync()`` runs (untimed) after each, so no variant pays for the
writeback of another's dirty pages. A second table gives checksum throughput, which is why the
store uses CRC-32. 1 torch thread; wall and CPU time (``time.process_time``) both reported.

    python benchmarks/checkpoint_save.py --pairs 7 --dir runs/bench --json runs/bench/checkpoint_save.json

``--training`` (issues 16, 29) times whole ``Trainer.fit`` runs of ResNet-18 (16x16 images, batch 8, Adam; 3 epochs
of ``--steps-per-epoch`` steps), each in a new process, without checkpoints, with a checkpoint every 4 steps written
in the step (``trainer.async_checkpoint=false``), and with one written by the background thread (``true``), in
rotated order, and gives the medians of per-round ratios: of the whole ``fit`` (which includes the wait for the last
save at the end), and of the mean step time of the epochs after the first, where the steady cost per save shows
without the end's one-time wait. ``--baseline-python PY`` runs the same three in another installation (an older
gputrain: ``PYTHONPATH=old/src python``) in the same rounds, rows marked ``before``.

    python benchmarks/checkpoint_save.py --training --pairs 8 --dir runs/bench
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shlex
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

from gputrain.models.vision import ConvAutoencoder


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a gputrain checkpoint holds, after one step so the optimizer has its buffers."""
    from gputrain.checkpoint.state import rng_state

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
    from gputrain.checkpoint import CheckpointStore

    store = CheckpointStore(folder / "store", keep_last=2)
    plain, durable = folder / "plain", folder / "durable"
    plain.mkdir()
    durable.mkdir()
    times: dict[str, list[tuple[float, float]]] = {"torch.save": [], "durable": [], "store.save": []}
    for i in range(pairs + 1):  # the first round warms caches and allocators and is dropped
        rounds: dict[str, Callable[[], Any]] = {
            "torch.save": functools.partial(torch.save, state, plain / f"{i}.pt"),
            "durable": functools.partial(durable_save, state, durable / f"{i}.pt"),
            "store.save": functools.partial(store.save, state, name=f"step_{i:06d}"),
        }
        order = list(rounds) if i % 2 else list(reversed(rounds))  # alternate who goes first
        for name in order:
            result = timed(rounds[name])
            os.sync()
            if i:
                times[name].append(result)
        for old in (plain / f"{i}.pt", durable / f"{i}.pt"):
            old.unlink()
    size = (folder / "store" / "last.pt").stat().st_size
    median = {name: statistics.median(w for w, _ in rows) for name, rows in times.items()}
    cpu = {name: statistics.median(c for _, c in rows) for name, rows in times.items()}

    def ratio(a: str, b: str, which: int = 0) -> float:
        return statistics.median(x[which] / y[which] for x, y in zip(times[a], times[b], strict=True))

    return {"bytes": size, "pairs": pairs, "wall_s": median, "cpu_s": cpu,
            "store/torch.save": ratio("store.save", "torch.save"),
            "store/durable": ratio("store.save", "durable"),
            "durable/torch.save": ratio("durable", "torch.save"),
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


TRAINING_VARIANTS = ("none", "sync", "thread")
"""No checkpoints; a save every 4 steps written in the step; the same written by the background thread."""


def training_run(out: Path, variant: str, steps_per_epoch: int, epochs: int) -> dict[str, float]:
    """A ResNet-18 ``Trainer.fit`` (16x16 images, batch 8, Adam), checkpointing every 4 steps or not: wall seconds
    of the whole ``fit`` and the mean step time after the first epoch. Written against what every gputrain version
    since issue 16 offers (hooks called by name with an object that has ``.state``), so ``--baseline-python`` can
    run it in an older installation."""
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from gputrain import Trainer

    class StepTimes:  # every hook method the Trainer calls, without importing its Hook class (it moved)
        def __init__(self) -> None:
            self.times: list[float] = []
            self.last = 0.0

        def before_epoch(self, run: Any) -> None:
            self.last = time.perf_counter()

        def after_step(self, run: Any, logs: Any) -> None:
            # The save of a checkpointing step runs after this hook, so it is counted in the next step's time.
            now = time.perf_counter()
            if run.state.epoch > 0:
                self.times.append(now - self.last)
            self.last = now

        def __getattr__(self, name: str) -> Callable[..., None]:
            return lambda *args: None

    g = torch.Generator().manual_seed(0)
    n = 8 * steps_per_epoch
    data = TensorDataset(torch.rand(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g))
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    every_4 = dict(checkpoint_every_n_steps=4, checkpoint_every_n_epochs=0)
    checkpoints: dict[str, Any] = {
        "none": dict(enable_checkpointing=False),
        "sync": dict(every_4, async_checkpoint=False),
        "thread": dict(every_4, async_checkpoint=True),
    }[variant]
    steps = StepTimes()
    trainer = Trainer(strategy="single", accelerator="cpu", progress_bar=False, loggers=[], batch_size=8,
                      epochs=epochs, out=str(out), overwrite=True, pictures=0, hooks=[steps], **checkpoints)
    start = time.perf_counter()
    trainer.fit(model, data, loss=F.cross_entropy)
    # Mean, not median: one step in four carries the save, and a median would hide it.
    return {"fit_s": time.perf_counter() - start, "step_s": statistics.fmean(steps.times)}


def _run_in_a_new_process(python: str, out: Path, variant: str, steps_per_epoch: int, epochs: int) -> dict[str, float]:
    """:func:`training_run` in a fresh interpreter, as a user's run is: no heap or buffers left by the run before."""
    done = subprocess.run([*shlex.split(python), __file__, "--one-run", variant, str(out), str(steps_per_epoch),
                           str(epochs)], capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"the {variant} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def compare_training(folder: Path, pairs: int, steps_per_epoch: int = 8, epochs: int = 3,
                     baseline_python: str = "") -> dict[str, Any]:
    """Interleaved rounds of every variant (rotated so none always goes first), each fit in a new process; medians of
    per-round ratios to the run without checkpoints of the same installation."""
    pythons = {"": sys.executable, **({"before ": baseline_python} if baseline_python else {})}
    variants = [(who, v) for who in pythons for v in TRAINING_VARIANTS]
    times: dict[str, list[dict[str, float]]] = {who + v: [] for who, v in variants}
    for i in range(pairs + 1):  # round 0 warms up (the disk, the page cache of torch's files) and is dropped
        k = i % len(variants)
        for who, variant in variants[k:] + variants[:k]:
            out = folder / f"{who.strip() or 'after'}-{variant}-{i}"
            result = _run_in_a_new_process(pythons[who], out, variant, steps_per_epoch, epochs)
            shutil.rmtree(out)  # outside the timing
            os.sync()
            if i:
                times[who + variant].append(result)

    def ratios(name: str, key: str) -> list[float]:
        none = name.rsplit(" ", 1)[0] + " none" if " " in name else "none"
        return [x[key] / y[key] for x, y in zip(times[name], times[none], strict=True)]

    saving = [n for n in times if not n.endswith("none")]
    return {"pairs": pairs, "steps": steps_per_epoch * epochs,
            "rounds": {f"{key} {n}/none": ratios(n, key) for n in saving for key in ("fit_s", "step_s")},
            "fit_s": {n: statistics.median(r["fit_s"] for r in t) for n, t in times.items()},
            "step_s": {n: statistics.median(r["step_s"] for r in t) for n, t in times.items()},
            **{f"{key} {n}/none": statistics.median(ratios(n, key)) for n in saving for key in ("fit_s", "step_s")}}


def report_training(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="gputrain-ckpt-train-", dir=args.dir or None) as tmp:
        r = compare_training(Path(tmp), args.pairs, steps_per_epoch=args.steps_per_epoch,
                             baseline_python=args.baseline_python)
    print("| ResNet-18, 16x16, batch 8, Adam | no checkpoint | sync every 4 | thread every 4 | sync / none "
          "| thread / none |")
    print("|---|---:|---:|---:|---:|---:|")
    for who in ("before ", "") if args.baseline_python else ("",):
        f, st = r["fit_s"], r["step_s"]
        print(f"| {who}whole fit, {r['steps']} steps | {f[who + 'none']:.2f} s | {f[who + 'sync']:.2f} s "
              f"| {f[who + 'thread']:.2f} s | {r[f'fit_s {who}sync/none']:.3f} | {r[f'fit_s {who}thread/none']:.3f} |")
        print(f"| {who}mean step, epochs 2-3 | {st[who + 'none'] * 1e3:.1f} ms | {st[who + 'sync'] * 1e3:.1f} ms "
              f"| {st[who + 'thread'] * 1e3:.1f} ms | {r[f'step_s {who}sync/none']:.3f} "
              f"| {r[f'step_s {who}thread/none']:.3f} |")
    spread = {k: f"{min(v):.3f}..{max(v):.3f}" for k, v in r["rounds"].items()}
    print(f"\nMedians of {args.pairs} rotated rounds, each fit in a new process; ratios are medians of per-round "
          f"ratios (per-round min..max: {spread}).")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=7, help="interleaved trials per state (at least 5)")
    parser.add_argument("--dir", default="", help="where to write (default: the system temporary folder)")
    parser.add_argument("--json", default="")
    parser.add_argument("--training", action="store_true",
                        help="instead: ResNet-18 training with a checkpoint every 4 steps: none / sync / thread")
    parser.add_argument("--steps-per-epoch", type=int, default=32, help="with --training: steps in each of 3 epochs")
    parser.add_argument("--baseline-python", default="",
                        help="with --training: also run the three in this interpreter (e.g. 'env PYTHONPATH=old/src "
                             "python'), in the same rounds")
    parser.add_argument("--one-run", nargs=4, metavar=("VARIANT", "OUT", "STEPS", "EPOCHS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.one_run:
        variant, out, steps, epochs = args.one_run
        print("RESULT " + json.dumps(training_run(Path(out), variant, int(steps), int(epochs))), flush=True)
        return
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    if args.training:
        report_training(args)
        return
    results: dict[str, Any] = {"save": {}, "checksum_GB_per_s": checksum_speeds()}
    with tempfile.TemporaryDirectory(prefix="gputrain-ckpt-bench-", dir=args.dir or None) as tmp:
        for label, state in states().items():
            folder = Path(tmp) / label.split()[0].lower()
            folder.mkdir()
            results["save"][label] = compare(state, folder, args.pairs)

    print("| state | size | torch.save | durable | store.save | store / torch.save | store / durable "
          "| CPU: store / torch.save | CPU: store / durable |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in results["save"].items():
        w = r["wall_s"]
        print(f"| {label} | {r['bytes'] / 1e6:.1f} MB | {w['torch.save'] * 1e3:.1f} ms | {w['durable'] * 1e3:.1f} ms "
              f"| {w['store.save'] * 1e3:.1f} ms | {r['store/torch.save']:.2f}x "
              f"| {r['store/durable']:.2f}x | {r['cpu store/torch.save']:.2f}x "
              f"| {r['cpu store/durable']:.2f}x |")
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
