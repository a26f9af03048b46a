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
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchvision
from checkpoint_save_trials import checksum_speeds, compare, states  # the save trials (the first table)

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
