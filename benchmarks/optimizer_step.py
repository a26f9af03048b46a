"""Optimizer step time on a CPU: torch's default kernel against its fused one (``optim.fused=true``).

ResNet-18 (11.7 M parameters, 10 classes) with gradients from one batch; for Adam, AdamW and SGD with momentum,
the median time of ``optimizer.step()`` over ``--steps`` steps, in ``--rounds`` rounds that alternate which kernel
goes first; the ratio default / fused is taken within each round and its median printed. 1 torch thread.

    python benchmarks/optimizer_step.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torchvision


def step_time(model: torch.nn.Module, cls: Any, kwargs: dict[str, Any], steps: int) -> float:
    optimizer = cls(model.parameters(), **kwargs)
    optimizer.step()  # builds the state (Adam's moments), not timed
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    torch.nn.functional.cross_entropy(model(torch.randn(8, 3, 16, 16)), torch.randint(0, 10, (8,))).backward()
    optimizers = {"Adam": (torch.optim.Adam, {}), "AdamW": (torch.optim.AdamW, {}),
                  "SGD, momentum 0.9": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}
    print("| optimizer | default | fused | default / fused (per-round min..max) |")
    print("|---|---:|---:|---:|")
    for name, (cls, kwargs) in optimizers.items():
        default, fused = [], []
        for r in range(args.rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            for use_fused in order:
                seconds = step_time(model, cls, {**kwargs, "fused": True} if use_fused else kwargs, args.steps)
                (fused if use_fused else default).append(seconds)
        ratios = [d / f for d, f in zip(default, fused, strict=True)]
        print(f"| {name} | {statistics.median(default) * 1e3:.1f} ms | {statistics.median(fused) * 1e3:.1f} ms "
              f"| {statistics.median(ratios):.1f}x ({min(ratios):.1f}..{max(ratios):.1f}) |")
    print(f"\nMedians of {args.rounds} rounds of {args.steps} steps, 1 thread, ResNet-18 (11.7 M parameters).")


if __name__ == "__main__":
    main()
