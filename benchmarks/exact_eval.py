"""What exact evaluation costs, and what padding gets wrong, on 2 real gloo ranks.

Exact evaluation (``EvalSampler``: each sample once, shards differ by one) against padded
``DistributedSampler`` evaluation (shards padded to equal length with repeated samples),
both reducing counts with :class:`~gputrain.metrics.classification.ClassificationEvaluator`.
The variants run interleaved in the same 2 workers (A B, B A, ...) after one warm-up pass
each; the figure is the median of the per-pair time ratios, as docs/platform-notes advise.

    python benchmarks/exact_eval.py [--samples 1001] [--pairs 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

from gputrain.dist import DistInfo, init_distributed, teardown
from gputrain.launcher.ranks import launch_all
from gputrain.metrics.classification import ClassificationEvaluator
from gputrain.strategies.base import Strategy
from gputrain.strategies.ddp import DDP

NUM_CLASSES = 10
IMAGE_SIDE = 64  # large enough that a pass outlasts the timing noise of a shared machine


def small_cnn() -> nn.Module:
    """A small CNN; one pass over 1,001 images of 3x64x64 takes about a second per rank."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, NUM_CLASSES),
    )


def _evaluate(
    model: nn.Module, loader: DataLoader, strategy: Strategy
) -> tuple[dict[str, float], float, float]:
    """One evaluation pass and its reduction; (metrics, wall s, CPU s) with the wall time of the slowest rank."""
    strategy.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    ev = ClassificationEvaluator(NUM_CLASSES)
    with torch.no_grad():
        for x, y in loader:
            logits = model(x)
            ev.update(logits, y, F.cross_entropy(logits, y), len(y))
    metrics = ev.compute(strategy)
    times = torch.tensor([time.perf_counter() - wall, time.process_time() - cpu], dtype=torch.float64)
    times = strategy.all_reduce(times, op="max")
    return metrics, float(times[0]), float(times[1])


def worker(samples: int, pairs: int, batch_size: int, seed: int) -> dict[str, Any]:
    """Runs on each rank: warm-up, then ``pairs`` interleaved exact/padded evaluations."""
    torch.set_num_threads(1)
    info: DistInfo = init_distributed("cpu")
    try:
        strategy = DDP(info)
        g = torch.Generator().manual_seed(seed)
        data = TensorDataset(
            torch.rand(samples, 3, IMAGE_SIDE, IMAGE_SIDE, generator=g),
            torch.randint(0, NUM_CLASSES, (samples,), generator=g),
        )
        torch.manual_seed(seed)
        model = small_cnn().eval()  # same weights on every rank; no DDP wrapper in eval (shards differ)
        samplers: dict[str, Sampler[int]] = {
            "exact": strategy.eval_sampler(samples),
            "padded": DistributedSampler(data, num_replicas=info.world_size, rank=info.rank, shuffle=False),
        }
        loaders = {k: DataLoader(data, batch_size=batch_size, sampler=s) for k, s in samplers.items()}
        metrics = {k: _evaluate(model, loader, strategy)[0] for k, loader in loaders.items()}  # warm-up
        runs: dict[str, list[tuple[float, float]]] = {"exact": [], "padded": []}
        for i in range(pairs):
            for variant in ("exact", "padded") if i % 2 == 0 else ("padded", "exact"):
                m, wall, cpu = _evaluate(model, loaders[variant], strategy)
                assert m == metrics[variant], "evaluation is deterministic; a change means a bug"
                runs[variant].append((wall, cpu))
        return {"metrics": metrics, "runs": runs, "shard_sizes": {k: len(s) for k, s in samplers.items()}}  # type: ignore[arg-type]
    finally:
        teardown()


def summarize(result: dict[str, Any], samples: int, world_size: int, startup_s: float) -> dict[str, Any]:
    """Medians, per-pair ratios and the padding error, from rank 0's result."""
    runs, metrics = result["runs"], result["metrics"]
    wall_ratio = [e[0] / p[0] for e, p in zip(runs["exact"], runs["padded"], strict=True)]
    cpu_ratio = [e[1] / p[1] for e, p in zip(runs["exact"], runs["padded"], strict=True)]
    return {
        "samples": samples,
        "world_size": world_size,
        "pairs": len(wall_ratio),
        "startup_s": startup_s,
        "variants": {
            k: {
                "counted": metrics[k]["samples"],
                "accuracy": metrics[k]["accuracy"],
                "loss": metrics[k]["loss"],
                "wall_s": statistics.median(r[0] for r in runs[k]),
                "cpu_s": statistics.median(r[1] for r in runs[k]),
            }
            for k in ("exact", "padded")
        },
        "ratio_wall_median": statistics.median(wall_ratio),
        "ratio_cpu_median": statistics.median(cpu_ratio),
        "ratio_wall_per_pair": wall_ratio,
        "accuracy_error": metrics["padded"]["accuracy"] - metrics["exact"]["accuracy"],
        "loss_error": metrics["padded"]["loss"] - metrics["exact"]["loss"],
        "duplicates": metrics["padded"]["samples"] - samples,
    }


def markdown(s: dict[str, Any]) -> str:
    rows = [
        f"Exact vs padded evaluation: {s['samples']} samples, {s['world_size']} gloo ranks, "
        f"{s['pairs']} interleaved pairs, images 3x{IMAGE_SIDE}x{IMAGE_SIDE}, 1 thread per rank",
        "",
        "| variant | sampler | samples counted | accuracy | loss | wall s/pass (median) | CPU s/pass (median) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    names = {"exact": "EvalSampler (no padding)", "padded": "DistributedSampler (padded)"}
    for k, v in s["variants"].items():
        rows.append(
            f"| {k} | {names[k]} | {v['counted']:.0f} | {v['accuracy']:.6f} | {v['loss']:.6f} "
            f"| {v['wall_s']:.4f} | {v['cpu_s']:.4f} |"
        )
    rows += [
        "",
        f"- time ratio exact/padded, median of per-pair ratios: wall {s['ratio_wall_median']:.3f}, "
        f"CPU {s['ratio_cpu_median']:.3f} (per pair: {', '.join(f'{r:.3f}' for r in s['ratio_wall_per_pair'])})",
        f"- padding error: {s['duplicates']:.0f} duplicate sample(s); accuracy {s['accuracy_error']:+.6f}, "
        f"loss {s['loss_error']:+.6f} (padded minus exact)",
        f"- launcher start-up, worker set-up and the 2 warm-up passes (not in the timings): {s['startup_s']:.1f} s",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=1001, help="evaluation set size (odd shows padding)")
    parser.add_argument("--pairs", type=int, default=7, help="interleaved exact/padded pairs (at least 5)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--devices", type=int, default=2, help="gloo ranks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = launch_all(worker, args.samples, args.pairs, args.batch_size, args.seed, devices=args.devices)
    elapsed = time.perf_counter() - start
    timed = sum(w for r in results[0]["runs"].values() for w, _ in r)
    summary = summarize(results[0], args.samples, args.devices, startup_s=elapsed - timed)
    summary["shard_sizes"] = [r["shard_sizes"] for r in results]
    print(markdown(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
