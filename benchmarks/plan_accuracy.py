"""How close ``gputrain plan``'s predictions come to what a step measures, per built-in recipe (issue 30).

For each recipe, at two input sizes and two batch sizes, on generated data, on this machine's device:

- memory: the plan's prediction of one single-device training step (two steps on fake tensors, counted by
  ``MemTracker``) against ``MemTracker``'s count of a real step of the same model, batch and optimizer (the issue's
  CPU reference; on a GPU, the plan's whole prediction against ``torch.cuda.max_memory_allocated`` of a run is
  ``bash scripts/gpu_check.sh plan``'s);
- time: the plan's prediction (real steps at a small batch and at twice it, taken as affine in the batch) against
  the median of ``--reps`` real steps at the batch. Both sides are timed in the same run, one after the other.

Also the time ``gputrain plan RECIPE --devices 2`` takes (every plan) at the first setting of each recipe, and
the time ``--strategy auto`` takes to choose there (``make_report(..., choice_only=True)``).
Multi-rank plans (ddp, fsdp, pipeline) are not compared here yet. Mask R-CNN cannot run on fake tensors: its
"prediction" is itself a real step, so it is listed but not scored.

Usage: ``python benchmarks/plan_accuracy.py [--recipes autoencoder,...] [--reps 3] [--json out.json] [--plan-times-only]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gputrain.config import load_config
from gputrain.tools.make_data import make_dataset
from gputrain.tools.plan import memory
from gputrain.tools.plan.command import make_report
from gputrain.tools.plan.timing import measure_step, measure_steps
from gputrain.tools.plan.workload import Workload

# recipe -> (data set kind, two input sizes, overrides)
SETTINGS: dict[str, tuple[str, tuple[int, int], list[str]]] = {
    "autoencoder": ("imagefolder", (40, 80), []),
    "cifar10-resnet18": ("cifar10", (32, 64), []),
    "imagefolder-resnet50": ("classfolder", (32, 64), []),
    "resnet50-model-parallel": ("classfolder", (32, 64), []),
    "ade20k-deeplabv3plus": ("ade20k", (64, 128), ["data.num_classes=8"]),
    "coco-maskrcnn": ("coco", (64, 96), ["model.kwargs.min_size=64", "model.kwargs.max_size=96"]),
}
BATCHES = (4, 8)


def one_setting(recipe: str, root: Path, size: int, batch: int, extra: list[str], reps: int) -> dict[str, Any]:
    size_key = [] if recipe == "coco-maskrcnn" else [f"data.image_size={size}"]
    cfg = load_config(recipe, [f"data.root={root}", "trainer.precision=32", *size_key, *extra])
    work = Workload.from_config(cfg, torch.device("cpu"), "32")
    predicted = memory.step_memory(work, batch)
    measured = memory.measured_step_memory(work, batch)
    probe = measure_steps(work, max(batch // 4, 2))  # the plan's probes are small batches
    step = measure_step(work, batch, repeats=reps)
    return {"recipe": recipe, "size": size, "batch": batch, "on_fake_tensors": work.runs_on_fake_tensors,
            "predicted_bytes": predicted.peak, "measured_bytes": measured.peak,
            "memory_error": predicted.peak / measured.peak - 1,
            "predicted_step_s": probe.step_at(batch), "measured_step_s": step.step_s,
            "time_error": probe.step_at(batch) / step.step_s - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Mask R-CNN is left out by default: its "prediction" is a real step (minutes of CPU per setting, no score).
    parser.add_argument("--recipes", default=",".join(r for r in SETTINGS if r != "coco-maskrcnn"))
    parser.add_argument("--reps", type=int, default=3, help="timed steps per measurement (median)")
    parser.add_argument("--json", default="")
    parser.add_argument("--plan-times-only", action="store_true", help="only the time `plan --devices 2` takes")
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    rows, plan_times, auto_times = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipes.split(","):
            kind, sizes, extra = SETTINGS[recipe]
            root = Path(tmp) / kind
            if not root.exists():
                make_dataset(kind, root, count=24, size=max(sizes) if kind != "cifar10" else 0)
            for size in () if args.plan_times_only else sizes:
                for batch in BATCHES:
                    row = one_setting(recipe, root, size, batch, extra, args.reps)
                    rows.append(row)
                    print(f"{recipe:24s} {size:4d}px b{batch}: memory {row['memory_error']:+7.2%}  "
                          f"time {row['time_error']:+7.2%}  (fake tensors: {row['on_fake_tensors']})", flush=True)
            size_key = [] if recipe == "coco-maskrcnn" else [f"data.image_size={sizes[0]}"]
            cfg = load_config(recipe, [f"data.root={root}", "trainer.batch_size=8", *size_key, *extra])
            start = time.perf_counter()
            make_report(cfg, devices=2)
            plan_times[recipe] = time.perf_counter() - start
            start = time.perf_counter()  # what --strategy auto counts to choose (the budget: this machine's)
            make_report(cfg, devices=2, choice_only=True)
            auto_times[recipe] = time.perf_counter() - start
            print(f"{recipe:24s} gputrain plan --devices 2: {plan_times[recipe]:.1f} s; --strategy auto's choice: "
                  f"{auto_times[recipe]:.1f} s", flush=True)
    result = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "rows": rows, "plan_s": plan_times,
              "auto_choice_s": auto_times}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
