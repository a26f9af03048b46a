"""ResNet-50 split over two GPUs: step time and peak memory for single, naive split and pipelined (issue 8).

The workload of PyTorch's model-parallel tutorial as issue 8 states it: torchvision ResNet-50 (1000
outputs), inputs 3x1024x1024 at batch 10, MSE against one-hot labels, SGD. Variants, each a fresh
model, interleaved over ``--reps`` repetitions (medians reported):

- ``single``: the whole model on the first device;
- ``naive``: strategy model_parallel, conv1 .. layer2 | layer3 .. fc, one micro-batch (stage 2 waits for stage 1);
- ``pipelined``: the same split, micro-batches of ``--splits`` samples (2 and 5 by default: 5 and 2 micro-batches).

Where 2 GPUs are visible the stages sit on cuda:0 and cuda:1. With one GPU both stages sit on cuda:0
(the script says so): the step times then show what splitting and pipelining cost without a second
device to overlap with, and memory is per device, not per stage. ``--device cpu --size 64`` runs the
same code on the CPU, to check the script where no GPU exists (its times mean nothing).

    python benchmarks/model_parallel_gpu.py --json runs/bench/model_parallel_gpu.json
    python benchmarks/model_parallel_gpu.py --device cpu --size 64 --reps 1 --steps 1   # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torchvision

from gputrain.dist import DistInfo
from gputrain.strategies.model_parallel import ModelParallel
from gputrain.strategies.stages import SplitOptions

CLASSES = 1000


def stage_devices(kind: str) -> tuple[list[torch.device], str]:
    if kind == "cpu":
        return [torch.device("cpu")] * 2, "cpu (smoke run: both stages on the CPU)"
    if not torch.cuda.is_available():
        raise SystemExit("model_parallel_gpu: no CUDA device is visible; run with --device cpu --size 64 to check it")
    if torch.cuda.device_count() >= 2:
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(2))
        return [torch.device("cuda", 0), torch.device("cuda", 1)], f"2 GPUs: stage 1 on cuda:0, stage 2 on cuda:1 ({names})"
    return [torch.device("cuda", 0)] * 2, (f"1 GPU ({torch.cuda.get_device_name(0)}): both stages on cuda:0, so nothing "
                                           "overlaps and memory is per device, not per stage")


def sync(devices: list[torch.device]) -> None:
    for d in set(devices):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def build(variant: str, split: int, devices: list[torch.device], batch: int) -> tuple[torch.nn.Module, torch.device]:
    """The model as the variant runs it, and where its outputs land."""
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=CLASSES)
    if variant == "single":
        return model.to(devices[0]), devices[0]
    micro = 1 if variant == "naive" else math.ceil(batch / split)
    options = SplitOptions(stages=2, micro_batches=micro, split_points=("layer3",), batch_size=batch)
    strategy = ModelParallel(DistInfo(device=devices[0]), devices=devices, options=options)
    with contextlib.redirect_stdout(io.StringIO()):  # the split is fixed and stated in the header
        module = strategy.setup_module(model)
    return module, strategy.output_device


def run_variant(variant: str, split: int, devices: list[torch.device], args: argparse.Namespace) -> dict[str, Any]:
    for d in set(devices):
        if d.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(d)
    module, out_device = build(variant, split, devices, args.batch)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.001)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g).to(devices[0])
    labels = torch.randint(0, CLASSES, (args.batch,), generator=g)
    target = F.one_hot(labels, CLASSES).float().to(out_device)
    times = []
    for i in range(args.warmup + args.steps):
        sync(devices)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(module(x), target).backward()
        optimizer.step()
        sync(devices)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    peaks = {str(d): torch.cuda.max_memory_allocated(d) / 2**30 for d in sorted(set(devices), key=str) if d.type == "cuda"}
    del module, optimizer, x, target
    return {"step_s": statistics.median(times), "peak_gib": peaks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--splits", default="2,5", help="micro-batch sizes (split_size) of the pipelined variants")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    devices, where = stage_devices(args.device)
    variants = [("single", 0), ("naive", 0)] + [("pipelined", int(s)) for s in args.splits.split(",")]
    print(f"model_parallel_gpu {datetime.date.today()}: ResNet-50, {args.batch}x3x{args.size}x{args.size}, MSE on one-hot, "
          f"SGD; split conv1 .. layer2 | layer3 .. fc; {where}; torch {torch.__version__}")
    results: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.reps):
        for variant, split in variants:
            name = variant if not split else f"{variant} split {split}"
            results.setdefault(name, []).append(run_variant(variant, split, devices, args))
    single = statistics.median(r["step_s"] for r in results["single"])
    rows = []
    for name, runs in results.items():
        step = statistics.median(r["step_s"] for r in runs)
        peaks = {d: max(r["peak_gib"][d] for r in runs) for d in runs[0]["peak_gib"]}
        rows.append({"variant": name, "step_s": step, "speedup_vs_single": single / step, "peak_gib": peaks})
        memory = "  ".join(f"{d} {g:.2f} GiB" for d, g in peaks.items()) or "(no CUDA memory figures on the CPU)"
        print(f"{name:<20} step {step:7.3f} s  x{single / step:5.2f} vs single  peak: {memory}")
    print("for reference, the tutorial's figures quoted in issue 8: single 3.75 s, naive split 4.02 s, pipelined 2.43-2.51 s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"where": where, "args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "rows": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
