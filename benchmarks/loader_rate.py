"""The plan's loader rate against the run's (issue 42): one worker's images/s as ``gputrain plan`` predicts it,
against what a training run measures, on the generated sets.

Predicted: the two figures the plan computes (``Workload.from_config(...)``: reads of the training set with the
recipe's transforms and collate, timed in one real loader worker and in the training process). Measured, twice, by the run's own reader clock
(``gputrain.data.reader_clock``: each reader times its reads and collates where it runs; the ``pace`` record's
``reader_images_per_s``): in a run with ``data.num_workers=0``, whose training process reads between its steps, and
in a run with ``data.num_workers=1``, whose one worker reads on a core of its own while the step runs on the other
(what a worker does beside a GPU). Rounds interleave the three, and each run trains ``--steps`` steps of the recipe
at its batch of 8 on one CPU process (the model is the recipe's; only the loader is compared). Medians over rounds,
and the medians of the per-round ratios predicted/measured (the aim: within 25 %).

    python benchmarks/loader_rate.py [--rounds 3] [--steps 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

BATCH = 8
SETS = {  # name: (kind, size, count, recipe, overrides)
    "JPEGs 224 px, crops of 64 (imagefolder-resnet50 with a ResNet-18)":
        ("classfolder", 224, 96, "imagefolder-resnet50", ["data.image_size=64", "model.name=resnet18"]),
    "video frames 80 px (autoencoder)": ("imagefolder", 80, 96, "autoencoder", []),
    "CIFAR-10 batches 32 px (cifar10-resnet18)": ("cifar10", 32, 120, "cifar10-resnet18", []),
    "ADE20K-layout JPEGs and PNG masks 128 px, crops of 64 (ade20k-deeplabv3plus)":
        ("ade20k", 128, 96, "ade20k-deeplabv3plus", ["data.image_size=64", "data.num_classes=8"]),
}


def predicted(recipe: str, overrides: list[str]) -> tuple[float, float]:
    """(one loader worker's images/s, the training process's), as the plan computes them."""
    import torch

    from gputrain.config import load_config
    from gputrain.tools.plan.workload import Workload

    cfg = load_config(recipe, [*overrides, "trainer.accelerator=cpu", f"trainer.batch_size={BATCH}"])
    work = Workload.from_config(cfg, torch.device("cpu"), "32")
    return 1.0 / (work.seconds_per_sample_in_worker or work.seconds_per_sample), 1.0 / work.seconds_per_sample


def measured(recipe: str, overrides: list[str], out: Path, steps: int, workers: int) -> float:
    """One reader's images/s in a run with ``workers`` loader workers (its pace record's reader clock)."""
    from gputrain.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", recipe, *overrides, "--accelerator", "cpu", "--batch-size", str(BATCH), "--epochs", "1",
                     "--out", str(out), f"data.num_workers={workers}", f"trainer.max_steps_per_epoch={steps}",
                     "trainer.eval_every_n_epochs=2", "trainer.enable_checkpointing=false", "trainer.pictures=0",
                     "trainer.loggers=[]", "trainer.progress_bar=false"])
    assert code == 0, f"{recipe}: exit {code}"
    return float(json.loads((out / "summary.json").read_text())["pace"]["reader_images_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="steps of each run (the pace counts all but the first)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from gputrain.tools.make_data import make_dataset

    results = {}
    with tempfile.TemporaryDirectory(prefix="loader-rate-") as tmp:
        for name, (kind, size, count, recipe, overrides) in SETS.items():
            root = make_dataset(kind, Path(tmp) / kind, size=size, count=count)
            given = [*overrides, f"data.root={root}"]
            rows = []
            for k in range(args.rounds):
                plan_worker, plan_inline = predicted(recipe, given)
                inline, worker = (measured(recipe, given, Path(tmp) / f"{kind}-{k}-{w}", args.steps, w) for w in (0, 1))
                rows.append({"plan_worker": plan_worker, "worker": worker, "ratio_worker": plan_worker / worker,
                             "plan_in_process": plan_inline, "in_process": inline,
                             "ratio_in_process": plan_inline / inline})
                print(f"{name}, round {k + 1}: one worker: plan {plan_worker:.0f} images/s, run {worker:.0f} "
                      f"({plan_worker / worker:.2f}); the training process: plan {plan_inline:.0f}, run {inline:.0f} "
                      f"({plan_inline / inline:.2f})", flush=True)
            results[name] = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    print("\n| set | one worker: plan | run | plan / run | training process: plan | run | plan / run |\n"
          "|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['plan_worker']:.0f} | {r['worker']:.0f} | {r['ratio_worker']:.2f} | "
              f"{r['plan_in_process']:.0f} | {r['in_process']:.0f} | {r['ratio_in_process']:.2f} |")
    if args.json:
        meta = {"rounds": args.rounds, "steps": args.steps, "date": datetime.date.today().isoformat(),
                "machine": platform.node(), "cores": os.cpu_count(), "torch": torch.__version__}
        args.json.write_text(json.dumps({"sets": results, **meta}, indent=2) + "\n")


if __name__ == "__main__":
    main()
