"""The plan's loader rate against the run's (issue 42): one worker's images/s as ``gputrain plan`` predicts it,
against what a training run measures, on the generated sets.

Predicted: the figure the plan computes (``Workload.from_config(...).seconds_per_sample``: reads of the training
set with the recipe's transforms, in one process). Measured: a run with ``data.num_workers=0``, whose training
process reads each batch in series with the step, so that each batch's data wait is one reader's time for it
(reads, transforms, collate); the run's ``pace`` record averages it over the steps after the first, and
batch / wait is one reader's images/s. Rounds interleave the two (plan, run), and each run trains
``--steps`` steps of the recipe at its batch of 8 on one CPU process (the model is the recipe's; only the loader
is compared). Medians over rounds, and the median of the per-round ratios predicted/measured (the aim: within
25 %).

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


def predicted(recipe: str, overrides: list[str]) -> float:
    """One worker's images/s, as the plan computes it."""
    import torch

    from gputrain.config import load_config
    from gputrain.tools.plan.workload import Workload

    cfg = load_config(recipe, [*overrides, "trainer.accelerator=cpu", f"trainer.batch_size={BATCH}"])
    return 1.0 / Workload.from_config(cfg, torch.device("cpu"), "32").seconds_per_sample


def measured(recipe: str, overrides: list[str], out: Path, steps: int) -> float:
    """One reader's images/s in a run with data.num_workers=0 (its pace record)."""
    from gputrain.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", recipe, *overrides, "--accelerator", "cpu", "--batch-size", str(BATCH), "--epochs", "1",
                     "--out", str(out), "data.num_workers=0", f"trainer.max_steps_per_epoch={steps}",
                     "trainer.eval_every_n_epochs=2", "trainer.enable_checkpointing=false", "trainer.pictures=0",
                     "trainer.loggers=[]", "trainer.progress_bar=false"])
    assert code == 0, f"{recipe}: exit {code}"
    pace = json.loads((out / "summary.json").read_text())["pace"]
    return BATCH / pace["data_wait_s"]


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
                plan, run = predicted(recipe, given), measured(recipe, given, Path(tmp) / f"{kind}-{k}", args.steps)
                rows.append({"predicted": plan, "measured": run, "ratio": plan / run})
                print(f"{name}, round {k + 1}: plan {plan:.0f} images/s per worker, run {run:.0f} ({plan / run:.2f})",
                      flush=True)
            results[name] = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    print("\n| set | plan, images/s per worker | run, one reader | plan / run |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['predicted']:.0f} | {r['measured']:.0f} | {r['ratio']:.2f} |")
    if args.json:
        meta = {"rounds": args.rounds, "steps": args.steps, "date": datetime.date.today().isoformat(),
                "machine": platform.node(), "cores": os.cpu_count(), "torch": torch.__version__}
        args.json.write_text(json.dumps({"sets": results, **meta}, indent=2) + "\n")


if __name__ == "__main__":
    main()
