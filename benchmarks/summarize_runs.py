"""Print a markdown table of training/evaluation throughput and final metrics from gputrain run folders.

    python benchmarks/summarize_runs.py runs/gpu/r_cifar runs/gpu/r_ade ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def summarize(run: Path) -> str:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if "time/train_s" in r]
    steady = epochs[1:] or epochs  # first epoch is warm-up (cuDNN autotune, allocator)
    train = sum(r["train/samples"] for r in steady) / sum(r["time/train_s"] for r in steady)
    evals = [r for r in steady if "time/val_s" in r]
    samples_key = "val/images" if evals and "val/images" in evals[0] else "val/samples"
    val = sum(r.get(samples_key, 0) for r in evals) / sum(r["time/val_s"] for r in evals) if evals else float("nan")
    summary = json.loads((run / "summary.json").read_text())
    last = epochs[-1]
    metric = next((f"{k}={last[k]:.3f}" for k in ("val/accuracy", "val/mIoU", "val/segm_mAP", "val/loss") if k in last), "")
    return (f"| {run.name} | {summary['world_size']} | {summary['batch_size_per_device']} | {summary['precision']} "
            f"| {train:.0f} | {val:.0f} | {last['train/loss']:.3f} | {metric} |")


if __name__ == "__main__":
    print("| run | processes | batch/device | precision | train images/s | eval images/s | last train loss | metric |")
    print("|---|---|---|---|---|---|---|---|")
    for arg in sys.argv[1:]:
        print(summarize(Path(arg)))
