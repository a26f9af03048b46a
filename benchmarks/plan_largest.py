"""The plan's largest batch: its prediction of a large batch's count against the count itself (issue 30).

For each recipe, the single-device step is counted on fake tensors at the plan's batch ``b`` and at ``2 b`` (what
``gputrain plan`` counts), then at 8 and 32 times ``b``. Two predictions of the large batches' counts from the
first two: the line through their two peaks (the plan's method up to 2026-11-26), and every moment's own line
(:func:`gputrain.tools.plan.memory.largest_batch`, now). Counts on fake tensors are deterministic: one run is the
figure.

Usage: ``python benchmarks/plan_largest.py [--batch 8]`` (generated data, CPU, about a minute).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from gputrain.config import load_config
from gputrain.tools.make_data import make_dataset
from gputrain.tools.plan import memory
from gputrain.tools.plan.workload import Workload

SETTINGS = [("autoencoder", "imagefolder", 40, []), ("cifar10-resnet18", "cifar10", 32, []),
            ("imagefolder-resnet50", "classfolder", 64, []), ("ade20k-deeplabv3plus", "ade20k", 64,
                                                              ["data.num_classes=8"])]


def moments_prediction(low: memory.StepMemory, high: memory.StepMemory, at: int, batch: int) -> float:
    """The count at ``batch`` that every moment's line gives (the largest moment)."""
    at_high = dict(high.moments)
    return max(held + rest + (at_high[held] - rest) * (batch - at) / at for held, rest in low.moments)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    b = args.batch
    print(f"{'recipe':<22} {'batch':>6} {'count MiB':>10} {'line through peaks':>19} {'every moment':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        for recipe, kind, size, extra in SETTINGS:
            root = Path(tmp) / kind
            make_dataset(kind, root, count=24, size=size if kind != "cifar10" else 0)
            cfg = load_config(recipe, [f"data.root={root}", "trainer.precision=32", f"data.image_size={size}", *extra])
            work = Workload.from_config(cfg, torch.device("cpu"), "32")
            low, high = memory.step_memory(work, b), memory.step_memory(work, 2 * b)
            for times in (8, 32):
                count = memory.step_memory(work, times * b).peak
                line = low.peak + (high.peak - low.peak) * (times - 1)
                moments = moments_prediction(low, high, b, times * b)
                print(f"{recipe:<22} {times * b:>6} {count / 2**20:>10.1f} {line / count - 1:>+18.1%} "
                      f"{moments / count - 1:>+12.1%}", flush=True)


if __name__ == "__main__":
    main()
